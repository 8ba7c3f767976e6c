"""The learner role: the whole model, a data shard, AdamW inner steps that never wait on the network, and a
`FragmentSync` that is a Decoupled DiLoCo learner for every fragment of the run.

Life of a learner: build the model from the manifest's seed, load the corpus (`--data` or the run's data
spec, else the built-in one) and take the shard `shard_for(peer_id, num_shards)` (a run on prepared token
shards instead downloads the shards the assignment gives it among the live learners, and follows churn:
node.roles.shard_data), start the sync client's
sender and watcher as supervised tasks, download the current global fragments from the syncer (late
joiners and restarted learners; with no syncer in `join_timeout_s` it starts from the seed, which is
version 0), then step. Each inner step runs in a worker thread (`asyncio.to_thread`), so the event loop
keeps serving heartbeats, the status API and the sync client while torch computes; the sync client's
`after_inner_step` runs in that same thread, between steps. In the synchronous baselines
(`diloco.mode` sync or elastic_sync) the learner waits at each round's apply step for the round's version,
which is exactly the stall those baselines pay. `min_step_s` pads every step to a fixed speed
(benchmarks), `--max-steps` ends the node.

Options (node.toml `[learner]`, see `LearnerConfig`).
"""

from __future__ import annotations

import asyncio
import collections
import logging
import math
import time
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any

import torch

from node.config import component_config
from node.diloco.attack_transport import AttackingTransport, learner_attack_from_env
from node.diloco.sync_client import FragmentSync, FramedSyncTransport, run_fragment_plan
from node.diloco.sync_types import SyncClientConfig, SyncTransport
from node.ml.device import autocast

if TYPE_CHECKING:
    from node.context import NodeContext
    from node.roles.shard_data import ShardData

logger = logging.getLogger(__name__)

THROUGHPUT_WINDOW_S = 10.0


@dataclass(frozen=True, kw_only=True, slots=True)
class LearnerConfig:
    """Learner-local settings (node.toml `[learner]`); the model, optimizer and DiLoCo knobs are the run's."""

    min_step_s: float = 0.0  # floor on the wall time of one inner step (a fixed speed for benchmarks)
    eval_every_steps: int = 50  # held-out loss every N inner steps (0 = never)
    eval_batches: int = 4  # held-out batches per evaluation
    num_shards: int = 16  # the training split is cut into this many shards; ours is chosen by peer id
    join_timeout_s: float = 30.0  # how long to look for a syncer before starting from the seed
    poll_wait_s: float = 5.0  # versions long-poll bound
    torch_threads: int = 0  # torch intra-op threads for the inner step (0 = torch's default)
    data_rebalance_s: float = (
        30.0  # token-shard runs: how often the shard assignment is checked against churn
    )

    def __post_init__(self) -> None:
        for name in ("min_step_s",):
            value = getattr(self, name)
            if not (isinstance(value, int | float) and math.isfinite(value) and value >= 0):
                raise ValueError(f"learner.{name} must be a number >= 0, got {value!r}")
        for name in ("join_timeout_s", "poll_wait_s", "data_rebalance_s"):
            value = getattr(self, name)
            if not (isinstance(value, int | float) and math.isfinite(value) and value > 0):
                raise ValueError(f"learner.{name} must be a positive number, got {value!r}")
        for name in ("eval_every_steps", "torch_threads"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"learner.{name} must be an int >= 0, got {value!r}")
        for name in ("eval_batches", "num_shards"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"learner.{name} must be an int >= 1, got {value!r}")

    @classmethod
    def from_options(cls, options: dict[str, Any]) -> LearnerConfig:
        """From `NodeConfig.learner` (node.toml `[learner]`, `HIVENODE_LEARNER`)."""
        return component_config(cls(), options, table="learner")


class Throughput:
    """Tokens per second over a sliding window of recent steps; the clock is passed in."""

    def __init__(self, window_s: float = THROUGHPUT_WINDOW_S) -> None:
        self.window_s = window_s
        self._samples: collections.deque[tuple[float, int]] = collections.deque()

    def add(self, now: float, tokens: int) -> None:
        self._samples.append((now, tokens))
        while self._samples and now - self._samples[0][0] > self.window_s:
            self._samples.popleft()

    def rate(self) -> float:
        if len(self._samples) < 2:
            return 0.0
        span = self._samples[-1][0] - self._samples[0][0]
        tokens = sum(t for _, t in list(self._samples)[1:])
        return tokens / span if span > 0 else 0.0


class LearnerRole:
    name = "learner"

    def __init__(self, ctx: NodeContext) -> None:
        self.ctx = ctx
        self.config = LearnerConfig.from_options(ctx.config.learner)
        self.state = "joining"
        self.inner_step = 0
        self.tokens = 0
        self.loss: float | None = None
        self.held_out_loss: float | None = None
        self.joined_from_syncer: bool | None = None
        self.barrier_wait_s = 0.0
        self.shard: int | None = None
        self.sync: FragmentSync | None = None
        self._throughput = Throughput()
        self._model: torch.nn.Module | None = None
        self._optimizer: torch.optim.Optimizer | None = None
        self._sampler: Any = None
        self._shards: ShardData | None = None  # the run's token shards, when it trains on them
        self.assigned: tuple[str, ...] = ()  # the shards the assignment gives us now

    async def run(self, ctx: NodeContext, stop: asyncio.Event) -> None:
        from node.context import RestartPolicy

        if self.config.torch_threads:
            torch.set_num_threads(self.config.torch_threads)
        from node.roles.shard_data import uses_shards

        streams = await self._open_shards() if uses_shards(ctx.manifest) else (None, None)
        held_out = await asyncio.to_thread(self._prepare, *streams)
        if self._shards is not None:
            ctx.supervisor.spawn("data-rebalance", partial(self._rebalance, stop), policy=RestartPolicy())
        plan = run_fragment_plan(ctx.manifest)
        transport = await self._transport(ctx, plan)
        assert self._model is not None
        barrier = getattr(ctx.manifest.diloco, "mode", "decoupled") != "decoupled"
        sync_config = SyncClientConfig(
            barrier=barrier, join_timeout_s=self.config.join_timeout_s, poll_wait_s=self.config.poll_wait_s
        )
        self.sync = FragmentSync.create(
            dict(self._model.named_parameters()),
            plan,
            ctx.manifest.diloco,
            transport,
            config=sync_config,
            codec=ctx.manifest.outer_codec,
        )
        if ctx.manifest.authorized_syncers:
            # the join first: a watcher started beside it fetched every version the join fetched, into its inbox
            # (each version's tensors and frame, dropped at the first step as not newer): 2 models more at the
            # start of a late joiner
            self.joined_from_syncer = await self.sync.join_global(stop)
            ctx.supervisor.spawn("diloco-sender", partial(self.sync.run_sender, stop), policy=RestartPolicy())
            ctx.supervisor.spawn(
                "diloco-watcher", partial(self.sync.run_watcher, stop), policy=RestartPolicy()
            )
        else:  # no syncer can ever exist in this run: nothing to wait for
            logger.warning(
                "run %r authorizes no syncer: training locally, nothing is merged", ctx.manifest.name
            )
            self.joined_from_syncer = False
        ctx.events.emit("learner_joined", from_syncer=self.joined_from_syncer, versions=self.sync.versions())
        self.state = "training"
        try:
            await self._train(stop, held_out)
        finally:
            if isinstance(transport, AttackingTransport):
                await transport.aclose()  # its copy watcher and pushes (benchmarks only)

    async def _transport(self, ctx: NodeContext, plan: Any) -> SyncTransport:
        """The framed transport to the run's syncers, wrapped by a poisoning one only through
        HIVENODE_UNSAFE_LEARNER_ATTACK (benchmarks)."""
        p2p = await ctx.dht.replicate_p2p()
        from node.swarm.admission import admission_meta

        # the run's admission cost, paid once per identity (cached); nothing to pay where no syncer can exist
        admission = await admission_meta(ctx) if ctx.manifest.authorized_syncers else None
        framed = FramedSyncTransport(
            p2p,
            ctx.identity,
            ctx.records,
            plan,
            authorized_syncers=ctx.manifest.authorized_syncers,
            lookup_period_s=ctx.manifest.heartbeat_period_s,
            admission=admission,
        )
        return learner_attack_from_env(framed)

    def _prepare(self, train: Any = None, held: Any = None) -> list[Any]:
        """Model, optimizer, data, held-out batches (in a worker thread: torch and file I/O). `train`/`held`:
        memmap streams of the run's token shards; None: the corpus of `--data` or the run's data spec."""
        from node.ml.data import BatchSampler, load_corpus, shard_for, validation_batches
        from node.ml.model import ModelConfig, build_model

        manifest, ctx = self.ctx.manifest, self.ctx
        cfg = ModelConfig.from_dict(manifest.model)
        model = build_model(cfg, manifest.seed).to(ctx.device)
        model.train()
        inner = manifest.inner
        self._optimizer = torch.optim.AdamW(model.parameters(), lr=inner.lr, weight_decay=inner.weight_decay)
        self._model = model
        if train is None:
            corpus = load_corpus(ctx.config.data or _data_spec(manifest)).with_encoder(ctx.encode)
            self.shard = shard_for(ctx.peer_id, self.config.num_shards)
            train, held = corpus.train_stream(self.shard, self.config.num_shards), corpus
        seed = (manifest.seed * 1_000_003 + int.from_bytes(ctx.peer_id.encode()[-8:], "big")) % (2**63)
        self._sampler = BatchSampler(
            train,
            batch_size=inner.batch_size,
            context_len=cfg.context_len,
            generator=torch.Generator().manual_seed(seed),
        )
        logger.info(
            "learner: shard %s (%d tokens), batch %d x %d",
            self.shard
            if self._shards is None
            else f"{len(self.assigned)} of {len(self._shards.index.train)}",
            len(train),
            inner.batch_size,
            cfg.context_len,
        )
        if not self.config.eval_every_steps or held is None:
            return []
        return validation_batches(
            held,
            batch_size=inner.batch_size,
            context_len=cfg.context_len,
            num_batches=self.config.eval_batches,
        )

    async def _open_shards(self) -> tuple[Any, Any]:
        """Our share of the run's token shards (and the held-out ones), downloaded and verified."""
        from node.roles.shard_data import live_learners, open_shard_data

        ctx = self.ctx
        self._shards = await open_shard_data(ctx)
        self.assigned = self._shards.assignment(ctx.peer_id, await live_learners(ctx)).shards_for(ctx.peer_id)
        train = await self._shards.stream(self.assigned)
        held = await self._shards.heldout_stream() if self.config.eval_every_steps else None
        ctx.events.emit("learner_shards", shards=len(self.assigned), tokens=len(train))
        return train, held

    async def _rebalance(self, stop: asyncio.Event) -> None:
        """Every `data_rebalance_s`: recompute the assignment over the live learners; on a change, fetch the new
        shards and swap the sampler's stream between two steps."""
        from node.context import wait_or_stop
        from node.roles.shard_data import live_learners

        assert self._shards is not None
        while not await wait_or_stop(stop, self.config.data_rebalance_s):
            live = sorted({*await live_learners(self.ctx), self.ctx.peer_id})
            epoch = self._data_epoch(len(live))
            mine = self._shards.assignment(self.ctx.peer_id, live, epoch).shards_for(self.ctx.peer_id)
            if mine == self.assigned:
                continue
            stream = await self._shards.stream(mine)
            self._sampler.stream, self.assigned = stream, mine
            logger.info(
                "learner set or epoch changed (%d live, epoch %d): now training on %d shards",
                len(live),
                epoch,
                len(mine),
            )
            self.ctx.events.emit(
                "learner_shards", shards=len(mine), tokens=len(stream), learners=len(live), epoch=epoch
            )

    def _data_epoch(self, learners: int) -> int:
        """The data epoch by the rounds merged so far (the lowest version we hold of any fragment)."""
        assert self._shards is not None
        versions = self.sync.versions() if self.sync is not None else {}
        from node.ml.model import ModelConfig

        manifest = self.ctx.manifest
        context_len = ModelConfig.from_dict(manifest.model).context_len
        tokens_per_round = manifest.diloco.sync_every_steps * manifest.inner.batch_size * context_len
        return self._shards.epoch(min(versions.values(), default=0), learners, max(1, tokens_per_round))

    async def _train(self, stop: asyncio.Event, held_out: list[Any]) -> None:
        from node.context import wait_or_stop
        from node.ml.data import evaluate

        assert self.sync is not None and self._model is not None
        max_steps = self.ctx.config.max_steps
        while not stop.is_set():
            started = time.monotonic()
            step = self.inner_step + 1
            loss, tokens = await asyncio.to_thread(self._inner_step, step)
            self.inner_step, self.loss = step, loss
            self.tokens += tokens
            if self.sync.barrier:
                self.barrier_wait_s += await self.sync.wait_barrier(step, stop)
            pause = self.config.min_step_s - (time.monotonic() - started)
            if pause > 0 and await wait_or_stop(stop, pause):
                break
            self._throughput.add(time.monotonic(), tokens)
            if held_out and step % self.config.eval_every_steps == 0:
                self.held_out_loss = await asyncio.to_thread(evaluate, self._model, held_out)
                self.ctx.events.emit(
                    "learner_eval", step=step, loss=round(self.held_out_loss, 5), tokens=self.tokens
                )
            if max_steps is not None and step >= max_steps:
                logger.info("reached --max-steps %d", max_steps)
                self.state = "idle"
                return

    def _inner_step(self, step: int) -> tuple[float, int]:
        """One AdamW step on a fresh batch, then the sync client's bookkeeping (same thread)."""
        assert self._model is not None and self._optimizer is not None and self.sync is not None
        inner, device = self.ctx.manifest.inner, self.ctx.device
        self._optimizer.zero_grad(set_to_none=True)
        total, tokens = 0.0, 0
        for _ in range(inner.accumulation):  # gradients summed over the batches, each loss scaled down
            inputs, targets = self._sampler.next_batch()
            # bf16 autocast on CUDA (fp32 master weights and optimizer state; the loss is fp32, lm_loss)
            with autocast(device):
                _, loss = self._model(inputs.to(device), targets.to(device))
            (loss / inner.accumulation).backward()
            total += float(loss.detach())
            tokens += int(inputs.numel())
        if inner.clip_norm:
            torch.nn.utils.clip_grad_norm_(self._model.parameters(), inner.clip_norm)
        for group in self._optimizer.param_groups:
            group["lr"] = inner.lr_at(step)
        self._optimizer.step()
        self.sync.after_inner_step(step, tokens)
        return total / inner.accumulation, tokens

    def status(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "state": self.state,
            "inner_step": self.inner_step,
            "tokens": self.tokens,
            "loss": self.loss,
            "held_out_loss": self.held_out_loss,
            "throughput": round(self._throughput.rate(), 1),
            "shard": self.shard,
            "data_shards": len(self.assigned) if self._shards is not None else None,
            "joined_from_syncer": self.joined_from_syncer,
            "barrier_wait_s": round(self.barrier_wait_s, 3),
            "min_step_s": self.config.min_step_s,
        }
        if self.sync is not None:
            sync = self.sync.status()
            out["versions"] = sync.pop("versions")
            out["sync"] = sync
        return out


def _data_spec(manifest: Any) -> str | None:
    source = manifest.data.get("source", "builtin")
    return None if source == "builtin" else str(source)


def create_role(ctx: NodeContext) -> LearnerRole:
    return LearnerRole(ctx)
