"""Evidence of work (issue 18, node.diloco.evidence): a contribution's merge weight scaled by its held-out slope
relative to recent full-weight ones. The pure rules first, then through SyncerCore with a real small model: noise
at an honest norm earns (nearly) no weight once the reference is warm while honest learners keep theirs (the
false-positive control), and with the weighting off the same noise holds its share (the negative control). The probation ramp
(test_probation.py) is off in the merges whose weights and steps are measured: they are the evidence's alone."""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Iterable

import pytest
import torch

from node.diloco.evidence import (
    NO_EVIDENCE,
    EvidenceConfig,
    EvidenceWeight,
    SustainedEvidence,
    ZeroStreak,
    ZeroStreaks,
)
from node.diloco.learner_ledger import LearnerLedger
from node.diloco.loss_probe import LossScore
from node.diloco.merge import MergeResult
from node.diloco.screening import ContributionScreen, ScreeningConfig
from node.diloco.syncer_core import MergeRecord
from tests.unit.test_loss_probe import Harness, Tensors, trained
from tests.unit.test_probation import no_ramp

pytestmark = pytest.mark.timeout(60)


def warm(weight: EvidenceWeight, slopes: list[float], fragment: int = 0) -> None:
    """Each slope the only full-weight one of a merge of its own (the reference keeps one value per merge)."""
    for slope in slopes:
        weight.commit(fragment, [slope])


def test_the_factor_is_one_in_warm_up_and_for_an_unscored_contribution() -> None:
    weight = EvidenceWeight(EvidenceConfig(min_history=4))
    assert weight.factor(0, -1.0) == 1.0  # no reference yet: nothing to judge by
    warm(weight, [1.0, 1.0, 1.0])
    assert weight.reference(0) is None and weight.factor(0, 0.0) == 1.0
    warm(weight, [1.0])
    assert weight.reference(0) == 1.0
    assert weight.factor(0, None) == 1.0 and weight.factor(0, math.nan) == 1.0  # not measured
    assert weight.factor(1, 0.0) == 1.0  # another fragment has its own reference


def test_the_factor_ramps_from_zero_to_one_between_the_fractions_of_the_reference() -> None:
    weight = EvidenceWeight(EvidenceConfig(zero_fraction=0.1, full_fraction=0.3, min_history=4))
    warm(weight, [2.0, 2.0, 4.0, 6.0])  # lower median 2.0: zero at or below 0.2, full at or above 0.6
    assert weight.factor(0, -0.5) == 0.0 and weight.factor(0, 0.0) == 0.0 and weight.factor(0, 0.2) == 0.0
    assert weight.factor(0, 0.4) == pytest.approx(0.5)
    assert weight.factor(0, 0.6) == 1.0 and weight.factor(0, 10.0) == 1.0
    assert weight.factors(0, {"a": 0.0, "b": 0.4, "c": 1.0}, {}) == {
        "a": 0.0,
        "b": pytest.approx(0.5),
        "c": 1.0,
    }
    assert weight.status() == {"scaled": 2, "zeroed": 1, "scaled_steps": 0, "zero_streaks": 0, "gated": 0}


def test_the_cosine_can_only_raise_the_factor_of_a_scored_contribution() -> None:
    # the rule before the public-direction one (`cosine_needs_slope` off): the cosine alone could raise from 0
    weight = EvidenceWeight(
        EvidenceConfig(zero_fraction=0.1, full_fraction=0.3, min_history=2, cosine_needs_slope=False)
    )
    for _ in range(2):
        weight.commit(0, [1.0, 1.0], [0.5, 0.5])  # reference slope 1.0, reference cosine 0.5
    assert weight.reference(0, cosine=True) == 0.5
    assert weight.factor(0, 0.0, 0.5) == 1.0  # little descent seen, but it agrees with the merged direction
    assert weight.factor(0, 0.0, 0.1) == pytest.approx(0.5)  # cosine 0.1: half way from 0.05 to 0.15
    assert weight.factor(0, 0.0, 0.0) == 0.0 and weight.factor(0, 0.0, None) == 0.0  # noise: neither
    assert weight.factor(0, 1.0, -0.54) == 1.0  # a disagreeing direction never lowers it (stage replicas)
    assert weight.factor(0, None, 0.0) == 1.0  # not scored: the cosine alone does not judge


def test_only_positive_finite_slopes_set_the_reference_and_the_window_is_bounded() -> None:
    weight = EvidenceWeight(EvidenceConfig(history=4, min_history=2))
    warm(weight, [-5.0, 0.0, math.inf, math.nan, 1.0])  # ascent, flat and broken slopes never lower it
    assert weight.reference(0) is None and weight.reference(0, cosine=True) is None
    warm(weight, [3.0])
    assert weight.reference(0) == 1.0
    warm(weight, [5.0, 5.0, 5.0, 5.0])  # the oldest go: the reference follows the recent slopes
    assert weight.reference(0) == 5.0


class PerContribution(EvidenceWeight):
    """The reference as it was: every full-weight slope its own value of the window (the negative control)."""

    def commit(self, fragment: int, slopes: Iterable[float], cosines: Iterable[float] = ()) -> None:
        for into, values in ((self._slopes, slopes), (self._cosines, cosines)):
            window = into.setdefault(fragment, deque(maxlen=self.config.history))
            window.extend(v for v in values if math.isfinite(v) and v > 0)


# the `clean` arm's embedding fragment (benchmarks/poisoning.py, 2026-12-07): its first round, 4 learners from the
# untrained model, then the slopes of its next rounds' honest contributions (each merge's, ~10x lower)
FIRST_ROUND = [0.392, 0.237, 0.233, 0.383]
LATER = [[0.030, 0.020], [0.026, 0.021, 0.040, 0.020], [0.030, 0.031, 0.023, 0.025], [0.020, 0.024, 0.028]]


def later_factors(weight: EvidenceWeight) -> list[float]:
    """The factors of `LATER`'s contributions, each round committed (at full weight when it earned 1) after it."""
    weight.commit(0, FIRST_ROUND)
    out = []
    for slopes in LATER:
        factors = [weight.factor(0, s) for s in slopes]
        weight.commit(0, [s for s, f in zip(slopes, factors, strict=True) if f >= 1.0])
        out.extend(factors)
    return out


def test_a_first_round_from_the_untrained_model_does_not_set_the_reference_alone() -> None:
    factors = later_factors(EvidenceWeight())
    assert all(f == 1.0 for f in factors), factors
    assert EvidenceWeight().config.min_history == 4  # a round of 4 learners filled the warm-up before


def test_negative_control_per_contribution_the_first_round_zeroes_every_later_honest_one() -> None:
    # the reference was 0.237, the lower median of the first round: 0.0237 and below earn nothing, and since
    # only full-weight slopes move it, it never came down (the live arm's fragment merged nothing for 6 rounds)
    weight = PerContribution()
    factors = later_factors(weight)
    assert sum(f == 0.0 for f in factors) >= 5 and max(factors) < 0.5, factors  # none at full weight
    assert sum(factors) / len(factors) < 0.1 and weight.reference(0) == 0.237  # so the reference stays


def test_off_the_factor_is_always_one() -> None:
    weight = EvidenceWeight(EvidenceConfig(enabled=False, min_history=1))
    warm(weight, [1.0])
    assert weight.factor(0, -1.0) == 1.0
    assert ScreeningConfig(enabled=False).evidence().enabled is False  # the whole screening off: off too
    assert ScreeningConfig(evidence_weighting=False).evidence().enabled is False


@pytest.mark.parametrize("zero,full", [(0.3, 0.3), (-0.1, 0.3), (0.1, math.inf)])
def test_bad_fractions_are_refused(zero: float, full: float) -> None:
    with pytest.raises(ValueError):
        ScreeningConfig(evidence_zero_fraction=zero, evidence_full_fraction=full)


def test_the_slope_is_the_descent_per_unit_norm_of_the_delta() -> None:
    score = LossScore(before=3.0, after=2.9, cost_s=0.0, opposite=3.1, norm=0.5)
    assert score.slope == pytest.approx(0.2 / (2 * 0.5))
    assert LossScore(before=3.0, after=2.9, cost_s=0.0, opposite=3.1).slope is None  # no norm measured
    assert LossScore(before=3.0, after=2.9, cost_s=0.0, norm=0.5).slope is None  # no reverse measured


def noise(h: Harness, honest: Tensors, seed: int) -> Tensors:
    """base - gaussian noise at the norm of `honest`'s delta (the benchmark's `noise` attacker)."""
    base = h.c.fragment_tensors(0)
    gen = torch.Generator().manual_seed(seed)
    norm = math.sqrt(sum(float((base[n] - t).double().pow(2).sum()) for n, t in honest.items()))
    draws = {n: torch.randn(t.shape, generator=gen) for n, t in honest.items()}
    total = math.sqrt(sum(float(d.double().pow(2).sum()) for d in draws.values()))
    return {n: base[n] - d * (norm / total) for n, d in draws.items()}


def noise_shares(screening: ScreeningConfig, rounds: int = 7) -> list[tuple[float, float]]:
    """Per round: (the noise learner's merge weight, the smallest honest one's over their even share of the
    rest), three honest learners and one pushing noise at their norm."""
    h = Harness(no_ramp(screening))
    shares = []
    for r in range(rounds):
        honest = {f"honest{i}": trained(h.c, seed=10 * r + i) for i in range(3)}
        for peer, params in honest.items():
            h.push(peer, params)
        h.push("noise", noise(h, honest["honest0"], seed=r))
        record = h.c.merge_now(0, 4, h.now)
        assert record is not None
        rest = 1.0 - record.weights.get("noise", 0.0)
        shares.append((record.weights.get("noise", 0.0), min(record.weights[p] for p in honest) / (rest / 3)))
    return shares


def test_noise_at_an_honest_norm_earns_no_weight_once_warm_and_honest_learners_keep_theirs() -> None:
    shares = noise_shares(ScreeningConfig())
    # warm-up: the reference needs 4 merges with a positive full-weight slope (everyone at factor 1 until then)
    assert all(noise_share < 0.05 for noise_share, _ in shares[4:]), shares
    # each honest learner keeps its share of the rest
    assert all(honest > 0.9 for _, honest in shares), shares


def test_negative_control_with_the_weighting_off_the_noise_holds_its_share() -> None:
    shares = noise_shares(ScreeningConfig(evidence_weighting=False))
    assert all(noise_share > 0.2 for noise_share, _ in shares), shares  # an even share of 4 is 0.25


def test_the_step_scale_is_the_largest_factor_among_the_weighted_peers() -> None:
    weight = EvidenceWeight(EvidenceConfig(min_history=1))
    assert weight.step_scale({"a": 0.2}, {"a": 5.0}) == 0.2  # alone: its own factor
    assert weight.step_scale({"a": 0.2, "b": 0.6}, {"a": 1.0, "b": 1.0}) == 0.6
    assert weight.step_scale({"a": 0.2}, {"a": 1.0, "b": 1.0}) == 1.0  # b not scored: factor 1, a full step
    assert weight.step_scale({"a": 0.2, "b": 0.9}, {"a": 1.0, "b": 0.0}) == 0.2  # no weight: not in the round
    assert weight.step_scale({"a": 0.0}, {"a": 1.0}) == 0.0  # nothing merges (NothingToMerge), not counted
    assert weight.status()["scaled_steps"] == 3
    off = EvidenceWeight(EvidenceConfig(scales_step=False))
    assert off.step_scale({"a": 0.2}, {"a": 1.0}) == 1.0 and off.status()["scaled_steps"] == 0
    assert ScreeningConfig(evidence_scales_step=False).evidence().scales_step is False


def low_evidence(h: Harness, seed: int, honest_part: float = 0.1) -> Tensors:
    """`honest_part` x an honest delta plus noise at the honest delta's norm: a little descent, mostly noise."""
    base = h.c.fragment_tensors(0)
    honest = trained(h.c, seed=seed)
    drawn = noise(h, honest, seed=seed)
    return {n: base[n] - (honest_part * (base[n] - honest[n]) + (base[n] - drawn[n])) for n in honest}


def lone_round(
    scales_step: bool, last: Callable[[Harness], Tensors], young_rounds: int = 16
) -> tuple[MergeRecord, float]:
    """Six honest rounds at K = 1 (the reference is warm), then a round of `last` alone: its record and how far it
    moved the fragment (outer momentum 0: the move is outer_lr x the outer gradient)."""
    h = Harness(no_ramp(ScreeningConfig(evidence_scales_step=scales_step, young_rounds=young_rounds)))
    for seed in range(6):
        h.push("honest", trained(h.c, seed=seed))
        assert h.c.merge_now(0, 1, h.now) is not None
    before = h.c.fragment_tensors(0)
    h.push("lone", last(h))
    record = h.c.merge_now(0, 1, h.now)
    assert record is not None
    after = h.c.fragment_tensors(0)
    return record, math.sqrt(sum(float((after[n] - before[n]).double().pow(2).sum()) for n in before))


def test_a_lone_low_evidence_contribution_at_k1_moves_the_model_by_at_most_its_factor() -> None:
    record, moved = lone_round(True, lambda h: low_evidence(h, seed=50))
    factor = record.evidence["lone"][2]
    assert factor is not None and 0.0 < factor < 0.5, record.evidence  # low, but not 0 (0 merges nothing)
    # (the event rounds factors to 4 digits, the step scale to 6)
    assert record.step_scale == pytest.approx(factor, abs=1e-4)
    assert record.weights["lone"] == pytest.approx(record.step_scale, abs=1e-6)
    # negative control: without the step scale the same contribution keeps the whole merge, a full step
    control, full = lone_round(False, lambda h: low_evidence(h, seed=50))
    assert (
        control.evidence["lone"][2] == factor and control.weights["lone"] == 1.0 and control.step_scale == 1.0
    )
    assert moved <= (factor + 1e-4) * full and full > 0.5, (moved, full)


def test_a_round_at_full_evidence_is_unchanged_bit_for_bit() -> None:
    def take(scales_step: bool) -> tuple[MergeRecord, dict[str, torch.Tensor]]:
        h = Harness(no_ramp(ScreeningConfig(evidence_scales_step=scales_step)))
        for seed in range(6):
            h.push("honest", trained(h.c, seed=seed))
            h.c.merge_now(0, 1, h.now)
        h.push("honest", trained(h.c, seed=60))  # K = 2: one at full evidence, one low
        h.push("low", low_evidence(h, seed=61, honest_part=0.2))
        record = h.c.merge_now(0, 2, h.now)
        assert record is not None
        return record, h.c.fragment_tensors(0)

    (on, after_on), (off, after_off) = take(True), take(False)
    assert on.evidence["honest"][2] == 1.0 and 0.0 < (on.evidence["low"][2] or 0.0) < 1.0, on.evidence
    assert on.step_scale == 1.0 and on.weights == off.weights
    assert all(torch.equal(after_on[n], after_off[n]) for n in after_on)


def test_a_run_of_zero_factors_is_one_streak_and_any_evidence_ends_it() -> None:
    streaks = ZeroStreaks(3)
    assert streaks.observe("a", 0.0, -0.1, None) is None and streaks.observe("a", 0.0, 0.01, 0.02) is None
    assert streaks.observe("a", 0.4, 0.5, None) is None  # some evidence: the run starts over
    assert [streaks.observe("a", 0.0, 0.0, None) for _ in range(2)] == [None, None]
    done = streaks.observe("a", 0.0, -0.2, 0.03)
    assert done is not None and done.peer == "a" and done.slopes == (0.0, 0.0, -0.2)
    assert done.scores() == {"slope_0": 0.0, "slope_1": 0.0, "slope_2": -0.2, "cosine_2": 0.03}
    assert streaks.observe("a", 0.0, 0.0, None) is None  # reported once: the next run starts from 0
    off = ZeroStreaks(0)
    assert all(off.observe("a", 0.0, 0.0, None) is None for _ in range(10))
    with pytest.raises(ValueError):
        ScreeningConfig(evidence_zero_violation_after=-1)


def lone_noise_streaks(screening: ScreeningConfig, rounds: int = 10) -> tuple[list[ZeroStreak], int]:
    """Six honest rounds at K = 1, then `rounds` of noise at an honest norm alone, then six honest ones again:
    the streaks the merges reported, and the honest peer's among them."""
    h = Harness(screening)
    for seed in range(6):
        h.push("honest", trained(h.c, seed=seed))
        h.c.merge_now(0, 1, h.now)
    for r in range(rounds):
        h.push("noise", noise(h, trained(h.c, seed=100 + r), seed=r))
        h.c.merge_now(0, 1, h.now)  # None when its factor is 0 (alone, nothing to merge)
    for seed in range(4):
        h.push("honest", trained(h.c, seed=200 + seed))
        h.c.merge_now(0, 1, h.now)
    streaks = h.c.take_zero_streaks()
    return streaks, sum(1 for s in streaks if s.peer == "honest")


def test_noise_alone_earns_ledger_violations_that_ban_and_honest_work_none() -> None:
    streaks, honest = lone_noise_streaks(ScreeningConfig(evidence_zero_violation_after=5))
    assert honest == 0 and len(streaks) >= 2, streaks  # 10 zeroed in a row: 2 runs of 5
    assert all(len(s.slopes) == 5 and s.digest for s in streaks)
    ledger = LearnerLedger(ban_after=2.0, forgive_half_life_s=600.0, ban_s=60.0)
    bans = [ledger.no_evidence(s, 1.0) for s in streaks]
    assert any(b is not None and b.offender == "noise" for b in bans)
    assert ledger.status(1.0)["noise"]["refused_by_tag"] == {NO_EVIDENCE: len(streaks)}
    assert "slope_4" in ledger.status(1.0)["noise"]["evidence"][-1]  # the run's slopes are the evidence
    assert ledger.banned("noise", 2.0) is not None and ledger.banned("honest", 2.0) is None


def test_negative_control_with_the_streak_off_noise_earns_no_violation() -> None:
    assert lone_noise_streaks(ScreeningConfig(evidence_zero_violation_after=0)) == ([], 0)


def test_the_step_scale_multiplies_the_seniority_caps_young_only_scale() -> None:
    # young_rounds 2: the honest learner is senior after its 6 rounds, "lone" is young and alone in its round
    record, _ = lone_round(True, lambda h: low_evidence(h, seed=50), young_rounds=2)
    factor = record.evidence["lone"][2]
    assert factor is not None and 0.0 < factor < 0.5, record.evidence
    assert record.step_scale == pytest.approx(0.25 * factor, abs=1e-4)  # young_weight_cap x the factor
    assert record.weights["lone"] == pytest.approx(record.step_scale, abs=1e-6)


def test_a_scaled_step_moves_the_recent_direction_by_its_scale_and_a_full_one_as_before() -> None:
    def direction_after(step_scale: float) -> torch.Tensor:
        screen = ContributionScreen(ScreeningConfig(direction_decay=0.5))
        for grad, scale in ((torch.tensor([1.0, 0.0]), 1.0), (torch.tensor([0.0, 3.0]), step_scale)):
            result = MergeResult(
                outer_grad={"w": grad * scale},
                weights={"a": scale},
                clipped={},
                fallback_tensors=(),
                rejected={},
                delta_norms={"a": 1.0},
                reason="",
            )
            screen.commit(0, screen.prepare_commit(0, result, step_scale=scale))
        direction = screen.direction(0)
        assert direction is not None
        return direction["w"]

    # decay 0.5: the first merge leaves [0.5, 0]; a full second one [0.25, 0.5] (the unit step's half)
    assert torch.equal(direction_after(1.0), torch.tensor([0.25, 0.5]))
    # scaled to 0.2, the second merge has 0.2 of that share: [0.5 x 0.9, 0.1]
    assert torch.allclose(direction_after(0.2), torch.tensor([0.45, 0.1]))


def test_the_sustained_gate_is_the_lower_median_of_a_peers_recent_judged_factors() -> None:
    gate = SustainedEvidence(4, max_peers=2)
    # this factor included; of two, the lower; of three, the middle one
    assert [gate.observe("a", f) for f in (1.0, 0.0, 1.0, 1.0)] == [1.0, 0.0, 1.0, 1.0]
    assert gate.observe("a", 0.0) == 0.0  # the window holds the last 4: (0, 1, 1, 0), half of them 0
    assert gate.observe("a", 1.0) == 1.0  # (1, 1, 0, 1): the first 1.0 left it
    assert SustainedEvidence(0).observe("a", 0.0) == 1.0  # off: no gate
    gate.observe("b", 0.5)
    gate.observe("c", 0.5)  # bounded: "a", the least recently scored, goes
    assert gate.observe("a", 1.0) == 1.0  # a fresh window


# A noise peer at an honest norm as the live `noise_k1` arm saw it: most scores under the zero fraction of the
# reference, one in three lucky (21 of 67 there: its small held-out batch, and the embedding fragment's reference
# that its own warm-up slopes pulled down). An honest peer: one score in ten misjudged to nothing.
NOISE_SLOPES = [0.01, -0.02, 0.5, 0.03, -0.01, 0.2] * 6  # reference 1.0: factors 0, 0, 1, 0, 0, 0.5
HONEST_SLOPES = [0.8, 1.2, 0.6, 0.9, 1.1, 0.7, 1.0, 0.5, 1.3, -0.05] * 4


def scored(weight: EvidenceWeight, slopes: dict[str, list[float]]) -> dict[str, list[float]]:
    """Each peer's slopes, one merge each in turn (fragment 0, reference 1.0, no cosine): the factors it earned,
    its zero streaks going to `take_streaks`."""
    warm(weight, [1.0] * 4)
    out: dict[str, list[float]] = {peer: [] for peer in slopes}
    for i in range(max(map(len, slopes.values()))):
        for peer, values in slopes.items():
            if i < len(values):
                f = weight.factors(0, {peer: values[i]}, {})
                weight.observe_streaks(f, {peer: values[i]}, {}, lambda p: f"digest-{p}")
                out[peer].append(f[peer])
    return out


def test_noise_with_lucky_scores_keeps_no_weight_and_honest_work_keeps_its_own() -> None:
    on = scored(
        EvidenceWeight(EvidenceConfig(min_history=4)), {"noise": NOISE_SLOPES, "honest": HONEST_SLOPES}
    )
    assert on["noise"][:3] == [0.0, 0.0, 0.0] and sum(on["noise"]) == 0.0  # its lucky third included
    expected = [0.0 if s <= 0.1 else min(1.0, (s - 0.1) / 0.2) for s in HONEST_SLOPES]
    assert on["honest"] == pytest.approx(expected)  # the gate never lowered an honest score (one in ten zero)


def test_negative_control_without_the_gate_noise_keeps_weight_in_its_lucky_scores() -> None:
    off = scored(EvidenceWeight(EvidenceConfig(min_history=4, sustained=0)), {"noise": NOISE_SLOPES})
    assert sum(off["noise"]) == pytest.approx(6 * 1.5)  # 1 + 0.5 in every six: a quarter of a full weight


def test_with_the_gate_lucky_noise_completes_zero_streaks_that_ban() -> None:
    def streaks(sustained: int) -> list[ZeroStreak]:
        weight = EvidenceWeight(EvidenceConfig(min_history=4, zero_streak=10, sustained=sustained))
        scored(weight, {"noise": NOISE_SLOPES, "honest": HONEST_SLOPES})
        return weight.take_streaks()

    found = streaks(16)
    assert [s.peer for s in found] == ["noise"] * 3 and found[0].digest == "digest-noise"
    assert 0.5 in found[0].slopes  # a lucky score no longer ends the run
    ledger = LearnerLedger(ban_after=3.0, forgive_half_life_s=600.0, ban_s=60.0)
    bans = [ledger.no_evidence(s, 1.0) for s in found]
    assert bans[-1] is not None and bans[-1].offender == "noise"
    assert streaks(0) == []  # negative control: one lucky score in every three ends each run, never 10


def k1_warm_up(window: int) -> tuple[list[float], list[float], float | None]:
    """K = 1 from a fresh model: an honest learner (slopes 0.40 falling 15 % a merge, as the benchmark's first
    merges) and a noise attacker (slopes +-0.0005), alternating, each alone in its merge; a merge at factor 1 commits
    its slope. The honest factors, the noise's, and the reference after 12 merges."""
    weight = EvidenceWeight(EvidenceConfig(min_history=4, warmup_window=window))
    honest, noise = [], []
    for i in range(12):
        peer, slope = ("honest", 0.40 * 0.85**i) if i % 2 else ("noise", 0.0005 * (-1) ** (i // 2))
        factor = weight.factors(0, {peer: slope}, {})[peer]
        (honest if peer == "honest" else noise).append(factor)
        weight.commit(0, [slope] if factor >= 1.0 else [])
    return honest, noise, weight.reference(0)


def test_warm_up_probation_gives_noise_no_whole_merges_before_the_reference() -> None:
    """The K = 1 warm-up (docs/security.md): before a fragment has a reference, noise's contributions are judged
    against the largest recent slope; honest work keeps factor 1 and the warm-up ends after its 4 merges."""
    honest, noise, on_reference = k1_warm_up(window=4)
    assert (
        noise[0] == 1.0
    )  # the very first contribution has nothing to compare with (its slope is the largest)
    assert noise[1:] == [0.0] * 5
    assert honest == [1.0] * 6
    assert on_reference is not None and on_reference > 0.1  # honest slopes set it (4 full-weight merges)
    # negative control, off: every warm-up merge is whole, noise's included (3 of them: its positive slopes then
    # enter the reference too, and pull it down)
    honest, noise, off_reference = k1_warm_up(window=0)
    assert noise[:3] == [1.0, 1.0, 1.0] and honest == [1.0] * 6
    assert off_reference is not None and off_reference < on_reference


def test_warm_up_probation_needs_a_positive_slope_first() -> None:
    weight = EvidenceWeight(EvidenceConfig(min_history=4, warmup_window=4))
    assert weight.factors(0, {"noise": -0.001}, {}) == {"noise": 0.0}  # an ascent first: nothing to earn
    assert weight.factors(0, {"a": None}, {}) == {"a": 1.0}  # type: ignore[dict-item]  # not scored
    assert weight.sustained.observe("honest", 1.0) == 1.0  # warm-up scores entered no window
