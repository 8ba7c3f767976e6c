"""Seniority (issue 18, Sybil resistance): young identities hold at most `young_weight_cap` of a merge, a refusal
makes an identity young again, idle identities are forgotten; and the syncer core applies the cap to its merges.
The clock is passed in. The probation ramp (test_probation.py) is off in the pure tests: they measure the cap
alone."""

from __future__ import annotations

import math

import pytest

from node.diloco.screening import ScreeningConfig
from node.diloco.seniority import Seniority, SeniorityConfig
from tests.unit.test_probation import NO_RAMP
from tests.unit.test_syncer_core import core, push

pytestmark = pytest.mark.timeout(60)

HONEST = [f"honest{i}" for i in range(4)]
SYBILS = [f"sybil{i}" for i in range(5)]


def _senior(policy: Seniority, peers: list[str], now: float = 0.0) -> None:
    for _ in range(policy.config.young_rounds):
        policy.observe_merge(peers, now)


def _share(weights: dict[str, float], peers: list[str]) -> float:
    return math.fsum(weights[p] for p in peers) / math.fsum(weights.values())


def test_a_burst_of_fresh_sybils_holds_at_most_the_cap_against_senior_honest_learners() -> None:
    policy = Seniority(SeniorityConfig(young_rounds=16, young_weight_cap=0.25, probation=NO_RAMP))
    _senior(policy, HONEST)
    raw = {**{p: 1.0 for p in HONEST}, **{p: 1.0 for p in SYBILS}}  # same token weight each
    capped = policy.cap(raw, now=1.0)
    assert capped.young_share == pytest.approx(5 / 9)
    assert _share(capped.weights, SYBILS) == pytest.approx(0.25)  # <= cap
    assert all(capped.weights[p] == 1.0 for p in HONEST) and capped.grad_scale == 1.0
    # even claiming 100x the tokens^2/steps weight each, they stay at the cap
    inflated = policy.cap({**{p: 1.0 for p in HONEST}, **{p: 100.0 for p in SYBILS}}, now=1.0)
    assert _share(inflated.weights, SYBILS) == pytest.approx(0.25)


def test_control_with_the_cap_off_the_sybils_hold_the_majority() -> None:
    policy = Seniority(SeniorityConfig(young_rounds=16, young_weight_cap=1.0, probation=NO_RAMP))
    _senior(policy, HONEST)
    capped = policy.cap({**{p: 1.0 for p in HONEST}, **{p: 1.0 for p in SYBILS}}, now=1.0)
    assert _share(capped.weights, SYBILS) > 0.5


def test_identities_become_senior_after_young_rounds_and_nothing_is_capped_at_a_run_start() -> None:
    policy = Seniority(SeniorityConfig(young_rounds=3, probation=NO_RAMP))
    everyone = {p: 1.0 for p in HONEST}
    assert policy.cap(everyone, now=0.0).weights == everyone  # all young, no senior: nothing to protect yet
    for round_ in range(3):
        assert policy.is_young("honest0", now=float(round_))
        policy.observe_merge(["honest0"], now=float(round_))
    assert not policy.is_young("honest0", now=3.0) and policy.rounds("honest0", now=3.0) == 3


def test_a_refusal_demotes_and_an_idle_identity_is_forgotten() -> None:
    policy = Seniority(SeniorityConfig(young_rounds=2, forget_s=100.0))
    _senior(policy, ["a", "b"], now=0.0)
    policy.demote("a", now=1.0)
    assert policy.is_young("a", now=1.0) and not policy.is_young("b", now=1.0)
    assert policy.demotions == 1
    assert policy.is_young("b", now=101.0)  # not merged for forget_s: banked seniority is gone


def test_a_young_only_merge_is_scaled_while_seniors_are_active() -> None:
    policy = Seniority(
        SeniorityConfig(young_rounds=2, young_weight_cap=0.25, senior_active_s=60.0, probation=NO_RAMP)
    )
    _senior(policy, HONEST, now=0.0)
    lone = policy.cap({"sybil0": 1.0}, now=10.0)  # K = 1: a round of its own
    assert lone.grad_scale == 0.25 and lone.weights == {"sybil0": 1.0}
    assert policy.cap({"sybil0": 1.0}, now=100.0).grad_scale == 1.0  # no senior merged recently


def test_the_syncer_core_caps_young_identities_in_its_merges_and_demotes_on_refusal() -> None:
    """4 senior honest learners (the young_rounds merges behind them) and 5 fresh identities in one round."""
    screening = ScreeningConfig(young_rounds=2, young_weight_cap=0.25, loss_probe=False, copy_tolerance=0.0)
    c = core(screening=screening, clip_factor=None)
    now = 10.0
    for _ in range(2):
        for peer in HONEST:
            push(c, peer, 0, now=now, base=c.versions[0], nonce=f"{peer}{now}".encode())
        assert c.merge_now(0, len(HONEST), now) is not None
        now += 10.0
    for peer in HONEST + SYBILS:
        push(c, peer, 0, now=now, base=c.versions[0], nonce=f"{peer}{now}".encode())
    record = c.merge_now(0, len(HONEST) + len(SYBILS), now)
    assert record is not None
    assert _share(record.weights, SYBILS) <= 0.25 + 1e-9
    assert c.seniority.status(now)["capped_merges"] >= 1
    # a blamed refusal (a duplicate of a merged contribution) makes a senior identity young again
    with pytest.raises(Exception, match="merged already"):
        push(c, "honest0", 0, now=now, base=c.versions[0] - 1, nonce=f"honest0{now}".encode())
    assert c.seniority.is_young("honest0", now)


def test_control_the_syncer_core_with_screening_off_lets_the_sybils_hold_the_majority() -> None:
    c = core(screening=ScreeningConfig(enabled=False, young_rounds=2), clip_factor=None)
    now = 10.0
    for _ in range(2):
        for peer in HONEST:
            push(c, peer, 0, now=now, base=c.versions[0], nonce=f"{peer}{now}".encode())
        c.merge_now(0, len(HONEST), now)
        now += 10.0
    for peer in HONEST + SYBILS:
        push(c, peer, 0, now=now, base=c.versions[0], nonce=f"{peer}{now}".encode())
    record = c.merge_now(0, len(HONEST) + len(SYBILS), now)
    assert record is not None and _share(record.weights, SYBILS) > 0.5


def test_a_capped_burst_ages_by_the_weight_it_was_left_not_by_whole_rounds() -> None:
    """Counted whole, 5 Sybils merged (capped) beside 4 seniors were senior after young_rounds merges and then
    held whole merges (seen live: benchmarks/poisoning.py sybil_late); credited with the fraction of weight the cap
    left them, they are still young after the same merges."""
    policy = Seniority(SeniorityConfig(young_rounds=16, young_weight_cap=0.25, probation=NO_RAMP))
    _senior(policy, HONEST)
    raw = {**{p: 1.0 for p in HONEST}, **{p: 1.0 for p in SYBILS}}
    for step in range(16):
        capped = policy.cap(raw, now=float(step))
        assert _share(capped.weights, SYBILS) == pytest.approx(0.25)
        policy.observe_merge(list(raw), float(step), capped.credit)
    assert all(policy.is_young(p, 16.0) for p in SYBILS)
    assert policy.rounds(SYBILS[0], 16.0) == pytest.approx(16 * 4 / 15)  # f = cap S / ((1 - cap) Y) = 4/15
    # control: counted whole (no credit), the same merges make them senior, and the next merge is theirs
    whole = Seniority(SeniorityConfig(young_rounds=16, young_weight_cap=0.25, probation=NO_RAMP))
    _senior(whole, HONEST)
    for step in range(16):
        whole.observe_merge(list(raw), float(step))
    assert _share(whole.cap(raw, now=16.0).weights, SYBILS) > 0.5
