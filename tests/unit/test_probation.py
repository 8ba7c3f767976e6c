"""Probation (issue 18, Sybil resistance): a new identity's merge weight ramps up with its accepted merges
(node.diloco.probation), before the young group's cap (node.diloco.seniority), and a merge of fresh identities only
steps by the ramp's start fraction. The clock is passed in; no sockets."""

from __future__ import annotations

import dataclasses
import math

import pytest

from node.diloco.probation import ProbationConfig, ramp, ramp_weights
from node.diloco.screening import ScreeningConfig
from node.diloco.seniority import Seniority, SeniorityConfig
from node.diloco.syncer_core import SyncerCore
from tests.unit.test_syncer_core import core, push

pytestmark = pytest.mark.timeout(60)

HONEST = [f"honest{i}" for i in range(4)]
SYBILS = [f"sybil{i}" for i in range(5)]
NO_RAMP = ProbationConfig(merges=0)


def no_ramp(screening: ScreeningConfig) -> ScreeningConfig:
    """`screening` with the probation ramp off: for tests that measure another defence's weights alone."""
    return dataclasses.replace(screening, probation_merges=0)


def _share(weights: dict[str, float], peers: list[str]) -> float:
    return math.fsum(weights[p] for p in peers) / math.fsum(weights.values())


def test_the_ramp_is_linear_from_the_start_fraction_to_one_and_off_at_zero_merges() -> None:
    config = ProbationConfig(merges=8, start_fraction=0.25)
    assert ramp(config, 0) == 0.25
    assert ramp(config, 4) == pytest.approx(0.625)
    assert ramp(config, 8) == 1.0 and ramp(config, 100) == 1.0
    assert ramp(config, -1) == 0.25  # never below the start
    assert ramp(NO_RAMP, 0) == 1.0 and ramp(ProbationConfig(start_fraction=1.0), 0) == 1.0
    for bad in ({"merges": -1}, {"start_fraction": 0.0}, {"start_fraction": 1.5}):
        with pytest.raises(ValueError):
            ProbationConfig(**bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        ScreeningConfig(probation_start_fraction=0.0)


def test_identities_equally_new_keep_their_shares_and_only_the_step_is_scaled() -> None:
    """Normalised weights: a ramp that scales everyone alike changes nothing relative (a run's start); what it does
    change is the step, by the largest multiplier in the round."""
    ramped = ramp_weights({"a": 1.0, "b": 3.0}, lambda _peer: 0.0, ProbationConfig())
    assert _share(ramped.weights, ["a"]) == pytest.approx(0.25)  # as before the ramp
    assert ramped.step_scale == 0.25
    mixed = ramp_weights(
        {"a": 1.0, "b": 1.0, "idle": 0.0}, {"a": 8.0, "b": 0.0, "idle": 0.0}.__getitem__, ProbationConfig()
    )
    assert mixed.step_scale == 1.0 and mixed.multipliers == {"b": 0.25}  # the established one steps whole
    assert mixed.weights == {"a": 1.0, "b": 0.25, "idle": 0.0}


def test_a_burst_of_fresh_identities_against_established_ones_gets_little_weight_even_with_nobody_senior() -> (
    None
):
    """4 learners in 8 merges (established, not yet senior: the young cap has nothing to protect) and 5 fresh
    identities at the same token weight: the ramp holds the burst to 5 x 0.25 / (5 x 0.25 + 4) of the merge."""
    policy = Seniority(SeniorityConfig(young_rounds=16, young_weight_cap=0.25))
    for step in range(8):
        policy.observe_merge(HONEST, float(step))
    raw = {p: 1.0 for p in HONEST + SYBILS}
    capped = policy.cap(raw, now=8.0)
    assert _share(capped.weights, SYBILS) == pytest.approx(1.25 / 5.25)
    assert capped.grad_scale == 1.0  # the established learners step whole
    # each fresh one ages by its ramp, a quarter of a round, not a whole one
    assert capped.credit == {p: 0.25 for p in SYBILS}
    assert policy.status(8.0)["ramped_merges"] == 1


def test_negative_control_with_the_ramp_off_the_same_burst_holds_the_majority() -> None:
    policy = Seniority(SeniorityConfig(young_rounds=16, young_weight_cap=0.25, probation=NO_RAMP))
    for step in range(8):
        policy.observe_merge(HONEST, float(step))
    capped = policy.cap({p: 1.0 for p in HONEST + SYBILS}, now=8.0)
    assert _share(capped.weights, SYBILS) == pytest.approx(5 / 9)  # nobody senior: nothing capped
    assert capped.credit == {}


def test_against_seniors_the_ramp_and_the_cap_together_never_age_a_burst_faster_than_the_cap_alone() -> None:
    """Senior learners and a burst of 5: ramped below the cap, the burst's share is its ramp's; ramped above it, the
    cap holds it; either way each Sybil ages by at most the fraction the cap alone left it (4/15 of a round)."""
    ramped, alone = (
        Seniority(SeniorityConfig(young_rounds=16, young_weight_cap=0.25, probation=p))
        for p in (ProbationConfig(), NO_RAMP)
    )
    for policy in (ramped, alone):
        for step in range(16):
            policy.observe_merge(HONEST, float(step))
    raw = {p: 1.0 for p in HONEST + SYBILS}
    for step in range(16, 40):
        capped, control = ramped.cap(raw, now=float(step)), alone.cap(raw, now=float(step))
        assert _share(capped.weights, SYBILS) <= _share(control.weights, SYBILS) + 1e-9 <= 0.25 + 1e-9
        assert all(capped.credit[p] <= control.credit[p] + 1e-9 for p in SYBILS)
        ramped.observe_merge(list(raw), float(step), capped.credit)
        alone.observe_merge(list(raw), float(step), control.credit)
    assert ramped.rounds(SYBILS[0], 40.0) <= alone.rounds(SYBILS[0], 40.0)
    assert all(ramped.is_young(p, 40.0) for p in SYBILS)


def test_a_run_of_fresh_learners_starts_at_the_start_fraction_and_reaches_full_steps_after_the_ramp() -> None:
    """The honest start is slowed, not stalled: the first merge steps at 0.25, every merge ages its participants by
    a whole round (all equally new), so 4 learners at K = 4 step whole from their 9th merge."""
    policy = Seniority(SeniorityConfig(young_rounds=16))
    scales = []
    for step in range(10):
        capped = policy.cap({p: 1.0 for p in HONEST}, now=float(step))
        assert _share(capped.weights, HONEST[:1]) == pytest.approx(0.25)
        assert capped.credit == {}  # equally new: a whole round each
        scales.append(capped.grad_scale)
        policy.observe_merge(HONEST, float(step), capped.credit)
    assert scales[0] == 0.25 and all(a < b for a, b in zip(scales[:8], scales[1:9], strict=True))
    assert scales[8] == scales[9] == 1.0


def test_a_refusal_starts_the_ramp_over() -> None:
    policy = Seniority(SeniorityConfig(young_rounds=16))
    for step in range(8):
        policy.observe_merge(["a", "b"], float(step))
    policy.demote("a", now=8.0)
    capped = policy.cap({"a": 1.0, "b": 1.0}, now=8.0)
    assert capped.weights == {"a": 0.25, "b": 1.0}


def _established_and_burst(c: SyncerCore) -> float:
    """4 learners merge 8 rounds of fragment 0 at K = 4, then 5 fresh identities join a round of the same token
    weight: the burst's share of that merge."""
    now = 10.0
    for _ in range(8):
        for peer in HONEST:
            push(c, peer, 0, now=now, base=c.versions[0], nonce=f"{peer}{now}".encode())
        assert c.merge_now(0, len(HONEST), now) is not None
        now += 10.0
    for peer in HONEST + SYBILS:
        push(c, peer, 0, now=now, base=c.versions[0], nonce=f"{peer}{now}".encode())
    record = c.merge_now(0, len(HONEST) + len(SYBILS), now)
    assert record is not None
    return _share(record.weights, SYBILS)


def test_the_syncer_core_ramps_a_fresh_burst_before_anyone_is_senior() -> None:
    screening = ScreeningConfig(loss_probe=False, copy_tolerance=0.0, trim_fraction=0.0)
    share = _established_and_burst(core(screening=screening, clip_factor=None))
    assert share == pytest.approx(1.25 / 5.25, rel=0.05)  # the same token weights: the ramp alone sets it


def test_negative_control_the_syncer_core_without_the_ramp_lets_the_burst_hold_the_majority() -> None:
    screening = ScreeningConfig(loss_probe=False, copy_tolerance=0.0, trim_fraction=0.0, probation_merges=0)
    share = _established_and_burst(core(screening=screening, clip_factor=None))
    assert share == pytest.approx(5 / 9, rel=0.05)  # nobody is senior at 8 merges: the young cap caps nothing


def test_a_lone_fresh_identity_at_a_runs_start_moves_the_model_by_the_start_fraction_of_a_step() -> None:
    """K = 1, the run's first merge: the lone contribution's step is scaled by the start fraction (outer momentum
    0.9 starts from nothing, so the move is outer_lr x the scaled gradient); control: the ramp off, a whole step."""

    def first_move(screening: ScreeningConfig) -> float:
        c = core(screening=screening, clip_factor=None)
        before = c.fragment_tensors(0)
        params = {n: t + 0.01 for n, t in before.items()}
        push(c, "fresh", 0, params=params)
        record = c.merge_now(0, 1, 10.0)
        assert record is not None
        after = c.fragment_tensors(0)
        return math.sqrt(sum(float((after[n] - before[n]).double().pow(2).sum()) for n in before))

    screening = ScreeningConfig(loss_probe=False, copy_tolerance=0.0)
    ramped, whole = first_move(screening), first_move(no_ramp(screening))
    assert whole > 0 and ramped == pytest.approx(0.25 * whole, rel=1e-4)
