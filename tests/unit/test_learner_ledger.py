"""The syncer's learner ledger and its bans (issue 18, part 3): violations with evidence, forgiveness, a ban
after repeated refusals; the syncer as a signer of learner bans in the ban gossip (evidence kind "contribution"),
each with its negative control."""

from __future__ import annotations

import math

import pytest
import torch

from node.diloco.learner_ledger import LearnerLedger, contribution_digest, peer_scores
from protocol import keys
from protocol.records import BanNotice
from tests.unit.test_records import NOW, PEER, SYNCER, check, make_envelope, reason_of
from verification.bans import BanEvidence, BanVote, decide_bans

pytestmark = pytest.mark.timeout(30)

LOSS = "screen: loss"


def ledger(**kw: float) -> LearnerLedger:
    return LearnerLedger(**{"ban_after": 2.5, "forgive_half_life_s": 600.0, "ban_s": 3600.0, **kw})


def test_an_attacker_that_keeps_sending_is_banned_on_its_third_refusal_with_evidence() -> None:
    book = ledger()
    assert book.record("evil", LOSS, "held-out loss up", "d1", 0.0, {"loss_after": 5.0}) is None
    assert book.record("evil", LOSS, "held-out loss up", "d2", 10.0) is None
    ban = book.record("evil", "copycat", "delta within 0.001", "d3", 20.0)
    assert ban is not None and ban.offender == "evil" and ban.until == 3620.0
    assert [v.digest for v in ban.evidence] == ["d1", "d2", "d3"] and ban.evidence[0].scores == {
        "loss_after": 5.0
    }
    assert "3 refused contributions" in ban.reason and book.banned("evil", 30.0) == ban.reason
    status = book.status(30.0)["evil"]
    assert status["banned"] and status["refused_by_tag"] == {LOSS: 2, "copycat": 1}
    assert book.banned("evil", 3621.0) is None  # the ban expires
    assert book.record("evil", LOSS, "again", "d4", 25.0) is None  # once per ban


def test_negative_control_with_bans_off_the_same_attacker_is_never_banned() -> None:
    book = ledger(ban_after=0.0)
    for i in range(20):
        assert book.record("evil", LOSS, "held-out loss up", f"d{i}", float(i)) is None
    assert book.banned("evil", 20.0) is None and book.status(20.0)["evil"]["refused"] == 20


def test_an_honest_learner_refused_once_in_a_while_is_forgiven() -> None:
    book = ledger()
    for hour in range(24):  # one refusal an hour (half-life 10 min): never adds up
        assert book.record("honest", LOSS, "unlucky", "d", hour * 3600.0) is None
        assert book.weight("honest", hour * 3600.0) < 1.1  # each refusal weighs about 1, never more
    assert book.banned("honest", 24 * 3600.0) is None


def test_a_non_finite_contribution_bans_at_once() -> None:
    ban = ledger().record("nan", "screen: non-finite", "non-finite", "d", 0.0)
    assert ban is not None


def test_the_digest_names_the_contribution() -> None:
    a = {"w": torch.zeros(3), "b": torch.ones(2)}
    assert contribution_digest(a) == contribution_digest(dict(reversed(list(a.items()))))
    assert contribution_digest(a) != contribution_digest({"w": torch.zeros(3), "b": torch.full((2,), 2.0)})


# ---- the syncer as a signer of learner bans ----

SYNCER_ID, VERIFIER_ID, LEARNER = "syncer-id", "verifier-id", "learner-id"


def syncer_vote(kind: str = "contribution", *, expires_at: float = 500.0) -> BanVote:
    evidence = BanEvidence(offender=LEARNER, verifier=SYNCER_ID, kind=kind, reason="3 refused")  # type: ignore[arg-type]
    return BanVote(
        verifier=SYNCER_ID,
        offender=LEARNER,
        reason="3 refused",
        evidence=evidence.to_bytes(),
        expires_at=expires_at,
    )


def test_a_syncers_contribution_ban_holds_alone() -> None:
    decisions = decide_bans(
        [syncer_vote()], authorized={VERIFIER_ID}, required=2, run_id="r", now=0.0, syncers={SYNCER_ID}
    )
    assert [(d.offender, d.verifiers) for d in decisions] == [(LEARNER, frozenset({SYNCER_ID}))]


def test_negative_control_a_syncer_not_listed_as_signer_or_without_contribution_evidence_bans_nobody() -> (
    None
):
    assert decide_bans([syncer_vote()], authorized={VERIFIER_ID}, required=1, run_id="r", now=0.0) == []
    other = syncer_vote("statistical")
    assert (
        decide_bans([other], authorized={VERIFIER_ID}, required=1, run_id="r", now=0.0, syncers={SYNCER_ID})
        == []
    )
    expired = syncer_vote(expires_at=0.0)
    assert decide_bans([expired], authorized=(), required=1, run_id="r", now=1.0, syncers={SYNCER_ID}) == []


def test_an_authorized_syncer_may_write_a_ban_record_and_an_ordinary_peer_may_not() -> None:
    from tests.unit.test_records import RUN_ID

    raw = keys.bans_key(RUN_ID, PEER.peer_id)
    body = BanNotice(offender=PEER.peer_id, reason="3 refused", issued_at=NOW).to_body()
    assert check(make_envelope(SYNCER, raw, SYNCER.peer_id, body, NOW + 60), raw, SYNCER.peer_id, NOW + 60)
    raw = keys.bans_key(RUN_ID, SYNCER.peer_id)
    body = BanNotice(offender=SYNCER.peer_id, reason="x", issued_at=NOW).to_body()
    envelope = make_envelope(PEER, raw, PEER.peer_id, body, NOW + 60)
    assert reason_of(lambda: check(envelope, raw, PEER.peer_id, NOW + 60)) == "unauthorized"
    assert math.isfinite(NOW)


def test_refusals_per_peer_are_exported_on_metrics() -> None:
    from prometheus_client import CollectorRegistry, generate_latest

    from node.status.http import StatusMetrics

    registry = CollectorRegistry()
    metrics = StatusMetrics(registry)
    book = ledger()
    book.record("evil", LOSS, "up", "d", 0.0)
    metrics.update({"refusals_by_peer": book.refusals()})
    text = generate_latest(registry).decode()
    assert 'hivenode_syncer_refused_contributions{peer="evil",reason="screen: loss"} 1.0' in text


def test_scores_and_bans_per_peer_are_exported_on_metrics() -> None:
    """Issue 18 part 5: each learner's latest evidence factor, held-out slope, merge share and, once refused, its
    trust and ban are gauges on /metrics, with the syncer's ban count. Control: an honest learner never refused
    shows factor 1 and no ban series, the noise learner factor 0 and banned 1."""
    from prometheus_client import CollectorRegistry, generate_latest

    from node.status.http import StatusMetrics

    book = ledger()
    for i in range(3):
        book.record("noise", "evidence: none", "no evidence", f"d{i}", float(i))
    merges = [
        {
            "evidence": {"noise": [0.5, 0.1, 1.0], "honest": [0.2, 0.3, 1.0]},
            "weights": {"noise": 0.5, "honest": 0.5},
        },
        {"evidence": {"noise": [0.001, None, 0.0], "honest": [0.25, 0.3, 1.0]}, "weights": {"honest": 1.0}},
        {"evidence": {"bad": [math.nan, None, 1.0]}, "weights": {}},
    ]
    scores = peer_scores(merges, book, 10.0)
    assert scores["noise"] == {
        "held_out_slope": 0.001,
        "evidence_factor": 0.0,  # the latest merge wins
        "merge_weight": 0.5,
        "trust": 0.0,
        "banned": 1.0,
    }
    assert scores["honest"] == {"held_out_slope": 0.25, "evidence_factor": 1.0, "merge_weight": 1.0}
    assert scores["bad"] == {"evidence_factor": 1.0}  # a NaN slope is left out
    registry = CollectorRegistry()
    StatusMetrics(registry).update({"scores_by_peer": scores, "learner_bans": book.bans})
    text = generate_latest(registry).decode()
    assert 'hivenode_syncer_peer_score{peer="noise",score="evidence_factor"} 0.0' in text
    assert 'hivenode_syncer_peer_score{peer="noise",score="banned"} 1.0' in text
    assert 'hivenode_syncer_peer_score{peer="honest",score="evidence_factor"} 1.0' in text
    assert 'peer="honest",score="banned"' not in text
    assert "hivenode_syncer_learner_bans 1.0" in text


def test_a_refused_peer_is_on_probation_and_its_merge_weight_falls() -> None:
    from tests.unit.test_claims import Swarm, core

    book = ledger()
    assert book.trust("evil", 0.0) == 1.0
    book.record("evil", LOSS, "up", "d", 0.0)
    trust = book.trust("evil", 0.0)
    assert trust == pytest.approx(0.6)
    assert book.trust("evil", 6000.0) > 0.99  # forgiven
    swarm = Swarm(core())
    swarm.round()
    swarm.now += 10.0
    for peer in swarm.peers:
        swarm.push(peer, swarm.honest())
    swarm.nonce += 1
    swarm.c.accept(
        "evil",
        0,
        swarm.honest(),
        base_version=swarm.c.versions[0],
        steps=4,
        tokens=256,
        sched_step=1,
        step_time_s=0.1,
        nonce=b"p" * 16,
        now=swarm.now,
        trust=trust,
    )
    record = swarm.c.merge_now(0, 4, swarm.now)
    assert record is not None
    assert record.weights["evil"] == pytest.approx(record.weights["honest0"] * trust**2, rel=0.05)
    # negative control: without probation (ban_after 0: bans off) it weighs as much as an honest peer
    assert ledger(ban_after=0.0).trust("evil", 0.0) == 1.0


def test_the_loss_screens_refusals_of_one_piece_of_work_weigh_once_other_refusals_each_time() -> None:
    """(fragment, base version) names a learner's trajectory between two overwrites: its snapshots are nested, so
    refusing the same trajectory again adds no weight (node.diloco.learner_ledger, `ONCE_PER_WORK`). A new base, a
    new fragment or another peer is new work; other tags, and a refusal without its work, weigh every time."""
    book = ledger(ban_after=10.0)
    assert book.record("a", LOSS, "ascent", "d1", 0.0, work=(0, 7)) is None
    assert book.record("a", LOSS, "ascent", "d2", 0.5, work=(0, 7)) is None  # the same work: no more weight
    assert book.weight("a", 0.5) == pytest.approx(1.0, abs=1e-3)
    book.record("a", LOSS, "ascent", "d3", 1.0, work=(0, 8))  # the next base
    book.record("a", LOSS, "ascent", "d4", 1.0, work=(1, 7))  # another fragment
    book.record("b", LOSS, "ascent", "d5", 1.0, work=(0, 7))  # another peer
    assert book.weight("a", 1.0) == pytest.approx(3.0, abs=1e-2) and book.weight("b", 1.0) == 1.0
    book.record("a", "copycat", "copy", "d6", 1.0, work=(0, 8))
    book.record("a", "copycat", "copy", "d7", 1.0, work=(0, 8))  # not a tag weighed once per work
    book.record("a", LOSS, "ascent", "d8", 1.0)
    book.record("a", LOSS, "ascent", "d9", 1.0)  # no work given: the old count
    status = book.status(1.0)["a"]
    assert status["weight"] == pytest.approx(7.0, abs=1e-2) and status["refused"] == 7
    assert status["repeats"] == 1 and status["refused_by_tag"] == {LOSS: 6, "copycat": 2}
    # a repeat is no new evidence
    assert [v["digest"] for v in status["evidence"]] == ["d6", "d7", "d8", "d9"]
