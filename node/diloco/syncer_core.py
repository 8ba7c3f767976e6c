"""The syncer's pure core: the global fragments and their outer Nesterov state, one open round per fragment,
admission of an identity (`admit_push`: the run's admission cost, protocol.admission) and of a contribution
(staleness, idempotency, the contribution screen of node.diloco.screening, counter caps, verifier receipts), the
quorum/grace decision (`QuorumPolicy`) and the merge (`merge_fragment` + `OuterNesterov`, young identities' weight
capped by node.diloco.seniority, a round rolled back when its outer step is not finite), split into a heavy
`compute_merge` (run in a worker thread) and a cheap `commit_merge`; snapshots for checkpoints. No sockets and no
clock of its own: the caller (node.roles.syncer) passes `now` and serialises calls."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
from collections import OrderedDict
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

import torch

from node.diloco import chunked
from node.diloco.claims import ClaimBound, copy_of
from node.diloco.compression import decode_contribution, push_mask
from node.diloco.counters import cap_counters
from node.diloco.evidence import ZeroStreak
from node.diloco.fragments import FragmentPlan
from node.diloco.learner_ledger import contribution_digest
from node.diloco.loss_probe import LossScore
from node.diloco.merge import Contribution, MergeResult, NothingToMerge, merge_fragment
from node.diloco.outer import NonFiniteStep, OuterNesterov
from node.diloco.param_store import Entry, MemoryParams, ParamStore, fragment_bytes, new_store
from node.diloco.probation import ProbationConfig
from node.diloco.quorum import QuorumConfig, QuorumPolicy, step_time_floor
from node.diloco.receipts import ReceiptLedger
from node.diloco.screening import ContributionScreen, ScreeningConfig, ScreenUpdate
from node.diloco.seniority import CappedWeights, Seniority, SeniorityConfig
from node.diloco.spill import (
    ScaledTensors,
    SpillDir,
    SpilledMomentum,
    SpilledTensors,
    release_freed_memory,
)
from node.ml.checkpoint import SyncerSnapshot
from protocol.admission import AdmissionRefused, AdmissionSpec, verify_admission
from protocol.compress import CodecSpec
from protocol.errors import MalformedFrame, ProtocolError

if TYPE_CHECKING:
    from protocol.receipts import TokenReceipt

logger = logging.getLogger(__name__)
MAX_STEP_TIME_S = 600.0  # a self-reported step time above this is nonsense; it only feeds the grace EMA


class Refusal(ProtocolError):
    """A contribution the syncer will not take; `reason` is the tag the learner sees, `cause` a finer one for
    metrics (an admission refusal's AdmissionRefused.cause), not sent."""

    cause = ""


def refuse(reason: str, message: str, *, blame: bool = False) -> Refusal:
    return Refusal(message, reason=reason, blame_sender=blame)


@dataclass(slots=True)
class _Entry:
    contribution: Contribution
    key: tuple[str, int, int, bytes]
    received_at: float
    # (verifier, session) -> verified tokens its receipts showed (stage replicas; committed once merged)
    receipt_counts: dict[tuple[str, str], int] = field(default_factory=dict)
    loss_delta: float | None = None  # its held-out loss-delta score, if measured (node.diloco.loss_probe)
    slope: float | None = None  # its held-out descent per unit norm, if measured (node.diloco.evidence)
    cosine: float | None = None  # with the recent merged direction, if the screen measured it (same)


@dataclass(slots=True)
class _Round:
    opened_at: float | None = None  # when the first contribution that counts toward K arrived
    entries: dict[str, _Entry] = field(default_factory=dict)  # peer -> its newest counting contribution
    quorum_reached_at: float | None = None
    # peers whose contribution to this round was refused for good: their learner drops it and sends nothing
    # more to the round, so it must not wait for them (see `refused_in_round`)
    refused: set[str] = field(default_factory=set)


@dataclass(frozen=True, kw_only=True, slots=True)
class Admission:
    target_version: int
    capped: bool  # the counters were reduced (count it against the sender)
    late: bool = False  # lock-step modes: its round merged without it (its learner realigns, see accept)
    receipt_capped: bool = False  # tokens were cut to what verifier receipts show (receipts lag: no strike)
    # (reason, numbers): the claim was implausible (ClaimBound.judge); the shell records it in the learner ledger
    claim_violation: tuple[str, dict[str, float]] | None = None


@dataclass(frozen=True, kw_only=True, slots=True)
class PreparedMerge:
    """What `compute_merge` produced; `commit_merge` publishes it."""

    fragment: int
    base_version: int
    round: _Round
    result: MergeResult
    new_params: Mapping[str, torch.Tensor]  # tensors, or their file (a merge with its state on disk)
    merged: dict[str, Contribution]  # per peer, what went into merge_fragment (its entries combined)
    sources: dict[str, list[_Entry]]  # per peer, the contributions combined
    required: int
    expected: int
    started_at: float
    screened: ScreenUpdate | None = None  # what the merge adds to the contribution screen's history
    # per young peer the seniority cap scaled down, the fraction of a round the merge ages it by
    seniority_credit: dict[str, float] = field(default_factory=dict)
    # per peer with a measured slope: (slope, cosine or None, the evidence factor its weight was scaled by;
    # node.diloco.evidence)
    evidence: dict[str, tuple[float, float | None, float]] = field(default_factory=dict)
    step_scale: float = 1.0  # what its outer gradient was scaled by (evidence x seniority; `merge_capped`)
    spilled: str | None = None  # the replaced version's file (VersionHistory.spill_now), if spilled


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
    # per scored contribution (weighted or not): [its held-out slope, its cosine with the recent merged direction
    # (None: not measured), the evidence factor its weight was scaled by]
    evidence: dict[str, list[float | None]] = field(default_factory=dict)
    # what the outer gradient was scaled by: the largest evidence factor merged x the seniority cap's young-only
    # scale (1: a full step); `weights` are already scaled by it (each one a share of a full step)
    step_scale: float = 1.0

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
    merge without a live learner). Given only a count, every contribution in counts. A holder whose
    contribution to the round was refused is not waited for."""
    refused = round_.refused - round_.entries.keys()
    if isinstance(expected, int):
        return max(expected - len(refused), len(round_.entries))
    return len(round_.entries) + len(set(expected) - round_.entries.keys() - refused)


def combine_round(
    round_: _Round,
    current_params: Mapping[str, torch.Tensor],
    history: Mapping[int, Mapping[str, torch.Tensor]],
    current: int,
    max_staleness: int,
) -> tuple[dict[str, Contribution], dict[str, list[_Entry]]]:
    """One contribution per peer, its delta taken against its own base version (`history`: the fragment's
    tensors of the versions still held; `current_params`: those of version `current`).

    A contribution on an older base (the synchronous modes take them, e.g. after a failover) is expressed
    as parameters against the current global value, so `merge_fragment` sees current - params == the
    learner's own progress (base value - learner value) instead of that progress minus every merge it
    missed. A base whose value we no longer hold (after a restore or an adoption) falls back to the
    current value, as if it were current. Ones older than max_staleness are dropped."""
    names = list(current_params)
    sources: dict[str, list[_Entry]] = {}
    for entry in round_.entries.values():
        if entry.contribution.base_version < current - max_staleness:
            logger.info("dropping a contribution of %s: base too old", entry.contribution.peer_id)
            continue
        sources.setdefault(entry.contribution.peer_id, []).append(entry)
    merged: dict[str, Contribution] = {}
    for peer, entries in sources.items():
        if len(entries) == 1 and entries[0].contribution.base_version == current:
            merged[peer] = entries[0].contribution
            continue
        delta = {n: torch.zeros_like(current_params[n]) for n in names}
        for entry in entries:
            c = entry.contribution
            base = history.get(c.base_version) or current_params
            for n in names:
                delta[n] += base[n] - c.params[n]
        merged[peer] = Contribution(
            peer_id=peer,
            params={n: current_params[n] - delta[n] for n in names},
            base_version=max(e.contribution.base_version for e in entries),
            steps=sum(e.contribution.steps for e in entries),
            tokens=sum(e.contribution.tokens for e in entries),
        )
    return merged, sources


def _mean_per_peer(
    sources: Mapping[str, list[_Entry]], value: Callable[[_Entry], float | None]
) -> dict[str, float]:
    """Per peer, the mean of `value` (a held-out score, slope or cosine) over its contributions that have one."""
    scores: dict[str, float] = {}
    for peer, entries in sources.items():
        measured = [v for e in entries if (v := value(e)) is not None]
        if measured:
            scores[peer] = math.fsum(measured) / len(measured)
    return scores


def _void_result(rejected: Mapping[str, str]) -> MergeResult:
    return MergeResult(
        outer_grad={},
        weights={},
        clipped={},
        fallback_tensors=(),
        rejected=dict(rejected),
        delta_norms={},
        reason="void round: nothing to merge, parameters unchanged",
    )


def due_rounds(
    rounds: Mapping[int, _Round], policy: QuorumPolicy, now: float, expected: Callable[[int], Expected]
) -> tuple[list[int], float | None]:
    """`SyncerCore.due` over `rounds`; notes each round's quorum time (and feeds it to the policy's EMA)."""
    ready, deadline = [], None
    for fragment, round_ in rounds.items():
        if round_.opened_at is None:
            continue
        received = len(round_.entries)
        num_expected = _num_expected(round_, expected(fragment))
        required = policy.required(num_expected)
        if received >= required and round_.quorum_reached_at is None:
            # when the required-th contribution arrived, not when we got to look (a merge of another
            # fragment may have held the loop): xi_quorum is the wait for learners, not for ourselves
            arrivals = sorted(e.received_at for e in round_.entries.values())
            round_.quorum_reached_at = arrivals[required - 1] if 0 < required <= len(arrivals) else now
            # from the first contribution still in the round, not from when the round opened: a peer's newer
            # contribution replaces its first one (retries after a takeover did), and that gap is no wait for
            # learners; counted, one 3 s gap closed the grace window for the next ten merges (K = 1: 0)
            first = arrivals[0] if arrivals else round_.opened_at
            policy.observe_quorum(max(0.0, round_.quorum_reached_at - first))
        decision = policy.decide(now, round_.opened_at, received, num_expected, round_.quorum_reached_at)
        if decision.action == "merge":
            ready.append(fragment)
        elif decision.deadline is not None:
            deadline = decision.deadline if deadline is None else min(deadline, decision.deadline)
    return ready, deadline


def merge_record(prepared: PreparedMerge, version: int, now: float) -> MergeRecord:
    """The tape line of a committed merge."""
    tokens = steps = late = 0
    contributed: dict[str, list[list[float]]] = {}
    for peer in prepared.result.participants:
        tokens += prepared.merged[peer].tokens
        steps += prepared.merged[peer].steps
        for entry in prepared.sources[peer]:
            c = entry.contribution
            late += c.base_version < prepared.base_version
            contributed.setdefault(peer, []).append(
                [c.steps, c.tokens, round(max(0.0, now - entry.received_at), 3), c.base_version]
            )
    result, round_, started = prepared.result, prepared.round, prepared.started_at
    reached = round_.quorum_reached_at
    return MergeRecord(
        fragment=prepared.fragment,
        version=version,
        participants=result.participants,
        weights=dict(result.weights),
        tokens=tokens,
        steps=steps,
        received=len(round_.entries),
        expected=prepared.expected,
        required=prepared.required,
        quorum_wait_s=round((reached or started) - (round_.opened_at or started), 4),
        grace_waited_s=round(started - reached, 4) if reached is not None else 0.0,
        clipped=dict(result.clipped),
        rejected=dict(result.rejected),
        duration_s=round(now - started, 4),
        late=late,
        contributed=contributed,
        evidence={
            p: [round(s, 6), None if c is None else round(c, 4), round(f, 4)]
            for p, (s, c, f) in prepared.evidence.items()
        },
        step_scale=round(prepared.step_scale, 6),
    )


class SpilledVersions(Mapping[int, Mapping[str, torch.Tensor]]):
    """A fragment's versions still held (`VersionHistory.of`): each either in memory or the key of its file in the
    spill directory, a mapping that reads a tensor (a fresh copy per read: hold it no longer than needed) or a chunk
    (node.diloco.chunked) when asked for."""

    def __init__(self, entries: Mapping[int, Entry], spill: SpillDir | None) -> None:
        self._entries, self._spill = entries, spill

    def __getitem__(self, version: int) -> Mapping[str, torch.Tensor]:
        entry = self._entries[version]
        if isinstance(entry, str):
            assert self._spill is not None
            return self._spill.tensors(entry)  # read a tensor or a chunk at a time when used
        return entry

    def __iter__(self) -> Iterator[int]:
        return iter(list(self._entries))

    def __len__(self) -> int:
        return len(self._entries)


class VersionHistory:
    """Per fragment, what is known of its versions: when each was published (on the core's clock) and the
    tensors of those a contribution may still be built on (its delta is taken against its own base, what the
    learner actually did since it overwrote, so one on an older base neither undoes the merges it missed nor
    is lost); whether the current version is one of our own merges (not restored, not adopted); and whether it
    is a regular round (our merge after one of our own merges), which learners may time their sends from: a
    first merge after a takeover gathers the learners' retried outage work of every fragment at once and
    would bunch their staggered sends.

    With a `spill` directory, only the current version of each fragment (the global parameters) is in memory; the
    older ones are in files (node.diloco.spill), read when a contribution on them is screened or merged."""

    def __init__(
        self, num_fragments: int, max_staleness: int, now: float, spill: SpillDir | None = None
    ) -> None:
        self.max_staleness = max_staleness
        self.spill = spill
        self.published_at: dict[tuple[int, int], float] = {}
        self.restored_at = now  # work on a version of unknown date is capped from here
        # fragment -> version -> its tensors, or the key of its file in `spill`
        self.tensors: dict[int, dict[int, Entry]] = {}
        self.merged_here = [False] * num_fragments
        self.dated = [False] * num_fragments
        self.ours: set[tuple[int, int]] = set()  # (fragment, version) published by one of our merges
        # (fragment, version) -> every fragment's version right after our merge published it: the model a
        # contribution on that base was trained in (`probe_context`)
        self.contexts: dict[tuple[int, int], tuple[int, ...]] = {}

    def measured(self, fragment: int, version: int) -> bool:
        """Whether work on `version` has a measured start: we published it (learners overwrite with it at once). Not
        the seed (each learner started from it whenever it joined) nor a version restored or adopted."""
        return (fragment, version) in self.ours

    def since(self, fragment: int, version: int) -> float:
        """When that version was published, or the last restore if unknown (the counters cap runs from it)."""
        return self.published_at.get((fragment, version), self.restored_at)

    def at(self, fragment: int, version: int) -> Mapping[str, torch.Tensor] | None:
        """The fragment as it was at `version`, if still held."""
        return self.of(fragment).get(version)

    def of(self, fragment: int) -> Mapping[int, Mapping[str, torch.Tensor]]:
        """The fragment's versions still held, version -> tensors (spilled ones read when asked for)."""
        return SpilledVersions(self.tensors.get(fragment, {}), self.spill)

    def spill_now(self, fragment: int, tensors: Mapping[str, torch.Tensor]) -> str | None:
        """Write a version about to be replaced to the spill directory (in the merge's worker thread, so that its
        commit need not): the key `publish` takes as `spilled`; None without a spill directory, or for a version
        already in a file (the global parameters on disk, node.diloco.param_store: nothing to copy)."""
        if self.spill is None or isinstance(tensors, SpilledTensors):
            return None
        key = self.spill.new_key(f"version-{fragment}")
        self.spill.write(key, tensors)
        return key

    def publish(
        self,
        fragment: int,
        version: int,
        tensors: Mapping[str, torch.Tensor] | str,
        now: float,
        *,
        spilled: str | None = None,
        context: Sequence[int] = (),
    ) -> None:
        """One of our merges published `version` (its tensors, or the key of its file: the global parameters on
        disk); `spilled`: the file of `version - 1` (`spill_now`), if written; `context`: every fragment's version
        then (this one's `version`)."""
        self.published_at[(fragment, version)] = now
        self.published_at.pop((fragment, version - self.max_staleness - 2), None)
        if context:
            self.contexts[(fragment, version)] = tuple(context)
        self.contexts.pop((fragment, version - self.max_staleness - 2), None)
        self.ours.add((fragment, version))
        self.ours.discard((fragment, version - self.max_staleness - 2))
        self.dated[fragment] = self.merged_here[fragment]
        self.merged_here[fragment] = True
        history = self.tensors.setdefault(fragment, {})
        history[version] = tensors if isinstance(tensors, str) else dict(tensors)
        for old in [v for v in history if v < version - self.max_staleness]:
            entry = history.pop(old)
            # a void round's version is its predecessor's file: that file goes with the last version that has it
            if not (isinstance(entry, str) and entry in history.values()):
                self.discard(entry)
        if spilled is not None and isinstance(history.get(version - 1), dict):
            history[version - 1] = spilled
        elif spilled is not None:
            self.discard(spilled)
        if self.spill is not None:
            self._spill_older(history, version)

    def retire(self, fragment: int, version: int, spilled: str) -> None:
        """The fragment's current `version` is about to be replaced in place: from now on it is its file `spilled`
        (`spill_now`), so that its tensors can go before the new ones are read (`SyncerCore._swap_in`)."""
        history = self.tensors.setdefault(fragment, {})
        if isinstance(history.get(version), dict):
            history[version] = spilled
        else:
            self.discard(spilled)

    def _spill_older(self, history: dict[int, Entry], version: int) -> None:
        """Older versions still in memory go to files, unless they are the current tensors (a void round); with
        the current version in a file (the global parameters on disk) every version is in one already."""
        current = history[version]
        assert self.spill is not None
        if isinstance(current, str):
            return
        for old, entry in list(history.items()):
            if old == version or isinstance(entry, str):
                continue
            if all(entry[n] is current.get(n) for n in entry):
                continue
            key = self.spill.new_key("version")
            self.spill.write(key, entry)
            history[old] = key

    def discard(self, entry: Entry | None) -> None:
        if isinstance(entry, str) and self.spill is not None:
            self.spill.delete(entry)

    def _drop_all(self, fragments: Iterable[int]) -> None:
        for fragment in fragments:
            for entry in self.tensors.get(fragment, {}).values():
                self.discard(entry)

    def replace(self, fragment: int, version: int, tensors: Entry, published_at: float) -> None:
        """An earlier syncer's `version` was adopted: the only one of the fragment known now, undated."""
        self.published_at[(fragment, version)] = published_at
        self._drop_all([fragment])
        self.ours = {key for key in self.ours if key[0] != fragment}
        self.contexts = {key: c for key, c in self.contexts.items() if key[0] != fragment}
        self.tensors[fragment] = {version: tensors if isinstance(tensors, str) else dict(tensors)}
        self.merged_here[fragment] = False
        self.dated[fragment] = False

    def reset(self, current: Sequence[tuple[int, Entry]], now: float) -> None:
        """After a restore: only the current (version, tensors) of each fragment are known, none of ours."""
        self.published_at.clear()
        self.ours.clear()
        self.contexts.clear()
        self.restored_at = now
        self._drop_all(list(self.tensors))
        self.tensors = {f: {v: tensors} for f, (v, tensors) in enumerate(current)}
        self.merged_here = [False] * len(current)
        self.dated = [False] * len(current)

    def date(self, versions: Sequence[int], published: Sequence[float | None]) -> None:
        """After a restore, per fragment when its version was published (this clock; None: unknown). The counters
        cap of work built on a restored version runs from its publication, not from the restore: a learner that
        stepped through the outage did that work (capped from the restore, an outage of 27 steps was cut to the
        5 steps since the takeover, and struck)."""
        for fragment, at in enumerate(published):
            if at is not None:
                self.published_at[(fragment, versions[fragment])] = min(self.restored_at, at)

    def ages(self, versions: Sequence[int], now: float) -> list[float]:
        """Per fragment, seconds since its current version was published, -1.0 unless a regular round."""
        ages = []
        for fragment, version in enumerate(versions):
            at = self.published_at.get((fragment, version)) if self.dated[fragment] else None
            ages.append(round(max(0.0, now - at), 4) if at is not None else -1.0)
        return ages


class MergedLedger:
    """What was merged already: per (peer, fragment, base version) the steps and tokens taken from that peer on
    that base, and when (a later contribution on the same base only counts, and weighs, what it adds); and the
    keys (peer, fragment, base, nonce) of merged contributions, so a replayed one is a duplicate. Both bounded,
    oldest first out."""

    def __init__(self, max_entries: int) -> None:
        self.max_entries = max_entries
        self.counters: OrderedDict[tuple[str, int, int], tuple[int, int, float]] = OrderedDict()
        self.keys: OrderedDict[tuple[str, int, int, bytes], None] = OrderedDict()

    def remember(self, entry: _Entry, now: float) -> None:
        c = entry.contribution
        key = (c.peer_id, entry.key[1], c.base_version)
        prior = self.counters.pop(key, (0, 0, now))  # re-insert: the dict stays ordered by recency
        self.counters[key] = (prior[0] + c.steps, prior[1] + c.tokens, now)
        self.keys[entry.key] = None
        while len(self.keys) > self.max_entries:
            self.keys.popitem(last=False)
        while len(self.counters) > self.max_entries:
            self.counters.popitem(last=False)

    def entries(
        self, versions: Sequence[int], max_staleness: int
    ) -> tuple[tuple[str, int, int, int, int], ...]:
        """(peer, fragment, base, steps, tokens) for bases that can still be contributed on."""
        return tuple(
            (peer, f, base, steps, tokens)
            for (peer, f, base), (steps, tokens, _) in self.counters.items()
            if base >= versions[f] - max_staleness
        )

    def load(self, ledger: Sequence[tuple[str, int, int, int, int]], num_fragments: int, now: float) -> None:
        for peer, f, base, steps, tokens in ledger:
            if 0 <= f < num_fragments:
                self.counters[(peer, f, base)] = (steps, tokens, now)


class ScheduleClock:
    """The run's schedule step from what contributors report: per peer its latest (step, when), bounded."""

    def __init__(self, max_peers: int) -> None:
        self.highest = 0  # highest schedule step a contributor reported
        self.max_peers = max_peers
        self._reports: OrderedDict[str, tuple[int, float]] = OrderedDict()

    def report(self, peer: str, step: int, now: float) -> None:
        self.highest = max(self.highest, step)
        self._reports.pop(peer, None)
        self._reports[peer] = (step, now)
        while len(self._reports) > self.max_peers:
            self._reports.popitem(last=False)

    def estimate(self, now: float, xi_step: float, max_age_s: float) -> int:
        """Per peer, its latest report plus the steps since (at `xi_step` seconds a step), then the median over
        peers that reported within `max_age_s`; 0 when nobody did."""
        estimates = sorted(
            step + (int((now - at) / xi_step) if xi_step > 0 else 0)
            for step, at in self._reports.values()
            if now - at <= max_age_s
        )
        if not estimates:
            return 0
        return estimates[(len(estimates) - 1) // 2]


class AdmissionGate:
    """The run's admission cost at the syncer (protocol.admission): checked before anything else looks at a push
    (one hash at most); the pushes it refused, per peer (bounded, oldest first out) and per cause."""

    def __init__(self, spec: AdmissionSpec, run_id: str, max_peers: int) -> None:
        self.spec, self.run_id, self.max_peers = spec, run_id, max_peers
        self.refused: dict[str, int] = {}
        self.refused_by_cause: dict[str, int] = {}  # ADMISSION_CAUSES: four keys at most

    def admit(self, peer: str, proof: object, now: float, seniority: Seniority) -> None:
        """Raise Refusal (reason "admission") unless `peer` is on the allow-list or `proof` (the push meta's
        `admission` value) is a proof-of-work bound to this run and to `peer`; a refusal demotes the peer."""
        try:
            verify_admission(self.spec, self.run_id, peer, proof)
        except AdmissionRefused as e:
            seniority.demote(peer, now)
            count = self.refused.pop(peer, 0) + 1
            self.refused[peer] = count  # re-inserted last: oldest first out
            while len(self.refused) > self.max_peers:
                del self.refused[next(iter(self.refused))]
            self.refused_by_cause[e.cause] = self.refused_by_cause.get(e.cause, 0) + 1
            if count == 1 or count % 100 == 0:  # logged, not a log line per push of a flood
                logger.warning("refused a push of %s: admission: %s (%d so far)", peer[-8:], e, count)
            refusal = refuse("admission", str(e), blame=True)
            refusal.cause = e.cause
            raise refusal from None


@contextlib.contextmanager
def demoted_on_refusal(seniority: Seniority, peer: str, now: float) -> Iterator[None]:
    """A blamed Refusal raised inside makes `peer` young again (node.diloco.seniority), then propagates."""
    try:
        yield
    except Refusal as e:
        if e.blame_sender:
            seniority.demote(peer, now)
        raise


def seniority_config(screening: ScreeningConfig, max_peers: int) -> SeniorityConfig:
    """The seniority cap and probation ramp of a screening config; off (cap 1.0, no ramp) when screening is off
    (comparisons only)."""
    on = screening.enabled
    ramp = ProbationConfig(
        merges=screening.probation_merges if on else 0, start_fraction=screening.probation_start_fraction
    )
    cap = screening.young_weight_cap if on else 1.0
    return SeniorityConfig(
        young_rounds=screening.young_rounds, young_weight_cap=cap, max_peers=max_peers, probation=ramp
    )


def check_shape(
    plan: FragmentPlan,
    shapes: Mapping[str, tuple[int, ...]],
    fragment: int,
    params: Mapping[str, torch.Tensor],
) -> None:
    """Raise MalformedFrame unless `params` are exactly the fragment's tensors, shapes and float dtypes."""
    if not 0 <= fragment < plan.num_fragments:
        raise MalformedFrame(f"fragment {fragment} out of range", reason="malformed contribution")
    names = plan.fragments[fragment].names
    if set(params) != set(names):
        raise MalformedFrame(f"fragment {fragment}: wrong tensor names", reason="malformed contribution")
    for name in names:  # (a push held in a spill file is not read for this)
        if chunked.shape(params, name) != shapes[name] or not chunked.is_float(params, name):
            raise MalformedFrame(f"{name}: wrong shape or dtype", reason="malformed contribution")


class CoreState:
    """The syncer core's versions and their persistence (snapshots, restores, adoption), split from `SyncerCore`
    (its base) to keep each class readable; `SyncerCore.__init__` sets every attribute declared here."""

    plan: FragmentPlan
    params: ParamStore  # the global parameters, in memory or on disk (node.diloco.param_store)
    outer: OuterNesterov
    spilled: SpilledMomentum | None
    versions: list[int]
    rounds: dict[int, _Round]
    merges: int
    tokens_merged: int
    max_staleness: int
    history: VersionHistory
    seniority: Seniority
    _ledger: MergedLedger

    @property
    def shapes(self) -> dict[str, tuple[int, ...]]:
        return self.params.shapes

    def check_contribution(self, fragment: int, params: Mapping[str, torch.Tensor]) -> None:
        """Raise MalformedFrame unless `params` are exactly the fragment's tensors, shapes and float dtypes."""
        check_shape(self.plan, self.shapes, fragment, params)

    def _current(self) -> list[tuple[int, Entry]]:
        return [(v, self.params.entry(f)) for f, v in enumerate(self.versions)]

    def version_ages(self, now: float) -> list[float]:
        """Per fragment, seconds since its current version was published by one of our merges; -1.0 when it
        is not a regular round (the seed, a version restored or adopted, or our first merge of the fragment
        after those: the learners' work retried through an outage, every fragment at once). Decoupled
        learners time their next send of a fragment from its round's publication
        (`SendTimer.anchor`): all of them see the same rounds, so they stay in phase without
        counting steps; through an undated version they keep their anchors, which kept the fragments'
        stagger."""
        return self.history.ages(self.versions, now)

    def merged_ledger(self) -> tuple[tuple[str, int, int, int, int], ...]:
        """(peer, fragment, base, steps, tokens) already merged, for bases that can still be contributed on."""
        return self._ledger.entries(self.versions, self.max_staleness)

    def load_ledger(self, ledger: tuple[tuple[str, int, int, int, int], ...], now: float) -> None:
        self._ledger.load(ledger, self.plan.num_fragments, now)

    def fragment_tensors(self, fragment: int) -> Mapping[str, torch.Tensor]:
        """The fragment's current tensors: in memory, or its file (read a tensor or a chunk at a time)."""
        return self.params.fragment(fragment)

    def fragment_momentum(self, fragment: int) -> dict[str, torch.Tensor]:
        if self.spilled is not None:
            return self.spilled.load(fragment)
        buffers = {name: self.outer.buffer(name) for name in self.plan.fragments[fragment].names}
        return {name: buf.clone() for name, buf in buffers.items() if buf is not None}

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
        self.check_contribution(fragment, params)
        if not all(bool(torch.isfinite(t).all()) for t in params.values()):
            return False
        self.params.put(fragment, params)
        self.versions[fragment] = version
        self.rounds.pop(fragment, None)  # its contributions were built on older versions
        at = now if published_at is None else min(now, published_at)
        self.history.replace(fragment, version, self.params.entry(fragment), at)
        return True

    def snapshot(self, run_id: str, term: int, *, wall_offset: float | None = None) -> SyncerSnapshot:
        """`wall_offset`: wall clock minus the clock this core is driven by, to date the versions (absent:
        undated, and a successor caps work on them from its own start).

        The tensors are shared, not copied: the core never writes a published tensor or a momentum buffer in
        place (a merge, an adoption, a restore put new ones in), so the snapshot keeps the state it was taken at
        while a checkpoint is written from it in a thread. Copies were two more models in memory at every
        checkpoint (docs/scale.md). Whoever holds a snapshot must not write into its tensors. With the parameters on
        disk the snapshot's are their files, pinned (node.diloco.param_store `FilesView`)."""
        return SyncerSnapshot(
            run_id=run_id,
            term=term,
            versions=tuple(self.versions),
            params=self.params.view(),
            momentum=self.spilled.view() if self.spilled is not None else self.outer.state_dict(share=True),
            merges=self.merges,
            tokens_merged=self.tokens_merged,
            merged=self.merged_ledger(),
            published_wall=tuple(self.published_wall(f, wall_offset) for f in range(self.plan.num_fragments))
            if wall_offset is not None
            else (),
            seniority=self.seniority.export(wall_offset) if wall_offset is not None else (),
        )

    def published_wall(self, fragment: int, wall_offset: float | None) -> float:
        """When the fragment's current version was published, on the wall clock; 0.0 if unknown."""
        at = self.history.published_at.get((fragment, self.versions[fragment]))
        return at + wall_offset if at is not None and wall_offset is not None else 0.0

    def restore(self, snapshot: SyncerSnapshot, now: float, *, wall_offset: float | None = None) -> None:
        if len(snapshot.versions) != self.plan.num_fragments or set(snapshot.params) != set(self.params):
            raise ValueError("snapshot does not fit this run's plan")
        self.params.load(snapshot.params)
        self.versions = list(snapshot.versions)
        self.history.reset(self._current(), now)  # (first: it drops the tensors the restore replaced)
        if self.spilled is None:
            self.outer.load_state_dict(snapshot.momentum)
        else:  # checked as load_state_dict checks, read and written one fragment at a time
            self.spilled.restore(snapshot.momentum)
        self.merges, self.tokens_merged = snapshot.merges, snapshot.tokens_merged
        self.rounds.clear()
        self._ledger.counters.clear()
        self.load_ledger(snapshot.merged, now)
        if wall_offset is not None and len(snapshot.published_wall) == self.plan.num_fragments:
            self.history.date(
                self.versions, [w - wall_offset if w > 0 else None for w in snapshot.published_wall]
            )
        if wall_offset is not None and snapshot.seniority:  # none saved (an older checkpoint): keep the table
            self.seniority.load(snapshot.seniority, now, wall_offset)


class SyncerCore(CoreState):
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
        screening: ScreeningConfig | None = None,  # None: the defaults (on)
        admission: AdmissionSpec | None = None,  # the manifest's [admission]; None: open (no cost)
        run_id: str = "",  # what admission proofs are bound to
        spill_dir: Path | None = None,  # None: all state in memory; else older versions and momentum on disk
        take_params: bool = False,  # the caller hands `params` over (never uses them again): no copy
        params_on_disk: bool = False,  # the global parameters in the spill directory too (needs `spill_dir`)
        sparse_merge: bool = False,  # a top-k outer codec: winsorize among the coordinates sent (merge_fragment)
    ) -> None:
        missing = set(plan.names()) - set(params)
        if missing:
            raise ValueError(f"params lack {len(missing)} planned tensors, e.g. {sorted(missing)[:2]}")
        self.plan = plan
        spill = SpillDir(spill_dir) if spill_dir is not None else None
        # a copy unless handed over: the seed model built and then copied was 2 models at the syncer's start
        self.params = new_store(plan, params, spill=spill, on_disk=params_on_disk, copy=not take_params)
        self.policy = QuorumPolicy(quorum)
        self.embedding_names = frozenset(embedding_names)
        self.outer = OuterNesterov(outer_lr, outer_momentum)
        fragments = [f.names for f in plan.fragments]
        # with a spill directory the momentum is in files (`self.outer` only steps), else in `self.outer`
        self.spilled = SpilledMomentum(spill, fragments) if spill is not None else None
        self.screen = ContributionScreen(screening, spill=spill)  # checks each contribution alone (issue 18)
        config = self.screen.config
        self.claims = ClaimBound(
            factor=config.claim_rate_factor,
            min_peers=config.claim_min_peers,
            violation_factor=config.claim_violation_factor,
        )
        self.clip_factor = clip_factor
        self.sparse_merge = sparse_merge
        self.max_staleness = max_staleness
        self.max_steps_per_s = max_steps_per_s
        self.tokens_per_step = tokens_per_step
        self.versions = [0] * plan.num_fragments
        self.rounds: dict[int, _Round] = {}
        self.merges = 0
        self.tokens_merged = 0
        # peer -> (schedule step it reported, when): the run's clock is the median of their extrapolations
        self._schedule = ScheduleClock(max_merged_keys)
        self._ledger = MergedLedger(max_merged_keys)
        self.history = VersionHistory(plan.num_fragments, max_staleness, now, spill)
        self.history.reset(self._current(), now)
        self.receipt_ledger = ReceiptLedger(max_merged_keys)
        self.gate = AdmissionGate(admission or AdmissionSpec(mode="open"), run_id, max_merged_keys)
        self.seniority = Seniority(seniority_config(self.screen.config, max_merged_keys))

    def take_zero_streaks(self) -> list[ZeroStreak]:
        """The runs of a learner's contributions at evidence factor 0 the merges found since the last call
        (node.diloco.evidence.ZeroStreak; the shell records each as a learner ledger violation)."""
        return self.screen.evidence.take_streaks()

    @property
    def tokens_in_model(self) -> int:
        """`tokens_merged` (each trained token counted once per fragment: a contribution carries all of them)
        over the fragments: the tokens the global model was trained on."""
        return self.tokens_merged // max(1, len(self.versions))

    # ---- admission ----

    def admit_push(self, peer: str, proof: object, now: float) -> None:
        """`AdmissionGate.admit`: Refusal "admission" unless `peer` paid the run's cost; demotes it if not."""
        self.gate.admit(peer, proof, now, self.seniority)

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
        loss: LossScore | None = None,
        trust: float = 1.0,
    ) -> Admission:
        """Put a contribution into its fragment's round (replacing the peer's earlier one) or raise Refusal.

        `receipts`: for a pipeline stage replica, the verifier receipts it relayed (already verified); its
        tokens are then capped at their growth since its last merged contribution (`ReceiptLedger`). None for
        a learner (no verifier watches it). `loss`: its held-out loss-delta score (`LossProbe.measure`), if the
        shell measured one. `trust` in [0, 1] scales the tokens it is credited with (the learner ledger's
        probation after refusals: its merge weight tokens^2 / steps falls with trust squared). A blamed refusal
        makes the peer young again (node.diloco.seniority)."""
        with demoted_on_refusal(self.seniority, peer, now):
            self.check_contribution(fragment, params)
            key = (peer, fragment, base_version, nonce)
            check_base(self, fragment, base_version, key)
            base = self.history.at(fragment, base_version)  # None: unknown, taken as current
            try:
                params, cosine = screened(self, peer, fragment, params, base, loss, steps)
                params = held(self, fragment, params)
            except Refusal:
                refused_in_round(self, peer, fragment, base_version)
                raise
            steps, tokens, capped, floor, implausible = new_counters(
                self, peer, fragment, base_version, steps, tokens, now
            )
            counts: dict[tuple[str, str], int] = {}
            receipt_capped = False
            if receipts is not None:
                verified, counts = self.receipt_ledger.growth(peer, fragment, receipts)
                if tokens > verified:
                    tokens, receipt_capped = verified, True
            tokens = math.floor(tokens * min(1.0, max(0.0, trust)))
            contribution = Contribution(peer, params, base_version, steps, tokens)
            entry = _Entry(contribution, key, now, counts, cosine=cosine)
            if loss is not None:
                entry.loss_delta, entry.slope = loss.delta, loss.evidence_slope
            self._enter(fragment, entry, now)
            if math.isfinite(step_time_s) and 0 < step_time_s <= MAX_STEP_TIME_S:
                self.policy.observe_peer_step(peer, step_time_s, now, floor_s=floor)
            self._schedule.report(peer, sched_step, now)
        admission = admission_of(self, fragment, base_version, capped, receipt_capped)
        return dataclasses.replace(admission, claim_violation=implausible)

    def _copied(
        self,
        peer: str,
        fragment: int,
        params: Mapping[str, torch.Tensor],
        base: Mapping[str, torch.Tensor] | None,
    ) -> tuple[str, str] | None:
        """(tag, reason) if the contribution is a free-rider or a copycat (node.diloco.claims.copy_of)."""
        tolerance = self.screen.config.copy_tolerance
        if tolerance <= 0 or not self.screen.config.enabled:
            return None
        current = self.fragment_tensors(fragment)
        round_ = self.rounds.get(fragment)
        others = []
        for other, e in round_.entries.items() if round_ is not None else ():
            if other != peer and (c := e.contribution).steps > 0:
                their_base = self.history.at(fragment, c.base_version) or current  # read once (maybe a file)
                others.append((other, chunked.Delta(their_base, c.params)))  # a chunk at a time
        published = self.history.of(fragment).items()  # read one at a time
        work = self.screen.median_norm(fragment)
        return copy_of(
            params, base if base is not None else current, published, others, tolerance, work_norm=work
        )

    def _enter(self, fragment: int, entry: _Entry, now: float) -> None:
        """Into the fragment's round, unless the peer's contribution there is on a newer base or has more steps."""
        round_ = self.rounds.get(fragment)
        if round_ is None:
            round_ = self.rounds[fragment] = _Round()
        c, earlier = entry.contribution, round_.entries.get(entry.contribution.peer_id)
        if earlier is None or (c.base_version, c.steps) >= (
            earlier.contribution.base_version,
            earlier.contribution.steps,
        ):
            round_.entries[c.peer_id] = entry
        if round_.opened_at is None:
            round_.opened_at = now

    @property
    def clock(self) -> int:
        """The highest schedule step a contributor reported."""
        return self._schedule.highest

    # ---- decisions ----

    def due(self, now: float, expected: Callable[[int], Expected]) -> tuple[list[int], float | None]:
        """Fragments whose round should merge now, and the earliest grace deadline among the others.

        `expected(fragment)`: the live peers that hold it, or just how many there are (see `_num_expected`)."""
        return due_rounds(self.rounds, self.policy, now, expected)

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
        global_params = self.fragment_tensors(fragment)
        merged, sources = combine_round(
            round_,
            global_params,
            self.history.of(fragment),
            self.versions[fragment],
            self.max_staleness,
        )
        slopes = _mean_per_peer(sources, lambda e: e.slope)
        cosines = _mean_per_peer(sources, lambda e: e.cosine)
        result, credit, factors, step_scale = merge_capped(
            self, fragment, global_params, merged, started_at, slopes, cosines
        )
        # the screen's update first: with the momentum on disk the outer step turns the gradient into the new params
        full = {p for p in result.participants if factors.get(p, 1.0) >= 1.0}
        screened_update = self.screen.prepare_commit(
            fragment,
            result,
            _mean_per_peer(sources, lambda e: e.loss_delta),
            {p: s for p, s in slopes.items() if p in full},
            {p: c for p, c in cosines.items() if p in full},
            step_scale=step_scale,
        )
        try:
            new_params = self._outer_step(fragment, global_params, result.outer_grad)
        except NonFiniteStep as e:  # nothing published, momentum untouched: the round is rolled back
            self.screen.discard(screened_update)
            raise self.screen.rolled_back(fragment, result, e) from None
        if self.spilled is not None:
            result = dataclasses.replace(result, outer_grad={})  # its tensors are the new params now
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
            screened=screened_update,
            seniority_credit=credit,
            evidence={p: (s, cosines.get(p), factors.get(p, 1.0)) for p, s in slopes.items()},
            step_scale=step_scale,
            spilled=self.history.spill_now(fragment, global_params),
        )

    def _outer_step(
        self, fragment: int, global_params: Mapping[str, torch.Tensor], outer_grad: Mapping[str, torch.Tensor]
    ) -> Mapping[str, torch.Tensor]:
        """The outer step of one fragment (NonFiniteStep: nothing changed); with the momentum on disk, the
        fragment's buffers are read and stepped a chunk at a time and written as a new generation, and the new
        parameters are written over `outer_grad` (`OuterNesterov.step_in_place`), a chunk at a time into its file
        when the merge wrote it to one (then the new version is that file, read in at the commit: issue 17)."""
        require_finite = self.screen.config.rollback
        if self.spilled is None:
            return self.outer.step(global_params, outer_grad, require_finite=require_finite)
        # a merge steps every tensor of the fragment, so the new generation holds all of its buffers
        layout = [(name, chunked.shape(outer_grad, name)) for name in outer_grad]
        spilled = outer_grad.file if isinstance(outer_grad, ScaledTensors) else None
        chunks = self.outer.step_in_place(
            self.spilled.current(fragment),
            global_params,
            outer_grad,
            require_finite=require_finite,
            put=spilled.put if spilled is not None else None,
        )
        self.spilled.store_stream(fragment, layout, chunks)
        return spilled if spilled is not None else dict(outer_grad)

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
        result = _void_result(rejected)
        return PreparedMerge(
            fragment=fragment,
            base_version=self.versions[fragment],
            round=round_,
            result=result,
            new_params=self.fragment_tensors(fragment),
            merged={},
            sources={},
            required=required,
            expected=expected,
            started_at=started_at,
        )

    def commit_merge(self, prepared: PreparedMerge, now: float) -> MergeRecord:
        fragment = prepared.fragment
        _check_unchanged(self, prepared)
        version = self._publish(fragment, prepared.new_params, now, spilled=prepared.spilled)
        self.screen.commit(fragment, prepared.screened)
        self.seniority.observe_merge(prepared.result.participants, now, prepared.seniority_credit)
        self._drop_missed(fragment)
        for peer in prepared.result.participants:
            for entry in prepared.sources[peer]:
                self._ledger.remember(entry, now)
                self.receipt_ledger.commit(peer, fragment, entry.receipt_counts)
        record = merge_record(prepared, version, now)
        self.merges += 1
        self.tokens_merged += record.tokens
        self.policy.observe_sync(max(0.0, now - prepared.started_at))
        return record

    def _publish(
        self, fragment: int, new_params: Mapping[str, torch.Tensor], now: float, *, spilled: str | None = None
    ) -> int:
        """Our merge's parameters become the fragment's next version (kept while contributions may build on it)."""
        entry, spilled = self.params.publish(
            fragment, new_params, self.history, self.versions[fragment], spilled
        )
        version = self.versions[fragment] = self.versions[fragment] + 1
        self.history.publish(fragment, version, entry, now, spilled=spilled, context=self.versions)
        return version

    def _drop_missed(self, fragment: int) -> None:
        """After a merge, contributions that arrived during it on the version it replaced missed that round:
        dropped like any contribution on an older base (QuorumConfig.drop_stale), never a round of their own."""
        round_ = self.rounds.get(fragment)
        if round_ is None:
            return  # (only called right after our own merge of the fragment)
        round_.refused.clear()  # refused on the version the merge replaced: not this round's
        if self.policy.config.drop_stale:
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
        record = self.commit_merge(prepared, now)
        del (
            prepared,
            round_,
            taken,
        )  # the round's contributions and the merge's temporaries, then back to the kernel
        release_freed_memory()
        return record

    def clock_estimate(self, now: float, *, max_age_s: float = 60.0) -> int:
        """The schedule step the run's learners are at now: per peer, its latest report plus the steps since
        (at the EMA step time), then the median over peers that reported within `max_age_s`. The median keeps
        one stale or lying report from moving everyone's schedule. 0 when nobody reported yet."""
        return self._schedule.estimate(now, self.policy.xi_step or 0.0, max_age_s)

    # ---- versions, adoption, snapshots ----


def wire_params(
    core: SyncerCore,
    codec: CodecSpec,
    fragment: int,
    base_version: int,
    tensors: Mapping[str, torch.Tensor],
    meta: Mapping[str, object],
) -> Mapping[str, torch.Tensor]:
    """The params a push stands for: its tensors under fp32, else rebuilt as base - decoded delta on the base
    version it names (the current one when the core lacks it: after a takeover, or too stale, which `accept`
    refuses anyway). Raises CompressionError for a payload the manifest's codec does not produce."""
    if codec.codec == "fp32":
        return tensors
    if not 0 <= fragment < core.plan.num_fragments:
        raise MalformedFrame(f"no fragment {fragment}", reason="malformed contribution")
    base = core.history.at(fragment, base_version) or core.fragment_tensors(fragment)
    names = core.plan.fragments[fragment].names
    # randk: the mask the learner derived from the same version (None for the other codecs)
    mask = push_mask(codec, fragment, base_version)
    return decode_contribution(tensors, meta, spec=codec, base=base, names=names, mask=mask)


def probe_base(core: SyncerCore, fragment: int, base_version: int) -> Mapping[str, torch.Tensor] | None:
    """The base a held-out loss-delta score (node.diloco.loss_probe) is measured on: the version the push names,
    if held. None (not scored) for a base we lack (an earlier syncer's version, after a takeover): with the
    current version standing in, the score would measure the gap between versions, not the learner's work, and
    it refused honest learners' outage work until all were banned. The other screens still apply. A spilled base is
    pinned (its file held open): a commit that drops that version while the probe's thread reads it deletes its
    key, and the probe still reads the version it started with."""
    base = core.history.at(fragment, base_version)
    if isinstance(
        base, SpilledTensors
    ):  # read in the probe's thread while commits may drop the version's file
        return SpilledTensors(base.spill, base.key, pinned=True)
    return base


class ProbeContext(Mapping[str, torch.Tensor]):
    """The model a contribution is scored in (`probe_context`), every global tensor by name: those held in memory,
    and versions in spill files (pinned: a commit that drops one meanwhile does not pull it from under the probe).
    A spilled tensor is never read whole by the probe's forward pass: it is `streamed` (node.ml.streamed_forward
    reads it by range, `chunk`), so a base context costs the syncer no memory beyond the model (issue 17)."""

    def __init__(
        self,
        tensors: dict[str, torch.Tensor],
        versions: tuple[int, ...],
        spilled: tuple[Mapping[str, torch.Tensor], ...] = (),
    ) -> None:
        self.tensors, self.versions, self.spilled = tensors, versions, spilled
        self._source = {name: mapping for mapping in spilled for name in mapping}
        self.streamed = frozenset(self._source)

    def chunk(self, name: str, start: int, stop: int) -> torch.Tensor:
        source = self._source.get(name)
        return chunked.piece(self.tensors if source is None else source, name, start, stop)

    def shape_of(self, name: str) -> tuple[int, ...]:
        source = self._source.get(name)
        return chunked.shape(self.tensors if source is None else source, name)

    def read(self) -> dict[str, torch.Tensor]:
        """Every tensor of the context, the spilled ones read whole now (for loss functions that need them so)."""
        return {name: self[name] for name in self}

    def __getitem__(self, name: str) -> torch.Tensor:
        source = self._source.get(name)
        return self.tensors[name] if source is None else source[name]

    def __contains__(self, name: object) -> bool:
        return name in self.tensors or name in self._source  # Mapping's own reads a spilled tensor whole

    def __iter__(self) -> Iterator[str]:
        yield from self.tensors
        yield from (name for name in self._source if name not in self.tensors)

    def __len__(self) -> int:
        return len(self.tensors) + sum(name not in self.tensors for name in self._source)


def probe_context(core: SyncerCore, fragment: int, base_version: int) -> ProbeContext:
    """The model a contribution to `fragment` on `base_version` is scored in (node.diloco.loss_probe), and its
    version vector: with `screening.loss_base_context`, every fragment as it stood when our merge published that
    base (the model its learner trained the fragment in), else today's global model. Applied alone to today's
    model, an honest token-embedding delta meets a head and body that moved on since (the other fragments merged
    at outer Nesterov): its loss rose and its reverse's fell, and the poisoning benchmark's `clean` arm refused
    such honest pushes as ascent steps (docs/security.md). Versions in spill files (the live syncer keeps only the
    current one in memory) are read by the probe while their total stays within `loss_context_read_mib` (a model
    bigger than that is scored in today's tensors for those fragments: issue 17's memory bound); a version no
    longer held, and a base we did not publish (restored, adopted), take today's tensors, as before. (The probe's
    forward reads spilled ones by range, not whole: the budget bounds the reading time, not memory.)"""
    # the global parameters on disk: their files, pinned, streamed as the spilled versions are
    store = core.params
    tensors = dict(store.tensors) if isinstance(store, MemoryParams) else {}
    current = (
        [] if isinstance(store, MemoryParams) else [store.fragment(f) for f in range(core.plan.num_fragments)]
    )
    versions = list(core.versions)
    vector = core.history.contexts.get((fragment, base_version))
    config = core.screen.config
    if vector is None or not config.loss_base_context:
        return ProbeContext(tensors, tuple(versions), tuple(current))
    budget, spilled = config.loss_context_read_mib * 2**20, current
    for other, version in enumerate(vector):
        held = core.history.tensors.get(other, {}).get(version) if version != versions[other] else None
        if isinstance(held, dict):
            tensors.update(held)
            versions[other] = version
        elif isinstance(held, str) and core.history.spill is not None:
            size = fragment_bytes(core.params, other)
            if size <= budget:
                budget -= size
                spilled.append(SpilledTensors(core.history.spill, held, pinned=True))
                versions[other] = version
    return ProbeContext(tensors, tuple(versions), tuple(spilled))


def screened(
    core: SyncerCore,
    peer: str,
    fragment: int,
    params: Mapping[str, torch.Tensor],
    base: Mapping[str, torch.Tensor] | None,
    loss: LossScore | None,
    steps: int,
) -> tuple[Mapping[str, torch.Tensor], float | None]:
    """What `accept` takes of `peer`'s push once screened (clipped, maybe) and its cosine with the recent merged
    direction (None: not measured), or raise the Refusal: the screen's verdict (blamed as a rule: the sender built
    it, the strikes count it per peer), or no work of its own."""
    current = core.fragment_tensors(fragment)
    verdict = core.screen.check(fragment, params, base, current, loss, peer, outage=is_outage(core, fragment))
    if verdict.params is None:
        raise refuse(verdict.tag, verdict.reason, blame=verdict.blame)
    if steps > 0 and (copied := core._copied(peer, fragment, verdict.params, base)) is not None:
        raise refuse(*copied, blame=True)  # it earns nothing
    return verdict.params, verdict.cosine


def refused_in_round(core: SyncerCore, peer: str, fragment: int, base_version: int) -> None:
    """`peer`'s contribution to the fragment's open round was screened out: its learner drops it for good
    (a refusal is final) and sends nothing more to that round, so the round stops counting it as expected.
    Counted, a lock-step run deadlocked on one honest push the loss screen refused: the round waited for its
    learner, who waited at the barrier for another fragment's round, which needed a learner waiting on it."""
    if base_version == core.versions[fragment]:  # else a stale base: its round merged already
        core.rounds.setdefault(fragment, _Round()).refused.add(peer)


def held(core: SyncerCore, fragment: int, params: Mapping[str, torch.Tensor]) -> Mapping[str, torch.Tensor]:
    """How the core holds an accepted contribution until its round merges: with a spill directory, in a file of its
    own (deleted when the contribution is dropped), read a chunk at a time by the copy check and the merge
    (node.diloco.chunked), so a round of K contributions is not K fragments in memory (issue 17); else as it is."""
    spill = core.history.spill
    if spill is None:
        return params
    if isinstance(params, SpilledTensors) and params.spill is spill and params.owned:
        return params  # already a file of its own there (a push that was never in memory)
    key = spill.new_key(f"contribution-{fragment}")
    spill.write(key, params)
    return spill.tensors(key, owned=True)


def is_outage(core: SyncerCore, fragment: int) -> bool:
    """Whether work on `fragment` now is outage work: its current version is one this syncer took over (restored
    from a checkpoint or an earlier syncer's mirror, not the seed) and has not merged since. Such work is many steps
    on an old base; applied alone it may raise the held-out loss though honest, and the loss bound has learned
    nothing yet: refused, the learners' outage progress was lost (test_syncer_failover, 1 run in 3). Bounded to the
    first round of each fragment after a takeover; the norm and finiteness screens, the seniority cap and the
    claims still apply."""
    return core.versions[fragment] > 0 and not core.history.merged_here[fragment]


def check_base(core: SyncerCore, fragment: int, base_version: int, key: tuple[str, int, int, bytes]) -> None:
    """Refuse a contribution on a base we cannot take: ahead of us, too stale, merged, or a missed round."""
    current = core.versions[fragment]
    if base_version > current:
        raise refuse("ahead of syncer", f"base version {base_version} > ours {current}")
    if base_version < current - core.max_staleness:
        raise refuse(
            "stale base", f"base version {base_version} is older than {current - core.max_staleness}"
        )
    if key in core._ledger.keys:
        raise refuse("duplicate", "this contribution was merged already", blame=True)
    if base_version < current and core.policy.config.drop_stale and core.history.merged_here[fragment]:
        # Q5: it missed the round that merged its base (weight 0, as the paper's late learners); merged
        # alone it would publish one more version that overwrites everyone's unsent progress, and folded
        # into the next round it would count twice what its learner re-learns from the version without it.
        # Not after a takeover, until we merged the fragment ourselves: a learner's work from the outage,
        # on a version an earlier syncer published, missed no round of ours (taken as before: merged)
        raise refuse("missed round", f"base version {base_version} < current {current}")


def takes_base(core: SyncerCore, key: tuple[str, int, int, bytes]) -> bool:
    """Whether `check_base` would let the contribution of `key` (peer, fragment, base version, nonce) through
    (the shell scores only those)."""
    try:
        check_base(core, key[1], key[2], key)
    except Refusal:
        return False
    return True


def new_counters(
    core: SyncerCore, peer: str, fragment: int, base_version: int, steps: int, tokens: int, now: float
) -> tuple[int, int, bool, float | None, tuple[str, dict[str, float]] | None]:
    """(steps, tokens, capped, floor, implausible): what the claim adds to what was merged from the peer on that
    base, capped at what the `elapsed` seconds since the base's publication (or that merge) allow: at
    `max_steps_per_s`, and at the swarm's measured rate (node.diloco.claims.ClaimBound), which work on a base we
    published also feeds; `implausible`: the claim as sent was far above that rate (`ClaimBound.judge`; only on such
    a base: the time since the seed, or since a version restored or adopted, says nothing of the work's); `floor`:
    on such a base, the least step time the peer may report (node.diloco.quorum.step_time_floor), else None."""
    since = core.history.since(fragment, base_version)
    prior = core._ledger.counters.get((peer, fragment, base_version))
    if prior is not None:  # part of this progress is in the model already (e.g. merged before a failover)
        steps, tokens, since = max(0, steps - prior[0]), max(0, tokens - prior[1]), max(since, prior[2])
    elapsed = now - since
    screen = core.screen.config.enabled  # screening off (comparisons only): the time/batch caps alone
    implausible = None
    if screen and core.history.measured(fragment, base_version):
        # judged against the median of the peers' claims as sent: capped samples let a median that started low
        # (first pushes after a slow start) rise only by the cap's factor a round, and judged by it, every honest
        # learner was banned in the benchmark; a minority's inflated claims do not move a median either
        implausible = core.claims.judge(steps, elapsed, now)
        core.claims.observe(peer, steps, elapsed, now)
    steps, tokens, capped = cap_counters(
        steps, tokens, elapsed, max_steps_per_s=core.max_steps_per_s, tokens_per_step=core.tokens_per_step
    )
    measured = False
    if screen:
        steps, tokens, measured = core.claims.cap(
            steps, tokens, elapsed, now, implausible=implausible is not None
        )
    timed = screen and core.history.measured(fragment, base_version)
    floor = step_time_floor(elapsed, steps, core.screen.config.step_time_slack_factor) if timed else None
    return steps, tokens, capped or measured, floor, implausible


def admission_of(
    core: SyncerCore, fragment: int, base_version: int, capped: bool, receipt_capped: bool
) -> Admission:
    """A late contribution in a lock-step mode (its round merged without its learner, e.g. one whose
    heartbeat expired while it was stopped) goes into the next round, but its learner must not wait for
    that round: the others send theirs only after rounds of other fragments that wait for this learner,
    and neither side would move. Told `late`, it loads the versions that exist now and realigns its
    schedule to the earliest open round, as a restarted learner does (SyncWatcher._rejoin)."""
    current = core.versions[fragment]
    late = not core.policy.config.drop_stale and base_version < current
    target = current if late else current + 1
    return Admission(target_version=target, capped=capped, receipt_capped=receipt_capped, late=late)


class CappedMerge(NamedTuple):
    result: MergeResult  # its outer gradient and weights scaled by `step_scale`
    credit: dict[str, float]  # per young peer the cap scaled down, the fraction of a round it ages by
    factors: dict[str, float]  # the evidence factor of each peer with a slope
    step_scale: float  # the evidence's step scale x the seniority cap's grad_scale (1: a full step)


def merge_capped(
    core: SyncerCore,
    fragment: int,
    global_params: Mapping[str, torch.Tensor],
    merged: Mapping[str, Contribution],
    now: float,
    slopes: Mapping[str, float] | None = None,
    cosines: Mapping[str, float] | None = None,
) -> CappedMerge:
    """`merge_fragment` with each weight scaled by its evidence of work (`slopes`: peer -> held-out slope, those
    measured; `cosines`: with the recent merged direction; node.diloco.evidence), then the seniority cap on young
    identities' weights (node.diloco.seniority), the outer gradient scaled by the product of the evidence's
    `step_scale` and the cap's `grad_scale`."""
    capped: list[CappedWeights] = []
    step_scales: list[float] = []
    scored = {p: s for p, s in (slopes or {}).items() if p in merged}
    factors = core.screen.evidence.factors(fragment, scored, cosines or {})
    # the last contribution of a run at factor 0 is the one its evidence names
    core.screen.evidence.observe_streaks(
        factors, scored, cosines or {}, lambda peer: contribution_digest(merged[peer].params)
    )

    def reweight(weights: Mapping[str, float]) -> Mapping[str, float]:
        step_scales.append(core.screen.evidence.step_scale(factors, weights))
        evidenced = {p: w * factors.get(p, 1.0) for p, w in weights.items()}
        capped.append(core.seniority.cap(evidenced, now))
        return capped[-1].weights

    result = merge_fragment(
        global_params,
        list(merged.values()),
        embedding_names=core.embedding_names,
        clip_factor=core.clip_factor,
        current_version=core.versions[fragment],
        max_staleness=core.max_staleness,
        trim_fraction=core.screen.config.trim_fraction if core.screen.config.enabled else 0.0,
        reweight=reweight,
        sparse=core.sparse_merge,
        # with the momentum on disk the outer gradient goes there too (a file the outer step overwrites)
        spill=core.history.spill if core.spilled is not None else None,
    )
    # below 1 for young identities alone while seniors are active, and for a round whose best evidence is low
    scale = (step_scales[-1] if step_scales else 1.0) * (capped[-1].grad_scale if capped else 1.0)
    if scale < 1.0:
        # the step and the recorded weights both shrink, as if learners without progress held the rest: a merge
        # event's weights are each contribution's effective share of a full step
        if isinstance(result.outer_grad, ScaledTensors):
            result.outer_grad.scale_all(scale)  # applied as it is read, as `mul_` would
        else:
            for g in result.outer_grad.values():
                g.mul_(scale)  # in place: the merge's own buffers (a copy was one fragment more)
        weights = {peer: w * scale for peer, w in result.weights.items()}
        result = dataclasses.replace(result, weights=weights)
    return CappedMerge(result, dict(capped[-1].credit) if capped else {}, factors, scale)


def read_in(core: SyncerCore, prepared: PreparedMerge) -> PreparedMerge:
    """The disk half of `SyncerCore.commit_merge`: a merge whose new version is a file gets it read in (`_swap_in`), the
    rest of the commit then publishes a version in memory. A worker thread may run it, so that the read (a
    fragment: 0.25-1 GiB at llama-1b) does not stall the event loop; while it runs the fragment's tensors are
    half swapped, so the caller keeps every other user of the core off until `commit_merge` has run
    (`node.roles.syncer.commit`)."""
    if not isinstance(prepared.new_params, SpilledTensors) or not isinstance(core.params, MemoryParams):
        # (with the parameters on disk the new version's file becomes the current one as it is: nothing to read)
        return prepared
    _check_unchanged(core, prepared)
    # a merge writes its new version to a file only with a spill directory
    assert prepared.spilled is not None
    fragment, version = prepared.fragment, core.versions[prepared.fragment]
    fresh = core.params.swap_in(fragment, prepared.new_params, core.history, version, prepared.spilled)
    # in the params already, the old version retired to its file: `_publish` takes it as a merge in memory
    return dataclasses.replace(prepared, new_params=fresh, spilled=None)


def _check_unchanged(core: SyncerCore, prepared: PreparedMerge) -> None:
    fragment = prepared.fragment
    if core.versions[fragment] != prepared.base_version:
        core.history.discard(prepared.spilled)
        core.screen.discard(prepared.screened)
        raise RuntimeError(f"fragment {fragment} changed during its merge")
