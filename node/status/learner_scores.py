"""Per learner, the active syncer's scores as the dashboard shows them (issue 18, "visible").

The syncer's `/api/status` carries them in two places: `scores_by_peer` (per learner: `evidence_factor` and
`held_out_slope` of its last scored contribution, `merge_weight`, its last share of a merge, and, for a learner it
refused, `trust` and `banned`; `node.diloco.learner_ledger.peer_scores`) and `learners` (per learner it refused:
`refused`, `banned`, `ban_reason` and its latest evidence; `LearnerLedger.status`). The bootstrap reads
that status every heartbeat period (`bootstrap.server`); `learner_scores(status)` joins the two into one row per
peer for `/api/swarm`'s `scores` section (learners; a stage replica appears with its merge weight only, and its
bans come from verifiers, in the ban records).

The status comes from a syncer the owner authorized, but the peer ids and reasons in it name identities anyone can
create, so every field is checked for its type and bounded in length here, and the page sets them as text only.
Pure: no I/O, no clock.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

# rows served in /api/swarm (banned first, then the most refused): what a page polling every 2 s should download
MAX_LEARNERS_SERVED = 64
MAX_PEER_ID_CHARS = 128
MAX_REASON_CHARS = 250
NO_SYNCER = "no active syncer answered its /api/status"
NO_SCORES = "the syncer's status lists no scores (an older syncer)"


@dataclass(frozen=True, kw_only=True, slots=True)
class LearnerScore:
    """One learner at the syncer. None: the syncer gave no value (never scored, never merged, an older syncer)."""

    peer_id: str
    evidence_factor: float | None  # of its last scored contribution: 0 (no evidence of work) to 1
    held_out_slope: float | None  # held-out loss descent per unit norm of that contribution (nats)
    merge_weight: float | None  # its share of the last merge it was in
    trust: float | None  # probation, 1 - forgiven violations / ban_after (1: never refused)
    rejected: int  # contributions refused (blamed on it) since the syncer started
    banned: bool
    ban_reason: str | None
    last_refusal: str | None  # "tag: reason" of its latest refusal

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def _num(value: object) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        return None
    return float(value)


def _count(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


def _text(value: object) -> str | None:
    return value[:MAX_REASON_CHARS] if isinstance(value, str) and value else None


def _last_refusal(ledger: Mapping[str, Any]) -> str | None:
    evidence = ledger.get("evidence")
    last = evidence[-1] if isinstance(evidence, list) and evidence else None
    if not isinstance(last, Mapping):
        return None
    return _text(f"{last.get('tag', '?')}: {last.get('reason', '')}")


def _row(peer_id: str, scores: Mapping[str, Any], ledger: Mapping[str, Any] | None) -> LearnerScore:
    """One learner from its `scores_by_peer` entry and its `learners` entry (None: the ledger has no record of
    it, so it was never refused: the syncer's trust for it is 1, `LearnerLedger.trust`)."""
    record: Mapping[str, Any] = ledger or {}
    trust = _num(scores.get("trust"))
    banned = record.get("banned") is True or _num(scores.get("banned")) == 1.0
    return LearnerScore(
        peer_id=peer_id[:MAX_PEER_ID_CHARS],
        evidence_factor=_num(scores.get("evidence_factor")),
        held_out_slope=_num(scores.get("held_out_slope")),
        merge_weight=_num(scores.get("merge_weight")),
        trust=1.0 if trust is None and ledger is None else trust,
        rejected=_count(record.get("refused")) or 0,
        banned=banned,
        ban_reason=_text(record.get("ban_reason")) if banned else None,
        last_refusal=_last_refusal(record),
    )


def _entries(status: Mapping[str, Any], key: str) -> dict[str, Mapping[str, Any]]:
    section = status.get(key)
    if not isinstance(section, Mapping):
        return {}
    return {str(peer): value for peer, value in section.items() if isinstance(value, Mapping)}


def learner_scores(status: object, *, limit: int = MAX_LEARNERS_SERVED) -> dict[str, Any]:
    """The `scores` section of `/api/swarm` from the active syncer's status (None: none answered):
    `syncer` (its peer id), `learners` (at most `limit` rows, `LearnerScore.to_json`: the banned first, then the
    most rejected, then by peer id), `total` (learners the status lists) and `unavailable` (why there are no rows
    to show, or None)."""
    if not isinstance(status, Mapping):
        return {"syncer": None, "learners": [], "total": 0, "unavailable": NO_SYNCER}
    syncer = status.get("peer_id")
    out: dict[str, Any] = {
        "syncer": syncer[:MAX_PEER_ID_CHARS] if isinstance(syncer, str) else None,
        "learners": [],
        "total": 0,
        "unavailable": None,
    }
    has_scores, known = (isinstance(status.get(k), Mapping) for k in ("scores_by_peer", "learners"))
    if not (has_scores or known):
        return {**out, "unavailable": NO_SCORES}
    scores, ledger = _entries(status, "scores_by_peer"), _entries(status, "learners")
    # a syncer without `learners` says nothing of refusals: then no trust is assumed either
    rows = [
        _row(peer, scores.get(peer, {}), ledger.get(peer) if known else {})
        for peer in dict.fromkeys([*scores, *ledger])
    ]
    rows.sort(key=lambda r: (not r.banned, -r.rejected, r.peer_id))
    return {**out, "learners": [r.to_json() for r in rows[:limit]], "total": len(rows)}
