"""The syncer's learner ledger (issue 18, part 3): per learner identity, the contributions it refused with their
evidence (the contribution's hash, the scores, the reason), forgiveness, and when the violations add up to a ban.

Each blamed refusal (the screen's rejections, copycat, free-rider, a replayed merged contribution), and each claim
far above the measured step rate (node.diloco.claims, merged but capped), adds a violation of weight 1 (`SEVERITY` may weigh a tag more: a non-finite contribution bans at once, no training
step produces one, whether the screen finds it or the wire codec refuses the frame before decoding it: there the
evidence is the digest of the signed frame, `frame_digest`). Violations are forgiven with a half-life (`forgive_half_life_s`): an honest learner that trips
the loss bound once in a while never reaches `ban_after`; an attacker that keeps sending does, within
`ban_after` pushes. A ban lasts `ban_s`; the shell publishes it through the signed ban gossip
(verification.bans, evidence kind "contribution") so a standby syncer refuses the learner too, and lists it with
its reason. Until then a refused peer is on probation: `trust` (1 - its forgiven violations / `ban_after`) scales
the tokens the syncer credits its accepted contributions with, so what slips through between its refusals weighs
little. Bounded: `max_peers` identities, the least recently seen first out; `max_evidence` per peer.

One piece of work weighs once (`ONCE_PER_WORK`): the held-out loss screen's refusals of a peer's contributions to
one fragment on one base version (`work`, (fragment, base version)) add one violation together. A learner's
snapshots of a fragment between two overwrites are nested (each holds the steps of the one before, counted from
the same base), so the second refusal of that trajectory judged the same work again and is no new evidence. Counted
apart, an honest learner whose schedule was re-aligned sent a fragment three times within 1.4 s on one base, each
judged an ascent step in that base's context, and was banned (tests/integration/test_poisoning.py, 2 runs of 5 on
2026-12-07; docs/security.md). A sign-flipper pushes each fragment once per round, each on the new base of the round
before: one violation per push, as before. Repeats are still refused, logged and counted by tag.
Pure: the caller passes `now`.
"""

from __future__ import annotations

import hashlib
import logging
import math
from collections import OrderedDict, deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from node.diloco.evidence import NO_EVIDENCE, ZeroStreak

logger = logging.getLogger(__name__)

# the reason protocol.codec gives a frame holding NaN/Inf (refused before it is decoded into a contribution)
WIRE_NON_FINITE = "non-finite values"
# by refusal tag; others weigh 1. A non-finite push bans at once wherever it is caught: no training step produces one
SEVERITY: Mapping[str, float] = {"screen: non-finite": math.inf, WIRE_NON_FINITE: math.inf}
# refusal tags that weigh once per piece of work (`LearnerLedger.record`'s `work`): the held-out loss screen's
# (node.diloco.loss_probe.LOSS), which judges where a trajectory from one base points, the same for each of its snapshots
ONCE_PER_WORK: frozenset[str] = frozenset({"screen: loss"})


def ban_evidence_scores(ban: LearnerBan) -> dict[str, float]:
    """The numbers of a ban's latest evidence, for verification.bans.BanEvidence.scores."""
    return dict(ban.evidence[-1].scores) if ban.evidence else {}


def contribution_digest(params: Mapping[str, torch.Tensor]) -> str:
    """sha256 (hex, first 16 bytes) of a contribution's tensors in name order: what the evidence names."""
    h = hashlib.sha256()
    for name in sorted(params):
        h.update(name.encode())
        h.update(params[name].detach().to("cpu").contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:32]


def frame_digest(frame: bytes | bytearray | memoryview) -> str:
    """sha256 (hex, first 16 bytes) of a signed frame: the evidence of a push refused before it was decoded."""
    return hashlib.sha256(frame).hexdigest()[:32]


@dataclass(frozen=True, kw_only=True, slots=True)
class Violation:
    at: float
    tag: str
    reason: str
    digest: str
    scores: dict[str, float] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {
            "at": round(self.at, 3),
            "tag": self.tag,
            "reason": self.reason,
            "digest": self.digest,
            **self.scores,
        }


@dataclass(slots=True)
class _Record:
    weight: float = 0.0  # forgiven violations so far, as of `at`
    at: float = 0.0
    total: int = 0  # every violation, never forgiven (for status)
    tags: dict[str, int] = field(default_factory=dict)  # every violation by tag
    accepted: int = 0
    banned_until: float = -math.inf
    ban_reason: str = ""
    evidence: deque[Violation] = field(default_factory=deque)
    # per (tag of `ONCE_PER_WORK`, fragment): the base version of its latest such violation (bounded by the
    # plan's fragments: a push names one of them, or is refused before it is scored)
    work: dict[tuple[str, int], int] = field(default_factory=dict)
    repeats: int = 0  # refusals of work already weighed (no weight; for status)


@dataclass(frozen=True, kw_only=True, slots=True)
class LearnerBan:
    """A ban the ledger decided: for the signed gossip and the log."""

    offender: str
    reason: str
    until: float
    evidence: tuple[Violation, ...]


class LearnerLedger:
    """See the module docstring."""

    def __init__(
        self,
        *,
        ban_after: float,
        forgive_half_life_s: float,
        ban_s: float,
        max_peers: int = 1024,
        max_evidence: int = 4,
    ) -> None:
        if not (ban_after >= 0 and forgive_half_life_s > 0 and ban_s > 0):
            raise ValueError("ban_after must be >= 0 (0: never ban), forgive_half_life_s and ban_s > 0")
        self.ban_after, self.half_life, self.ban_s = ban_after, forgive_half_life_s, ban_s
        self.max_peers, self.max_evidence = max_peers, max_evidence
        self._peers: OrderedDict[str, _Record] = OrderedDict()
        self.bans = 0

    def _record(self, peer: str) -> _Record:
        record = self._peers.pop(peer, None) or _Record()
        self._peers[peer] = record  # most recent last
        while len(self._peers) > self.max_peers:
            self._peers.popitem(last=False)
        return record

    def weight(self, peer: str, now: float) -> float:
        """The peer's violations, forgiven by the half-life up to `now`."""
        record = self._peers.get(peer)
        if record is None:
            return 0.0
        return float(record.weight * 0.5 ** (max(0.0, now - record.at) / self.half_life))

    def record(
        self,
        peer: str,
        tag: str,
        reason: str,
        digest: str,
        now: float,
        scores: Mapping[str, float] | None = None,
        work: tuple[int, int] | None = None,
    ) -> LearnerBan | None:
        """A blamed refusal of `peer`'s contribution; the ban it triggers, if it does (once per ban). `work`: what
        the contribution is a snapshot of, (fragment, base version); a tag of `ONCE_PER_WORK` weighs once per work
        (see the module docstring). None: every refusal weighs."""
        record = self._record(peer)
        record.tags[tag] = record.tags.get(tag, 0) + 1
        if work is not None and tag in ONCE_PER_WORK:
            fragment, base_version = work
            if record.work.get((tag, fragment)) == base_version:
                record.repeats += 1
                logger.info(
                    "contribution of %s refused again (%s), the same work %s: no more weight: %s [%s]",
                    peer[-8:],
                    tag,
                    work,
                    reason,
                    digest,
                )
                return None
            record.work[(tag, fragment)] = base_version
        weight = self.weight(peer, now) + SEVERITY.get(tag, 1.0)
        record.weight, record.at, record.total = weight, now, record.total + 1
        record.evidence.append(
            Violation(at=now, tag=tag, reason=reason[:200], digest=digest, scores=dict(scores or {}))
        )
        while len(record.evidence) > self.max_evidence:
            record.evidence.popleft()
        logger.warning("contribution of %s refused (%s): %s [%s]", peer[-8:], tag, reason, digest)
        if self.ban_after <= 0 or weight < self.ban_after or record.banned_until > now:
            return None
        record.banned_until = now + self.ban_s
        record.ban_reason = f"{record.total} refused contributions, last: {tag}: {reason}"[:250]
        self.bans += 1
        return LearnerBan(
            offender=peer,
            reason=record.ban_reason,
            until=record.banned_until,
            evidence=tuple(record.evidence),
        )

    def no_evidence(self, streak: ZeroStreak, now: float) -> LearnerBan | None:
        """A run of `streak.peer`'s contributions that all earned evidence factor 0 (node.diloco.evidence): one
        violation, its slopes and cosines the evidence; the ban it triggers, if it does."""
        n = len(streak.slopes)
        reason = f"{n} contributions in a row with no evidence of work (evidence factor 0)"
        return self.record(streak.peer, NO_EVIDENCE, reason, streak.digest, now, streak.scores())

    def trust(self, peer: str, now: float) -> float:
        """Probation: 1 - (forgiven violations / ban_after), at least 0; 1 for a peer never refused (or bans off).
        The syncer scales the tokens it credits a contribution with it, so a peer refused a moment ago weighs
        little in the merges until it is banned or forgiven."""
        if self.ban_after <= 0:
            return 1.0
        return max(0.0, 1.0 - self.weight(peer, now) / self.ban_after)

    def accepted(self, peer: str) -> None:
        record = self._peers.get(peer)
        if record is not None:
            record.accepted += 1

    def refusals(self) -> dict[str, dict[str, int]]:
        """Per peer, refused contributions by tag (for /metrics)."""
        return {peer: dict(r.tags) for peer, r in self._peers.items()}

    def banned(self, peer: str, now: float) -> str | None:
        """The reason `peer` is banned here now, or None."""
        record = self._peers.get(peer)
        return record.ban_reason if record is not None and record.banned_until > now else None

    def status(self, now: float) -> dict[str, dict[str, Any]]:
        """Per peer with a violation: counts by tag, the forgiven weight, the ban and the latest evidence."""
        out: dict[str, dict[str, Any]] = {}
        for peer, r in self._peers.items():
            out[peer] = {
                "refused": r.total,
                "repeats": r.repeats,
                "accepted": r.accepted,
                "weight": round(self.weight(peer, now), 3),
                "banned": r.banned_until > now,
                "ban_reason": r.ban_reason if r.banned_until > now else None,
                "refused_by_tag": dict(r.tags),
                "evidence": [v.to_json() for v in r.evidence],
            }
        return out


def peer_scores(
    merges: Iterable[Mapping[str, Any]], ledger: LearnerLedger, now: float
) -> dict[str, dict[str, float]]:
    """Per learner, its latest scores for /metrics (issue 18, "visible"): from the recent merge events (oldest
    first, so the latest wins) the evidence factor and held-out slope of its last scored contribution and its
    last share of a merge; from the ledger, for a learner it refused, its probation trust and whether it is banned
    (1.0 or 0.0). Non-finite or missing values are left out."""
    out: dict[str, dict[str, float]] = {}

    def put(peer: str, name: str, value: Any) -> None:
        if isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value):
            out.setdefault(str(peer), {})[name] = float(value)

    for merge in merges:
        for peer, scored in (merge.get("evidence") or {}).items():
            if isinstance(scored, list | tuple) and len(scored) == 3:
                put(peer, "held_out_slope", scored[0])
                put(peer, "evidence_factor", scored[2])
        for peer, weight in (merge.get("weights") or {}).items():
            put(peer, "merge_weight", weight)
    for peer in ledger.refusals():
        put(peer, "trust", ledger.trust(peer, now))
        put(peer, "banned", 1.0 if ledger.banned(peer, now) is not None else 0.0)
    return out
