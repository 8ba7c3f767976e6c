"""The dashboard's per-learner scores (issue 18, "visible"): `node.status.learner_scores` joins the syncer's
`scores_by_peer` and `learners` (built here by the syncer's own `peer_scores` and `LearnerLedger.status`) into
one row per learner, says why there are none, and bounds what a status names."""

from __future__ import annotations

import math
from typing import Any

import pytest

from node.diloco.learner_ledger import LearnerLedger, peer_scores
from node.status.learner_scores import (
    MAX_PEER_ID_CHARS,
    MAX_REASON_CHARS,
    NO_SCORES,
    NO_SYNCER,
    learner_scores,
)

pytestmark = pytest.mark.timeout(30)

SYNCER_ID = "12D3KooWSyncer0001"
HONEST, NOISE, UNLUCKY = "12D3KooWHonest01", "12D3KooWNoise002", "12D3KooWUnlucky3"


def syncer_status(
    book: LearnerLedger, merges: list[dict[str, Any]], now: float, peer_id: str = SYNCER_ID
) -> dict[str, Any]:
    """The fields of a syncer's /api/status the scores come from, as `node.roles.syncer` fills them."""
    return {
        "peer_id": peer_id,
        "state": "syncing",
        "learners": book.status(now),
        "scores_by_peer": peer_scores(merges, book, now),
    }


def a_swarm(now: float = 10.0) -> dict[str, Any]:
    """An honest learner (never refused), a noise learner banned on its third refusal, one refused once."""
    book = LearnerLedger(ban_after=2.5, forgive_half_life_s=600.0, ban_s=3600.0)
    for i in range(3):
        book.record(NOISE, "evidence: none", "no evidence of work", f"d{i}", float(i))
    book.record(UNLUCKY, "screen: loss", "held-out loss up 0.4", "u0", 5.0)
    merges = [
        {"evidence": {HONEST: [0.2, 0.3, 1.0], NOISE: [0.5, 0.1, 1.0]}, "weights": {HONEST: 0.5, NOISE: 0.5}},
        {
            "evidence": {HONEST: [0.25, 0.3, 1.0], NOISE: [0.001, None, 0.0], UNLUCKY: [0.1, 0.2, 0.6]},
            "weights": {HONEST: 0.7, UNLUCKY: 0.3},
        },
    ]
    return syncer_status(book, merges, now)


def test_one_row_per_learner_with_its_scores_refusals_and_ban() -> None:
    section = learner_scores(a_swarm())
    assert section["syncer"] == SYNCER_ID and section["unavailable"] is None and section["total"] == 3
    rows = {row["peer_id"]: row for row in section["learners"]}
    # the banned first, then the most rejected
    assert [row["peer_id"] for row in section["learners"]] == [NOISE, UNLUCKY, HONEST]
    noise = rows[NOISE]
    assert noise["banned"] and "3 refused contributions" in noise["ban_reason"]
    assert noise["evidence_factor"] == 0.0 and noise["held_out_slope"] == 0.001  # its latest scored merge
    assert noise["merge_weight"] == 0.5 and noise["trust"] == 0.0 and noise["rejected"] == 3
    assert noise["last_refusal"] == "evidence: none: no evidence of work"
    unlucky = rows[UNLUCKY]
    assert not unlucky["banned"] and unlucky["ban_reason"] is None and unlucky["rejected"] == 1
    assert 0.0 < unlucky["trust"] < 1.0 and unlucky["last_refusal"] == "screen: loss: held-out loss up 0.4"
    # never refused: the ledger has no record of it, so its trust at the syncer is 1
    assert rows[HONEST] == {
        "peer_id": HONEST,
        "evidence_factor": 1.0,
        "held_out_slope": 0.25,
        "merge_weight": 0.7,
        "trust": 1.0,
        "rejected": 0,
        "banned": False,
        "ban_reason": None,
        "last_refusal": None,
    }


def test_no_syncer_or_a_syncer_without_scores_says_why() -> None:
    assert learner_scores(None) == {"syncer": None, "learners": [], "total": 0, "unavailable": NO_SYNCER}
    older = learner_scores({"peer_id": SYNCER_ID, "state": "syncing", "recent_merges": []})
    assert older["learners"] == [] and older["unavailable"] == NO_SCORES and older["syncer"] == SYNCER_ID
    quiet = learner_scores({"peer_id": SYNCER_ID, "scores_by_peer": {}, "learners": {}})
    assert quiet["learners"] == [] and quiet["unavailable"] is None  # nobody scored yet: the page says so
    # without the ledger's view, a learner's trust is not assumed
    only_scores = learner_scores({"scores_by_peer": {HONEST: {"merge_weight": 1.0}}})
    assert only_scores["learners"][0]["trust"] is None and only_scores["syncer"] is None


def test_malformed_fields_are_dropped_and_long_ones_bounded() -> None:
    long_id, long_reason = "12D3KooW" + "x" * 5000, "r" * 5000
    status = {
        "peer_id": 42,
        "scores_by_peer": {
            HONEST: {
                "evidence_factor": True,
                "held_out_slope": math.nan,
                "merge_weight": "0.5",
                "trust": 0.8,
            },
            NOISE: "not a mapping",
            long_id: {"merge_weight": 0.1},
        },
        "learners": {
            long_id: {"refused": 2, "banned": True, "ban_reason": long_reason, "evidence": "not a list"},
            UNLUCKY: {"refused": -4, "banned": "yes", "ban_reason": "not banned: no reason shown"},
        },
    }
    section = learner_scores(status)
    rows = {row["peer_id"]: row for row in section["learners"]}
    assert section["syncer"] is None and set(rows) == {HONEST, long_id[:MAX_PEER_ID_CHARS], UNLUCKY}
    honest = rows[HONEST]
    assert (honest["evidence_factor"], honest["held_out_slope"], honest["merge_weight"]) == (None, None, None)
    assert honest["trust"] == 0.8
    long_row = rows[long_id[:MAX_PEER_ID_CHARS]]
    assert long_row["banned"] and long_row["ban_reason"] == long_reason[:MAX_REASON_CHARS]
    assert long_row["last_refusal"] is None
    unlucky = rows[UNLUCKY]
    assert unlucky["rejected"] == 0 and not unlucky["banned"] and unlucky["ban_reason"] is None


def test_rows_are_capped_and_the_total_says_how_many_there_were() -> None:
    scores = {f"12D3KooWPeer{i:04d}": {"merge_weight": 0.01} for i in range(100)}
    learners = {"12D3KooWPeer0099": {"refused": 1, "banned": False, "evidence": []}}
    section = learner_scores({"scores_by_peer": scores, "learners": learners}, limit=10)
    assert section["total"] == 100 and len(section["learners"]) == 10
    assert section["learners"][0]["peer_id"] == "12D3KooWPeer0099"  # the refused one is never cut first
