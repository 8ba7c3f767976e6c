"""Violation ledger: bans need repeated own flags, corroboration and room under the stage cap."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from verification.ledger import LedgerConfig, LedgerDecision, ViolationLedger

REPLICAS = ["a", "b", "c"]
# Most tests look at one rule at a time: no confirmation period unless the test is about it.
PROMPT = LedgerConfig(confirm_s=0.0)


def feed(
    ledger: ViolationLedger, events: list[tuple[str, bool]], stage: int = 1, start: int = 0
) -> list[LedgerDecision]:
    out = []
    for i, (signer, flagged) in enumerate(events, start=start):
        out.append(ledger.record(signer, stage, flagged, float(i), replicas=REPLICAS))
    return out


def actions(decisions: list[LedgerDecision]) -> list[tuple[str, str]]:
    return [(d.signer, d.action) for dec in decisions for d in dec.all() if d.action != "none"]


def round_robin(rounds: int, bad: dict[str, list[bool]] | None = None) -> list[tuple[str, bool]]:
    """a, b, c in turn; `bad[signer][i]` says whether that signer's i-th microbatch is flagged."""
    bad = bad or {}
    return [(s, bad.get(s, [False] * rounds)[r]) for r in range(rounds) for s in REPLICAS]


def test_persistent_offender_quarantined_then_banned_on_its_third_flag() -> None:
    ledger = ViolationLedger(PROMPT)
    got = actions(feed(ledger, round_robin(5, {"a": [True] * 5})))
    assert got == [("a", "quarantine"), ("a", "ban")]
    assert ledger.is_banned("a") and ledger.microbatches_seen("a") == 3
    assert ledger.banned(1) == {"a"}


def test_quarantined_and_flagged_list_suspects_but_not_the_banned() -> None:
    ledger = ViolationLedger(PROMPT)
    feed(ledger, round_robin(2, {"a": [True, True]}))
    assert ledger.quarantined() == ["a"] and ledger.flagged() == {"a": 2}
    feed(ledger, round_robin(1, {"a": [True]}), start=6)
    assert ledger.is_banned("a") and ledger.quarantined() == [] and ledger.flagged() == {}


def test_ban_decision_carries_a_reason() -> None:
    ledger = ViolationLedger(PROMPT)
    bans = [d for d in feed(ledger, round_robin(3, {"a": [True] * 3})) if d.action == "ban"]
    assert len(bans) == 1 and "3 flags" in bans[0].reason


def test_counting_is_per_own_microbatch_not_per_traffic_share() -> None:
    # Two flags in every 20 own microbatches never ban, however much peer traffic is interleaved.
    cfg = LedgerConfig(max_strikes=1000)  # isolate the window rule from the strike rule
    for peers_per_own in (0, 1, 5):
        ledger = ViolationLedger(cfg)
        t = 0
        for i in range(200):
            ledger.record("a", 1, i % 10 == 0, float(t), replicas=REPLICAS)
            t += 1
            for _ in range(peers_per_own):
                ledger.record("b", 1, False, float(t), replicas=REPLICAS)
                t += 1
        assert not ledger.is_banned("a"), peers_per_own


def test_strikes_catch_an_intermittent_attacker_that_dodges_the_window() -> None:
    # One flag every 12 own microbatches: never 3 in 20, but strikes grow faster than forgiveness.
    ledger = ViolationLedger(PROMPT)
    bad = [i % 12 == 0 for i in range(200)]
    got = actions(feed(ledger, round_robin(200, {"a": bad})))
    assert ("a", "ban") in got
    banned_at = ledger.microbatches_seen("a")
    assert 60 <= banned_at <= 80  # 6 strikes, one forgiven per 50 clean


def test_forgiveness_keeps_rare_flags_from_adding_up() -> None:
    ledger = ViolationLedger()
    bad = [i % 60 == 0 for i in range(1200)]
    feed(ledger, round_robin(1200, {"a": bad}))
    assert not ledger.is_banned("a")


def test_statistical_evidence_must_stand_for_the_confirmation_period() -> None:
    ledger = ViolationLedger(LedgerConfig(confirm_s=20.0))
    decisions = feed(ledger, round_robin(30, {"a": [True] * 30}))
    bans = [(i, d) for i, dec in enumerate(decisions) for d in dec.all() if d.action == "ban"]
    assert len(bans) == 1
    # a's third flag arrives at t=6 (its microbatches are at t=0, 3, 6, ...): the ban comes 20 later
    assert bans[0][0] == 6 + 20  # the first record once the confirmation is over (here c's)
    assert any("confirming until t=26.0" in d.reason for dec in decisions for d in dec.all())


def test_a_storm_anywhere_pauses_statistical_bans_and_restarts_confirmation() -> None:
    cfg = LedgerConfig(confirm_s=20.0, storm_cooldown_s=60.0)
    ledger = ViolationLedger(cfg)
    t = 0
    for _ in range(4):  # a is flagged on every microbatch of stage 1 ...
        for s in REPLICAS:
            ledger.record(s, 1, s == "a", float(t), replicas=REPLICAS)
            t += 1
    # ... when most replicas of stage 2 start flagging together (turbulence reaching the pipeline)
    for s in ("x", "y"):
        ledger.record(s, 2, True, float(t), replicas=["x", "y", "z"])
    storm_at = t
    banned_at = None
    while banned_at is None and t < 400:
        t += 1
        for s in REPLICAS:
            for d in ledger.record(s, 1, s == "a", float(t), replicas=REPLICAS).all():
                if d.action == "ban":
                    banned_at = t
    assert banned_at is not None and banned_at >= storm_at + 60 + 20
    assert ledger.banned(1) == {"a"}


def test_a_storm_during_a_pause_restarts_the_confirmation_again() -> None:
    # a collects 3 flags before any storm; storms elsewhere at t=10 and t=40 pause bans until 70, then
    # 100. The confirmation must restart from the later pause's end, not stay at the first's.
    ledger = ViolationLedger(LedgerConfig(confirm_s=20.0, storm_cooldown_s=60.0, window_microbatches=60))
    t = 0
    banned_at = None
    while t < 200 and banned_at is None:
        for s in REPLICAS:
            for d in ledger.record(s, 1, s == "a" and t < 9, float(t), replicas=REPLICAS).all():
                if d.action == "ban":
                    banned_at = t
            t += 1
        if t in (9, 39):  # a storm in stage 2 right after
            ledger.record("x", 2, True, float(t + 1), replicas=["x", "y", "z"])
            ledger.record("y", 2, True, float(t + 1), replicas=["x", "y", "z"])
    assert banned_at is not None and banned_at >= 40 + 60 + 20


def test_flags_during_a_storm_pause_add_no_strikes() -> None:
    ledger = ViolationLedger(LedgerConfig(storm_cooldown_s=1000.0))
    ledger.record("x", 2, True, 0.0, replicas=["x", "y", "z"])
    assert ledger.record("y", 2, True, 1.0, replicas=["x", "y", "z"]).action == "rewarm"
    for t in range(2, 40):  # one flag per 4 own microbatches: strikes would otherwise reach 6
        ledger.record("a", 1, t % 4 == 0, float(t), replicas=REPLICAS)
    assert ledger.state_dict()["signers"]["a"]["strikes"] == 0
    assert ledger.flags_in_window("a") > 0


def test_stage_wide_storm_means_rewarm_and_forgiveness_not_ban() -> None:
    ledger = ViolationLedger()
    # Everyone's tensors look odd at once (a new merged version, an lr change).
    decisions = feed(ledger, round_robin(4, {s: [True] * 4 for s in REPLICAS}))
    got = actions(decisions)
    assert ("b", "rewarm") in got
    assert not any(a == "ban" for _, a in got)
    assert ledger.flags_in_window("a") <= 1  # storm flags were forgiven


def test_one_dominant_replica_plus_a_coincidence_is_not_a_storm() -> None:
    # a is flagged on every microbatch; b's single honest false flag must not call a storm that would
    # forgive a (measured in the harness: storm after storm, the attacker never banned).
    ledger = ViolationLedger(PROMPT)
    got = actions(
        feed(ledger, round_robin(6, {"a": [True] * 6, "b": [False, False, True, False, False, False]}))
    )
    assert not any(action == "rewarm" for _, action in got)
    assert ("a", "ban") in got


def test_flags_during_a_storm_pause_quarantine_but_never_ban() -> None:
    ledger = ViolationLedger(LedgerConfig(storm_cooldown_s=50.0, confirm_s=0.0))
    ledger.record("x", 2, True, 0.0, replicas=["x", "y", "z"])
    assert ledger.record("y", 2, True, 1.0, replicas=["x", "y", "z"]).action == "rewarm"
    t = 2
    for _ in range(12):  # a is flagged on every microbatch during the pause
        for s in REPLICAS:
            ledger.record(s, 1, s == "a", float(t), replicas=REPLICAS)
            t += 1
    assert ledger.is_quarantined("a") and not ledger.is_banned("a")
    # once the pause is over, three fresh flags are needed
    got = actions(feed(ledger, round_robin(4, {"a": [True] * 4}), start=100))
    assert got == [("a", "ban")]
    assert ledger.is_banned("a")


def test_ban_waits_for_peer_corroboration() -> None:
    ledger = ViolationLedger(PROMPT)
    # a's three flags arrive back to back before any peer was checked: quarantine, not ban.
    got = actions(feed(ledger, [("a", True)] * 3))
    assert got == [("a", "quarantine")]
    assert ledger.is_quarantined("a")
    # Peers then send clean microbatches: the evidence stands, the ban follows (as a related decision).
    got = actions(feed(ledger, [("b", False), ("c", False)], start=3))
    assert got == [("a", "ban")]


def test_quarantine_is_lifted_after_a_clean_run() -> None:
    ledger = ViolationLedger(LedgerConfig(release_clean_microbatches=5))
    events = round_robin(30, {"a": [True, True] + [False] * 28})
    got = actions(feed(ledger, events))
    assert got == [("a", "quarantine"), ("a", "release")]
    assert not ledger.is_quarantined("a")


def test_cap_never_bans_a_stage_out_of_existence() -> None:
    ledger = ViolationLedger(PROMPT)  # 3 replicas: at most 1 ban (min 2 active, max half)
    events = round_robin(10, {"a": [True] * 10, "b": [i % 2 == 0 for i in range(10)]})
    feed(ledger, events)
    assert len(ledger.banned(1)) <= 1


def test_cap_scales_with_the_number_of_replicas() -> None:
    members = ["a", "b", "c", "d", "e", "f", "g"]
    for offenders, allowed in ((["a", "b", "c"], 3), (["a", "b"], 2)):
        ledger = ViolationLedger(LedgerConfig(max_banned_fraction_per_stage=0.3, confirm_s=0.0))
        for r in range(6):
            for s in members:
                ledger.record(s, 1, s in offenders, float(r), replicas=members)
        assert len(ledger.banned(1)) == min(allowed, 2)  # floor(0.3 * 7) = 2


def test_two_replica_stage_gets_no_statistical_ban() -> None:
    ledger = ViolationLedger(PROMPT)
    for r in range(10):
        ledger.record("a", 1, True, float(r), replicas=["a", "b"])
        ledger.record("b", 1, False, float(r), replicas=["a", "b"])
    assert not ledger.is_banned("a") and ledger.is_quarantined("a")


def test_spot_check_convictions_quarantine_then_ban_and_proofs_ban_at_once() -> None:
    ledger = ViolationLedger()
    first = ledger.record_evidence("a", 1, 0.0, reason="spot check", replicas=REPLICAS)
    assert first.action == "quarantine" and "conviction 1" in first.reason
    ledger.record("a", 1, False, 1.0, replicas=REPLICAS)
    second = ledger.record_evidence("a", 1, 2.0, reason="spot check", replicas=REPLICAS)
    assert second.action == "ban" and "2 spot-check convictions" in second.reason
    # the stage cap applies to convictions ...
    for t in (3.0, 4.0):
        capped = ledger.record_evidence("b", 1, t, reason="spot check", replicas=REPLICAS)
    assert capped.action == "none" and "cap" in capped.reason and ledger.is_quarantined("b")
    # ... not to cryptographic proof
    proof = ledger.record_evidence("b", 1, 5.0, reason="equivocation", proof=True, replicas=REPLICAS)
    assert proof.action == "ban"
    # the earlier keyword for proofs (verification/tap.py uses it) still works
    assert ledger.record_evidence("c", 2, 6.0, reason="equivocation", bypass_cap=True).action == "ban"


def test_uncorroborated_convictions_quarantine_but_never_ban() -> None:
    # Outvoted by two identical copies of one version (SpotCheckVerdict.corroborated False): distrusted,
    # never banned, however often; one corroborated conviction later still counts as the first.
    ledger = ViolationLedger()
    first = ledger.record_evidence("a", 1, 0.0, reason="one opinion", corroborated=False, replicas=REPLICAS)
    assert first.action == "quarantine" and ledger.is_quarantined("a")
    for t in range(1, 6):
        ledger.record("a", 1, False, float(t), microbatch_id=t, replicas=REPLICAS)
        decision = ledger.record_evidence(
            "a", 1, float(t), reason="again", corroborated=False, replicas=REPLICAS
        )
        assert decision.action != "ban"
    assert ledger.record_evidence("a", 1, 7.0, reason="two opinions", replicas=REPLICAS).action != "ban"
    assert ledger.record_evidence("a", 1, 8.0, reason="two opinions", replicas=REPLICAS).action == "ban"


def test_marginal_convictions_take_twice_as_many_to_ban_and_survive_a_restart() -> None:
    # Convictions near the tolerance (SpotCheckVerdict.marginal) weigh half: 4 ban, or 1 full + 2 marginal.
    def convict(ledger: ViolationLedger, t: int, *, marginal: bool) -> str:
        ledger.record("a", 1, False, float(t), microbatch_id=t, replicas=REPLICAS)
        return ledger.record_evidence(
            "a", 1, float(t), reason="near", marginal=marginal, replicas=REPLICAS
        ).action

    ledger = ViolationLedger()
    assert [convict(ledger, t, marginal=True) for t in range(1, 4)] == ["quarantine", "none", "none"]
    assert ledger.is_quarantined("a") and not ledger.is_banned("a")
    restored = ViolationLedger()
    restored.load_state_dict(ledger.state_dict())  # the marginal ones are kept across a restart
    assert convict(restored, 4, marginal=True) == "ban"
    mixed = ViolationLedger()
    assert convict(mixed, 1, marginal=False) == "quarantine"
    assert convict(mixed, 2, marginal=True) != "ban"
    assert convict(mixed, 3, marginal=True) == "ban"
    with pytest.raises(ValueError):
        LedgerConfig(convictions_to_ban=3, marginal_convictions_to_ban=2)


def test_a_lone_old_conviction_expires_with_the_window() -> None:
    ledger = ViolationLedger()
    ledger.record_evidence("a", 1, 0.0, reason="stale replica", replicas=REPLICAS)
    for t in range(1, 26):
        ledger.record("a", 1, False, float(t), replicas=REPLICAS)
    ledger.record_evidence("a", 1, 30.0, reason="stale replica", replicas=REPLICAS)
    assert not ledger.is_banned("a")


def test_forward_and_backward_checks_of_one_microbatch_count_once() -> None:
    ledger = ViolationLedger(LedgerConfig(quarantine_flags=3, confirm_s=0.0))
    for mb in range(2):  # both directions flagged: still one flagged microbatch each
        ledger.record("a", 1, True, float(mb), microbatch_id=mb, replicas=REPLICAS)
        ledger.record("a", 1, True, float(mb), microbatch_id=mb, replicas=REPLICAS)
        ledger.record("b", 1, False, float(mb), microbatch_id=100 + mb, replicas=REPLICAS)
    assert ledger.flags_in_window("a") == 2 and ledger.microbatches_seen("a") == 2
    # a clean forward then a flagged backward of the same microbatch flags it
    ledger.record("a", 1, False, 2.0, microbatch_id=2, replicas=REPLICAS)
    decision = ledger.record("a", 1, True, 2.0, microbatch_id=2, replicas=REPLICAS)
    assert ledger.flags_in_window("a") == 3 and ledger.microbatches_seen("a") == 3
    assert decision.action == "ban"


def test_checks_of_one_microbatch_count_once_with_several_in_flight() -> None:
    # With microbatches in flight concurrently a microbatch's backward check need not follow its forward.
    ledger = ViolationLedger(PROMPT)
    for mb in range(3):
        ledger.record("a", 1, False, float(mb), microbatch_id=mb, replicas=REPLICAS)
    ledger.record("a", 1, True, 3.0, microbatch_id=0, replicas=REPLICAS)  # backward of 0, after 1 and 2
    ledger.record("a", 1, False, 3.0, microbatch_id=1, replicas=REPLICAS)
    assert ledger.microbatches_seen("a") == 3 and ledger.flags_in_window("a") == 1


def test_a_matching_recomputation_takes_a_flag_back_but_never_a_conviction() -> None:
    ledger = ViolationLedger(PROMPT)
    for mb in range(20):
        ledger.record("b", 1, False, float(mb), microbatch_id=100 + mb, replicas=REPLICAS)
        ledger.record("c", 1, False, float(mb), microbatch_id=200 + mb, replicas=REPLICAS)
    for mb in range(2):
        ledger.record("a", 1, True, float(mb), microbatch_id=mb, replicas=REPLICAS)
    assert ledger.is_quarantined("a") and ledger.flags_in_window("a") == 2
    released = ledger.exonerate("a", 1)
    assert released.action == "release" and ledger.flags_in_window("a") == 1
    assert "nothing" in ledger.exonerate("a", 1).reason  # once only
    assert "nothing" in ledger.exonerate("a", 99).reason  # unknown microbatch
    # the flag that came back does not count towards a ban any more
    ledger.record("a", 1, True, 3.0, microbatch_id=3, replicas=REPLICAS)
    assert not ledger.is_banned("a") and ledger.flags_in_window("a") == 2
    # a conviction keeps the replica quarantined whatever is taken back, and storms do not release it
    ledger.record_evidence("a", 1, 4.0, reason="spot check", replicas=REPLICAS)
    ledger.exonerate("a", 0)
    assert ledger.is_quarantined("a")
    feed(ledger, [("b", True), ("c", True), ("b", True), ("c", True)], start=5)
    assert ledger.is_quarantined("a") and not ledger.is_banned("a")


def test_banned_signer_records_are_ignored() -> None:
    ledger = ViolationLedger()
    ledger.record_evidence("a", 1, 0.0, reason="test", proof=True, replicas=REPLICAS)
    decision = ledger.record("a", 1, True, 1.0, replicas=REPLICAS)
    assert decision.action == "none" and "banned" in decision.reason


def test_state_dict_round_trip_keeps_evidence_and_bans() -> None:
    ledger = ViolationLedger()
    feed(ledger, round_robin(2, {"a": [True, True], "b": [True, False]})[:5])
    ledger.record_evidence("c", 2, 5.0, reason="x", proof=True, replicas=["c", "d", "e"])
    ledger.record_evidence("d", 2, 6.0, reason="y", replicas=["c", "d", "e"])
    restored = ViolationLedger()
    restored.load_state_dict(ledger.state_dict())
    assert restored.state_dict() == ledger.state_dict()
    assert restored.is_banned("c") and restored.flags_in_window("a") == ledger.flags_in_window("a")
    # and it decides the same next step
    assert ledger.record("a", 1, True, 9.0, replicas=REPLICAS) == restored.record(
        "a", 1, True, 9.0, replicas=REPLICAS
    )


@pytest.mark.parametrize(
    "kwargs",
    [
        {"window_microbatches": 0},
        {"ban_flags": 30},
        {"quarantine_flags": 4, "ban_flags": 3},
        {"storm_fraction": 1.0},
        {"storm_min_replicas": 1},
        {"storm_dominance": 0.5},
        {"convictions_to_ban": 0},
        {"max_banned_fraction_per_stage": 1.0},
        {"min_active_replicas_per_stage": 0},
        {"confirm_s": -1.0},
        {"storm_cooldown_s": -1.0},
    ],
)
def test_config_validation(kwargs: dict[str, object]) -> None:
    with pytest.raises(ValueError):
        LedgerConfig(**kwargs)  # type: ignore[arg-type]


signers = st.sampled_from(["a", "b", "c", "d", "e"])
stages = st.integers(min_value=0, max_value=2)
clean_events = st.lists(st.tuples(signers, stages, st.integers(0, 50)), max_size=400)


@settings(max_examples=150, deadline=None)
@given(events=clean_events, use_members=st.booleans())
def test_no_sequence_of_clean_microbatches_ever_bans_or_quarantines(
    events: list[tuple[str, int, int]], use_members: bool
) -> None:
    ledger = ViolationLedger()
    for t, (signer, stage, mb) in enumerate(events):
        members = ["a", "b", "c", "d", "e"] if use_members else None
        decision = ledger.record(signer, stage, False, float(t), microbatch_id=mb, replicas=members)
        assert all(d.action == "none" for d in decision.all())
    assert not any(ledger.banned(s) for s in range(3))


flag_events = st.lists(st.tuples(signers, st.booleans()), max_size=300)


@settings(max_examples=150, deadline=None)
@given(events=flag_events, fraction=st.sampled_from([0.0, 0.34, 0.5, 0.8]))
def test_the_stage_cap_holds_for_any_flag_sequence(events: list[tuple[str, bool]], fraction: float) -> None:
    cfg = LedgerConfig(max_banned_fraction_per_stage=fraction, min_active_replicas_per_stage=2, confirm_s=0.0)
    ledger = ViolationLedger(cfg)
    members = ["a", "b", "c", "d", "e"]
    for t, (signer, flagged) in enumerate(events):
        for d in ledger.record(signer, 0, flagged, float(t), replicas=members).all():
            if d.action == "ban":
                assert d.signer in members
        banned = ledger.banned(0)
        assert len(banned) <= int(fraction * len(members))
        assert len(members) - len(banned) >= 2


@settings(max_examples=150, deadline=None)
@given(events=flag_events)
def test_a_ban_always_rests_on_flags_of_the_banned_signer(events: list[tuple[str, bool]]) -> None:
    ledger = ViolationLedger(PROMPT)
    flags: dict[str, int] = {}
    for t, (signer, flagged) in enumerate(events):
        flags[signer] = flags.get(signer, 0) + int(flagged)
        for d in ledger.record(signer, 0, flagged, float(t), replicas=["a", "b", "c", "d", "e"]).all():
            if d.action == "ban":
                assert flags.get(d.signer, 0) >= ledger.config.ban_flags
