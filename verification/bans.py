"""Swarm-wide bans: what a ban notice carries, when notices add up to a ban, and the ban list every role consults.

This module is pure (no sockets, no DHT, no clock reads): the records layer verifies each notice's signature
and that its signer is an authorized verifier; `decide_bans` checks the signer against the manifest again
(defence in depth) and counts distinct authorized verifiers per offender. A ban takes effect when
`bans_required` of them have unexpired notices against the same offender, or at once when one notice carries
an equivocation proof (two valid signatures by the offender over different digests for one slot), which
anyone can re-check from the offender's peer id and therefore needs no quorum.

`BanList` is the enforcement view: a set of offenders with expiry, the clock passed in.
"""

from __future__ import annotations

import logging
import math
import statistics
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import msgpack

from protocol.envelope import SIGNATURE_DOMAIN as ENVELOPE_SIGNATURE_DOMAIN
from protocol.identity import SIGNATURE_SIZE, verify_signature

logger = logging.getLogger(__name__)

EvidenceKind = Literal["statistical", "spotcheck", "equivocation", "contribution"]
# "contribution": an authorized syncer's learner ledger (node.diloco.learner_ledger) refused the offender's
# contributions; such a notice bans alone (the syncer measured it, and is trusted with the model anyway)
EVIDENCE_KINDS: tuple[str, ...] = ("statistical", "spotcheck", "equivocation", "contribution")
MAX_EVIDENCE_BYTES = 8 * 1024  # protocol.records.RecordLimits.max_evidence_bytes
_EVIDENCE_VERSION = 1
# Positions in protocol.envelope's canonical header array (see `_encode_header` there).
_H_RUN, _H_SENDER, _H_STAGE, _H_DIRECTION, _H_MICROBATCH, _H_STEP, _H_DIGEST, _H_META = (
    1,
    3,
    5,
    6,
    7,
    8,
    12,
    13,
)


@dataclass(frozen=True, slots=True)
class SignedBoundaryHeader:
    """An offender's canonical envelope header and its signature, as received."""

    header: bytes
    signature: bytes


@dataclass(frozen=True, kw_only=True, slots=True)
class BanEvidence:
    """What a verifier attaches to a ban notice: enough for another party to see why, and for an
    equivocation, enough to re-check the proof without trusting the verifier."""

    offender: str
    verifier: str
    kind: EvidenceKind
    reason: str
    stage: int | None = None
    headers: tuple[SignedBoundaryHeader, ...] = ()  # offender-signed headers of the tensors in question
    scores: Mapping[str, float] = field(default_factory=dict)  # metric scores of the flagged tensor
    fences: Mapping[str, tuple[float, float]] = field(default_factory=dict)  # (low, high) per metric
    microbatches: tuple[int, ...] = ()  # the offender's flagged microbatches

    def __post_init__(self) -> None:
        if self.kind not in EVIDENCE_KINDS:
            raise ValueError(f"kind must be one of {EVIDENCE_KINDS}, got {self.kind!r}")

    def to_bytes(self, max_bytes: int = MAX_EVIDENCE_BYTES) -> bytes:
        """msgpack, trimmed to `max_bytes` (the record cap): details go first, signed headers last."""
        body = self._body(keep_details=True)
        packed = msgpack.packb(body, use_bin_type=True)
        if len(packed) > max_bytes:
            packed = msgpack.packb(self._body(keep_details=False), use_bin_type=True)
        if len(packed) > max_bytes:
            body = self._body(keep_details=False)
            body["headers"] = []
            body["reason"] = self.reason[:200]
            packed = msgpack.packb(body, use_bin_type=True)
        return packed

    def _body(self, *, keep_details: bool) -> dict[str, Any]:
        return {
            "v": _EVIDENCE_VERSION,
            "offender": self.offender,
            "verifier": self.verifier,
            "kind": self.kind,
            "reason": self.reason,
            "stage": self.stage,
            "headers": [[h.header, h.signature] for h in self.headers],
            "scores": {k: float(v) for k, v in self.scores.items()} if keep_details else {},
            "fences": {k: [float(a), float(b)] for k, (a, b) in self.fences.items()} if keep_details else {},
            "microbatches": list(self.microbatches[-16:]) if keep_details else [],
        }

    @classmethod
    def from_bytes(cls, data: bytes) -> BanEvidence:
        """Parse evidence from a notice; raises ValueError on anything malformed (never trust the bytes)."""
        if len(data) > MAX_EVIDENCE_BYTES:
            raise ValueError("evidence over the cap")
        try:
            body = msgpack.unpackb(data, raw=False, strict_map_key=True, max_bin_len=MAX_EVIDENCE_BYTES)
            if body.get("v") != _EVIDENCE_VERSION:
                raise ValueError("unknown evidence version")
            return cls(
                offender=str(body["offender"]),
                verifier=str(body["verifier"]),
                kind=body["kind"],
                reason=str(body["reason"]),
                stage=None if body["stage"] is None else int(body["stage"]),
                headers=tuple(SignedBoundaryHeader(bytes(h), bytes(s)) for h, s in body["headers"]),
                scores={str(k): float(v) for k, v in body["scores"].items()},
                fences={str(k): (float(a), float(b)) for k, (a, b) in body["fences"].items()},
                microbatches=tuple(int(m) for m in body["microbatches"]),
            )
        except ValueError:
            raise
        except Exception as e:  # msgpack and shape errors of every kind mean "garbage"
            raise ValueError(f"malformed evidence: {type(e).__name__}") from None


@dataclass(frozen=True, slots=True)
class HeaderSlot:
    """The fields of a signed boundary header that an equivocation proof compares."""

    run_id: str
    sender: str
    stage: int
    direction: str
    microbatch: int
    digest: bytes
    input_digest: str = ""  # which request the payload answered (stages bind it in their output headers)
    step: int = (
        -1
    )  # the signer's inner step when it computed the payload (see verification.equivocation.Slot)


def _input_digest(fields: list[Any]) -> str:
    meta = fields[_H_META] if len(fields) > _H_META else None
    return str(meta.get("input_digest", "")) if isinstance(meta, dict) else ""


def signed_header_of(frame: bytes | bytearray | memoryview) -> SignedBoundaryHeader | None:
    """The header bytes and signature of an envelope frame (`[u32 len][header][64-byte signature][payload]`),
    or None if the frame is too short to hold them. Use on frames that already passed `open_envelope`."""
    view = memoryview(frame)
    if len(view) < 4:
        return None
    header_len = int.from_bytes(view[:4], "big")
    end = 4 + header_len + SIGNATURE_SIZE
    if end > len(view):
        return None
    return SignedBoundaryHeader(bytes(view[4 : 4 + header_len]), bytes(view[4 + header_len : end]))


def verified_slot(signer: str, signed: SignedBoundaryHeader) -> HeaderSlot | None:
    """The slot and digest of a header, if `signer` really signed it and it names `signer` as its sender."""
    if not verify_signature(signer, ENVELOPE_SIGNATURE_DOMAIN + signed.header, signed.signature):
        return None
    try:
        fields = msgpack.unpackb(signed.header, raw=False, max_bin_len=64, max_str_len=4096, max_array_len=64)
        slot = HeaderSlot(
            run_id=str(fields[_H_RUN]),
            sender=str(fields[_H_SENDER]),
            stage=int(fields[_H_STAGE]),
            direction=str(fields[_H_DIRECTION]),
            microbatch=int(fields[_H_MICROBATCH]),
            digest=bytes(fields[_H_DIGEST]),
            input_digest=_input_digest(fields),
            step=int(fields[_H_STEP]),
        )
    except Exception:  # a validly signed header we cannot read proves nothing
        return None
    return slot if slot.sender == signer else None


def proves_equivocation(evidence: BanEvidence, run_id: str) -> bool:
    """Two headers validly signed by the offender for one (run, microbatch, stage, direction, input, step) with
    different payload digests. Checked from the offender's peer id alone: no trust in the verifier needed."""
    slots = [verified_slot(evidence.offender, h) for h in evidence.headers[:2]]
    if len(slots) != 2:
        return False
    a, b = slots
    if a is None or b is None:
        return False
    same_slot = (a.run_id, a.stage, a.direction, a.microbatch, a.input_digest, a.step) == (
        b.run_id,
        b.stage,
        b.direction,
        b.microbatch,
        b.input_digest,
        b.step,
    )
    return a.run_id == run_id and same_slot and a.digest != b.digest


# ---------------------------------------------------------------------------------------------------- aggregation


@dataclass(frozen=True, kw_only=True, slots=True)
class BanVote:
    """One verifier's notice against one offender, as read from the DHT (signature already verified)."""

    verifier: str
    offender: str
    reason: str
    evidence: bytes
    expires_at: float
    stage: int | None = None


@dataclass(frozen=True, kw_only=True, slots=True)
class BanDecision:
    offender: str
    verifiers: frozenset[str]  # the authorized verifiers whose notices count
    reason: str
    until: float  # the ban holds while enough of those notices do
    proof: bool = False  # an equivocation proof carried it alone


def decide_bans(
    votes: Iterable[BanVote],
    *,
    authorized: Collection[str],
    required: int,
    run_id: str,
    now: float,
    syncers: Collection[str] = (),
) -> list[BanDecision]:
    """Bans in effect: offenders with unexpired notices from `required` distinct authorized verifiers, or one
    notice carrying a valid equivocation proof, or one by an authorized syncer (`syncers`) whose evidence is of
    kind "contribution" (its learner ledger). Notices from unauthorized signers (a syncer's of any other kind
    among them), expired ones and a signer's notice against itself are ignored."""
    if required < 1:
        raise ValueError("required must be >= 1")
    by_offender: dict[str, dict[str, BanVote]] = {}
    decisions = []
    for vote in votes:
        if vote.verifier in syncers and vote.verifier not in authorized:
            if (decision := _syncer_ban(vote, now)) is not None:
                decisions.append(decision)
            continue
        if vote.verifier not in authorized:
            logger.warning("ignoring a ban notice by unauthorized %s", vote.verifier[-8:])
            continue
        if vote.expires_at <= now or vote.verifier == vote.offender:
            continue
        current = by_offender.setdefault(vote.offender, {}).get(vote.verifier)
        if current is None or current.expires_at < vote.expires_at:
            by_offender[vote.offender][vote.verifier] = vote
    for offender, per_verifier in sorted(by_offender.items()):
        decision = _decide_one(offender, per_verifier, required=required, run_id=run_id)
        if decision is not None:
            decisions.append(decision)
    return decisions


def _syncer_ban(vote: BanVote, now: float) -> BanDecision | None:
    """A syncer's learner ban, if its notice is unexpired, not against itself, and carries contribution evidence."""
    evidence = _evidence_of(vote)
    if vote.expires_at <= now or vote.verifier == vote.offender:
        return None
    if evidence is None or evidence.kind != "contribution":
        logger.warning("ignoring a ban notice by syncer %s without contribution evidence", vote.verifier[-8:])
        return None
    return BanDecision(
        offender=vote.offender,
        verifiers=frozenset({vote.verifier}),
        reason=vote.reason,
        until=vote.expires_at,
    )


def _decide_one(
    offender: str, per_verifier: Mapping[str, BanVote], *, required: int, run_id: str
) -> BanDecision | None:
    for vote in per_verifier.values():
        evidence = _evidence_of(vote)
        if evidence is not None and evidence.kind == "equivocation" and proves_equivocation(evidence, run_id):
            return BanDecision(
                offender=offender,
                verifiers=frozenset({vote.verifier}),
                reason=vote.reason,
                until=vote.expires_at,
                proof=True,
            )
    if len(per_verifier) < required:
        return None
    # The ban lasts while `required` notices last: the required-th latest expiry.
    expiries = sorted((v.expires_at for v in per_verifier.values()), reverse=True)
    reasons = sorted({v.reason for v in per_verifier.values()})
    return BanDecision(
        offender=offender,
        verifiers=frozenset(per_verifier),
        reason="; ".join(reasons)[:500],
        until=expiries[required - 1],
    )


def _evidence_of(vote: BanVote) -> BanEvidence | None:
    if not vote.evidence:
        return None
    try:
        evidence = BanEvidence.from_bytes(vote.evidence)
    except ValueError:
        return None
    return evidence if evidence.offender == vote.offender else None


def suspicious_verifiers(
    votes: Iterable[BanVote], *, required: int, min_notices: int = 3, factor: float = 3.0
) -> dict[str, int]:
    """Verifiers that accuse far more than their peers: uncorroborated notices (no other verifier agrees
    about that offender) of at least `min_notices` and over `factor` times the other verifiers' median.
    An honest verifier rarely stands alone; one that keeps accusing alone is itself worth a look."""
    accusers: dict[str, set[str]] = {}
    for vote in votes:
        accusers.setdefault(vote.offender, set()).add(vote.verifier)
    alone: dict[str, int] = {}
    everyone: set[str] = set()
    for verifiers in accusers.values():
        everyone |= verifiers
        if len(verifiers) < max(required, 2):
            for verifier in verifiers:
                alone[verifier] = alone.get(verifier, 0) + 1
    out = {}
    for verifier in sorted(everyone):
        count = alone.get(verifier, 0)
        others = [alone.get(v, 0) for v in everyone if v != verifier]
        baseline = statistics.median(others) if others else 0.0
        if count >= min_notices and count > factor * max(baseline, 1.0):
            out[verifier] = count
    return out


# ---------------------------------------------------------------------------------------------------- the list


class BanList:
    """Offenders and until when each is banned; `update` replaces the DHT-derived part, `add` adds one."""

    def __init__(self) -> None:
        self._until: dict[str, float] = {}
        self._reasons: dict[str, str] = {}

    def add(self, offender: str, *, until: float, reason: str) -> bool:
        """Ban (or extend); True when the offender was not banned before at `until`'s horizon."""
        previous = self._until.get(offender)
        self._until[offender] = max(until, previous if previous is not None else -math.inf)
        self._reasons.setdefault(offender, reason)
        return previous is None

    def update(self, decisions: Iterable[BanDecision], now: float) -> list[BanDecision]:
        """Fold in the bans in effect; returns those that are new."""
        fresh = []
        for decision in decisions:
            was = self.is_banned(decision.offender, now)
            self.add(decision.offender, until=decision.until, reason=decision.reason)
            if not was and self.is_banned(decision.offender, now):
                fresh.append(decision)
        return fresh

    def is_banned(self, peer_id: str, now: float) -> bool:
        until = self._until.get(peer_id)
        return until is not None and until > now

    def active(self, now: float) -> frozenset[str]:
        self._expire(now)
        return frozenset(self._until)

    def reason(self, peer_id: str) -> str | None:
        return self._reasons.get(peer_id)

    def _expire(self, now: float) -> None:
        for peer in [p for p, until in self._until.items() if until <= now]:
            del self._until[peer]
            self._reasons.pop(peer, None)


__all__ = [
    "BanDecision",
    "BanEvidence",
    "BanList",
    "BanVote",
    "HeaderSlot",
    "SignedBoundaryHeader",
    "decide_bans",
    "proves_equivocation",
    "signed_header_of",
    "suspicious_verifiers",
    "verified_slot",
]
