"""The syncer role: holds the global fragments and their outer Nesterov state, merges learner contributions by
quorum, publishes versions, and hands over to a standby when it dies.

Two layers:

* `SyncerCore` (no sockets, no clock of its own): the global parameters, fragment versions and momentum;
  one open round per fragment; admission of a contribution (staleness, idempotency, counter caps); the
  quorum/grace decision (`QuorumPolicy`); the merge (`merge_fragment` + `OuterNesterov`), split into a
  heavy `compute_merge` (run in a worker thread) and a cheap `commit_merge`; snapshots for checkpoints.
* `SyncerRole` (`create_role(ctx)`): the networked shell. Framed, signed RPCs (`node.diloco.sync_client`
  names them): push a contribution, long-poll the version vector, fetch a fragment version, offer
  versions signed by an earlier syncer, and (syncers only) read the state for mirroring. A lease record
  in the DHT says which authorized syncer is active; the others stand by, mirror the active one, and
  take over when its lease lapses.

Failover (docs/diloco.md has the full story). The active syncer renews `<run_id>/syncer` every
`renew_every_s` with `lease_until = now + lease_s`, its term and its versions. It never merges while its
own lease has expired (a SIGSTOPped primary that wakes up re-reads the DHT first and steps down if a
higher term took over). A standby that sees no live active lease in two consecutive looks takes over
with term + 1, resuming from the freshest of (a) the latest safetensors checkpoint in its checkpoint
directory (shared with the primary where the operator can arrange it) and (b) its own mirror of the
primary's state, pulled every `mirror_every_s`. For `recovery_s` after a takeover it accepts
contributions and offers but does not merge: learners keep the last version envelope of each fragment
they applied, signed by the syncer that published it, and offer those that are newer than what the new
syncer serves; the new syncer verifies the signature (an authorized syncer, this run, this learner as
receiver) and adopts them, so versions only move forward.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import math
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from node.diloco.counters import cap_counters
from node.diloco.fragments import FragmentPlan
from node.diloco.merge import Contribution, MergeResult, NothingToMerge, merge_fragment
from node.diloco.outer import STATE_PREFIX, OuterNesterov
from node.diloco.quorum import QuorumConfig, QuorumPolicy
from node.diloco.receipts import ReceiptLedger
from node.diloco.sync_client import (
    FETCH_ROUTE,
    OFFER_PREFIX,
    OFFER_ROUTE,
    PUSH_ROUTE,
    STATE_ROUTE,
    VERSIONS_ROUTE,
    FramedSyncTransport,
    SyncUnavailable,
    choose_syncer,
    control_limits,
    fragment_limits,
    offer_limits,
    open_version_envelope,
    run_fragment_plan,
)
from node.ml.checkpoint import (
    CheckpointError,
    SyncerSnapshot,
    checkpoint_path,
    ledger_from_json,
    load_checkpoint,
    save_checkpoint,
)
from protocol.errors import ConfigError, MalformedFrame, ProtocolError
from protocol.receipts import FORGERY_REASONS, parse_receipts_meta, verify_receipts

if TYPE_CHECKING:
    from node.context import NodeContext
    from protocol.receipts import TokenReceipt
    from protocol.records import SyncerRecord

logger = logging.getLogger(__name__)
RECENT_MERGES = 64  # merges kept for /api/status (the JSONL tape keeps them all)

MODES = ("decoupled", "sync", "elastic_sync")
HOLDER_ROLES = ("learner", "stage")
MAX_STEP_TIME_S = 600.0  # a self-reported step time above this is nonsense; it only feeds the grace EMA
OFFER_MAX_AGE_S = 7 * 86400.0  # a signed version stays offerable this long after it was published


# ---------------------------------------------------------------------------------------------- config


@dataclass(frozen=True, kw_only=True, slots=True)
class SyncerConfig:
    """Syncer-local settings (node.toml `[syncer]`); run-wide ones (mode, K, H, tau, gamma) are in the manifest."""

    lease_s: float = 6.0  # a lease lasts this long past each renewal
    renew_every_s: float = 2.0  # renewal period (and how often a standby looks at the lease)
    recovery_s: float = 6.0  # after a takeover: collect offers from learners before merging
    checkpoint_every_merges: int = 16  # also on takeover and on shutdown
    checkpoint_dir: str = ""  # "" = <state_dir>/syncer; point primary and standby at one shared dir
    mirror_every_s: float = 2.0  # a standby pulls the active syncer's changed fragments this often
    max_steps_per_s: float = 50.0  # cap on claimed inner steps per second of elapsed time
    max_staleness: int = 2  # contributions built on a version older than current - this are refused
    clip_factor: float = 3.0  # outlier clipping at clip_factor x the median delta norm; 0 disables
    max_grace_s: float = 5.0  # absolute cap on the grace window
    max_poll_s: float = 10.0  # longest versions long-poll served
    membership_refresh_s: float = 1.0  # how often the live learner/stage list is re-read
    # A standby takes over only while it sees most of the learners/stages it knew when it last saw the lease
    # (a partition can hide a live lease holder); false: on a lapsed lease alone (liveness over safety).
    takeover_quorum: bool = True
    eval_every_merges: int = 0  # held-out loss of the global model every N merges (0 = never)
    eval_batches: int = 4
    eval_batch_size: int = 8
    max_merged_keys: int = 65536  # remembered (peer, fragment, base, nonce) of merged contributions

    def __post_init__(self) -> None:
        for name in ("lease_s", "renew_every_s", "mirror_every_s", "max_steps_per_s", "max_poll_s"):
            value = getattr(self, name)
            if not (isinstance(value, int | float) and math.isfinite(value) and value > 0):
                raise ValueError(f"syncer.{name} must be a positive number, got {value!r}")
        for name in ("recovery_s", "clip_factor", "max_grace_s", "membership_refresh_s"):
            value = getattr(self, name)
            if not (isinstance(value, int | float) and math.isfinite(value) and value >= 0):
                raise ValueError(f"syncer.{name} must be a number >= 0, got {value!r}")
        if self.renew_every_s * 2 > self.lease_s:
            raise ValueError("syncer.renew_every_s must be at most half of lease_s (a renewal may fail)")
        if 0 < self.clip_factor < 1:
            raise ValueError("syncer.clip_factor must be 0 (off) or >= 1")
        for name in ("checkpoint_every_merges", "max_staleness", "eval_every_merges", "eval_batches"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"syncer.{name} must be an int >= 0, got {value!r}")
        if self.eval_batch_size < 1 or self.max_merged_keys < 1:
            raise ValueError("syncer.eval_batch_size and max_merged_keys must be >= 1")

    @classmethod
    def from_options(cls, options: Mapping[str, Any], *, heartbeat_period_s: float) -> SyncerConfig:
        """From node.toml's `[syncer]` table; lease timing defaults to the run's heartbeat period."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(options) - known)
        if unknown:
            raise ConfigError(f"unknown [syncer] settings {unknown}")
        values: dict[str, Any] = {
            "renew_every_s": heartbeat_period_s,
            "lease_s": 3 * heartbeat_period_s,
            "recovery_s": 3 * heartbeat_period_s,
            "mirror_every_s": heartbeat_period_s,
        }
        values.update(options)
        try:
            return cls(**values)
        except (TypeError, ValueError) as e:
            raise ConfigError(f"[syncer]: {e}") from None


def quorum_config(spec: Any, *, max_grace_s: float) -> QuorumConfig:
    """The merge trigger of the manifest's mode (DilocoSpec.mode; see node.diloco.quorum for the baselines)."""
    mode = getattr(spec, "mode", "decoupled")
    if mode == "sync":
        return QuorumConfig.synchronous(spec.sync_learners)
    if mode == "elastic_sync":
        return QuorumConfig.elastic_synchronous()
    gamma = min(spec.grace_gamma, 0.99)
    # tau of the grace formula is at most the tau learners apply a merge at (FragmentSync.create): a wait longer
    # than what they keep computing after a send would stall them (or, decoupled, waste their steps)
    overlap = max(0, min(spec.overlap_steps, spec.sync_every_steps - 1))
    return QuorumConfig.decoupled(
        spec.min_quorum, grace_gamma=gamma, grace_tau=min(spec.grace_tau, overlap), max_grace_s=max_grace_s
    )


# ---------------------------------------------------------------------------------------------- the core


class Refusal(ProtocolError):
    """A contribution the syncer will not take; `reason` is the tag the learner sees."""


def _refuse(reason: str, message: str, *, blame: bool = False) -> Refusal:
    return Refusal(message, reason=reason, blame_sender=blame)


@dataclass(slots=True)
class _Entry:
    contribution: Contribution
    key: tuple[str, int, int, bytes]
    received_at: float
    # (verifier, session) -> verified tokens its receipts showed (stage replicas; committed once merged)
    receipt_counts: dict[tuple[str, str], int] = field(default_factory=dict)


@dataclass(slots=True)
class _Round:
    opened_at: float | None = None  # when the first contribution that counts toward K arrived
    entries: dict[str, _Entry] = field(default_factory=dict)  # peer -> its newest counting contribution
    quorum_reached_at: float | None = None


@dataclass(frozen=True, kw_only=True, slots=True)
class Admission:
    target_version: int
    capped: bool  # the counters were reduced (count it against the sender)
    late: bool = False  # lock-step modes: its round merged without it (its learner realigns, see accept)
    receipt_capped: bool = False  # tokens were cut to what verifier receipts show (receipts lag: no strike)


@dataclass(frozen=True, kw_only=True, slots=True)
class PreparedMerge:
    """What `compute_merge` produced; `commit_merge` publishes it."""

    fragment: int
    base_version: int
    round: _Round
    result: MergeResult
    new_params: dict[str, torch.Tensor]
    merged: dict[str, Contribution]  # per peer, what went into merge_fragment (its entries combined)
    sources: dict[str, list[_Entry]]  # per peer, the contributions combined
    required: int
    expected: int
    started_at: float


@dataclass(frozen=True, kw_only=True, slots=True)
class MergeRecord:
    """One line of the event tape."""

    fragment: int
    version: int
    participants: tuple[str, ...]
    weights: dict[str, float]
    tokens: int  # tokens (capped) of the participants with positive weight: what entered the model
    steps: int
    received: int
    expected: int
    required: int
    quorum_wait_s: float
    grace_waited_s: float
    clipped: dict[str, float]
    rejected: dict[str, str]
    duration_s: float
    late: int = 0  # contributions on an older base merged (only the synchronous modes take them)
    # per participant, one [steps, tokens, seconds from its arrival to the merge, base version] per contribution
    contributed: dict[str, list[list[float]]] = field(default_factory=dict)

    def to_event(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data["participants"] = list(self.participants)
        data["weights"] = {peer: round(w, 6) for peer, w in self.weights.items()}
        return data


Expected = int | Collection[str]  # the live peers that hold a fragment, or only their number


def _num_expected(round_: _Round, expected: Expected) -> int:
    """How many contributions make the round complete. Given the live holders, those still missing plus
    what is in: a contribution from a peer outside them (its heartbeat expired while it was stopped) counts
    towards K but never stands in for a live holder that has not sent yet (counted, it let an elastic round
    merge without a live learner). Given only a count, every contribution in counts."""
    if isinstance(expected, int):
        return max(expected, len(round_.entries))
    return len(round_.entries) + len(set(expected) - round_.entries.keys())


class SyncerCore:
    """Global state and merge decisions; the caller passes `now` (monotonic seconds) and serialises calls."""

    def __init__(
        self,
        plan: FragmentPlan,
        params: Mapping[str, torch.Tensor],
        *,
        quorum: QuorumConfig,
        embedding_names: Collection[str],
        outer_lr: float,
        outer_momentum: float,
        clip_factor: float | None,
        max_staleness: int,
        max_steps_per_s: float,
        tokens_per_step: int,
        now: float,
        max_merged_keys: int = 65536,
    ) -> None:
        missing = set(plan.names()) - set(params)
        if missing:
            raise ValueError(f"params lack {len(missing)} planned tensors, e.g. {sorted(missing)[:2]}")
        self.plan = plan
        self.params = {n: params[n].detach().to("cpu", torch.float32).clone() for n in plan.names()}
        self.shapes = {n: tuple(t.shape) for n, t in self.params.items()}
        self.policy = QuorumPolicy(quorum)
        self.embedding_names = frozenset(embedding_names)
        self.outer = OuterNesterov(outer_lr, outer_momentum)
        self.clip_factor = clip_factor
        self.max_staleness = max_staleness
        self.max_steps_per_s = max_steps_per_s
        self.tokens_per_step = tokens_per_step
        self.versions = [0] * plan.num_fragments
        self.rounds: dict[int, _Round] = {}
        self.merges = 0
        self.tokens_merged = 0
        self.clock = 0  # highest schedule step a contributor reported
        # peer -> (schedule step it reported, when): the run's clock is the median of their extrapolations
        self._clocks: OrderedDict[str, tuple[int, float]] = OrderedDict()
        self._published_at: dict[tuple[int, int], float] = {}
        self._restored_at = now
        # (peer, fragment, base version) -> (steps, tokens) already merged from that peer on that base, and when:
        # a later contribution on the same base only counts (and weighs) what it adds
        self._merged: OrderedDict[tuple[str, int, int], tuple[int, int, float]] = OrderedDict()
        self._merged_keys: OrderedDict[tuple[str, int, int, bytes], None] = OrderedDict()
        self._max_merged_keys = max_merged_keys
        # fragment -> version -> its published tensors, for versions a contribution may still be built on: a
        # contribution's delta is taken against its own base (what the learner actually did since it
        # overwrote), so one on an older base neither undoes the merges it missed nor is lost
        self._history: dict[int, dict[int, dict[str, torch.Tensor]]] = {}
        self._reset_history()
        # per fragment: whether its current version is one of our own merges (not restored, not adopted)
        self._merged_here = [False] * plan.num_fragments
        # per fragment: whether its current version is a regular round (our merge after one of our own merges),
        # which learners may time their sends from (version_ages); a first merge after a takeover gathers the
        # learners' retried outage work of every fragment at once and would bunch their staggered sends
        self._dated = [False] * plan.num_fragments
        self.receipt_ledger = ReceiptLedger(max_merged_keys)

    # ---- admission ----

    def accept(
        self,
        peer: str,
        fragment: int,
        params: Mapping[str, torch.Tensor],
        *,
        base_version: int,
        steps: int,
        tokens: int,
        sched_step: int,
        step_time_s: float,
        nonce: bytes,
        now: float,
        receipts: Sequence[TokenReceipt] | None = None,
    ) -> Admission:
        """Put a contribution into its fragment's round (replacing the peer's earlier one) or raise Refusal.

        `receipts`: for a pipeline stage replica, the verifier receipts it relayed (already verified); its
        tokens are then capped at their growth since its last merged contribution (`ReceiptLedger`). None for
        a learner (no verifier watches it)."""
        self._check_shape(fragment, params)
        current = self.versions[fragment]
        if base_version > current:
            raise _refuse("ahead of syncer", f"base version {base_version} > ours {current}")
        if base_version < current - self.max_staleness:
            raise _refuse(
                "stale base", f"base version {base_version} is older than {current - self.max_staleness}"
            )
        key = (peer, fragment, base_version, nonce)
        if key in self._merged_keys:
            raise _refuse("duplicate", "this contribution was merged already", blame=True)
        if base_version < current and self.policy.config.drop_stale and self._merged_here[fragment]:
            # Q5: it missed the round that merged its base (weight 0, as the paper's late learners); merged
            # alone it would publish one more version that overwrites everyone's unsent progress, and folded
            # into the next round it would count twice what its learner re-learns from the version without it.
            # Not after a takeover, until we merged the fragment ourselves: a learner's work from the outage,
            # on a version an earlier syncer published, missed no round of ours (taken as before: merged)
            raise _refuse("missed round", f"base version {base_version} < current {current}")
        since = self._published_at.get((fragment, base_version), self._restored_at)
        prior = self._merged.get((peer, fragment, base_version))
        if prior is not None:  # part of this progress is in the model already (e.g. merged before a failover)
            steps, tokens, since = max(0, steps - prior[0]), max(0, tokens - prior[1]), max(since, prior[2])
        steps, tokens, capped = cap_counters(
            steps,
            tokens,
            now - since,
            max_steps_per_s=self.max_steps_per_s,
            tokens_per_step=self.tokens_per_step,
        )
        round_ = self.rounds.get(fragment)
        if round_ is None:
            round_ = self.rounds[fragment] = _Round()
        counts: dict[tuple[str, str], int] = {}
        receipt_capped = False
        if receipts is not None:
            verified, counts = self.receipt_ledger.growth(peer, fragment, receipts)
            if tokens > verified:
                tokens, receipt_capped = verified, True
        contribution = Contribution(
            peer_id=peer,
            params={n: t.detach().to(torch.float32) for n, t in params.items()},
            base_version=base_version,
            steps=steps,
            tokens=tokens,
        )
        entry = _Entry(contribution, key, now, counts)
        earlier = round_.entries.get(peer)
        if earlier is None or (base_version, steps) >= (
            earlier.contribution.base_version,
            earlier.contribution.steps,
        ):
            round_.entries[peer] = entry
        if round_.opened_at is None:
            round_.opened_at = now
        if math.isfinite(step_time_s) and 0 < step_time_s <= MAX_STEP_TIME_S:
            self.policy.observe_step(step_time_s)
        self.clock = max(self.clock, sched_step)
        self._clocks.pop(peer, None)
        self._clocks[peer] = (sched_step, now)
        while len(self._clocks) > self._max_merged_keys:
            self._clocks.popitem(last=False)
        # A late contribution in a lock-step mode (its round merged without its learner, e.g. one whose
        # heartbeat expired while it was stopped) goes into the next round, but its learner must not wait for
        # that round: the others send theirs only after rounds of other fragments that wait for this learner,
        # and neither side would move. Told `late`, it loads the versions that exist now and realigns its
        # schedule to the earliest open round, as a restarted learner does (FragmentSync._rejoin).
        late = not self.policy.config.drop_stale and base_version < current
        return Admission(
            target_version=current if late else current + 1,
            capped=capped,
            receipt_capped=receipt_capped,
            late=late,
        )

    def check_contribution(self, fragment: int, params: Mapping[str, torch.Tensor]) -> None:
        """Raise MalformedFrame unless `params` are exactly the fragment's tensors, shapes and float dtypes."""
        self._check_shape(fragment, params)

    def _check_shape(self, fragment: int, params: Mapping[str, torch.Tensor]) -> None:
        if not 0 <= fragment < self.plan.num_fragments:
            raise MalformedFrame(f"fragment {fragment} out of range", reason="malformed contribution")
        names = self.plan.fragments[fragment].names
        if set(params) != set(names):
            raise MalformedFrame(f"fragment {fragment}: wrong tensor names", reason="malformed contribution")
        for name in names:
            tensor = params[name]
            if tuple(tensor.shape) != self.shapes[name] or not tensor.is_floating_point():
                raise MalformedFrame(f"{name}: wrong shape or dtype", reason="malformed contribution")

    # ---- decisions ----

    def due(self, now: float, expected: Callable[[int], Expected]) -> tuple[list[int], float | None]:
        """Fragments whose round should merge now, and the earliest grace deadline among the others.

        `expected(fragment)`: the live peers that hold it, or just how many there are (see `_num_expected`)."""
        ready, deadline = [], None
        for fragment, round_ in self.rounds.items():
            if round_.opened_at is None:
                continue
            received = len(round_.entries)
            num_expected = _num_expected(round_, expected(fragment))
            required = self.policy.required(num_expected)
            if received >= required and round_.quorum_reached_at is None:
                # when the required-th contribution arrived, not when we got to look (a merge of another
                # fragment may have held the loop): xi_quorum is the wait for learners, not for ourselves
                arrivals = sorted(e.received_at for e in round_.entries.values())
                round_.quorum_reached_at = arrivals[required - 1] if 0 < required <= len(arrivals) else now
                # from the first contribution still in the round, not from when the round opened: a peer's newer
                # contribution replaces its first one (retries after a takeover did), and that gap is no wait for
                # learners; counted, one 3 s gap closed the grace window for the next ten merges (K = 1: 0)
                first = arrivals[0] if arrivals else round_.opened_at
                self.policy.observe_quorum(max(0.0, round_.quorum_reached_at - first))
            decision = self.policy.decide(
                now, round_.opened_at, received, num_expected, round_.quorum_reached_at
            )
            if decision.action == "merge":
                ready.append(fragment)
            elif decision.deadline is not None:
                deadline = decision.deadline if deadline is None else min(deadline, decision.deadline)
        return ready, deadline

    # ---- the merge ----

    def take_round(self, fragment: int, expected: Expected, now: float) -> tuple[_Round, int, int] | None:
        round_ = self.rounds.pop(fragment, None)
        if round_ is None:
            return None
        num_expected = _num_expected(round_, expected)
        return round_, num_expected, self.policy.required(num_expected)

    def compute_merge(
        self, fragment: int, round_: _Round, *, expected: int, required: int, started_at: float
    ) -> PreparedMerge:
        """The heavy part (safe in a worker thread while nothing else mutates this fragment)."""
        names = self.plan.fragments[fragment].names
        global_params = {n: self.params[n] for n in names}
        merged, sources = self._combine(fragment, round_)
        result = merge_fragment(
            global_params,
            list(merged.values()),
            embedding_names=self.embedding_names,
            clip_factor=self.clip_factor,
            current_version=self.versions[fragment],
            max_staleness=self.max_staleness,
        )
        new_params = self.outer.step(global_params, result.outer_grad)
        return PreparedMerge(
            fragment=fragment,
            base_version=self.versions[fragment],
            round=round_,
            result=result,
            new_params=new_params,
            merged=merged,
            sources=sources,
            required=required,
            expected=expected,
            started_at=started_at,
        )

    def void_merge(
        self,
        fragment: int,
        round_: _Round,
        *,
        expected: int,
        required: int,
        started_at: float,
        rejected: Mapping[str, str],
    ) -> PreparedMerge:
        """A round with nothing to merge (every contribution rejected or of zero weight), to be published as a
        version whose parameters are unchanged (no outer step, momentum untouched).

        The synchronous modes need it: each learner waits for its round's version, and a round that publishes
        nothing held all of them for good (seen in the goodput benchmark's synchronous arm after a syncer
        restart: "no weighted contribution among 4", then no learner stepped again)."""
        names = self.plan.fragments[fragment].names
        result = MergeResult(
            outer_grad={},
            weights={},
            clipped={},
            fallback_tensors=(),
            rejected=dict(rejected),
            delta_norms={},
            reason="void round: nothing to merge, parameters unchanged",
        )
        return PreparedMerge(
            fragment=fragment,
            base_version=self.versions[fragment],
            round=round_,
            result=result,
            new_params={n: self.params[n] for n in names},
            merged={},
            sources={},
            required=required,
            expected=expected,
            started_at=started_at,
        )

    def _combine(
        self, fragment: int, round_: _Round
    ) -> tuple[dict[str, Contribution], dict[str, list[_Entry]]]:
        """One contribution per peer, its delta taken against its own base version.

        A contribution on an older base (the synchronous modes take them, e.g. after a failover) is expressed
        as parameters against the current global value, so `merge_fragment` sees current - params == the
        learner's own progress (base value - learner value) instead of that progress minus every merge it
        missed. A base whose value we no longer hold (after a restore or an adoption) falls back to the
        current value, as if it were current. Ones older than max_staleness are dropped."""
        current = self.versions[fragment]
        names = self.plan.fragments[fragment].names
        history = self._history.get(fragment, {})
        sources: dict[str, list[_Entry]] = {}
        for entry in round_.entries.values():
            if entry.contribution.base_version < current - self.max_staleness:
                logger.info("dropping a contribution of %s: base too old", entry.contribution.peer_id)
                continue
            sources.setdefault(entry.contribution.peer_id, []).append(entry)
        merged: dict[str, Contribution] = {}
        for peer, entries in sources.items():
            if len(entries) == 1 and entries[0].contribution.base_version == current:
                merged[peer] = entries[0].contribution
                continue
            delta = {n: torch.zeros_like(self.params[n]) for n in names}
            for entry in entries:
                c = entry.contribution
                base = history.get(c.base_version) or {n: self.params[n] for n in names}
                for n in names:
                    delta[n] += base[n] - c.params[n]
            merged[peer] = Contribution(
                peer_id=peer,
                params={n: self.params[n] - delta[n] for n in names},
                base_version=max(e.contribution.base_version for e in entries),
                steps=sum(e.contribution.steps for e in entries),
                tokens=sum(e.contribution.tokens for e in entries),
            )
        return merged, sources

    def _reset_history(self) -> None:
        """Forget older versions: only the current value of each fragment is known."""
        self._history = {
            f: {v: {n: self.params[n] for n in self.plan.fragments[f].names}}
            for f, v in enumerate(self.versions)
        }

    def commit_merge(self, prepared: PreparedMerge, now: float) -> MergeRecord:
        fragment = prepared.fragment
        if self.versions[fragment] != prepared.base_version:
            raise RuntimeError(f"fragment {fragment} changed during its merge")
        self.params.update(prepared.new_params)
        version = self.versions[fragment] = prepared.base_version + 1
        self._published_at[(fragment, version)] = now
        self._published_at.pop((fragment, version - self.max_staleness - 2), None)
        self._dated[fragment] = self._merged_here[fragment]
        self._merged_here[fragment] = True
        history = self._history.setdefault(fragment, {})
        history[version] = dict(prepared.new_params)
        for old in [v for v in history if v < version - self.max_staleness]:
            del history[old]
        self._drop_missed(fragment)
        result = prepared.result
        participants = result.participants
        tokens = steps = late = 0
        contributed: dict[str, list[list[float]]] = {}
        for peer in participants:
            tokens += prepared.merged[peer].tokens
            steps += prepared.merged[peer].steps
            for entry in prepared.sources[peer]:
                c = entry.contribution
                late += c.base_version < prepared.base_version
                contributed.setdefault(peer, []).append(
                    [c.steps, c.tokens, round(max(0.0, now - entry.received_at), 3), c.base_version]
                )
                self._remember_merged(entry, now)
                self.receipt_ledger.commit(peer, fragment, entry.receipt_counts)
        self.merges += 1
        self.tokens_merged += tokens
        duration = now - prepared.started_at
        self.policy.observe_sync(max(0.0, duration))
        reached = prepared.round.quorum_reached_at
        return MergeRecord(
            fragment=fragment,
            version=version,
            participants=participants,
            weights=dict(result.weights),
            tokens=tokens,
            steps=steps,
            received=len(prepared.round.entries),
            expected=prepared.expected,
            required=prepared.required,
            quorum_wait_s=round(
                (reached or prepared.started_at) - (prepared.round.opened_at or prepared.started_at), 4
            ),
            grace_waited_s=round(prepared.started_at - reached, 4) if reached is not None else 0.0,
            clipped=dict(result.clipped),
            rejected=dict(result.rejected),
            duration_s=round(duration, 4),
            late=late,
            contributed=contributed,
        )

    def _drop_missed(self, fragment: int) -> None:
        """After a merge, contributions that arrived during it on the version it replaced missed that round:
        dropped like any contribution on an older base (QuorumConfig.drop_stale), never a round of their own."""
        round_ = self.rounds.get(fragment)
        if round_ is None or not self.policy.config.drop_stale:
            return  # (only called right after our own merge of the fragment)
        current = self.versions[fragment]
        for peer, entry in list(round_.entries.items()):
            if entry.contribution.base_version < current:
                del round_.entries[peer]
        if not round_.entries:
            del self.rounds[fragment]

    def merge_now(self, fragment: int, expected: int, now: float) -> MergeRecord | None:
        """Take, compute and commit in one call (tests and single-threaded callers); None if nothing merged."""
        taken = self.take_round(fragment, expected, now)
        if taken is None:
            return None
        round_, num_expected, required = taken
        try:
            prepared = self.compute_merge(
                fragment, round_, expected=num_expected, required=required, started_at=now
            )
        except NothingToMerge:
            return None
        return self.commit_merge(prepared, now)

    def _remember_merged(self, entry: _Entry, now: float) -> None:
        c = entry.contribution
        key = (c.peer_id, entry.key[1], c.base_version)
        prior = self._merged.pop(key, (0, 0, now))  # re-insert: the dict stays ordered by recency
        self._merged[key] = (prior[0] + c.steps, prior[1] + c.tokens, now)
        self._merged_keys[entry.key] = None
        while len(self._merged_keys) > self._max_merged_keys:
            self._merged_keys.popitem(last=False)
        while len(self._merged) > self._max_merged_keys:
            self._merged.popitem(last=False)

    def version_ages(self, now: float) -> list[float]:
        """Per fragment, seconds since its current version was published by one of our merges; -1.0 when it
        is not a regular round (the seed, a version restored or adopted, or our first merge of the fragment
        after those: the learners' work retried through an outage, every fragment at once). Decoupled
        learners time their next send of a fragment from its round's publication
        (`FragmentSync._anchor_locked`): all of them see the same rounds, so they stay in phase without
        counting steps; through an undated version they keep their anchors, which kept the fragments'
        stagger."""
        ages = []
        for fragment, version in enumerate(self.versions):
            at = self._published_at.get((fragment, version)) if self._dated[fragment] else None
            ages.append(round(max(0.0, now - at), 4) if at is not None else -1.0)
        return ages

    def clock_estimate(self, now: float, *, max_age_s: float = 60.0) -> int:
        """The schedule step the run's learners are at now: per peer, its latest report plus the steps since
        (at the EMA step time), then the median over peers that reported within `max_age_s`. The median keeps
        one stale or lying report from moving everyone's schedule. 0 when nobody reported yet."""
        xi = self.policy.xi_step or 0.0
        estimates = sorted(
            step + (int((now - at) / xi) if xi > 0 else 0)
            for step, at in self._clocks.values()
            if now - at <= max_age_s
        )
        if not estimates:
            return 0
        return estimates[(len(estimates) - 1) // 2]

    def merged_ledger(self) -> tuple[tuple[str, int, int, int, int], ...]:
        """(peer, fragment, base, steps, tokens) already merged, for bases that can still be contributed on."""
        return tuple(
            (peer, f, base, steps, tokens)
            for (peer, f, base), (steps, tokens, _) in self._merged.items()
            if base >= self.versions[f] - self.max_staleness
        )

    def load_ledger(self, ledger: tuple[tuple[str, int, int, int, int], ...], now: float) -> None:
        for peer, f, base, steps, tokens in ledger:
            if 0 <= f < self.plan.num_fragments:
                self._merged[(peer, f, base)] = (steps, tokens, now)

    # ---- versions, adoption, snapshots ----

    def fragment_tensors(self, fragment: int) -> dict[str, torch.Tensor]:
        return {n: self.params[n] for n in self.plan.fragments[fragment].names}

    def fragment_momentum(self, fragment: int) -> dict[str, torch.Tensor]:
        out = {}
        for name in self.plan.fragments[fragment].names:
            buf = self.outer.buffer(name)
            if buf is not None:
                out[name] = buf.clone()
        return out

    def adopt(
        self,
        fragment: int,
        version: int,
        params: Mapping[str, torch.Tensor],
        now: float,
        *,
        published_at: float | None = None,
    ) -> bool:
        """Take a newer version of `fragment` published by an earlier syncer; momentum is kept as it is.
        `published_at` (this core's clock; at most `now`): when it was published, if known."""
        if version <= self.versions[fragment]:
            return False
        self._check_shape(fragment, params)
        if not all(bool(torch.isfinite(t).all()) for t in params.values()):
            return False
        for name, tensor in params.items():
            self.params[name] = tensor.detach().to(torch.float32).clone()
        self.versions[fragment] = version
        self._published_at[(fragment, version)] = now if published_at is None else min(now, published_at)
        self.rounds.pop(fragment, None)  # its contributions were built on older versions
        self._history[fragment] = {version: {n: self.params[n] for n in self.plan.fragments[fragment].names}}
        self._merged_here[fragment] = False
        self._dated[fragment] = False
        return True

    def snapshot(self, run_id: str, term: int, *, wall_offset: float | None = None) -> SyncerSnapshot:
        """`wall_offset`: wall clock minus the clock this core is driven by, to date the versions (absent:
        undated, and a successor caps work on them from its own start)."""
        return SyncerSnapshot(
            run_id=run_id,
            term=term,
            versions=tuple(self.versions),
            params={n: t.clone() for n, t in self.params.items()},
            momentum=self.outer.state_dict(),
            merges=self.merges,
            tokens_merged=self.tokens_merged,
            merged=self.merged_ledger(),
            published_wall=tuple(self.published_wall(f, wall_offset) for f in range(self.plan.num_fragments))
            if wall_offset is not None
            else (),
        )

    def published_wall(self, fragment: int, wall_offset: float | None) -> float:
        """When the fragment's current version was published, on the wall clock; 0.0 if unknown."""
        at = self._published_at.get((fragment, self.versions[fragment]))
        return at + wall_offset if at is not None and wall_offset is not None else 0.0

    def restore(self, snapshot: SyncerSnapshot, now: float, *, wall_offset: float | None = None) -> None:
        if len(snapshot.versions) != self.plan.num_fragments or set(snapshot.params) != set(self.params):
            raise ValueError("snapshot does not fit this run's plan")
        self.params = {n: t.detach().to(torch.float32).clone() for n, t in snapshot.params.items()}
        self.outer.load_state_dict(snapshot.momentum)
        self.versions = list(snapshot.versions)
        self.merges, self.tokens_merged = snapshot.merges, snapshot.tokens_merged
        self.rounds.clear()
        self._published_at.clear()
        self._merged.clear()
        self.load_ledger(snapshot.merged, now)
        self._restored_at = now
        if wall_offset is not None and len(snapshot.published_wall) == self.plan.num_fragments:
            # the counters cap of work built on a restored version runs from its publication, not from now:
            # a learner that stepped through the outage did that work (capped from now, an outage of 27 steps
            # was cut to the 5 steps since the takeover, and struck)
            for fragment, wall in enumerate(snapshot.published_wall):
                if wall > 0:
                    self._published_at[(fragment, self.versions[fragment])] = min(now, wall - wall_offset)
        self._reset_history()
        self._merged_here = [False] * self.plan.num_fragments
        self._dated = [False] * self.plan.num_fragments


# ---------------------------------------------------------------------------------------------- the lease


@dataclass(frozen=True, kw_only=True, slots=True)
class LeaseView:
    """What one look at the `syncer` records says, from one syncer's point of view."""

    live_active: tuple[SyncerRecord, ...]  # other authorized syncers with an unexpired active lease
    highest_term: int  # over every record seen


def lease_action(
    *, me: str, active: bool, term: int, view: LeaseView, vacant_looks: int, quorum: bool | None = True
) -> str:
    """renew | step_down | stand_by | take_over | no_quorum | wait. A standby takes over only after two looks
    in a row found no live active lease (`vacant_looks` counts them, this one included), so one missed DHT read
    cannot start a second primary, and only with `quorum` (see `takeover_quorum`; None: not known yet): a lapsed
    lease may be a partition hiding a live holder, and the smaller side must not start a second lineage."""
    rivals = [r for r in view.live_active if (r.state.term, me) > (term, r.peer_id)]
    if active:
        return "step_down" if rivals else "renew"
    if view.live_active:
        return "stand_by"
    if vacant_looks < 2 or quorum is None:
        return "wait"
    return "take_over" if quorum else "no_quorum"


def takeover_quorum(
    seen: Mapping[str, float], *, lease_seen_at: float | None, memory_s: float, fresh_after_s: float
) -> tuple[int, int]:
    """(live, members) for a standby deciding to take over; it may when `not members or 2 * live > members`.

    `seen` maps each learner/stage to when this standby last saw its heartbeat (local monotonic time);
    `lease_seen_at` is when it last saw a live lease. Members are the holders seen within `memory_s` before that;
    live are those seen at least `fresh_after_s` (a heartbeat's lifetime) after it, i.e. whose heartbeats were
    stored on this side after the lease vanished from it. A holder cut off with the lease holder can only be seen
    through heartbeats stored before the cut, so a standby with the minority never has a majority; two disjoint
    sides cannot both have one. Never having seen a lease (a fresh run) needs no quorum.
    """
    if lease_seen_at is None:
        return 0, 0
    members = [t for t in seen.values() if t >= lease_seen_at - memory_s]
    return sum(1 for t in members if t >= lease_seen_at + fresh_after_s), len(members)


# ---------------------------------------------------------------------------------------------- the role


class SyncerRole:
    """The networked syncer; see the module docstring. `is_banned` is the hook SENTINEL bans plug into."""

    name = "syncer"

    def __init__(self, ctx: NodeContext) -> None:
        manifest = ctx.manifest
        if ctx.peer_id not in manifest.authorized_syncers:
            raise ConfigError(
                f"this node's key {ctx.peer_id} is not an authorized syncer of run {manifest.name!r}; the owner "
                f"can add it with `python -m bootstrap --authorize-syncer {ctx.peer_id}`"
            )
        self.ctx = ctx
        self.config = SyncerConfig.from_options(
            ctx.config.syncer, heartbeat_period_s=manifest.heartbeat_period_s
        )
        self.mode = getattr(manifest.diloco, "mode", "decoupled")
        self.is_banned: Callable[[str], bool] = lambda _peer: False
        self.plan = run_fragment_plan(manifest)
        self.limits = fragment_limits(self.plan)
        self.fragment_stage = _fragment_stages(manifest, self.plan)
        directory = (
            Path(self.config.checkpoint_dir).expanduser()
            if self.config.checkpoint_dir
            else ctx.config.state_dir / "syncer"
        )
        self.checkpoint_file = checkpoint_path(directory, ctx.run_id)
        from protocol.replay import ReplayGuard
        from protocol.rpc import PeerStrikes

        self.strikes = PeerStrikes()
        self._push_replay = ReplayGuard()
        self._control_replay = ReplayGuard()
        self.core: SyncerCore | None = None
        self.active = False
        self.term = 0
        self.primary: str | None = None
        self.recovering_until = 0.0
        self._fresh: set[tuple[str, int]] = set()  # in recovery: (peer, fragment) that sent a snapshot for us
        self.held_out_loss: float | None = None
        self.last_checkpoint_at: float | None = None
        self.takeover_source = ""
        self.adopted = 0
        self.refusals: dict[str, int] = {}
        self.receipts_verified = 0
        self.receipts_rejected: dict[str, int] = {}  # by reason
        self.receipt_capped = 0  # stage contributions whose tokens the receipts cut
        self._live: dict[str, Any] = {}
        self._live_read_at = -math.inf
        self._vacant_looks = 0
        # for `takeover_quorum`: when (monotonic) we last saw each learner/stage, and a live lease (ours or not)
        self._holders_seen: dict[str, float] = {}
        self._lease_seen_at: float | None = None
        self._quorum: tuple[int, int] = (0, 0)  # (live, members) at the last look; see `takeover_quorum`
        self._takeover_refused = False
        self._lease_expiration = 0.0
        self._lease_until = 0.0
        self._merge_lock = asyncio.Lock()
        self._wake = asyncio.Event()
        self._published = asyncio.Event()
        self._mirror: SyncerSnapshot | None = None
        self._mirror_transport: FramedSyncTransport | None = None
        self._server: Any = None
        self._p2p: Any = None
        self._eval: Any = None
        self._merges_since_checkpoint = 0
        # the last merges with their quorum, grace and weights, for /api/status and so the dashboard of any swarm
        self.recent_merges: deque[dict[str, Any]] = deque(maxlen=RECENT_MERGES)

    # ---- lifecycle ----

    async def run(self, ctx: NodeContext, stop: asyncio.Event) -> None:
        from protocol.envelope import max_frame_bytes
        from protocol.rpc import FramedServer, Route

        self.core = await asyncio.to_thread(self._build_core)
        self._p2p = await ctx.dht.replicate_p2p()
        control = max_frame_bytes(control_limits())
        routes = {
            PUSH_ROUTE: Route(self._handle_push, max_frame_bytes(self.limits)),
            VERSIONS_ROUTE: Route(self._handle_versions, control),
            FETCH_ROUTE: Route(self._handle_fetch, control),
            OFFER_ROUTE: Route(self._handle_offer, max_frame_bytes(offer_limits(self.plan))),
            STATE_ROUTE: Route(self._handle_state, control),
        }
        self._server = FramedServer(
            self._p2p,
            routes,
            strikes=self.strikes,
            on_reject=self._on_reject,
            on_throttle=ctx.metrics.count_throttle,
        )
        await self._server.start()
        from node.context import RestartPolicy

        ctx.supervisor.spawn("syncer-lease", partial(self._lease_loop, stop), policy=RestartPolicy())
        ctx.supervisor.spawn("syncer-members", partial(self._membership_loop, stop), policy=RestartPolicy())
        ctx.supervisor.spawn("syncer-merge", partial(self._merge_loop, stop), policy=RestartPolicy())
        ctx.supervisor.spawn("syncer-mirror", partial(self._mirror_loop, stop), policy=RestartPolicy())
        if self.config.eval_every_merges:  # optional: load the held-out data after we serve, not before
            ctx.supervisor.spawn("syncer-eval-data", self._load_eval, policy=RestartPolicy())
        from node.swarm.bans import ban_watcher_for  # SENTINEL bans: refuse banned peers' contributions

        bans = ban_watcher_for(ctx)
        self.is_banned = bans.is_banned
        ctx.supervisor.spawn("syncer-bans", partial(bans.run, stop), policy=RestartPolicy())
        logger.info(
            "syncer ready: mode %s, %d fragments, checkpoints in %s",
            self.mode,
            self.plan.num_fragments,
            self.checkpoint_file,
        )
        try:
            await stop.wait()
        finally:
            await self._shutdown()

    def _build_core(self) -> SyncerCore:
        from node.ml.model import ModelConfig, build_model, embedding_param_names

        manifest = self.ctx.manifest
        cfg = ModelConfig.from_dict(manifest.model)
        model = build_model(cfg, manifest.seed)
        clip = self.config.clip_factor or None
        return SyncerCore(
            self.plan,
            dict(model.named_parameters()),
            quorum=quorum_config(manifest.diloco, max_grace_s=self.config.max_grace_s),
            embedding_names=embedding_param_names(cfg),
            outer_lr=manifest.diloco.outer_lr,
            outer_momentum=manifest.diloco.outer_momentum,
            clip_factor=clip,
            max_staleness=self.config.max_staleness,
            max_steps_per_s=self.config.max_steps_per_s,
            tokens_per_step=manifest.inner.batch_size * cfg.context_len,
            now=time.monotonic(),
            max_merged_keys=self.config.max_merged_keys,
        )

    def _build_eval(self) -> Any:
        from node.ml.data import load_corpus, validation_batches
        from node.ml.model import ModelConfig, build_model

        manifest = self.ctx.manifest
        cfg = ModelConfig.from_dict(manifest.model)
        corpus = load_corpus(self.ctx.config.data or _data_spec(manifest))
        batches = validation_batches(
            corpus,
            batch_size=self.config.eval_batch_size,
            context_len=cfg.context_len,
            num_batches=self.config.eval_batches,
        )
        return build_model(cfg, manifest.seed), batches

    async def _load_eval(self) -> None:
        self._eval = await asyncio.to_thread(self._build_eval)
        if self.active:
            await self._evaluate()  # the loss the run starts (or resumes) from

    async def _shutdown(self) -> None:
        with contextlib.suppress(Exception):
            if self._server is not None:
                await asyncio.wait_for(self._server.stop(), 2.0)
        if self.active and self.core is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._checkpoint(), 2.0)
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._publish_lease(release=True), 2.0)
            self.active = False

    # ---- the lease ----

    async def _lease_loop(self, stop: asyncio.Event) -> None:
        from node.context import wait_or_stop

        while True:
            try:
                await self._lease_tick()
            except asyncio.TimeoutError:
                logger.warning("syncer lease: DHT did not answer in time")
            if await wait_or_stop(stop, self.config.renew_every_s):
                return

    async def _lease_tick(self) -> None:
        records = self.ctx.records
        found = await records.list_syncers()
        now = records.clock()
        authorized = set(self.ctx.manifest.authorized_syncers)
        others = [r for r in found if r.peer_id != self.ctx.peer_id and r.peer_id in authorized]
        live = tuple(r for r in others if r.state.state == "active" and r.state.lease_until > now)
        view = LeaseView(live_active=live, highest_term=max([r.state.term for r in found] + [self.term]))
        self._vacant_looks = 0 if live else self._vacant_looks + 1
        if live or self.active:
            self._lease_seen_at = time.monotonic()
            self._takeover_refused = False
        action = lease_action(
            me=self.ctx.peer_id,
            active=self.active,
            term=self.term,
            view=view,
            vacant_looks=self._vacant_looks,
            quorum=self._has_takeover_quorum(),
        )
        if action == "no_quorum" and not self._takeover_refused:  # once per lapse
            self._takeover_refused = True
            live_holders, members = self._quorum
            self.ctx.events.emit("takeover_refused", live=live_holders, members=members, term=self.term)
            logger.warning(
                "no live syncer lease, but only %d of the %d learners/stages seen with it are here: not taking "
                "over (the lease holder may be alive on the other side of a partition)",
                live_holders,
                members,
            )
        if action == "renew":
            await self._publish_lease()
        elif action == "step_down":
            winner = choose_syncer(live, now=now, authorized=tuple(authorized))
            await self._step_down(winner.peer_id if winner else None, view.highest_term)
        elif action == "take_over":
            await self._take_over(view.highest_term + 1)
        elif action == "stand_by":
            winner = choose_syncer(live, now=now, authorized=tuple(authorized))
            self.primary = winner.peer_id if winner else None
            self.term = max(self.term, view.highest_term)
            await self._publish_lease()
        else:
            await self._publish_lease()

    def _heartbeat_ttl_s(self) -> float:
        from node.swarm import HEARTBEAT_TTL_PERIODS

        return HEARTBEAT_TTL_PERIODS * self.ctx.manifest.heartbeat_period_s

    def _quorum_memory_s(self) -> float:
        return self.config.lease_s + self._heartbeat_ttl_s()

    def _has_takeover_quorum(self) -> bool | None:
        """Whether a standby may take over now; None until heartbeats stored since the lease lapsed could show."""
        fresh_after_s = self._heartbeat_ttl_s() + self.config.membership_refresh_s
        self._quorum = takeover_quorum(
            self._holders_seen,
            lease_seen_at=self._lease_seen_at,
            memory_s=self._quorum_memory_s(),
            fresh_after_s=fresh_after_s,
        )
        live_holders, members = self._quorum
        if not self.config.takeover_quorum or not members or 2 * live_holders > members:
            return True
        assert self._lease_seen_at is not None  # members are only counted relative to a lease seen
        return False if self._live_read_at >= self._lease_seen_at + fresh_after_s else None

    async def _publish_lease(self, *, release: bool = False) -> None:
        from protocol.records import SyncerState

        records = self.ctx.records
        now = records.clock()
        assert self.core is not None
        active = self.active and not release
        lease_until = now + self.config.lease_s if active else now
        expiration = max(now + self.config.lease_s, self._lease_expiration + 1e-3)
        state = SyncerState(
            lease_until=lease_until,
            term=self.term,
            versions=tuple(self.core.versions),
            http=self.ctx.http_address,
            state="active" if active else "standby",
            sent_at=now,
        )
        if await records.publish_syncer(state, expiration=expiration):
            self._lease_expiration = expiration
            if active:
                self._lease_until = time.monotonic() + self.config.lease_s
        else:
            logger.warning("syncer lease record was not stored")

    async def _take_over(self, term: int) -> None:
        assert self.core is not None
        async with self._merge_lock:
            source, seen_term = await self._restore_best()
            # terms never go back, even when every lease record has expired: the saved state knows its term
            term = self.term = max(term, seen_term + 1, self.term + 1)
            self.active = True
            self.primary = None
            self.recovering_until = time.monotonic() + self.config.recovery_s
            self._fresh = set()
            self.takeover_source = source
        await self._publish_lease()
        self.ctx.events.emit("syncer_takeover", term=term, source=source, versions=list(self.core.versions))
        logger.info("took over as the active syncer, term %d, state from %s", term, source)
        await self._checkpoint()
        self._notify()
        if self.config.eval_every_merges:
            await self._evaluate()  # the loss the run resumes from (the seed's, on a fresh run)

    def _notify(self) -> None:
        """Wake every versions long-poll; later polls wait on a fresh event."""
        self._published.set()
        self._published = asyncio.Event()

    async def _restore_best(self) -> tuple[str, int]:
        """Resume from the freshest of the checkpoint file and the mirror (by total version count)."""
        assert self.core is not None
        candidates: list[tuple[int, str, SyncerSnapshot]] = []
        try:
            snapshot = await asyncio.to_thread(
                load_checkpoint,
                self.checkpoint_file,
                run_id=self.ctx.run_id,
                expected=self.core.shapes,
                num_fragments=self.plan.num_fragments,
            )
            candidates.append((sum(snapshot.versions), "checkpoint", snapshot))
        except FileNotFoundError:
            pass
        except CheckpointError as e:
            logger.warning("ignoring checkpoint: %s", e)
        if self._mirror is not None:
            candidates.append((sum(self._mirror.versions), "mirror", self._mirror))
        current = sum(self.core.versions)
        seen_term = max((c[2].term for c in candidates), default=0)
        best = max(candidates, key=lambda c: (c[0], c[1] == "checkpoint"), default=None)
        if best is None or best[0] < current:
            return ("memory" if current else "seed"), seen_term
        self.core.restore(best[2], time.monotonic(), wall_offset=_wall_offset())
        return best[1], seen_term

    async def _step_down(self, winner: str | None, term: int) -> None:
        async with self._merge_lock:
            self.active = False
            self.primary = winner
            self.term = max(self.term, term)
            assert self.core is not None
            self.core.rounds.clear()
        self.ctx.events.emit("syncer_step_down", term=self.term, winner=winner)
        logger.warning("another syncer holds a newer lease (term %d); standing by", self.term)
        await self._publish_lease()

    def _lease_valid(self) -> bool:
        return self.active and time.monotonic() < self._lease_until

    # ---- membership ----

    async def _membership_loop(self, stop: asyncio.Event) -> None:
        from node.context import wait_or_stop

        while True:
            await self._refresh_members()
            if await wait_or_stop(stop, max(self.config.membership_refresh_s, 0.1)):
                return

    async def _refresh_members(self) -> None:
        try:
            peers = await self.ctx.records.list_peers()
        except asyncio.TimeoutError:
            return
        self._live = {p.peer_id: p.heartbeat for p in peers if p.heartbeat.role in HOLDER_ROLES}
        self._live_read_at = time.monotonic()
        for peer in self._live:
            self._holders_seen[peer] = self._live_read_at
        if self._lease_seen_at is not None:  # older sightings can no longer make anyone a member
            horizon = self._lease_seen_at - self._quorum_memory_s()
            self._holders_seen = {p: t for p, t in self._holders_seen.items() if t >= horizon}

    def _holders(self, fragment: int) -> set[str]:
        """Live peers that hold the fragment: every learner, and the replicas of its pipeline stage."""
        stage = self.fragment_stage[fragment]
        return {peer for peer, hb in self._live.items() if hb.role == "learner" or hb.stage == stage}

    async def _check_known(self, peer: str) -> None:
        if self.is_banned(peer):
            raise _refuse("banned", f"{peer[-8:]} is banned")
        if peer in self._live:
            return
        if time.monotonic() - self._live_read_at > 0.5:
            await self._refresh_members()
        if peer not in self._live:
            raise _refuse("unknown peer", f"{peer[-8:]} has no live learner or stage heartbeat")

    # ---- the merge loop ----

    async def _merge_loop(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            timeout = 1.0
            if self._lease_valid() and time.monotonic() >= self.recovering_until:
                assert self.core is not None
                ready, deadline = self.core.due(time.monotonic(), self._holders)
                for fragment in ready:
                    await self._merge(fragment)
                if deadline is not None:
                    timeout = min(timeout, max(0.0, deadline - time.monotonic()))
                if ready:
                    continue
            elif self.active and time.monotonic() < self.recovering_until:
                timeout = min(timeout, self.recovering_until - time.monotonic())
            self._wake.clear()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._wake.wait(), max(timeout, 0.005))

    async def _merge(self, fragment: int) -> None:
        core = self.core
        assert core is not None
        async with self._merge_lock:
            if not self._lease_valid():
                return
            started = time.monotonic()
            taken = core.take_round(fragment, self._holders(fragment), started)
            if taken is None:
                return
            round_, expected, required = taken
            try:
                prepared = await asyncio.to_thread(
                    core.compute_merge,
                    fragment,
                    round_,
                    expected=expected,
                    required=required,
                    started_at=started,
                )
            except NothingToMerge as e:
                self.ctx.events.emit("merge_skipped", fragment=fragment, reason=str(e), rejected=e.rejected)
                if self.mode == "decoupled":
                    return  # nobody waits for a round: the next one merges their work
                prepared = core.void_merge(
                    fragment,
                    round_,
                    expected=expected,
                    required=required,
                    started_at=started,
                    rejected=e.rejected,
                )
            record = core.commit_merge(prepared, time.monotonic())
        self._merges_since_checkpoint += 1
        event = {
            **record.to_event(),
            "term": self.term,
            "mode": self.mode,
            "tokens_total": core.tokens_merged,
            "merges": core.merges,
            "grace_s": round(core.policy.grace_s(), 4),
            "xi_step_s": round(core.policy.xi_step or 0.0, 4),
        }
        self.recent_merges.append({"t": time.time(), **event})
        self.ctx.events.emit("merge", **event)
        self._notify()
        if (
            self.config.checkpoint_every_merges
            and self._merges_since_checkpoint >= self.config.checkpoint_every_merges
        ):
            await self._checkpoint()
        if self.config.eval_every_merges and core.merges % self.config.eval_every_merges == 0:
            await self._evaluate()

    async def _checkpoint(self) -> None:
        core = self.core
        if core is None:
            return
        async with self._merge_lock:
            snapshot = core.snapshot(self.ctx.run_id, self.term, wall_offset=_wall_offset())
        await asyncio.to_thread(save_checkpoint, self.checkpoint_file, snapshot)
        self._merges_since_checkpoint = 0
        self.last_checkpoint_at = time.time()
        self.ctx.events.emit(
            "checkpoint",
            path=str(self.checkpoint_file),
            versions=list(snapshot.versions),
            merges=snapshot.merges,
        )

    async def _evaluate(self) -> None:
        from node.ml.data import evaluate

        core = self.core
        if self._eval is None or core is None:
            return
        model, batches = self._eval
        async with self._merge_lock:
            state = {n: t.clone() for n, t in core.params.items()}
            tokens, merges = core.tokens_merged, core.merges

        def run() -> float:
            with torch.no_grad():
                for name, param in model.named_parameters():
                    param.copy_(state[name])
            return evaluate(model, batches)

        self.held_out_loss = await asyncio.to_thread(run)
        self.ctx.events.emit("eval", loss=round(self.held_out_loss, 5), tokens_total=tokens, merges=merges)

    # ---- the mirror (standby) ----

    async def _mirror_loop(self, stop: asyncio.Event) -> None:
        from node.context import wait_or_stop

        while True:
            if not self.active and self.primary is not None and self.core is not None:
                try:
                    await self._mirror_once()
                except SyncUnavailable as e:
                    logger.debug("mirror: %s", e)
            if await wait_or_stop(stop, self.config.mirror_every_s):
                return

    async def _mirror_once(self) -> None:
        from protocol.envelope import Context, Kind, max_frame_bytes, open_envelope, seal
        from protocol.errors import ProtocolError, RemoteRefused

        assert self.core is not None
        if self._mirror_transport is None:
            self._mirror_transport = FramedSyncTransport(
                self._p2p,
                self.ctx.identity,
                self.ctx.records,
                self.plan,
                authorized_syncers=self.ctx.manifest.authorized_syncers,
            )
        transport = self._mirror_transport
        base = self._mirror or self.core.snapshot(self.ctx.run_id, self.term, wall_offset=_wall_offset())
        view = await transport.versions(list(base.versions), 0.0)
        changed = [f for f, v in enumerate(view.versions) if v > base.versions[f]]
        if not changed:
            return
        params, momentum, versions = dict(base.params), dict(base.momentum), list(base.versions)
        ledger = list(base.merged)
        published = list(base.published_wall) or [0.0] * self.plan.num_fragments
        state_limits = fragment_limits(self.plan, factor=2)
        for fragment in changed:
            frame = seal(
                self.ctx.identity,
                Context(run_id=self.ctx.run_id, kind=Kind.CONTROL, receiver=view.syncer),
                microbatch=fragment,
                step=0,
                now=time.time(),
                meta={"fragment": fragment},
            )
            try:
                peer, answer = await transport._call(STATE_ROUTE, frame, max_frame_bytes(state_limits))
                opened = open_envelope(
                    answer,
                    remote_peer=peer,
                    expect=Context(run_id=self.ctx.run_id, kind=Kind.VERSION, receiver=self.ctx.peer_id),
                    limits=state_limits,
                    replay=self._control_replay,
                    now=time.time(),
                )
            except (RemoteRefused, ProtocolError) as e:
                raise SyncUnavailable(f"state of fragment {fragment}: {e}") from None
            names = self.plan.fragments[fragment].names
            for name in names:
                params[name] = opened.tensors[f"param/{name}"]
                if f"momentum/{name}" in opened.tensors:
                    momentum[STATE_PREFIX + name] = opened.tensors[f"momentum/{name}"]
            versions[fragment] = opened.header.step
            wall = opened.meta.get("published_wall")
            published[fragment] = (
                float(wall) if type(wall) is float and math.isfinite(wall) and wall > 0 else 0.0
            )
            with contextlib.suppress(ValueError, TypeError):
                entries = ledger_from_json(str(opened.meta.get("merged", "[]")))
                ledger = [e for e in ledger if e[1] != fragment] + [e for e in entries if e[1] == fragment]
        self._mirror = SyncerSnapshot(
            run_id=self.ctx.run_id,
            term=view.term,
            versions=tuple(versions),
            params=params,
            momentum=momentum,
            merges=base.merges,
            tokens_merged=base.tokens_merged,
            merged=tuple(ledger),
            published_wall=tuple(published),
        )

    # ---- RPC handlers ----

    def _on_reject(self, remote: str, route: str, error: ProtocolError) -> None:
        self.refusals[error.reason] = self.refusals.get(error.reason, 0) + 1

    def _answer(
        self, kind: Any, receiver: str, *, microbatch: int = 0, step: int = 0, **kwargs: Any
    ) -> bytes:
        from protocol.envelope import Context, seal

        context = Context(run_id=self.ctx.run_id, kind=kind, receiver=receiver)
        return seal(self.ctx.identity, context, microbatch=microbatch, step=step, now=time.time(), **kwargs)

    def _open(self, frame: bytearray, remote: str, kind: Any, limits: Any, replay: Any) -> Any:
        from protocol.envelope import Context, open_envelope

        expect = Context(run_id=self.ctx.run_id, kind=kind, receiver=self.ctx.peer_id)
        return open_envelope(
            frame, remote_peer=remote, expect=expect, limits=limits, replay=replay, now=time.time()
        )

    def _require_active(self) -> None:
        if not self.active:
            raise _refuse("standby", "this syncer is on standby")

    async def _handle_push(self, frame: bytearray, remote: str) -> bytes:
        from protocol.envelope import Kind

        opened = self._open(frame, remote, Kind.FRAGMENT, self.limits, self._push_replay)
        meta, header = opened.meta, opened.header
        fields = _contribution_fields(meta)
        if fields["fragment"] != header.microbatch or fields["base_version"] != header.step:
            raise MalformedFrame("meta disagrees with the signed header", reason="malformed contribution")
        frames = parse_receipts_meta(meta)
        core = self.core
        assert core is not None
        core.check_contribution(fields["fragment"], opened.tensors)  # malformed: refused and counted first
        self._require_active()
        await self._check_known(remote)
        holder = self._live.get(remote)
        receipts = None
        if holder is not None and holder.role == "stage":  # verifiers watch stages: weigh them by receipts
            receipts = self._verified_receipts(remote, fields["fragment"], frames)
        recovering = time.monotonic() < self.recovering_until
        try:
            admission = core.accept(
                remote,
                fields["fragment"],
                opened.tensors,
                base_version=fields["base_version"],
                steps=fields["steps"],
                tokens=fields["tokens"],
                sched_step=fields["sched_step"],
                step_time_s=fields["step_time_s"],
                nonce=header.nonce,
                now=time.monotonic(),
                receipts=receipts,
            )
        except Refusal as e:
            if e.reason == "ahead of syncer" and recovering:
                raise _refuse("recovering", "recovering after a takeover") from None
            raise
        if admission.capped:
            self.strikes.record(remote, "counters capped")
        self.receipt_capped += admission.receipt_capped
        if recovering and fields["seen_term"] == self.term:
            self._fresh.add((remote, fields["fragment"]))
            if self._every_round_fresh():
                # every live holder sent every fragment's work through the outage, snapshotted once it knew
                # us, so none has a version to offer that we lack (a contribution on a base we lack is
                # deferred) nor progress still to send: waiting out recovery_s would only let their steps
                # since pile up, to be overwritten by the merge
                self.recovering_until = time.monotonic()
                logger.info("recovery complete: every live holder sent every fragment's outage work")
        self._wake.set()
        meta = {"target_version": admission.target_version, "late": admission.late}
        return self._answer(Kind.CONTROL, remote, meta=meta)

    def _every_round_fresh(self) -> bool:
        for fragment in range(self.plan.num_fragments):
            holders = self._holders(fragment)
            if not holders or any((peer, fragment) not in self._fresh for peer in holders):
                return False
        return True

    def _verified_receipts(self, remote: str, fragment: int, frames: list[bytes]) -> list[TokenReceipt]:
        """The receipts that verify for `remote` on the fragment's stage; the others are counted (and struck when
        forged), never raised: a bad receipt costs the contribution its credit, not the syncer anything."""
        valid, errors = verify_receipts(
            frames,
            run_id=self.ctx.run_id,
            replica=remote,
            stage=self.fragment_stage[fragment],
            authorized_verifiers=self.ctx.manifest.authorized_verifiers,
            now=time.time(),
        )
        for error in errors:
            self.receipts_rejected[error.reason] = self.receipts_rejected.get(error.reason, 0) + 1
            if error.reason in FORGERY_REASONS:
                self.strikes.record(remote, "bad receipt")
            logger.info("receipt from %s rejected: %s: %s", remote[-8:], error.reason, error)
        self.receipts_verified += len(valid)
        return valid

    async def _handle_versions(self, frame: bytearray, remote: str) -> bytes:
        from protocol.envelope import Kind

        opened = self._open(frame, remote, Kind.CONTROL, control_limits(), self._control_replay)
        self._require_active()
        known, wait_s = opened.meta.get("known"), opened.meta.get("wait_s", 0.0)
        num = self.plan.num_fragments
        if not (isinstance(known, list) and len(known) == num and all(type(v) is int for v in known)):
            raise MalformedFrame("known must list one int per fragment")
        if not (type(wait_s) is float and math.isfinite(wait_s)):
            raise MalformedFrame("wait_s must be a float")
        deadline = time.monotonic() + min(max(wait_s, 0.0), self.config.max_poll_s)
        core = self.core
        assert core is not None
        while self.active and not any(v > k for v, k in zip(core.versions, known, strict=True)):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._published.wait(), remaining)
        self._require_active()
        now = time.monotonic()
        meta = {
            "versions": list(core.versions),
            "term": self.term,
            "barrier": self.mode != "decoupled",
            "clock": core.clock_estimate(now),
            "ages": core.version_ages(now),
            "step_time_s": float(core.policy.xi_step or 0.0),
        }
        return self._answer(Kind.CONTROL, remote, meta=meta)

    async def _handle_fetch(self, frame: bytearray, remote: str) -> bytes:
        from protocol.envelope import Kind

        opened = self._open(frame, remote, Kind.CONTROL, control_limits(), self._control_replay)
        self._require_active()
        fragment = opened.meta.get("fragment")
        if type(fragment) is not int or not 0 <= fragment < self.plan.num_fragments:
            raise MalformedFrame("bad fragment id")
        core = self.core
        assert core is not None
        version = core.versions[fragment]
        return self._answer(
            Kind.VERSION,
            remote,
            microbatch=fragment,
            step=version,
            tensors=core.fragment_tensors(fragment),
            meta={"fragment": fragment, "version": version, "term": self.term},
        )

    async def _handle_state(self, frame: bytearray, remote: str) -> bytes:
        from protocol.envelope import Kind

        opened = self._open(frame, remote, Kind.CONTROL, control_limits(), self._control_replay)
        if remote not in self.ctx.manifest.authorized_syncers:
            raise _refuse("unauthorized", "only authorized syncers may read the syncer state", blame=True)
        self._require_active()
        fragment = opened.meta.get("fragment")
        if type(fragment) is not int or not 0 <= fragment < self.plan.num_fragments:
            raise MalformedFrame("bad fragment id")
        core = self.core
        assert core is not None
        async with self._merge_lock:
            tensors = {f"param/{n}": t.clone() for n, t in core.fragment_tensors(fragment).items()}
            tensors.update({f"momentum/{n}": t for n, t in core.fragment_momentum(fragment).items()})
            version = core.versions[fragment]
            ledger = _ledger_json([e for e in core.merged_ledger() if e[1] == fragment])
            published = core.published_wall(fragment, _wall_offset())
        return self._answer(
            Kind.VERSION,
            remote,
            microbatch=fragment,
            step=version,
            tensors=tensors,
            meta={"term": self.term, "merged": ledger, "published_wall": published},
        )

    async def _handle_offer(self, frame: bytearray, remote: str) -> bytes:
        from protocol.envelope import Kind

        opened = self._open(frame, remote, Kind.CONTROL, offer_limits(self.plan), self._control_replay)
        self._require_active()
        core = self.core
        assert core is not None
        adopted = 0
        for name, tensor in opened.tensors.items():
            if not name.startswith(OFFER_PREFIX):
                raise MalformedFrame("offer tensors are named offer/<fragment>")
            try:
                inner = open_version_envelope(
                    tensor.numpy().tobytes(),
                    run_id=self.ctx.run_id,
                    receiver=remote,
                    signer_candidates=self.ctx.manifest.authorized_syncers,
                    limits=self.limits,
                    now=time.time(),
                    max_age_s=OFFER_MAX_AGE_S,
                )
            except ProtocolError as e:
                raise MalformedFrame(
                    f"offered version does not verify: {e.reason}", reason="bad offer"
                ) from None
            fragment = inner.header.microbatch
            if name != f"{OFFER_PREFIX}{fragment}" or not 0 <= fragment < self.plan.num_fragments:
                raise MalformedFrame("offered version names another fragment", reason="bad offer")
            # sealed by the old syncer when the learner fetched it, just after its publication
            fetched_at = time.monotonic() - max(0.0, time.time() - inner.header.timestamp)
            async with self._merge_lock:
                if core.adopt(
                    fragment, inner.header.step, inner.tensors, time.monotonic(), published_at=fetched_at
                ):
                    adopted += 1
                    self.adopted += 1
                    self.ctx.events.emit(
                        "adopted",
                        fragment=fragment,
                        version=inner.header.step,
                        signer=inner.header.sender,
                        via=remote,
                    )
        if adopted:
            self._notify()
        return self._answer(Kind.CONTROL, remote, meta={"adopted": adopted})

    # ---- status ----

    def status(self) -> dict[str, Any]:
        core = self.core
        if core is None:
            return {"state": "joining", "mode": self.mode}
        policy = core.policy
        return {
            "state": "syncing" if self.active else "standby",
            "mode": self.mode,
            "term": self.term,
            "primary": self.primary,
            "recovering": self.active and time.monotonic() < self.recovering_until,
            # an active syncer whose lease renewals failed for lease_s still answers but merges nothing
            "lease_left_s": round(self._lease_until - time.monotonic(), 3) if self.active else None,
            "takeover_source": self.takeover_source,
            "versions": list(core.versions),
            "merges": core.merges,
            "tokens_merged": core.tokens_merged,
            "inner_step": core.merges,
            "tokens": core.tokens_merged,
            "loss": self.held_out_loss,
            "held_out_loss": self.held_out_loss,
            "open_rounds": {str(f): len(r.entries) for f, r in core.rounds.items()},
            "live_holders": len(self._live),
            "takeover_quorum": list(self._quorum),
            "lease_vacant_looks": self._vacant_looks,
            "grace_s": round(policy.grace_s(), 4),
            "xi_step_s": policy.xi_step,
            "xi_quorum_s": policy.xi_quorum,
            "xi_sync_s": policy.xi_sync,
            "adopted": self.adopted,
            "refusals": dict(self.refusals),
            "receipts": {
                "verified": self.receipts_verified,
                "rejected": dict(self.receipts_rejected),
                "capped": self.receipt_capped,
            },
            "strikes": self.strikes.snapshot(),
            "checkpoint": str(self.checkpoint_file),
            "last_checkpoint_at": self.last_checkpoint_at,
            "mirror_versions": list(self._mirror.versions) if self._mirror is not None else None,
            "recent_merges": list(self.recent_merges),
        }


def _ledger_json(entries: list[tuple[str, int, int, int, int]], max_chars: int = 4000) -> str:
    """The ledger as JSON for an envelope's meta (4096 characters at most): the most recent entries first."""
    kept: list[list[object]] = []
    for entry in reversed(entries):
        if len(json.dumps([*kept, list(entry)])) > max_chars:
            break
        kept.append(list(entry))
    return json.dumps(kept)


def _contribution_fields(meta: Mapping[str, Any]) -> dict[str, Any]:
    ints = ("fragment", "base_version", "steps", "tokens", "sched_step")
    out: dict[str, Any] = {}
    for name in ints:
        value = meta.get(name)
        if type(value) is not int or value < 0:
            raise MalformedFrame(
                f"contribution meta {name} must be an int >= 0", reason="malformed contribution"
            )
        out[name] = value
    step_time = meta.get("step_time_s")
    if type(step_time) is not float or not math.isfinite(step_time) or step_time < 0:
        raise MalformedFrame(
            "contribution meta step_time_s must be a float >= 0", reason="malformed contribution"
        )
    out["step_time_s"] = step_time
    seen_term = meta.get("seen_term", 0)  # absent from an older learner: never counts as fresh
    if type(seen_term) is not int or seen_term < 0:
        raise MalformedFrame(
            "contribution meta seen_term must be an int >= 0", reason="malformed contribution"
        )
    out["seen_term"] = seen_term
    return out


def _wall_offset() -> float:
    """Wall clock minus the monotonic clock the syncer core runs on: dates versions across syncers."""
    return time.time() - time.monotonic()


def _fragment_stages(manifest: Any, plan: FragmentPlan) -> list[int]:
    """The pipeline stage whose span holds each fragment (run_fragment_plan numbers them stage by stage)."""
    from node.ml.model import ModelConfig, StageModule, stage_spans

    cfg = ModelConfig.from_dict(manifest.model)
    spans = stage_spans(cfg.num_layers, manifest.num_stages)
    owner: dict[str, int] = {}
    for index, span in enumerate(spans):
        with torch.device("meta"):
            stage = StageModule(cfg, span, is_first=index == 0, is_last=index == len(spans) - 1)
        for name, _ in stage.named_parameters():
            owner[name] = index
    return [owner[f.names[0]] for f in plan.fragments]


def _data_spec(manifest: Any) -> str | None:
    source = manifest.data.get("source", "builtin")
    return None if source == "builtin" else str(source)


def create_role(ctx: NodeContext) -> SyncerRole:
    return SyncerRole(ctx)


__all__ = [
    "MODES",
    "Admission",
    "LeaseView",
    "MergeRecord",
    "Refusal",
    "SyncerConfig",
    "SyncerCore",
    "SyncerRole",
    "create_role",
    "lease_action",
    "quorum_config",
]
