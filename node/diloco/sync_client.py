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
    see `_anchor_locked`); before a fragment's first dated round, and in the synchronous modes, by the step
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
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import math
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import torch

from node.diloco.counters import CounterBank
from node.diloco.fragments import (
    Fragment,
    FragmentPlan,
    FragmentSchedule,
    SyncFloor,
    SyncFloorConfig,
    plan_fragments,
)

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


def covered_fragments(plan: FragmentPlan, names: Sequence[str] | Mapping[str, Any]) -> list[int]:
    """Global ids of the fragments whose tensors are all in `names`; ValueError if one is only partly in."""
    held = set(names)
    out = []
    for fragment in plan.fragments:
        inside = [n for n in fragment.names if n in held]
        if len(inside) == len(fragment.names):
            out.append(fragment.index)
        elif inside:
            raise ValueError(
                f"fragment {fragment.index} is only partly held ({len(inside)}/{len(fragment.names)} tensors)"
            )
    return out


# ---------------------------------------------------------------------------------------------- messages


@dataclass(frozen=True, kw_only=True, slots=True)
class OutgoingContribution:
    """A snapshot of one fragment, taken when it was due, on its way to the syncer."""

    fragment: int  # global fragment id
    params: dict[str, torch.Tensor]  # private CPU copies
    base_version: int  # version of the global fragment these parameters last overwrote
    steps: int  # inner steps since that overwrite
    tokens: int  # tokens since that overwrite
    sent_step: int  # local inner step at which the snapshot was taken
    sched_step: int  # our schedule step (run-aligned); on the wire: at the time of sending
    step_time_s: float  # the holder's recent mean inner-step time (the syncer's xi_step estimate)
    # verifier token receipts (stage replicas), the newest, added at push time
    receipts: tuple[bytes, ...] = ()
    # term of the syncer we knew when the snapshot was taken: a syncer just taken over ends its recovery
    # early only on snapshots taken for it (everything its holders did through the outage), see the syncer
    seen_term: int = 0


@dataclass(frozen=True, kw_only=True, slots=True)
class PushReceipt:
    target_version: int  # the version that will include the contribution
    term: int | None = None  # term of the syncer that took it (None: unknown, the watcher's view is assumed)
    late: bool = False  # lock-step modes: its round merged without us; load the current versions and realign


@dataclass(frozen=True, kw_only=True, slots=True)
class FragmentVersion:
    """A merged global fragment as published by a syncer."""

    fragment: int
    version: int
    params: dict[str, torch.Tensor]
    term: int = 0  # the lease term of the syncer that published it
    signer: str = ""  # that syncer's peer id
    envelope: bytes | None = None  # the signed frame, kept to offer a successor syncer after a failover


@dataclass(frozen=True, kw_only=True, slots=True)
class VersionsView:
    """The syncer's current version of every fragment of the run."""

    versions: tuple[int, ...]
    term: int
    syncer: str
    barrier: bool = False  # the run is in a synchronous mode: learners wait for their round
    clock: int = 0  # schedule step the run's learners are at (for aligning a late joiner), 0 if unknown
    # per fragment of the run: seconds since its current version was published, at answer time (< 0 unknown:
    # version 0, or one this syncer restored or adopted); () from a syncer that does not say
    ages: tuple[float, ...] = ()
    step_time_s: float = 0.0  # the syncer's EMA of the learners' step time (xi_step), 0 if unknown


class SyncUnavailable(Exception):  # noqa: N818 - reads as the condition
    """No syncer answered (none holds the lease, timeout, connection failure); retry later."""


class SyncDeferred(SyncUnavailable):
    """The syncer answered "not now" (recovering after a takeover, a base version it has yet to adopt, busy):
    the contribution is kept and sent again soon; the other fragments' contributions may go through."""

    def __init__(self, message: str, *, reason: str) -> None:
        super().__init__(message)
        self.reason = reason


class ContributionRefused(Exception):  # noqa: N818
    """The syncer refused a contribution for good (stale base, unknown peer, ...); do not resend it."""

    def __init__(self, message: str, *, reason: str) -> None:
        super().__init__(message)
        self.reason = reason


class SyncTransport(Protocol):
    """How a FragmentSync reaches the syncer. Every call is bounded; raise SyncUnavailable on no answer."""

    async def push(self, contribution: OutgoingContribution) -> PushReceipt:
        """Send a contribution; raise ContributionRefused when the syncer refuses it for good."""

    async def versions(self, known: Sequence[int], wait_s: float) -> VersionsView:
        """The syncer's versions, as soon as one is newer than `known`, else after at most `wait_s`."""

    async def fetch(self, fragment: int) -> FragmentVersion:
        """The syncer's current version of `fragment`."""

    async def offer(self, held: Sequence[FragmentVersion]) -> int:
        """Hand signed versions (from an earlier syncer) to the current one; returns how many it adopted."""


# ---------------------------------------------------------------------------------------------- the client

# bounds on the step time a versions answer may anchor sends with (the syncer ignores reports above 600 s)
MIN_ANCHOR_STEP_S = 1e-3
MAX_ANCHOR_STEP_S = 600.0


@dataclass(frozen=True, kw_only=True, slots=True)
class SyncClientConfig:
    poll_wait_s: float = 5.0  # bound of one versions long-poll
    retry_min_s: float = 0.2  # first pause after the syncer did not answer
    retry_max_s: float = 3.0  # longest pause between retries
    deferred_retry_s: float = 0.5  # pause before re-sending what a syncer deferred (it is there, not ready)
    barrier: bool = False  # synchronous baselines: wait at send step + tau for the round's version
    join_timeout_s: float = 30.0  # how long join_global looks for a syncer before starting from the seed
    step_time_ema: float = 0.2  # weight of a new step time in the reported xi_step
    align_confirmations: int = 5  # decoupled: shift the schedule once this many answers in a row say we lead
    # (or lag) the run's clock; by the smallest offset among them, since the clock estimate jitters
    anchor_rounds: bool = True  # decoupled: time each fragment's next send from its last round's publication
    anchor_lead_steps: float = 1.0  # step times from a round's first send to its publication (~ the grace)

    def __post_init__(self) -> None:
        for name in ("poll_wait_s", "retry_min_s", "retry_max_s", "deferred_retry_s", "join_timeout_s"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"SyncClientConfig.{name} must be finite and > 0, got {value!r}")
        if self.retry_max_s < self.retry_min_s:
            raise ValueError("retry_max_s must be >= retry_min_s")
        if not 0 < self.step_time_ema <= 1:
            raise ValueError("step_time_ema must be in (0, 1]")
        if not (math.isfinite(self.anchor_lead_steps) and self.anchor_lead_steps >= 0):
            raise ValueError("anchor_lead_steps must be finite and >= 0")


@dataclass(slots=True)
class _Pending:
    """A contribution in flight: its merged version is applied at `apply_at` (send step + tau)."""

    base_version: int
    apply_at: int
    target_version: int | None = None  # known once the syncer acknowledged
    contribution: OutgoingContribution | None = None  # kept until answered, to re-send to a new syncer
    term: int | None = None  # term of the syncer that acknowledged it


@dataclass(slots=True)
class _Stats:
    sent: int = 0
    acked: int = 0
    refused: int = 0
    retries: int = 0
    applied: int = 0
    skipped: int = 0  # due sends skipped right after a version overwrote unsent progress
    anchored: int = 0  # fragment send times re-anchored to a published round
    phase_skips: int = 0  # anchored sends skipped because we were a period or more behind them (a stall)
    rejoins: int = 0  # lock-step modes: realigned after a round merged without us (see _rejoin)
    offered: int = 0
    adopted_by_syncer: int = 0
    fetched: int = 0
    last_error: str = ""
    refusals: dict[str, int] = field(default_factory=dict)


def _scheduled_fragments(
    plan: FragmentPlan, params: Mapping[str, torch.Tensor], schedule: FragmentSchedule
) -> list[int]:
    """The plan's fragments `params` cover, one per fragment of `schedule`; ValueError if they disagree."""
    fragment_ids = covered_fragments(plan, params)
    if not fragment_ids:
        raise ValueError("the parameters cover no fragment of the plan")
    if schedule.num_fragments != len(fragment_ids):
        raise ValueError(
            f"schedule has {schedule.num_fragments} fragments, the parameters cover {len(fragment_ids)}"
        )
    return fragment_ids


class FragmentSync:
    """See the module docstring. Thread-safe: `after_inner_step` may run on a worker thread while the
    background loops run on the event loop; shared state is guarded by one lock."""

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
    ) -> None:
        self.params = dict(params)
        self.plan = plan
        self.fragment_ids = _scheduled_fragments(plan, self.params, schedule)
        self.schedule = schedule
        self.floor = floor
        self.transport = transport
        self.config = config or SyncClientConfig()
        self.clock = clock
        # a stage replica's verifier receipts (raw frames, oldest first): relayed with every push so the syncer
        # weighs its work by what verifiers signed (node.diloco.receipts)
        self.receipts = receipts
        self._local = {fid: i for i, fid in enumerate(self.fragment_ids)}
        self._names = [plan.fragments[fid].names for fid in self.fragment_ids]
        self._lock = threading.Lock()
        self._counters = CounterBank(len(self.fragment_ids))
        self._versions = [0] * len(self.fragment_ids)
        self._outbox: dict[int, OutgoingContribution] = {}
        self._pending: dict[int, _Pending] = {}
        self._overwritten_at: dict[int, int] = {}  # fragment -> step a version overwrote unsent progress
        self._inbox: dict[int, FragmentVersion] = {}
        self._held: dict[int, FragmentVersion] = {}  # last applied signed versions, for failover offers
        self._offered: set[tuple[str, int, int]] = set()  # (syncer, fragment, version) already offered
        self._step = 0
        self._sched_offset = 0
        self._align_diffs: list[int] = []  # recent offsets to the run's clock, all of one sign
        # decoupled, per fragment: when its next send is due (our clock) and the version that anchored it; the
        # period is H step times of the run (see _anchor_locked)
        self._due_at: dict[int, float] = {}
        self._anchored: dict[int, int] = {}
        self._period_s = 0.0
        self._last_step_at: float | None = None
        self._step_time_s = 0.0
        self._view: VersionsView | None = None
        self._stats = _Stats()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._outbox_ready: asyncio.Event | None = None
        self._arrived: asyncio.Event | None = None
        # failover hand-offs between the two loops, so that neither sits out its backoff while the other has
        # found the new syncer: the watcher saw a new syncer or term (the sender retries now), the sender got
        # an answer after failures or a deferral (the watcher polls now and offers what the syncer lacks)
        self._reconnected: asyncio.Event | None = None
        self._kick: asyncio.Event | None = None
        self._rejoin_due = False  # lock-step modes: a round merged without us; the watcher realigns us

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
    ) -> FragmentSync:
        """Schedule (H, tau) and real-time floor from the manifest's DilocoSpec."""
        count = len(covered_fragments(plan, params))
        tau = min(spec.overlap_steps, spec.sync_every_steps - 1)
        schedule = FragmentSchedule(
            num_fragments=max(count, 1), sync_every_steps=spec.sync_every_steps, overlap_steps=tau
        )
        floor = SyncFloor(SyncFloorConfig(min_interval_s=spec.min_sync_interval_s))
        return cls(params, plan, schedule, floor, transport, config=config, clock=clock, receipts=receipts)

    # ---- the inner loop's side (any thread) ----

    @property
    def barrier(self) -> bool:
        return self.config.barrier

    def after_inner_step(self, step: int, tokens: int) -> None:
        """Count the step, apply due versions, snapshot due fragments. Never blocks on the network."""
        now = self.clock()
        with self._lock:
            if self._last_step_at is not None:
                self._observe_step_time(now - self._last_step_at)
            self._last_step_at = now
            self._step = step
            self._counters.record_step(tokens)
            self._apply_due_locked(step)
            queued = self._snapshot_due_locked(step, now)
        if queued:
            self._wake(self._outbox_ready)

    def apply_arrived(self, step: int) -> int:
        """Apply versions that arrived and are due at `step` (the barrier loop calls this); returns how many."""
        with self._lock:
            return self._apply_due_locked(step)

    def blocked_at(self, step: int) -> list[int]:
        """Global ids of fragments whose round version is due by `step` but has not been applied."""
        with self._lock:
            return [self.fragment_ids[i] for i, p in self._pending.items() if p.apply_at <= step]

    async def wait_barrier(self, step: int, stop: asyncio.Event) -> float:
        """Synchronous baselines: wait until no round version due by `step` is missing; returns seconds waited."""
        started = self.clock()
        while not stop.is_set():
            self.apply_arrived(step)
            if not self.blocked_at(step):
                break
            arrived = self._arrived
            if arrived is None:
                await asyncio.sleep(0.05)
                continue
            arrived.clear()
            if not self.blocked_at(step):
                continue
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(_first(arrived, stop), self.config.poll_wait_s)
        return self.clock() - started

    def load_global(self, versions: Sequence[FragmentVersion], *, clock: int = 0) -> int:
        """Overwrite the parameters with global versions (counters reset); returns how many were loaded.

        `clock` is the schedule step the run is at: the holder's schedule is shifted so its next sends
        fall in phase with the other learners (in the synchronous modes, on the rounds still open)."""
        loaded = 0
        with self._lock:
            for version in versions:
                index = self._local.get(version.fragment)
                if index is None or not self._fits(version):
                    continue
                self._overwrite_locked(index, version)
                self._pending.pop(index, None)
                loaded += 1
            self._sched_offset = max(0, clock - self._step)
        return loaded

    def align_to_rounds(self) -> int:
        """The schedule step at which the earliest unmerged round of a lock-step run opens, minus one.

        In the synchronous modes every round of fragment p merges exactly one send of each learner, so
        version v means sends 1..v were merged and the next send is number v+1."""
        with self._lock:
            return self._align_to_rounds_locked()

    def _align_to_rounds_locked(self) -> int:
        nexts = [
            self.schedule.next_send(i, 0) + self._versions[i] * self.schedule.sync_every_steps
            for i in range(len(self.fragment_ids))
        ]
        return max(0, min(nexts) - 1)

    # ---- internals under the lock ----

    def _observe_step_time(self, seconds: float) -> None:
        if not math.isfinite(seconds) or seconds < 0:
            return
        alpha = self.config.step_time_ema
        prior = self._step_time_s
        self._step_time_s = seconds if prior == 0.0 else (1 - alpha) * prior + alpha * seconds

    def _apply_due_locked(self, step: int) -> int:
        applied = 0
        missed = False
        for index in list(self._inbox):
            version = self._inbox[index]
            if version.version <= self._versions[index]:
                del self._inbox[index]  # older than what we hold: versions only move forward
                continue
            pending = self._pending.get(index)
            if pending is not None and step < pending.apply_at:
                continue  # tau overlap: the merged version is applied tau steps after the send
            del self._inbox[index]
            if pending is None and not self.config.barrier and self._counters[index].steps > 0:
                # we were behind the learners of that round (the paper's weight 0): our steps since our last
                # overwrite are lost; do not follow up with a near-empty send that would start another round
                self._overwritten_at[index] = step
            missed |= pending is None and self.config.barrier
            self._overwrite_locked(index, version)
            applied += 1
            if pending is not None and (
                pending.target_version is None or version.version >= pending.target_version
            ):
                del self._pending[index]
        if missed and not self._pending:
            # lock-step: a round merged without us while we had nothing in flight (we were stopped and our
            # heartbeat expired); our place in the fragment cycle is now off the others', who wait on a round
            # that needs us while we would wait on another that needs them
            self._realign_locked(step, "a round merged without us")
        return applied

    def _realign_locked(self, step: int, why: str) -> None:
        """Lock-step modes: drop what was built on versions we have since replaced (each would be late in
        turn) and move our schedule to the earliest open round (the held versions say which), as a restarted
        learner does."""
        for index in list(self._pending):
            if self._pending[index].base_version < self._versions[index]:
                del self._pending[index]
        for index in list(self._outbox):
            if self._outbox[index].base_version < self._versions[index]:
                del self._outbox[index]
        clock = self._align_to_rounds_locked()
        self._sched_offset = clock - step  # the next step is the open round's send, either way
        self._stats.rejoins += 1
        logger.info("%s: schedule realigned to the earliest open round (step %d)", why, clock + 1)

    def _overwrite_locked(self, index: int, version: FragmentVersion) -> None:
        with torch.no_grad():
            for name in self._names[index]:
                target = self.params[name]
                target.copy_(version.params[name].to(device=target.device, dtype=target.dtype))
        self._versions[index] = version.version
        self._counters.reset(index)
        if version.envelope is not None:
            self._held[index] = version
        self._stats.applied += 1

    def _due_locked(self, step: int, now: float) -> list[int]:
        """Fragments due to be sent now: an anchored one once its send time has come (see `_anchor_locked`),
        the others by the step schedule shifted to the run's clock."""
        by_schedule = set(self.schedule.due_to_send(step + self._sched_offset))
        due = []
        for index in range(len(self.fragment_ids)):
            due_at = self._due_at.get(index)
            if due_at is None:
                if index in by_schedule:
                    due.append(index)
                continue
            if now < due_at:
                continue
            # the next send one period after this one's due time, not after now: lateness does not pile up
            late_s = now - due_at
            self._due_at[index] = due_at + self._period_s * (1 + int(late_s // self._period_s))
            if late_s >= self._period_s / 2:
                # a stall (SIGSTOP, a long pause) put us a period or more behind: the others sent long ago and
                # a send now would open a round of its own out of phase; wait for the next one (a version
                # that arrives in the meantime re-anchors us)
                self._stats.phase_skips += 1
                continue
            due.append(index)
        return due

    def _anchor_locked(self, view: VersionsView, now: float) -> None:
        """Time each fragment's next send from the publication of its current version (decoupled only).

        All learners see the same publications, so sends timed from them fall together on every round, and
        the phase error cannot build up from round to round as with a step count: a learner that steps 5 %
        slower than another drifts by H/20 steps per period on a step schedule, but here sends on time each
        period (in wall time; that is fewer of its own steps). The next send of fragment p is due
        `H - anchor_lead_steps` step times after its version was published (the round's first send came
        about the grace window, ~one step, before), with the step time the syncer reports (one for
        everyone, so that learners do not drift apart either), and every H step times after that until a
        newer version re-anchors it. A version the syncer cannot date (restored, adopted) anchors nothing."""
        if self.config.barrier or not self.config.anchor_rounds or len(view.ages) != len(view.versions):
            return
        xi = view.step_time_s if view.step_time_s > 0 else self._step_time_s
        if not (math.isfinite(xi) and MIN_ANCHOR_STEP_S <= xi <= MAX_ANCHOR_STEP_S):
            return  # unknown, or nonsense that would make the period overflow: keep the anchors we have
        h = self.schedule.sync_every_steps
        self._period_s = h * xi
        lead = min(self.config.anchor_lead_steps, h - 1)
        for index, fid in enumerate(self.fragment_ids):
            version, age = view.versions[fid], view.ages[fid]
            if (
                version <= 0
                or not (math.isfinite(age) and age >= 0)
                or version <= self._anchored.get(index, 0)
            ):
                continue
            due_at = now - age + (h - lead) * xi
            if due_at < now:  # published more than a period ago (a joiner, a long stall): the next period
                due_at = now + (due_at - now) % self._period_s
            self._due_at[index] = due_at
            self._anchored[index] = version
            self._stats.anchored += 1

    def _snapshot_due_locked(self, step: int, now: float) -> bool:
        queued = False
        sched_step = step + self._sched_offset
        for index in self._due_locked(step, now):
            overwritten = self._overwritten_at.pop(index, None)
            if overwritten is not None and step - overwritten < self.schedule.sync_every_steps // 2:
                self._stats.skipped += 1
                continue  # a few steps since a round we were late for: not worth a round of their own
            counters = self._counters[index]
            if counters.steps == 0 or not self.floor.may_send(index, now):
                continue  # nothing new to contribute, or too soon: counters keep growing until next time
            self._snapshot_locked(index, step, sched_step, now)
            queued = True
        return queued

    def _snapshot_locked(self, index: int, step: int, sched_step: int, now: float) -> None:
        counters = self._counters[index]
        self.floor.mark_sent(index, now)
        with torch.no_grad():
            params = {n: self.params[n].detach().to("cpu", copy=True) for n in self._names[index]}
        self._outbox[index] = OutgoingContribution(
            fragment=self.fragment_ids[index],
            params=params,
            base_version=self._versions[index],
            steps=counters.steps,
            tokens=counters.tokens,
            sent_step=step,
            sched_step=sched_step,
            step_time_s=self._step_time_s,
            seen_term=self._view.term if self._view is not None else 0,
        )
        self._pending[index] = _Pending(
            base_version=self._versions[index], apply_at=self.schedule.apply_at(step)
        )

    # ---- the event loop's side ----

    def _bind_loop(self) -> None:
        if self._loop is None:
            self._loop = asyncio.get_running_loop()
            self._outbox_ready = asyncio.Event()
            self._arrived = asyncio.Event()
            self._reconnected = asyncio.Event()
            self._kick = asyncio.Event()
            if self._outbox:
                self._outbox_ready.set()

    def _wake(self, event: asyncio.Event | None) -> None:
        loop = self._loop
        if loop is None or event is None or loop.is_closed():
            return
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is loop:
            event.set()
        else:
            loop.call_soon_threadsafe(event.set)

    async def run_sender(self, stop: asyncio.Event) -> None:
        """Push snapshots until `stop`; newest per fragment wins; retry with backoff while the syncer is away.

        A contribution the syncer defers (`SyncDeferred`) does not hold back the other fragments' ones, and is
        re-sent after `deferred_retry_s`: after a takeover the new syncer defers a contribution built on a
        version it has yet to adopt, and its recovery window is short."""
        self._bind_loop()
        assert self._outbox_ready is not None and self._reconnected is not None
        backoff = self.config.retry_min_s
        while not stop.is_set():
            with self._lock:
                batch = sorted(self._outbox.items(), key=lambda kv: kv[1].sent_step)
            if not batch:
                self._outbox_ready.clear()
                with self._lock:
                    empty = not self._outbox
                if empty:
                    await _first(self._outbox_ready, stop)
                continue
            outcomes = []
            for index, contribution in batch:
                if stop.is_set():
                    return
                outcome = await self._push_one(index, contribution)
                outcomes.append(outcome)
                if outcome == "unreachable":
                    break
            if "unreachable" in outcomes:
                self._stats.retries += 1
                await self._pause(stop, self._reconnected, backoff)
                backoff = min(backoff * 2, self.config.retry_max_s)
                continue
            if backoff > self.config.retry_min_s or "deferred" in outcomes:
                # a syncer answers again, or lacks a version we hold: the watcher polls and offers now
                self._wake(self._kick)
            backoff = self.config.retry_min_s
            if "deferred" in outcomes:
                self._stats.retries += 1
                await self._pause(stop, self._reconnected, self.config.deferred_retry_s)

    @staticmethod
    async def _pause(stop: asyncio.Event, wake: asyncio.Event, seconds: float) -> None:
        """Wait `seconds`, less if `stop` or `wake` is set first (`wake` is cleared before waiting)."""
        wake.clear()
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(_first(wake, stop), seconds)

    async def _push_one(self, index: int, contribution: OutgoingContribution) -> str:
        """The outcome: settled (acked, or refused for good), deferred (the syncer said not now) or
        unreachable (no syncer answered)."""
        self._stats.sent += 1
        with self._lock:
            now_step = self._step + self._sched_offset
        # the syncer derives the run's schedule clock from what senders report: say where we are now, not
        # where we were when the snapshot was taken (a retried or re-sent one may be seconds old)
        wire = dataclasses.replace(contribution, sched_step=now_step, receipts=self._receipts_now())
        try:
            receipt = await self.transport.push(wire)
        except ContributionRefused as e:
            with self._lock:
                if self._outbox.get(index) is contribution:
                    del self._outbox[index]
                pending = self._pending.get(index)
                if pending is not None and pending.base_version == contribution.base_version:
                    del self._pending[index]  # no round will answer it: never hold a barrier on it
            self._stats.refused += 1
            self._stats.refusals[e.reason] = self._stats.refusals.get(e.reason, 0) + 1
            logger.info("fragment %d contribution refused: %s", contribution.fragment, e)
            self._wake(self._arrived)
            return "settled"
        except SyncUnavailable as e:
            self._stats.last_error = str(e)[:200]
            logger.debug("fragment %d push deferred: %s", contribution.fragment, e)
            return "deferred" if isinstance(e, SyncDeferred) else "unreachable"
        view = self._view
        with self._lock:
            if self._outbox.get(index) is contribution:
                del self._outbox[index]
            if receipt.late and self.config.barrier:
                self._rejoin_due = True
                self._wake(self._kick)
            pending = self._pending.get(index)
            if pending is not None and pending.base_version == contribution.base_version:
                pending.target_version = receipt.target_version
                pending.contribution = contribution
                # the term of the syncer that took it, not the one the watcher last saw: after a takeover the
                # sender may reach the new syncer first, and what it took must not be re-sent on the switch
                pending.term = receipt.term if receipt.term is not None else (view.term if view else None)
        self._stats.acked += 1
        return "settled"

    def _receipts_now(self) -> tuple[bytes, ...]:
        if self.receipts is None:
            return ()
        try:
            return tuple(bytes(f) for f in self.receipts())
        except Exception as e:  # a broken provider costs this push its receipts, not the push
            logger.warning("receipts provider failed: %s: %s", type(e).__name__, e)
            return ()

    async def run_watcher(self, stop: asyncio.Event) -> None:
        """Long-poll versions, fetch newer fragments into the inbox, offer held versions to a lagging syncer.

        After a failed poll the next one does not wait: the syncer may have changed, and a new one that
        lacks a version we hold would otherwise keep the poll open (nothing newer than ours) while its
        recovery window, in which it adopts offered versions, runs out."""
        self._bind_loop()
        assert self._kick is not None
        backoff = self.config.retry_min_s
        wait_s = self.config.poll_wait_s
        while not stop.is_set():
            try:
                if self._rejoin_due:
                    await self._rejoin()
                view = await self.transport.versions(self._known(), wait_s)
                wait_s = self.config.poll_wait_s
                await self._absorb(view)
                backoff = self.config.retry_min_s
                await asyncio.sleep(0)  # a transport that answers without suspending must not starve the loop
            except SyncUnavailable as e:
                self._stats.last_error = str(e)[:200]
                wait_s = 0.0
                await self._pause(stop, self._kick, backoff)
                backoff = min(backoff * 2, self.config.retry_max_s)

    async def _rejoin(self) -> None:
        """Lock-step modes, after the syncer said a contribution of ours was late (its round merged without
        us, say while we were stopped and our heartbeat expired): load every current version and realign the
        schedule to the earliest open round, as a restarted learner does. Waiting for our fragment's next
        round instead deadlocks: the others send to it only after rounds of other fragments that wait for us.
        What we computed since our last overwrites is dropped; the late contributions are merged."""
        view = await self.transport.versions([0] * self.plan.num_fragments, 0.0)
        fetched = [await self.transport.fetch(fid) for fid in self.fragment_ids if view.versions[fid] > 0]
        with self._lock:
            for version in fetched:
                index = self._local.get(version.fragment)
                if index is None or not self._fits(version) or version.version < self._versions[index]:
                    continue
                self._overwrite_locked(index, version)
            self._inbox.clear()
            self._rejoin_due = False
            self._realign_locked(self._step, "a contribution of ours was late")
        self._wake(self._arrived)

    def _known(self) -> list[int]:
        """What we already hold or have fetched, as a run-wide vector (unsynced fragments: the syncer's)."""
        with self._lock:
            view = self._view
            known = list(view.versions) if view is not None else [0] * self.plan.num_fragments
            for index, fid in enumerate(self.fragment_ids):
                inbox = self._inbox.get(index)
                held = self._versions[index]
                known[fid] = max(held, inbox.version if inbox is not None else 0)
        return known

    async def _absorb(self, view: VersionsView) -> None:
        if len(view.versions) != self.plan.num_fragments:
            raise SyncUnavailable(
                f"syncer reports {len(view.versions)} fragments, the plan has {self.plan.num_fragments}"
            )
        previous = self._view
        self._view = view
        with self._lock:
            self._anchor_locked(view, self.clock())
        if not self.config.barrier and view.clock > 0:
            self._align(view.clock)
        if previous is not None and (previous.syncer, previous.term) != (view.syncer, view.term):
            self._resend_unanswered(view)
            self._wake(self._reconnected)
        known = self._known()
        newer = [fid for fid in self.fragment_ids if view.versions[fid] > known[fid]]
        behind = [fid for fid in self.fragment_ids if view.versions[fid] < known[fid]]
        for fid in newer:
            version = await self.transport.fetch(fid)
            self._stats.fetched += 1
            if not self._fits(version):
                continue
            with self._lock:
                index = self._local[fid]
                current = self._inbox.get(index)
                if version.version > self._versions[index] and (
                    current is None or version.version > current.version
                ):
                    self._inbox[index] = version
        if newer:
            self._wake(self._arrived)
        if behind:
            await self._offer(view, behind)

    def _align(self, clock: int) -> None:
        """Keep our schedule in phase with the run's: learners that send a fragment at the same time land in
        the same round (the grace window merges them together) instead of overwriting each other's unsent
        progress with every merge."""
        with self._lock:
            diff = clock - (self._step + self._sched_offset)
            gross = abs(diff) >= max(2, self.schedule.sync_every_steps // 2)  # a restart or a long stall
            votes = self._align_diffs
            if diff == 0 or (votes and (diff > 0) != (votes[-1] > 0)):
                votes.clear()
            if diff != 0:
                votes.append(diff)
            if gross or len(votes) >= self.config.align_confirmations:
                shift = diff if gross else min(votes, key=abs)
                self._sched_offset += shift
                votes.clear()
                logger.info("schedule re-aligned by %+d steps to the run's clock %d", shift, clock)

    def _resend_unanswered(self, view: VersionsView) -> None:
        """A new syncer does not have the rounds of the old one. Decoupled: send it a fresh snapshot of every
        fragment we made progress on (all of it since our last overwrite, the outage included; a snapshot
        queued at a due time in the outage, or one the old syncer took and never answered, lacks the steps
        since, which the merge's overwrite would then discard). Else, and for a fragment without progress,
        queue again what the old syncer acknowledged but never answered (unless a newer snapshot is queued)."""
        fresh = requeued = 0
        with self._lock:
            now = self.clock()
            for index in range(len(self.fragment_ids)):
                if not self.config.barrier and self._counters[index].steps > 0:
                    self._snapshot_locked(index, self._step, self._step + self._sched_offset, now)
                    fresh += 1
                    continue
                pending = self._pending.get(index)
                if pending is None or pending.contribution is None or pending.term == view.term:
                    continue
                if index in self._outbox:
                    continue
                self._outbox[index] = pending.contribution
                pending.target_version = None
                requeued += 1
        if fresh or requeued:
            logger.info(
                "syncer changed to %s (term %d): sending %d fresh snapshots, re-sending %d contributions",
                view.syncer[-8:],
                view.term,
                fresh,
                requeued,
            )
            self._wake(self._outbox_ready)

    def _fits(self, version: FragmentVersion) -> bool:
        """Whether a version carries exactly our tensors of that fragment, with our shapes."""
        index = self._local.get(version.fragment)
        if index is None:
            return False
        names = self._names[index]
        ok = set(version.params) == set(names) and all(
            tuple(version.params[n].shape) == tuple(self.params[n].shape) for n in names
        )
        if not ok:
            logger.warning(
                "ignoring a version of fragment %d that does not fit our tensors", version.fragment
            )
        return ok

    async def _offer(self, view: VersionsView, behind: Sequence[int]) -> None:
        with self._lock:
            offers = []
            for fid in behind:
                held = self._held.get(self._local[fid])
                key = (view.syncer, fid, held.version if held is not None else -1)
                published_elsewhere = held is not None and (held.signer, held.term) != (
                    view.syncer,
                    view.term,
                )
                if held is not None and published_elsewhere and key not in self._offered:
                    offers.append(held)
                    self._offered.add(key)
        if not offers:
            return
        adopted = await self.transport.offer(offers)
        self._stats.offered += len(offers)
        self._stats.adopted_by_syncer += adopted
        logger.info(
            "offered %d held versions to syncer %s, %d adopted", len(offers), view.syncer[-8:], adopted
        )

    async def join_global(self, stop: asyncio.Event, timeout_s: float | None = None) -> bool:
        """Load the current global value of every synced fragment; False if no syncer answered in time."""
        self._bind_loop()
        deadline = self.clock() + (self.config.join_timeout_s if timeout_s is None else timeout_s)
        backoff = self.config.retry_min_s
        while not stop.is_set():
            try:
                view = await self.transport.versions([0] * self.plan.num_fragments, 0.0)
                fetched = [
                    await self.transport.fetch(fid) for fid in self.fragment_ids if view.versions[fid] > 0
                ]
            except SyncUnavailable as e:
                self._stats.last_error = str(e)[:200]
                if self.clock() + backoff > deadline:
                    logger.warning("no syncer answered within the join timeout; starting from the seed")
                    return False
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(stop.wait(), backoff)
                backoff = min(backoff * 2, self.config.retry_max_s)
                continue
            self._view = view
            self.load_global(fetched)
            clock = self.align_to_rounds() if view.barrier else view.clock
            with self._lock:
                self._sched_offset = max(0, clock - self._step)
                self._anchor_locked(view, self.clock())  # in phase with the rounds from our first send
            logger.info(
                "loaded %d global fragments from syncer %s (term %d), schedule clock %d",
                len(fetched),
                view.syncer[-8:],
                view.term,
                clock,
            )
            return True
        return False

    # ---- reporting ----

    def versions(self) -> dict[int, int]:
        """Global fragment id -> version held."""
        with self._lock:
            return {fid: self._versions[i] for i, fid in enumerate(self.fragment_ids)}

    def status(self) -> dict[str, Any]:
        with self._lock:
            view = self._view
            return {
                "versions": {str(fid): self._versions[i] for i, fid in enumerate(self.fragment_ids)},
                "sent": self._stats.sent,
                "acked": self._stats.acked,
                "refused": self._stats.refused,
                "refusals": dict(self._stats.refusals),
                "retries": self._stats.retries,
                "applied": self._stats.applied,
                "sends_skipped": self._stats.skipped,
                "phase_anchors": self._stats.anchored,
                "phase_skips": self._stats.phase_skips,
                "rejoins": self._stats.rejoins,
                "fetched": self._stats.fetched,
                "offered": self._stats.offered,
                "in_flight": len(self._outbox),
                "pending": len(self._pending),
                "syncer": view.syncer if view is not None else None,
                "syncer_term": view.term if view is not None else None,
                "step_time_s": round(self._step_time_s, 4),
                "last_error": self._stats.last_error,
            }


async def _first(event: asyncio.Event, stop: asyncio.Event) -> None:
    """Wait until `event` or `stop` is set."""
    waiters = [asyncio.ensure_future(event.wait()), asyncio.ensure_future(stop.wait())]
    try:
        await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for waiter in waiters:
            waiter.cancel()


# ---------------------------------------------------------------------------------------------- the wire

PUSH_ROUTE = "diloco.push"  # learner -> syncer: Kind.FRAGMENT with the fragment's tensors
VERSIONS_ROUTE = "diloco.versions"  # learner -> syncer: Kind.CONTROL long-poll of the version vector
FETCH_ROUTE = "diloco.fetch"  # learner -> syncer: Kind.CONTROL; answer Kind.VERSION with the tensors
OFFER_ROUTE = "diloco.offer"  # learner -> syncer: signed versions of an earlier syncer, as uint8 tensors
STATE_ROUTE = "diloco.state"  # standby syncer -> syncer: one fragment's params and momentum (syncers only)
MAX_CONTROL_BYTES = 64 * 1024  # a metadata-only frame: header with a version vector and a few fields
OFFER_PREFIX = "offer/"


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
    """Caps for an offer: up to every fragment's signed version, each as one uint8 tensor."""
    from protocol.codec import TensorLimits
    from protocol.envelope import max_frame_bytes

    per_version = max_frame_bytes(fragment_limits(plan))
    return TensorLimits(
        max_bytes=per_version * plan.num_fragments,
        max_tensors=plan.num_fragments,
        max_dim=per_version,
        allowed_dtypes=frozenset({"uint8"}),
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
        self, route: str, frame: bytes | bytearray, max_response_bytes: int, timeout_s: float | None = None
    ) -> tuple[str, bytearray]:
        from hivemind.p2p import P2PDaemonError

        from protocol.errors import ProtocolError, RemoteRefused
        from protocol.rpc import call_framed

        peer, _term = await self.current_syncer()
        try:
            answer = await call_framed(
                self.p2p,
                peer,
                route,
                frame,
                max_response_bytes=max_response_bytes,
                timeout_s=timeout_s or self.call_timeout_s,
            )
        except RemoteRefused:
            raise
        except (asyncio.TimeoutError, ConnectionError, OSError, P2PDaemonError, ProtocolError) as e:
            self.forget_syncer()
            raise SyncUnavailable(f"{route} to {peer[-8:]} failed: {type(e).__name__}: {e}") from None
        return peer, answer

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

        peer, term = await self.current_syncer()
        frame = self._seal(
            Kind.FRAGMENT,
            peer,
            microbatch=contribution.fragment,
            step=contribution.base_version,
            tensors=contribution.params,
            meta=contribution_meta(contribution),
        )
        try:
            peer, answer = await self._call(PUSH_ROUTE, frame, max_frame_bytes(control_limits()))
        except RemoteRefused as e:
            if e.reason in RETRYABLE_REFUSALS:
                raise SyncDeferred(f"push deferred by the syncer: {e.reason}", reason=e.reason) from None
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
        return parse_versions_meta(meta, syncer=peer, num_fragments=self.plan.num_fragments)

    async def fetch(self, fragment: int) -> FragmentVersion:
        from protocol.envelope import Kind, max_frame_bytes
        from protocol.errors import RemoteRefused

        peer, _ = await self.current_syncer()
        frame = self._seal(Kind.CONTROL, peer, microbatch=fragment, step=0, meta={"fragment": fragment})
        try:
            peer, answer = await self._call(FETCH_ROUTE, frame, max_frame_bytes(self.limits))
        except RemoteRefused as e:
            raise SyncUnavailable(f"fetch refused: {e.reason}") from None
        opened = self._open(answer, peer, Kind.VERSION, self.limits)
        return version_from_opened(opened, self.plan, envelope=bytes(answer))

    async def offer(self, held: Sequence[FragmentVersion]) -> int:
        from protocol.envelope import Kind, max_frame_bytes
        from protocol.errors import RemoteRefused

        tensors = {
            f"{OFFER_PREFIX}{v.fragment}": torch.frombuffer(bytearray(v.envelope), dtype=torch.uint8)
            for v in held
            if v.envelope
        }
        if not tensors:
            return 0
        peer, _ = await self.current_syncer()
        frame = self._seal(Kind.CONTROL, peer, microbatch=0, step=0, tensors=tensors)
        try:
            peer, answer = await self._call(OFFER_ROUTE, frame, max_frame_bytes(control_limits()))
        except RemoteRefused as e:
            logger.info("offer refused: %s", e.reason)
            return 0
        adopted = self._open(answer, peer, Kind.CONTROL, control_limits()).meta.get("adopted")
        return adopted if type(adopted) is int else 0


# Refusals that say "not now" rather than "never": the contribution is kept and sent again.
RETRYABLE_REFUSALS = frozenset(
    {"busy", "recovering", "standby", "internal error", "ahead of syncer", "unknown peer"}
)


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


def contribution_meta(contribution: OutgoingContribution) -> dict[str, Any]:
    from protocol.receipts import RECEIPTS_META, receipts_meta

    meta: dict[str, Any] = {
        "fragment": contribution.fragment,
        "base_version": contribution.base_version,
        "steps": contribution.steps,
        "tokens": contribution.tokens,
        "sched_step": contribution.sched_step,
        "step_time_s": float(contribution.step_time_s),
        "seen_term": contribution.seen_term,
    }
    if contribution.receipts:
        meta[RECEIPTS_META] = receipts_meta(contribution.receipts)
    return meta


def parse_versions_meta(meta: Mapping[str, Any], *, syncer: str, num_fragments: int) -> VersionsView:
    versions, term = meta.get("versions"), meta.get("term")
    barrier, clock = meta.get("barrier", False), meta.get("clock", 0)
    ages, step_time_s = meta.get("ages", []), meta.get("step_time_s", 0.0)
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
    )


def version_from_opened(opened: Opened, plan: FragmentPlan, *, envelope: bytes | None) -> FragmentVersion:
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
