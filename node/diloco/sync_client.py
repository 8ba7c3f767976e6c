"""Learner-side Decoupled DiLoCo: `FragmentSync`, the outer-sync machinery every parameter holder shares.

A full-model learner and a pipeline stage replica both train some parameters with AdamW and both are
DiLoCo learners for the fragments those parameters make up. Neither should care where gradients come
from, so this module only sees named parameters and "an inner step happened":

    plan = run_fragment_plan(manifest)                      # one plan for the whole run (all stages)
    sync = FragmentSync.create(params, plan, manifest.diloco, transport)
    supervisor.spawn("diloco-send", partial(sync.run_sender, stop))
    supervisor.spawn("diloco-watch", partial(sync.run_watcher, stop))
    await sync.join_global(stop)                            # late joiner: current global values first
    for each inner step:
        optimizer.step()                                    # in whatever thread owns the parameters
        sync.after_inner_step(step, tokens)                 # same thread; never blocks on the network
        if sync.barrier: await sync.wait_barrier(step, stop)  # synchronous baselines only

API
---
`run_fragment_plan(manifest) -> FragmentPlan`
    The run-wide fragment plan: for each pipeline stage, that stage's tensors bin-packed into
    `diloco.num_fragments` fragments (plus one embedding fragment on stage 0), numbered stage by stage.
    Every learner, stage and syncer of a run derives the same plan, so a stage's fragments are exactly a
    subset of a learner's and the syncer merges both kinds of contribution into the same fragments.

`FragmentSync(params, plan, schedule, floor, transport, *, config=SyncClientConfig(), clock=time.monotonic)`
    `params` maps parameter names to the tensors the holder trains (a stage passes its span). It syncs
    every fragment of `plan` whose tensors are all in `params` (`fragment_ids`, in plan order); a fragment
    only partly covered is a ValueError. `schedule` must have one entry per synced fragment (local index
    i <-> global id `fragment_ids[i]`). `FragmentSync.create(params, plan, diloco_spec, transport)` builds
    schedule and floor from the manifest's DilocoSpec.

`after_inner_step(step, tokens) -> None`
    Call once after every inner step from the thread that owns the parameters, with the number of
    completed inner steps and the tokens of that step. It (1) advances every fragment's counters,
    (2) overwrites fragments whose merged version has arrived and is due (the send step + tau, or at once
    if we had no contribution in flight) and resets their counters, and (3) for each fragment that is due
    and the real-time floor allows, clones its tensors with their counters and hands the copy to the
    background sender. Due: decoupled, H run step times after the last round of that fragment (timed from
    its publication, which the versions answers date, so that all learners send together on every round;
    see `SendTimer.anchor`); before a fragment's first dated round, and in the synchronous modes, by the step
    schedule. Decoupled only: a send due less than H/2 steps after a version overwrote unsent progress of
    that fragment is skipped (it would carry a few steps and start one more round).
    Cost: one tensor copy per due fragment; no I/O, no waiting.

`FragmentSync(..., receipts=provider)`: a stage replica passes a callable returning its verifier token
    receipts (raw frames, oldest first); the newest are relayed with every push (`node.diloco.receipts`).

`run_sender(stop)`, `run_watcher(stop)`
    The two background loops; run them as supervised tasks on the node's event loop. The sender pushes
    snapshots, newest per fragment wins, retrying with backoff while the syncer is away (training goes
    on and the counters keep growing, so nothing is lost but time). The watcher long-polls the syncer's
    version vector, fetches every newer fragment version into an inbox, and, after a syncer failover,
    offers the signed versions we hold to a syncer that is behind them.

`join_global(stop, timeout_s=None) -> bool`, `load_global(versions)`
    Download the current global value of every synced fragment and overwrite the parameters (late
    joiners and restarted learners, before their first step). True if a syncer answered; False if none
    did within the timeout (the holder then starts from the seed, which is version 0).

`wait_barrier(step, stop)`, `barrier`
    Synchronous baselines only (`config.barrier`): block until every fragment due to be applied at
    `step` has received the version that follows its send. Decoupled learners never call it.

`status() -> dict`
    versions per fragment, contributions sent/acked/refused, versions applied, the syncer in use.

`SyncTransport` is the async interface the background loops use; `FramedSyncTransport` implements it
over signed envelopes on `protocol.rpc` framed streams to the syncer that holds the lease in the DHT.
Tests use a fake. The wire helpers at the end of this module (route names, caps, meta keys) are shared
with `node.roles.syncer`, the serving side.

`FragmentSync` itself only wires its parts: the messages, the transport interface and the settings are in
`node.diloco.sync_types`; the state under the lock in `node.diloco.fragment_ledger` (`FragmentLedger`), with
the send times in `node.diloco.send_timer` (`SendTimer`), both pure; the two loops in
`node.diloco.loops_transport` (`SyncSender`, `SyncWatcher`).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import math
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

import torch

from node.diloco.compression import ContributionEncoder
from node.diloco.fragment_ledger import FragmentLedger
from node.diloco.fragments import (
    Fragment,
    FragmentPlan,
    FragmentSchedule,
    SyncFloor,
    SyncFloorConfig,
    covered_fragments,
    plan_fragments,
)
from node.diloco.loops_transport import LoopSignals, SyncSender, SyncWatcher, first
from node.diloco.push_wait import MAX_PUSH_WAIT_S, PUSH_WAIT_FACTOR, push_deadline_s
from node.diloco.sync_types import (
    ContributionRefused,
    FragmentVersion,
    OutgoingContribution,
    PushReceipt,
    SyncClientConfig,
    SyncDeferred,
    SyncStats,
    SyncTransport,
    SyncUnavailable,
    VersionsView,
)
from protocol.compress import CodecSpec

if TYPE_CHECKING:
    from hivemind.p2p import P2P

    from protocol.codec import TensorLimits
    from protocol.dht_io import SwarmRecords
    from protocol.envelope import Opened
    from protocol.identity import NodeIdentity
    from protocol.manifest import DilocoSpec, RunManifest
    from protocol.records import SyncerRecord

logger = logging.getLogger(__name__)


# ---------------------------------------------------------------------------------------------- the plan


def run_fragment_plan(manifest: RunManifest) -> FragmentPlan:
    """The run-wide plan: per pipeline stage, its tensors packed into `diloco.num_fragments` fragments
    (the embedding apart, on stage 0), renumbered stage by stage. Shapes come from meta-device modules,
    so this allocates nothing."""
    from node.ml.model import ModelConfig, StageModule, embedding_param_names, stage_spans

    cfg = ModelConfig.from_dict(manifest.model)
    spans = stage_spans(cfg.num_layers, manifest.num_stages)
    embedding = embedding_param_names(cfg)
    fragments: list[Fragment] = []
    for index, span in enumerate(spans):
        with torch.device("meta"):
            stage = StageModule(cfg, span, is_first=index == 0, is_last=index == len(spans) - 1)
        sizes = {name: p.numel() for name, p in stage.named_parameters()}
        for fragment in plan_fragments(sizes, manifest.diloco.num_fragments, embedding).fragments:
            fragments.append(
                Fragment(
                    index=len(fragments),
                    names=fragment.names,
                    num_params=fragment.num_params,
                    is_embedding=fragment.is_embedding,
                )
            )
    return FragmentPlan(fragments=tuple(fragments))


# ---------------------------------------------------------------------------------------------- the client


class FragmentSync:
    """See the module docstring. Composes the pieces, one job each: the `FragmentLedger` (state under one
    lock, with its `SendTimer`), the `SyncSender` and the `SyncWatcher` (the background loops) and the
    `LoopSignals` between them. Thread-safe: `after_inner_step` may run on a worker thread while the
    background loops run on the event loop."""

    def __init__(
        self,
        params: Mapping[str, torch.Tensor],
        plan: FragmentPlan,
        schedule: FragmentSchedule,
        floor: SyncFloor,
        transport: SyncTransport,
        *,
        config: SyncClientConfig | None = None,
        clock: Callable[[], float] = time.monotonic,
        receipts: Callable[[], Sequence[bytes]] | None = None,
        codec: CodecSpec | None = None,  # the run's outer codec; None or fp32: parameters as they are
    ) -> None:
        self.config = config or SyncClientConfig()
        self.clock = clock
        self.stats = SyncStats()
        lossy = codec is not None and codec.codec != "fp32"
        self.ledger = FragmentLedger(
            params, plan, schedule, floor, config=self.config, clock=clock, stats=self.stats, keep_bases=lossy
        )
        self.signals = LoopSignals()
        # a stage replica's verifier receipts (raw frames, oldest first): relayed with every push so the syncer
        # weighs its work by what verifiers signed (node.diloco.receipts)
        self.sender = SyncSender(
            self.ledger,
            transport,
            self.signals,
            config=self.config,
            stats=self.stats,
            clock=clock,
            receipts=receipts,
            encoder=ContributionEncoder(codec, plan) if codec is not None and lossy else None,
        )
        self.watcher = SyncWatcher(
            self.ledger, transport, self.signals, config=self.config, stats=self.stats, clock=clock
        )

    @classmethod
    def create(
        cls,
        params: Mapping[str, torch.Tensor],
        plan: FragmentPlan,
        spec: DilocoSpec,
        transport: SyncTransport,
        *,
        config: SyncClientConfig | None = None,
        clock: Callable[[], float] = time.monotonic,
        receipts: Callable[[], Sequence[bytes]] | None = None,
        codec: CodecSpec | None = None,
    ) -> FragmentSync:
        """Schedule (H, tau) and real-time floor from the manifest's DilocoSpec; `codec`, its outer codec."""
        count = len(covered_fragments(plan, params))
        tau = min(spec.overlap_steps, spec.sync_every_steps - 1)
        schedule = FragmentSchedule(
            num_fragments=max(count, 1), sync_every_steps=spec.sync_every_steps, overlap_steps=tau
        )
        floor = SyncFloor(SyncFloorConfig(min_interval_s=spec.min_sync_interval_s))
        return cls(
            params,
            plan,
            schedule,
            floor,
            transport,
            config=config,
            clock=clock,
            receipts=receipts,
            codec=codec,
        )

    @property
    def transport(self) -> SyncTransport:
        return self.sender.transport

    @transport.setter
    def transport(self, transport: SyncTransport) -> None:
        """Both loops reach the syncer through this one transport from now on."""
        self.sender.transport = self.watcher.transport = transport

    @property
    def params(self) -> dict[str, torch.Tensor]:
        return self.ledger.params

    @property
    def plan(self) -> FragmentPlan:
        return self.ledger.plan

    @property
    def fragment_ids(self) -> list[int]:
        return self.ledger.fragment_ids

    @property
    def schedule(self) -> FragmentSchedule:
        return self.ledger.schedule

    @property
    def floor(self) -> SyncFloor:
        return self.ledger.floor

    # ---- the inner loop's side (any thread) ----

    @property
    def barrier(self) -> bool:
        return self.config.barrier

    def after_inner_step(self, step: int, tokens: int) -> None:
        """Count the step, apply due versions, snapshot due fragments. Never blocks on the network."""
        if self.ledger.after_inner_step(step, tokens):
            self.signals.wake(self.signals.outbox_ready)

    def apply_arrived(self, step: int) -> int:
        """Apply versions that arrived and are due at `step` (the barrier loop calls this); returns how many."""
        return self.ledger.apply_arrived(step)

    def blocked_at(self, step: int) -> list[int]:
        """Global ids of fragments whose round version is due by `step` but has not been applied."""
        return self.ledger.blocked_at(step)

    async def wait_barrier(self, step: int, stop: asyncio.Event) -> float:
        """Synchronous baselines: wait until no round version due by `step` is missing; returns seconds waited."""
        started = self.clock()
        while not stop.is_set():
            self.apply_arrived(step)
            if not self.blocked_at(step):
                break
            arrived = self.signals.arrived
            if arrived is None:
                await asyncio.sleep(0.05)
                continue
            arrived.clear()
            if not self.blocked_at(step):
                continue
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(first(arrived, stop), self.config.poll_wait_s)
        return self.clock() - started

    def load_global(self, versions: Sequence[FragmentVersion], *, clock: int = 0) -> int:
        """Overwrite the parameters with global versions (counters reset); returns how many were loaded.

        `clock` is the schedule step the run is at: the holder's schedule is shifted so its next sends
        fall in phase with the other learners (in the synchronous modes, on the rounds still open)."""
        return self.ledger.load(versions, clock=clock)

    def align_to_rounds(self) -> int:
        """The schedule step at which the earliest unmerged round of a lock-step run opens, minus one
        (`SendTimer.open_round`)."""
        return self.ledger.open_round()

    # ---- the event loop's side ----

    async def run_sender(self, stop: asyncio.Event) -> None:
        """Push snapshots until `stop` (`SyncSender.run`)."""
        await self.sender.run(stop)

    async def run_watcher(self, stop: asyncio.Event) -> None:
        """Long-poll versions until `stop`, fetch newer fragments, offer held ones (`SyncWatcher.run`)."""
        await self.watcher.run(stop)

    async def join_global(self, stop: asyncio.Event, timeout_s: float | None = None) -> bool:
        """Load the current global value of every synced fragment; False if no syncer answered in time."""
        return await self.watcher.join(stop, timeout_s)

    # ---- reporting ----

    def versions(self) -> dict[int, int]:
        """Global fragment id -> version held."""
        return self.ledger.held_versions()

    def status(self) -> dict[str, Any]:
        return self.ledger.status()


# ---------------------------------------------------------------------------------------------- the wire

PUSH_ROUTE = "diloco.push"  # learner -> syncer: Kind.FRAGMENT with the fragment's tensors
VERSIONS_ROUTE = "diloco.versions"  # learner -> syncer: Kind.CONTROL long-poll of the version vector
FETCH_ROUTE = "diloco.fetch"  # learner -> syncer: Kind.CONTROL; answer Kind.VERSION with the tensors
OFFER_ROUTE = "diloco.offer"  # learner -> syncer: signed versions of an earlier syncer, as uint8 tensors
STATE_ROUTE = "diloco.state"  # standby syncer -> syncer: one fragment's params and momentum (syncers only)
MAX_CONTROL_BYTES = 64 * 1024  # a metadata-only frame: header with a version vector and a few fields
OFFER_PREFIX = "offer/"
# A call moving a fragment may take base + its bytes at this rate: a flat 10 s timed out every push and fetch of a
# llama-124m fragment (~100 MiB) on links under ~10 MiB/s, and the learner retried the same push for good.
TRANSFER_RATE_BYTES_S = 8 * 1024 * 1024
T = TypeVar("T")


def transfer_timeout_s(base_s: float, num_bytes: int, rate_bytes_s: float = TRANSFER_RATE_BYTES_S) -> float:
    """Timeout of a call that moves `num_bytes` (request and answer together): `base_s` + bytes / rate."""
    return base_s + max(0, num_bytes) / rate_bytes_s


async def answer_within(call: Awaitable[T], deadline_s: Callable[[], float], clock: Callable[[], float]) -> T:
    """`call`'s result, or asyncio.TimeoutError (the call cancelled) once `deadline_s()` seconds have passed since the
    start; the deadline is read again each time it is reached, so a longer one announced meanwhile extends the wait
    (a push the syncer is still judging: node.diloco.push_wait)."""
    started = clock()
    task = asyncio.ensure_future(call)
    try:
        while not task.done():
            remaining = started + deadline_s() - clock()
            if remaining <= 0:
                raise asyncio.TimeoutError
            await asyncio.wait({task}, timeout=remaining)
        return task.result()
    finally:
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task


def fragment_bytes(plan: FragmentPlan, fragment: int, *, factor: int = 1) -> int:
    """fp32 bytes of one fragment's tensors (x `factor`: params and momentum), what a fetch or state answer moves."""
    return plan.fragments[fragment].num_params * 4 * factor


def fragment_limits(plan: FragmentPlan, *, factor: int = 1) -> TensorLimits:
    """Caps for a frame carrying one fragment (float tensors), or `factor` times that (params + momentum)."""
    from protocol.codec import FLOAT_DTYPES, TensorLimits

    largest = max(f.num_params for f in plan.fragments)
    most_tensors = max(len(f.names) for f in plan.fragments)
    return TensorLimits(
        max_bytes=largest * 4 * factor,
        max_tensors=most_tensors * factor,
        allowed_dtypes=FLOAT_DTYPES,
    )


def offer_limits(plan: FragmentPlan) -> TensorLimits:
    """Caps for an offer: one fragment's signed version as one uint8 tensor. One per request, so that an offer is
    no larger than a push and the syncer's bytes in flight stay ~2 fragments whatever the fragment count."""
    from protocol.codec import TensorLimits
    from protocol.envelope import max_frame_bytes

    per_version = max_frame_bytes(fragment_limits(plan))
    return TensorLimits(
        max_bytes=per_version, max_tensors=1, max_dim=per_version, allowed_dtypes=frozenset({"uint8"})
    )


def control_limits() -> TensorLimits:
    from protocol.codec import TensorLimits

    return TensorLimits(max_bytes=1, max_tensors=1)


def open_version_envelope(
    frame: bytes | bytearray | memoryview,
    *,
    run_id: str,
    receiver: str,
    signer_candidates: Sequence[str],
    limits: TensorLimits,
    now: float,
    max_age_s: float,
) -> Opened:
    """Verify a signed version frame from one of `signer_candidates` (authorized syncers), however it reached
    us (directly, or relayed by a learner after a failover). The receiver named in it must be `receiver`."""
    from protocol.envelope import Context, Kind, open_envelope
    from protocol.errors import SignerMismatch, WrongContext
    from protocol.replay import ReplayConfig, ReplayGuard

    expect = Context(run_id=run_id, kind=Kind.VERSION, receiver=receiver)
    last: Exception = WrongContext("no authorized syncer to check against")
    for candidate in signer_candidates:
        guard = ReplayGuard(ReplayConfig(max_skew_s=max_age_s))
        try:
            return open_envelope(
                frame, remote_peer=candidate, expect=expect, limits=limits, replay=guard, now=now
            )
        except SignerMismatch as e:
            last = e
    raise last


class FramedSyncTransport:
    """`SyncTransport` over signed envelopes on framed streams to the syncer holding the DHT lease.

    The syncer is looked up in the run's `syncer` records: among authorized syncers whose record says
    `active` with an unexpired lease, the highest term wins (ties: lowest peer id). The choice is cached
    for `lookup_period_s` and dropped when a call fails, so a failover is noticed within a lease period.
    """

    def __init__(
        self,
        p2p: P2P,
        identity: NodeIdentity,
        records: SwarmRecords,
        plan: FragmentPlan,
        *,
        authorized_syncers: Sequence[str],
        call_timeout_s: float = 10.0,
        lookup_period_s: float = 2.0,
        wall_clock: Callable[[], float] = time.time,
        dht_clock: Callable[[], float] | None = None,
        admission: int | None = None,
        push_wait_factor: float = PUSH_WAIT_FACTOR,
        max_push_wait_s: float = MAX_PUSH_WAIT_S,
    ) -> None:
        from protocol.replay import ReplayGuard

        self.p2p = p2p
        self.identity = identity
        self.records = records
        self.plan = plan
        self.run_id = records.run_id
        self.authorized = tuple(authorized_syncers)
        self.call_timeout_s = call_timeout_s
        self.lookup_period_s = lookup_period_s
        self.wall_clock = wall_clock
        self.dht_clock = dht_clock or records.clock
        self.limits = fragment_limits(plan)
        # our admission proof (protocol.admission, node.swarm.admission), sent with every push; None: none needed
        self.admission = admission
        # a push waits for its answer the transfer timeout plus this x the hold its syncer announced (capped;
        # node.diloco.push_wait); factor 0: the transfer timeout alone, as before issue 17's fix
        self.push_wait_factor = push_wait_factor
        self.max_push_wait_s = max_push_wait_s
        self._push_wait: tuple[str, float] = ("", 0.0)  # (syncer, its latest announced hold in seconds)
        self._replay = ReplayGuard()
        self._syncer: tuple[str, int] | None = None  # (peer id, term)
        self._looked_up_at = -math.inf

    async def current_syncer(self) -> tuple[str, int]:
        """(peer id, term) of the syncer to talk to; SyncUnavailable if no authorized one holds the lease."""
        if self._syncer is not None and time.monotonic() - self._looked_up_at < self.lookup_period_s:
            return self._syncer
        try:
            found = await self.records.list_syncers()
        except (asyncio.TimeoutError, OSError) as e:
            raise SyncUnavailable(f"syncer lookup failed: {type(e).__name__}") from None
        choice = choose_syncer(found, now=self.dht_clock(), authorized=self.authorized)
        self._looked_up_at = time.monotonic()
        if choice is None:
            self._syncer = None
            raise SyncUnavailable("no authorized syncer holds the lease")
        self._syncer = (choice.peer_id, choice.state.term)
        return self._syncer

    def forget_syncer(self) -> None:
        self._syncer = None

    async def _call(
        self,
        route: str,
        frame: bytes | bytearray,
        max_response_bytes: int,
        timeout_s: float | None = None,
        *,
        answer_bytes: int = 0,
        judged: bool = False,
    ) -> tuple[str, bytearray]:
        """One call to the syncer; without `timeout_s`, the timeout grows with the frame's bytes and the
        `answer_bytes` expected back (`transfer_timeout_s`). `judged` (a push): plus the hold the syncer announces,
        re-read while the call waits (`answer_within`)."""
        from hivemind.p2p import P2PDaemonError

        from protocol.errors import ProtocolError, RemoteRefused
        from protocol.rpc import call_framed

        peer, _term = await self.current_syncer()
        limit_s = timeout_s or transfer_timeout_s(self.call_timeout_s, len(frame) + answer_bytes)
        deadline_s = functools.partial(self._deadline_s, peer, limit_s, judged)
        try:
            call = call_framed(
                self.p2p,
                peer,
                route,
                frame,
                max_response_bytes=max_response_bytes,
                timeout_s=limit_s + (self.max_push_wait_s if judged else 0.0),
                # a push's answer comes after its judgement: its first bytes are awaited as long as the call (the
                # stream layer's 10 s for them cut off every push judged longer: issue 17), else 10 s as before
                answer_wait_s=limit_s + self.max_push_wait_s if judged else None,
            )
            answer = await answer_within(call, deadline_s, time.monotonic)
        except RemoteRefused:
            raise
        except (asyncio.TimeoutError, ConnectionError, OSError, P2PDaemonError, ProtocolError) as e:
            self.forget_syncer()
            raise SyncUnavailable(f"{route} to {peer[-8:]} failed: {type(e).__name__}: {e}") from None
        return peer, answer

    def _deadline_s(self, peer: str, limit_s: float, judged: bool) -> float:
        """Seconds a call to `peer` waits for its answer (see `_call`)."""
        announcer, announced_s = self._push_wait
        if not judged or announcer != peer:
            return limit_s
        return push_deadline_s(limit_s, announced_s, factor=self.push_wait_factor, cap_s=self.max_push_wait_s)

    def _seal(self, kind: Any, receiver: str, **kwargs: Any) -> bytearray:
        from protocol.envelope import Context, seal

        context = Context(run_id=self.run_id, kind=kind, receiver=receiver)
        return seal(self.identity, context, now=self.wall_clock(), **kwargs)

    def _open(self, answer: bytearray, peer: str, kind: Any, limits: TensorLimits) -> Opened:
        from protocol.envelope import Context, open_envelope
        from protocol.errors import ProtocolError

        expect = Context(run_id=self.run_id, kind=kind, receiver=self.identity.peer_id)
        try:
            return open_envelope(
                answer,
                remote_peer=peer,
                expect=expect,
                limits=limits,
                replay=self._replay,
                now=self.wall_clock(),
            )
        except ProtocolError as e:
            self.forget_syncer()
            raise SyncUnavailable(f"answer of {peer[-8:]} rejected: {e.reason}: {e}") from None

    async def push(self, contribution: OutgoingContribution) -> PushReceipt:
        from protocol.envelope import Kind, max_frame_bytes
        from protocol.errors import RemoteRefused
        from protocol.rpc import PeerThrottled

        peer, term = await self.current_syncer()
        frame = self._seal(
            Kind.FRAGMENT,
            peer,
            microbatch=contribution.fragment,
            step=contribution.base_version,
            tensors=contribution.params,
            meta=contribution_meta(contribution, admission=self.admission),
        )
        try:
            peer, answer = await self._call(PUSH_ROUTE, frame, max_frame_bytes(control_limits()), judged=True)
        except RemoteRefused as e:
            if is_retryable(e):
                # a throttle carries the limiter's hint (finite here: an infinite one is not retryable)
                hint = e.retry_after_s if isinstance(e, PeerThrottled) else None
                raise SyncDeferred(
                    f"push deferred by the syncer: {e.reason}", reason=e.reason, retry_after_s=hint
                ) from None
            raise ContributionRefused(str(e), reason=e.reason) from None
        opened = self._open(answer, peer, Kind.CONTROL, control_limits())
        target = opened.meta.get("target_version")
        if type(target) is not int or target < 0:
            raise SyncUnavailable("push answer lacks target_version")
        return PushReceipt(target_version=target, term=term, late=opened.meta.get("late") is True)

    async def versions(self, known: Sequence[int], wait_s: float) -> VersionsView:
        from protocol.envelope import Kind, max_frame_bytes
        from protocol.errors import RemoteRefused

        peer, term = await self.current_syncer()
        frame = self._seal(
            Kind.CONTROL,
            peer,
            microbatch=0,
            step=0,
            meta={"known": [int(v) for v in known], "wait_s": float(wait_s)},
        )
        try:
            peer, answer = await self._call(
                VERSIONS_ROUTE, frame, max_frame_bytes(control_limits()), self.call_timeout_s + wait_s
            )
        except RemoteRefused as e:
            self.forget_syncer()
            raise SyncUnavailable(f"versions refused: {e.reason}") from None
        meta = self._open(answer, peer, Kind.CONTROL, control_limits()).meta
        view = parse_versions_meta(meta, syncer=peer, num_fragments=self.plan.num_fragments)
        self._push_wait = (peer, view.push_wait_s)
        return view

    async def fetch(self, fragment: int) -> FragmentVersion:
        from protocol.envelope import Kind, max_frame_bytes
        from protocol.errors import RemoteRefused

        peer, _ = await self.current_syncer()
        frame = self._seal(Kind.CONTROL, peer, microbatch=fragment, step=0, meta={"fragment": fragment})
        try:
            peer, answer = await self._call(
                FETCH_ROUTE,
                frame,
                max_frame_bytes(self.limits),
                answer_bytes=fragment_bytes(self.plan, fragment)
                if 0 <= fragment < self.plan.num_fragments
                else 0,
            )
        except RemoteRefused as e:
            raise SyncUnavailable(f"fetch refused: {e.reason}") from None
        opened = self._open(answer, peer, Kind.VERSION, self.limits)
        # the answer itself is the signed frame kept to offer: a copy of it (`bytes(answer)`) held a third
        # fragment-sized buffer beside the frame and its decoded tensors at every fetch
        return version_from_opened(opened, self.plan, envelope=answer)

    async def offer(self, held: Sequence[FragmentVersion]) -> int:
        """Offer each held version (one request each, see `offer_limits`); how many the syncer adopted."""
        adopted = 0
        for version in held:
            if version.envelope:
                adopted += await self._offer_one(version.fragment, version.envelope)
        return adopted

    async def _offer_one(self, fragment: int, envelope: bytes | bytearray) -> int:
        from protocol.envelope import Kind, max_frame_bytes
        from protocol.errors import RemoteRefused

        tensor = torch.frombuffer(bytearray(envelope), dtype=torch.uint8)
        peer, _ = await self.current_syncer()
        frame = self._seal(
            Kind.CONTROL, peer, microbatch=0, step=0, tensors={f"{OFFER_PREFIX}{fragment}": tensor}
        )
        try:
            peer, answer = await self._call(OFFER_ROUTE, frame, max_frame_bytes(control_limits()))
        except RemoteRefused as e:
            logger.info("offer of fragment %d refused: %s", fragment, e.reason)
            return 0
        adopted = self._open(answer, peer, Kind.CONTROL, control_limits()).meta.get("adopted")
        return adopted if type(adopted) is int else 0


# Refusals that say "not now" rather than "never": the contribution is kept and sent again.
RETRYABLE_REFUSALS = frozenset(
    {"busy", "recovering", "standby", "internal error", "ahead of syncer", "unknown peer"}
)


def is_retryable(error: Exception) -> bool:
    """A "not now": a retryable reason, or a refusal for load that could pass later (other peers' requests held
    the syncer's bytes in flight when a chunk of ours arrived); one that can never pass (`retry_after_s` inf: a
    request over the syncer's caps alone) is final."""
    from protocol.rpc import PeerThrottled

    if isinstance(error, PeerThrottled):
        return math.isfinite(error.retry_after_s)
    return getattr(error, "reason", None) in RETRYABLE_REFUSALS


def choose_syncer(
    found: Sequence[SyncerRecord], *, now: float, authorized: Sequence[str]
) -> SyncerRecord | None:
    """The active syncer learners should use: unexpired active lease, highest term, then lowest peer id."""
    live = [
        r
        for r in found
        if r.peer_id in authorized and r.state.state == "active" and r.state.lease_until > now
    ]
    if not live:
        return None
    return min(live, key=lambda r: (-r.state.term, r.peer_id))


def contribution_meta(contribution: OutgoingContribution, *, admission: int | None = None) -> dict[str, Any]:
    from protocol.admission import ADMISSION_META
    from protocol.receipts import RECEIPTS_META, receipts_meta

    meta: dict[str, Any] = {
        "fragment": contribution.fragment,
        "base_version": contribution.base_version,
        "steps": contribution.steps,
        "tokens": contribution.tokens,
        "sched_step": contribution.sched_step,
        "step_time_s": float(contribution.step_time_s),
        "seen_term": contribution.seen_term,
        **contribution.codec_meta,  # a lossy codec's header (keys under protocol.compress.META_PREFIX)
    }
    if contribution.receipts:
        meta[RECEIPTS_META] = receipts_meta(contribution.receipts)
    if admission is not None:
        meta[ADMISSION_META] = admission
    return meta


def parse_versions_meta(meta: Mapping[str, Any], *, syncer: str, num_fragments: int) -> VersionsView:
    versions, term = meta.get("versions"), meta.get("term")
    barrier, clock = meta.get("barrier", False), meta.get("clock", 0)
    ages, step_time_s = meta.get("ages", []), meta.get("step_time_s", 0.0)
    push_wait_s = meta.get("push_wait_s", 0.0)  # an older syncer does not say
    ok = (
        isinstance(versions, list)
        and len(versions) == num_fragments
        and all(type(v) is int and v >= 0 for v in versions)
        and type(term) is int
        and type(barrier) is bool
        and type(clock) is int
        and isinstance(ages, list)
        and len(ages) in (0, num_fragments)
        and all(type(a) is float and math.isfinite(a) for a in ages)
        and type(step_time_s) is float
        and math.isfinite(step_time_s)
        and type(push_wait_s) is float
        and math.isfinite(push_wait_s)
    )
    if not ok or not isinstance(versions, list) or not isinstance(term, int):
        raise SyncUnavailable("malformed versions answer")
    return VersionsView(
        versions=tuple(versions),
        term=term,
        syncer=syncer,
        barrier=barrier,
        clock=max(clock, 0),
        ages=tuple(ages),
        step_time_s=max(step_time_s, 0.0),
        push_wait_s=max(push_wait_s, 0.0),
    )


def version_from_opened(
    opened: Opened, plan: FragmentPlan, *, envelope: bytes | bytearray | None
) -> FragmentVersion:
    """A FragmentVersion from a verified Kind.VERSION frame; SyncUnavailable if it does not fit the plan."""
    header = opened.header
    fragment = header.microbatch
    if not 0 <= fragment < plan.num_fragments:
        raise SyncUnavailable(f"version of unknown fragment {fragment}")
    names = plan.fragments[fragment].names
    if set(opened.tensors) != set(names):
        raise SyncUnavailable(f"version of fragment {fragment} has the wrong tensors")
    term = opened.meta.get("term", 0)
    return FragmentVersion(
        fragment=fragment,
        version=header.step,
        params=dict(opened.tensors),
        term=term if type(term) is int else 0,
        signer=header.sender,
        envelope=envelope,
    )
