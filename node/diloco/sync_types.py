"""What a learner and the syncer exchange (`FragmentSync`'s side): the messages, the async `SyncTransport`
interface the background loops call, the client's settings and its counters. Pure data: no I/O here."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from protocol.envelope import MetaValue

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
    # a lossy outer codec: the version these parameters last overwrote (the base of the encoded delta), and
    # on the wire the codec's header (`params` then holds the one encoded payload)
    base: Mapping[str, torch.Tensor] | None = None
    codec_meta: Mapping[str, MetaValue] = field(default_factory=dict)


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
    # the signed frame, kept to offer a successor syncer after a failover (as received: never written to)
    envelope: bytes | bytearray | None = None


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
    # the longest its push route held a recent or open push before answering (node.diloco.push_wait), 0 if unknown
    push_wait_s: float = 0.0


class SyncUnavailable(Exception):  # noqa: N818 - reads as the condition
    """No syncer answered (none holds the lease, timeout, connection failure); retry later."""


class SyncDeferred(SyncUnavailable):
    """The syncer answered "not now" (recovering after a takeover, a base version it has yet to adopt, busy):
    the contribution is kept and sent again soon; the other fragments' contributions may go through."""

    def __init__(self, message: str, *, reason: str, retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.reason = reason
        # set when the syncer's limiter refused the push for load (`protocol.rpc.PeerThrottled`): its hint, 0 when
        # it cannot tell (bytes in flight); None for a refusal of the syncer's own state (recovering, ahead of it)
        self.retry_after_s = retry_after_s

    @property
    def throttled(self) -> bool:
        return self.retry_after_s is not None


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


# ---------------------------------------------------------------------------------------------- settings


@dataclass(frozen=True, kw_only=True, slots=True)
class SyncClientConfig:
    poll_wait_s: float = 5.0  # bound of one versions long-poll
    retry_min_s: float = 0.2  # first pause after the syncer did not answer
    retry_max_s: float = 3.0  # longest pause between retries
    deferred_retry_s: float = 0.5  # pause before re-sending what a syncer deferred (it is there, not ready)
    # a push the syncer's limiter throttled: backoff from deferred_retry_s doubling per throttle in a row up to this,
    # shortened by up to this fraction at random; at most flood_budget throttles per flood_window_s (the syncer
    # reports a flood past 20 in 10 s: node.diloco.push_pacer); pace_throttles False: the fixed deferred_retry_s
    throttle_backoff_max_s: float = 8.0
    throttle_jitter: float = 0.25
    flood_budget: int = 10
    flood_window_s: float = 10.0
    pace_throttles: bool = True
    barrier: bool = False  # synchronous baselines: wait at send step + tau for the round's version
    join_timeout_s: float = 30.0  # how long join_global looks for a syncer before starting from the seed
    step_time_ema: float = 0.2  # weight of a new step time in the reported xi_step
    align_confirmations: int = 5  # decoupled: shift the schedule once this many answers in a row say we lead
    # (or lag) the run's clock; by the smallest offset among them, since the clock estimate jitters
    anchor_rounds: bool = True  # decoupled: time each fragment's next send from its last round's publication
    anchor_lead_steps: float = 1.0  # step times from a round's first send to its publication (~ the grace)

    def __post_init__(self) -> None:
        names = (
            "poll_wait_s",
            "retry_min_s",
            "retry_max_s",
            "deferred_retry_s",
            "join_timeout_s",
            "flood_window_s",
        )
        for name in (*names, "throttle_backoff_max_s"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"SyncClientConfig.{name} must be finite and > 0, got {value!r}")
        if self.throttle_backoff_max_s < self.deferred_retry_s:
            raise ValueError("throttle_backoff_max_s must be >= deferred_retry_s")
        if not 0 <= self.throttle_jitter < 1:
            raise ValueError("throttle_jitter must be in [0, 1)")
        if self.flood_budget < 1:
            raise ValueError("flood_budget must be >= 1")
        if self.retry_max_s < self.retry_min_s:
            raise ValueError("retry_max_s must be >= retry_min_s")
        if not 0 < self.step_time_ema <= 1:
            raise ValueError("step_time_ema must be in (0, 1]")
        if not (math.isfinite(self.anchor_lead_steps) and self.anchor_lead_steps >= 0):
            raise ValueError("anchor_lead_steps must be finite and >= 0")


@dataclass(slots=True)
class SyncStats:
    """Counters of one FragmentSync, shared by its ledger, its send timer and its two loops (`status()`)."""

    sent: int = 0
    acked: int = 0
    refused: int = 0
    retries: int = 0
    throttled: int = 0  # pushes the syncer's limiter refused for load (paced by node.diloco.push_pacer)
    unanswered: int = 0  # pushes that got no answer: the call timed out or failed (not a refusal)
    applied: int = 0
    skipped: int = 0  # due sends skipped right after a version overwrote unsent progress
    anchored: int = 0  # fragment send times re-anchored to a published round
    phase_skips: int = 0  # anchored sends skipped because we were a period or more behind them (a stall)
    rejoins: int = 0  # lock-step modes: realigned after a round merged without us (see SyncWatcher._rejoin)
    offered: int = 0
    adopted_by_syncer: int = 0
    fetched: int = 0
    last_error: str = ""
    refusals: dict[str, int] = field(default_factory=dict)
    push_bytes: int = 0  # tensor bytes of the pushes the syncer took, as sent (encoded, under a lossy codec)
    push_bytes_fp32: int = 0  # what the same pushes would have been as float32 parameters

    def counts(self) -> dict[str, Any]:
        """The counters as `FragmentSync.status()` names them."""
        return {
            "sent": self.sent,
            "acked": self.acked,
            "push_bytes": self.push_bytes,
            "push_bytes_fp32": self.push_bytes_fp32,
            "refused": self.refused,
            "refusals": dict(self.refusals),
            "retries": self.retries,
            "throttled": self.throttled,
            "unanswered": self.unanswered,
            "applied": self.applied,
            "sends_skipped": self.skipped,
            "phase_anchors": self.anchored,
            "phase_skips": self.phase_skips,
            "rejoins": self.rejoins,
            "fetched": self.fetched,
            "offered": self.offered,
        }
