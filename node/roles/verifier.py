"""The verifier role: owns data shards and walks microbatches through one replica per stage.

A verifier is SWARM's "trainer" with SENTINEL's verification point on the path (papers/sentinel.md §3.1): every
boundary tensor of its microbatches passes through it, in both directions, signed by the replica that made it.
The parts, most of them in node/pipeline/driver.py and verification/tap.py:

* `PipelineDriver` (transport-agnostic): for one microbatch, picks a replica per stage (`node.pipeline.routing`), sends
  the tokens to stage 0, each activation on to the next stage, the last stage answers the loss and the gradient
  of its input, and the gradients walk back. Several microbatches are in flight at once (the role runs up to
  `max_in_flight` drivers concurrently). A failed or timed-out hop is retried on another replica; when the
  replica holding a microbatch's autograd context is gone, the forward of that stage is re-run on another
  replica before the backward. Every answer must be signed by the replica that was asked (else it is rejected
  and struck), and every backward application is recorded once in an `IdempotencyLedger`.
* `BoundaryTap.check` is the ONE place each received boundary tensor passes through (the SENTINEL seam):
  it returns the tensor to use (possibly a replacement) or a `Drop`. `PassThroughTap` passes everything
  through; the verifier role plugs in `verification.tap.SentinelTap`. When the tap draws a spot check
  (`spot_check_due`), the driver recomputes the same request on a random other replica of the stage (a third
  after a mismatch), disguised as an ordinary training request under a fresh id from `ids` (or, with
  `disguised_spot_checks` off, marked `EVAL_META`, `RECOMPUTE_GRAD_META` for gradients) and lets the tap
  judge (`spot_check`): a convicted tensor is dropped, a flagged one that the recomputation cleared is used.
* `ReceiptBook` counts verified tokens per stage replica and emits signed `TokenReceipt`s (format in
  `protocol.receipts`), sent to each replica on `stage.receipt` for its syncer contributions.
* `HopTransport` moves bytes: `FramedTransport` over hivemind P2P framed streams, `DirectTransport` in process
  (tests, benchmarks: the same sealing, opening and stage code, no network).
* `VerifierRole` (`--role verifier`, only for keys the manifest authorizes): data, replica discovery from
  heartbeats, the driving loop, held-out loss through the pipeline, receipts, status.

`--device`: a verifier runs no model. Every recomputation it asks for (a spot check) runs on another stage
replica, on that replica's device (`StageCore` computes there and answers CPU fp32), and what the verifier does
itself (dtype and shape checks, the tap's statistics, the spot-check comparisons) works on the opened wire
tensors: CPU fp32, whatever device any replica computed on. The device is reported (heartbeat, status), not used.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import random
import time
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING, Any

import torch

from node.config import component_config, run_sentinel_config
from node.ml.data import Batch, BatchSampler, load_corpus, validation_batches
from node.pipeline.accounting import DriverStats, HopError, MicrobatchAbandoned, MicrobatchOutcome
from node.pipeline.driver import PipelineDriver
from node.pipeline.ids import MicrobatchIds
from node.pipeline.routing import (
    ReplicaInfo,
    ReplicaRouter,
    RetryPolicy,
    RoutingConfig,
)
from node.pipeline.transport import FramedTransport
from node.roles.stage import replicas_from_peers
from protocol.pipeline import (
    MAX_CONTROL_BYTES,
    RECEIPT_RPC,
    BoundaryShape,
)
from protocol.receipts import TokenReceipt
from protocol.records import MAX_MEASURED_REPLICAS, MeasuredThroughputs

if TYPE_CHECKING:
    from node.context import NodeContext
    from node.swarm.bans import BanWatcher
    from verification.tap import SentinelTap

logger = logging.getLogger(__name__)

VERIFIER_ENV = (
    "HIVENODE_VERIFIER"  # overrides of VerifierConfig, "key=value,..." (read once, when the role is built)
)


# ---------------------------------------------------------------------------------------------------- config


@dataclass(frozen=True, kw_only=True, slots=True)
class VerifierConfig:
    """Settings of the driving half of a verifier."""

    microbatch_size: int = 8  # sequences per microbatch (capped by the manifest's wire.max_batch)
    max_in_flight: int = 4  # microbatches driven concurrently
    retry: RetryPolicy = field(default_factory=RetryPolicy)
    routing: RoutingConfig = field(default_factory=RoutingConfig)
    eval_every_s: float = 30.0  # held-out loss through the pipeline this often (and at start and end)
    eval_batches: int = 4  # held-out batches per evaluation (microbatch_size sequences each)
    receipt_every_s: float = 10.0  # signed token receipts to each replica this often
    receipt_timeout_s: float = 5.0  # one receipt delivery
    replica_refresh_s: float = 0.0  # heartbeat reads this often; 0 = the manifest's heartbeat period
    idle_wait_s: float = 1.0  # pause when a stage has no usable replica
    connect_timeout_s: float = 5.0  # dialing a replica's announced addresses
    history: int = 256  # evaluations kept in status
    # torch intra-op threads of the verifier process; 0 = torch's default. One, because a verifier's tensor work
    # is small and latency-bound: with two OpenMP threads on a busy machine, the finite-value check of a 512 KiB
    # activation took 10 ms instead of 6 us (measured here).
    torch_threads: int = 1
    # publish what this verifier measured of each stage replica (a signed `measured` DHT record, every replica
    # refresh): placement and rebalancing trust it over the replicas' own announced throughputs
    publish_measured: bool = True
    # Send spot-check recomputations as ordinary training requests under fresh microbatch ids, which a checker
    # cannot tell from training traffic (docs/sentinel.md, "Disguised spot checks"); False: marked as checks
    # (`eval` meta, the original's id), which a checker colluding with the checked replica can answer falsely.
    disguised_spot_checks: bool = True

    def __post_init__(self) -> None:
        if self.microbatch_size < 1 or self.max_in_flight < 1 or self.eval_batches < 1 or self.history < 1:
            raise ValueError("microbatch_size, max_in_flight, eval_batches and history must be >= 1")
        for name in (
            "eval_every_s",
            "receipt_every_s",
            "receipt_timeout_s",
            "idle_wait_s",
            "connect_timeout_s",
        ):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"{name} must be positive, got {value}")
        if not (math.isfinite(self.replica_refresh_s) and self.replica_refresh_s >= 0):
            raise ValueError("replica_refresh_s must be >= 0")
        if self.torch_threads < 0:
            raise ValueError("torch_threads must be >= 0")


def verifier_config(
    table: Mapping[str, Any] | None = None, environ: Mapping[str, str] | None = None
) -> VerifierConfig:
    """VerifierConfig from `NodeConfig.verifier` (node.toml `[verifier]` and `HIVENODE_VERIFIER`, merged by
    `node.config.load_node_config`), then `HIVENODE_VERIFIER` from `environ` if one is given."""
    return component_config(VerifierConfig(), table, table="verifier", env=VERIFIER_ENV, environ=environ)


# ---------------------------------------------------------------------------------------------------- the seam


# ---------------------------------------------------------------------------------------------------- transports


# ---------------------------------------------------------------------------------------------------- receipts


# ---------------------------------------------------------------------------------------------------- the driver


# ---------------------------------------------------------------------------------------------------- the role


@dataclass(slots=True)
class _Progress:
    started_at: float = 0.0
    microbatches_started: int = 0
    sequences: int = 0
    loss_ema: float | None = None
    val_history: deque[dict[str, float]] = field(default_factory=deque)
    window: deque[tuple[float, int]] = field(default_factory=deque)  # (time, tokens) of recent completions
    receipts_sent: int = 0
    receipts_failed: int = 0
    measured_published: int = 0  # `measured` records stored
    in_flight: dict[int, float] = field(default_factory=dict)


class VerifierRole:
    """`--role verifier`: drive microbatches through the pipeline until stopped (or `--max-steps` steps)."""

    name = "verifier"

    def __init__(self, ctx: NodeContext, config: VerifierConfig | None = None) -> None:
        if ctx.peer_id not in ctx.manifest.authorized_verifiers:
            raise ValueError(f"{ctx.peer_id} is not an authorized verifier of this run")
        self.ctx = ctx
        self.config = config or verifier_config(getattr(ctx.config, "verifier", None))
        self.sentinel = run_sentinel_config(ctx.manifest.sentinel)  # the run's policy; no local override
        if self.config.torch_threads > 0:
            torch.set_num_threads(self.config.torch_threads)
        self.manifest = ctx.manifest
        self.shape = BoundaryShape.from_manifest(ctx.manifest)
        self.microbatch_size = min(self.config.microbatch_size, ctx.manifest.wire.max_batch)
        self.state = "joining"
        self.progress = _Progress()
        self._replicas: list[ReplicaInfo] = []
        self._measured_expiration = 0.0
        self.driver: PipelineDriver | None = None
        self.tap: SentinelTap | None = None  # once running
        self.bans: BanWatcher | None = None  # once running
        # training microbatches, evaluations and disguised spot checks all take their ids from this one counter
        self.ids = MicrobatchIds.from_clock()

    # ---- life

    async def run(self, ctx: NodeContext, stop: asyncio.Event) -> None:
        p2p = await ctx.dht.replicate_p2p()
        transport = FramedTransport(p2p, connect_timeout_s=self.config.connect_timeout_s)
        from node.swarm.bans import ban_watcher_for
        from verification.tap import SentinelTap

        self.tap = SentinelTap(
            verifier=ctx.peer_id,
            run_id=ctx.run_id,
            config=self.sentinel,
            stage_replicas=lambda s: [r.peer_id for r in self._replicas if r.stage == s],
            emit=ctx.events.emit,
        )
        self.bans = ban_watcher_for(ctx, outbox=self.tap.pending)
        tap, bans = self.tap, self.bans
        self.driver = PipelineDriver(
            identity=ctx.identity,
            run_id=ctx.run_id,
            num_stages=self.manifest.num_stages,
            shape=self.shape,
            transport=transport,
            replicas=lambda: self._replicas,
            router=ReplicaRouter(self.config.routing),
            retry=self.config.retry,
            tap=tap,
            banned=lambda: tap.banned() | bans.active(),
            rng=random.Random(ctx.peer_id),
            ids=self.ids,
            disguised_spot_checks=self.config.disguised_spot_checks,
        )
        self.driver.on_failure = self._on_failure
        self._transport = transport
        sampler, held_out = self._data(ctx, *await self._shard_streams(ctx))
        await self._refresh_replicas()
        ctx.supervisor.spawn("verifier-replicas", partial(self._refresh_loop, stop))
        ctx.supervisor.spawn("verifier-receipts", partial(self._receipt_loop, stop))
        ctx.supervisor.spawn("verifier-bans", partial(bans.run, stop))
        await self._wait_for_stages(stop)
        if stop.is_set():
            return
        self.state = "verifying"
        self.progress.started_at = time.monotonic()
        await self._evaluate(held_out)
        await self._drive(sampler, held_out, stop)
        if not stop.is_set():
            await self._evaluate(held_out)
            await self._send_receipts()

    async def _shard_streams(self, ctx: NodeContext) -> tuple[Any, Any]:
        """On a token-shard run: the training shards the assignment gives us among the authorized verifiers (the
        pipeline's data drivers), and the held-out shards; else (None, None): the corpus."""
        from node.roles.shard_data import open_shard_data, uses_shards

        if not uses_shards(ctx.manifest):
            return None, None
        data = await open_shard_data(ctx)
        verifiers = list(self.manifest.authorized_verifiers)
        mine = data.assignment(ctx.peer_id, verifiers).shards_for(ctx.peer_id)
        return await data.stream(mine), await data.heldout_stream()

    def _data(
        self, ctx: NodeContext, train: Any = None, held: Any = None
    ) -> tuple[BatchSampler, list[Batch]]:
        verifiers = sorted(self.manifest.authorized_verifiers)
        shard = verifiers.index(ctx.peer_id)
        if train is None:
            source = ctx.config.data
            if source is None and ctx.manifest.data.get("source") not in (None, "builtin"):
                source = str(ctx.manifest.data["source"])
            corpus = load_corpus(source).with_encoder(ctx.encode)
            train, held = corpus.train_stream(shard, len(verifiers)), corpus
        seed = (self.manifest.seed * 1_000_003 + shard) % (2**63)
        sampler = BatchSampler(
            train,
            batch_size=self.microbatch_size,
            context_len=self.shape.context_len,
            generator=torch.Generator().manual_seed(seed),
        )
        held_out = validation_batches(
            held,
            batch_size=self.microbatch_size,
            context_len=self.shape.context_len,
            num_batches=self.config.eval_batches,
        )
        logger.info(
            "driving shard %d of %d, microbatches of %d sequences",
            shard,
            len(verifiers),
            self.microbatch_size,
        )
        return sampler, held_out

    async def _wait_for_stages(self, stop: asyncio.Event) -> None:
        assert self.driver is not None
        announced = False
        while not stop.is_set():
            missing = self.driver.missing_stages()
            if not missing:
                return
            if not announced:
                logger.info("waiting for replicas of stage(s) %s", missing)
                announced = True
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(stop.wait(), self.config.idle_wait_s)

    async def _drive(self, sampler: BatchSampler, held_out: list[Batch], stop: asyncio.Event) -> None:
        assert self.driver is not None
        tasks: set[asyncio.Task[MicrobatchOutcome]] = set()
        next_eval = time.monotonic() + self.config.eval_every_s
        max_steps = self.ctx.config.max_steps
        try:
            while not stop.is_set() and not self._done(max_steps):
                if self.driver.missing_stages():
                    await self._wait_for_stages(stop)
                    continue
                while len(tasks) < self.config.max_in_flight and not self._done(max_steps):
                    tasks.add(asyncio.create_task(self._one(sampler.next_batch())))
                finished, tasks = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
                for task in finished:
                    self._account(task.result())
                if time.monotonic() >= next_eval:
                    await self._evaluate(held_out)
                    next_eval = time.monotonic() + self.config.eval_every_s
            if tasks:
                for task in await _wait_all(tasks, self.config.retry.hop_timeout_s * 4):
                    self._account(task.result())
                tasks = set()
        finally:
            for task in tasks:
                task.cancel()

    def _done(self, max_steps: int | None) -> bool:
        return max_steps is not None and self.progress.microbatches_started * self.microbatch_size >= (
            max_steps * self.manifest.inner.batch_size
        )

    async def _one(self, batch: Batch) -> MicrobatchOutcome:
        assert self.driver is not None
        microbatch = self.ids.take()
        self.progress.microbatches_started += 1
        self.progress.in_flight[microbatch] = time.monotonic()
        self.driver.step = self.progress.sequences // self.manifest.inner.batch_size
        inputs, targets = batch
        try:
            return await self.driver.run_microbatch(microbatch, inputs, targets)
        finally:
            self.progress.in_flight.pop(microbatch, None)

    def _account(self, outcome: MicrobatchOutcome) -> None:
        progress = self.progress
        if outcome.completed:
            progress.sequences += self.microbatch_size
            assert outcome.loss is not None
            progress.loss_ema = (
                outcome.loss if progress.loss_ema is None else 0.95 * progress.loss_ema + 0.05 * outcome.loss
            )
            now = time.monotonic()
            progress.window.append((now, outcome.tokens))
            while progress.window and now - progress.window[0][0] > 30.0:
                progress.window.popleft()
        # every microbatch with a hop_failed (every retried one has one) gets an end on the tape
        if outcome.failures:
            self.ctx.events.emit(
                "microbatch_recovered" if outcome.completed else "microbatch_abandoned",
                microbatch=outcome.microbatch,
                retries=outcome.retries,
                recomputed=outcome.recomputed,
                replicas=outcome.replicas,
                failures=outcome.failures,
                maybe_twice=outcome.maybe_twice,
                reason=outcome.reason,
            )

    def _on_failure(self, microbatch: int, stage: int, replica: str, error: HopError) -> None:
        self.ctx.events.emit(
            "hop_failed",
            microbatch=microbatch,
            stage=stage,
            replica=replica,
            failure=error.failure.value,
            detail=error.detail[:200],
        )

    async def _evaluate(self, held_out: list[Batch]) -> None:
        assert self.driver is not None
        first_id = self.ids.take(len(held_out))
        try:
            loss = await self.driver.evaluate(held_out, first_id)
        except MicrobatchAbandoned as e:
            logger.warning("held-out evaluation skipped: %s", e)
            return
        entry = {
            "t": round(time.monotonic() - self.progress.started_at, 2),
            "microbatches": self.driver.stats.completed,
            "tokens": self.driver.stats.tokens,
            "loss": round(loss, 5),
        }
        history = self.progress.val_history
        history.append(entry)
        while len(history) > self.config.history:
            history.popleft()
        logger.info("held-out loss %.4f after %d microbatches", loss, self.driver.stats.completed)
        self.ctx.events.emit("evaluated", **entry)

    # ---- replicas and receipts

    async def _refresh_replicas(self) -> None:
        from hivemind.utils import get_dht_time

        try:
            peers = await self.ctx.records.list_peers()
        except asyncio.TimeoutError:
            logger.warning("listing stage replicas timed out; keeping the last view")
            return
        self._replicas = replicas_from_peers(peers, get_dht_time())
        for replica in self._replicas:
            self._transport.maddrs[replica.peer_id] = replica.maddrs
        if self.tap is not None:
            members: dict[int, list[str]] = {stage: [] for stage in range(self.manifest.num_stages)}
            for replica in self._replicas:
                members.setdefault(replica.stage, []).append(replica.peer_id)
            self.tap.observe_replicas(members)

    async def _refresh_loop(self, stop: asyncio.Event) -> None:
        period = self.config.replica_refresh_s or self.manifest.heartbeat_period_s
        while not stop.is_set():
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(stop.wait(), period)
            await self._refresh_replicas()
            if self.config.publish_measured:
                await self._publish_measured(period)

    async def _publish_measured(self, period_s: float) -> None:
        """Sign and store the throughput measured of each replica (end to end, this verifier's own hops), so
        placement need not believe what replicas announce."""
        from hivemind.utils import get_dht_time

        if self.driver is None:
            return
        router = self.driver.router
        rates = {
            r.peer_id: measured
            for r in self._replicas
            if (measured := router.measured_throughput(r.peer_id)) is not None
            and math.isfinite(measured)
            and measured >= 0
        }
        if not rates:
            return
        now = get_dht_time()
        kept = dict(sorted(rates.items(), key=lambda item: -item[1])[:MAX_MEASURED_REPLICAS])
        # freshness is the readers' measured_max_age_s; the TTL only clears the record of a verifier gone for
        # good, and outlives a few late refreshes on a busy machine (a missing record: announcements count)
        ttl_s = min(max(2 * period_s, 60.0), self.ctx.records.limits.max_ttl_peer_s)
        expiration = max(now + ttl_s, self._measured_expiration + 1e-3)  # the DHT refuses going backwards
        self._measured_expiration = expiration
        try:
            ok = await self.ctx.records.publish_measured(
                MeasuredThroughputs(rates=kept, sent_at=now), expiration=expiration
            )
        except asyncio.TimeoutError:
            ok = False
        self.progress.measured_published += int(ok)
        if not ok:
            logger.warning("publishing measured throughputs of %d replica(s) failed", len(kept))

    async def _receipt_loop(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(stop.wait(), self.config.receipt_every_s)
            await self._send_receipts()

    async def _send_receipts(self) -> None:
        if self.driver is None:
            return
        due = self.driver.receipts.due(time.time())
        results = await asyncio.gather(*(self._send_receipt(r, f) for r, f in due), return_exceptions=True)
        for (receipt, _), result in zip(due, results, strict=True):
            if result is True:
                self.progress.receipts_sent += 1
            else:
                self.progress.receipts_failed += 1
                logger.debug("receipt to %s not delivered: %r", receipt.replica[-8:], result)

    async def _send_receipt(self, receipt: TokenReceipt, frame: bytes) -> bool:
        await self._transport.call(
            receipt.replica,
            RECEIPT_RPC,
            frame,
            timeout_s=self.config.receipt_timeout_s,
            max_response_bytes=MAX_CONTROL_BYTES,
        )
        return True

    # ---- status

    def status(self) -> dict[str, Any]:
        progress = self.progress
        driver = self.driver
        elapsed = time.monotonic() - progress.started_at if progress.started_at else 0.0
        stats = driver.stats if driver is not None else DriverStats()
        window = progress.window
        recent = (
            sum(t for _, t in window) / max(window[-1][0] - window[0][0], 1e-9) if len(window) > 1 else 0.0
        )
        status: dict[str, Any] = {
            "state": self.state,
            "stage": None,
            "inner_step": progress.sequences // self.manifest.inner.batch_size,
            "tokens": stats.tokens,
            "loss": progress.loss_ema,
            "throughput": round(recent, 1),
            "throughput_mean": round(stats.tokens / elapsed, 1) if elapsed > 0 else 0.0,
            "microbatches_driven": progress.microbatches_started,
            "microbatches_completed": stats.completed,
            "microbatches_abandoned": stats.abandoned,
            "microbatches_recovered": stats.recovered,
            "in_flight": len(progress.in_flight),
            "retries": stats.retries,
            "recomputed": stats.recomputed,
            "failures": dict(stats.failures),
            "bad_replies": stats.bad_replies,
            "double_applied": stats.double_applied,
            "maybe_applied_twice": stats.maybe_applied_twice,
            "disguised_checks": stats.disguised_checks,
            "duplicate_gradients": stats.duplicate_gradients,
            "applied_per_stage": {str(k): v for k, v in sorted(stats.applied_per_stage.items())},
            "val_loss": progress.val_history[-1]["loss"] if progress.val_history else None,
            "val_history": list(progress.val_history),
            "receipts_sent": progress.receipts_sent,
            "receipts_failed": progress.receipts_failed,
            "measured_published": progress.measured_published,
        }
        if driver is not None:
            status["route"] = driver.last_route
            status["replicas"] = self._replicas_status(driver)
            status["verified_tokens"] = driver.receipts.tokens_by_replica()
            status["strikes"] = driver.strikes.snapshot()
            status["timings"] = {k: round(v, 3) for k, v in driver.stats.timings.items()}
        if self.tap is not None:
            banned = self.bans.active() if self.bans is not None else set()
            status["sentinel"] = {**self.tap.status(), "swarm_banned": sorted(banned)}
        return status

    def _replicas_status(self, driver: PipelineDriver) -> dict[str, list[dict[str, Any]]]:
        """Each stage's replicas: announced and measured throughput (what `measured` records publish), load."""
        router, now = driver.router, time.monotonic()
        return {
            str(s): [
                {
                    "peer_id": r.peer_id,
                    "announced_throughput": r.throughput,
                    "queue": r.queue,
                    "measured_throughput": router.measured_throughput(r.peer_id),
                    "in_flight": router.in_flight(r.peer_id),  # hops of any kind, spot checks too
                    "holding": driver.holding(r.peer_id),
                    "blocked": router.is_blocked(r.peer_id, now),
                }
                for r in self._replicas
                if r.stage == s
            ]
            for s in range(self.manifest.num_stages)
        }


async def _wait_all(
    tasks: set[asyncio.Task[MicrobatchOutcome]], timeout_s: float
) -> set[asyncio.Task[MicrobatchOutcome]]:
    done, pending = await asyncio.wait(tasks, timeout=timeout_s)
    for task in pending:
        task.cancel()
    return done


def create_role(ctx: NodeContext) -> VerifierRole:
    return VerifierRole(ctx)


__all__ = [
    "FramedTransport",
    "HopError",
    "MicrobatchAbandoned",
    "MicrobatchOutcome",
    "PipelineDriver",
    "VerifierConfig",
    "VerifierRole",
    "create_role",
]
