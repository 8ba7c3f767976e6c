"""Evidence of work (issue 18, node.diloco.evidence): a contribution's merge weight scaled by its held-out slope
relative to recent full-weight ones. The pure rules first, then through SyncerCore with a real small model: noise
at an honest norm earns (nearly) no weight once the reference is warm while honest learners keep theirs (the
false-positive control), and with the weighting off the same noise holds its share (the negative control)."""

from __future__ import annotations

import math

import pytest
import torch

from node.diloco.evidence import EvidenceConfig, EvidenceWeight
from node.diloco.loss_probe import LossScore
from node.diloco.screening import ScreeningConfig
from tests.unit.test_loss_probe import Harness, Tensors, trained

pytestmark = pytest.mark.timeout(60)


def warm(weight: EvidenceWeight, slopes: list[float], fragment: int = 0) -> None:
    weight.commit(fragment, slopes)


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
    assert weight.status() == {"scaled": 2, "zeroed": 1}


def test_the_cosine_can_only_raise_the_factor_of_a_scored_contribution() -> None:
    weight = EvidenceWeight(EvidenceConfig(zero_fraction=0.1, full_fraction=0.3, min_history=2))
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


def noise_shares(screening: ScreeningConfig, rounds: int = 6) -> list[tuple[float, float]]:
    """Per round: (the noise learner's merge weight, the smallest honest one's over their even share of the
    rest), three honest learners and one pushing noise at their norm."""
    h = Harness(screening)
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
    # warm-up: the reference needs 4 positive slopes (the honest learners' 3 a round, the noise's when positive)
    assert all(noise_share < 0.05 for noise_share, _ in shares[2:]), shares
    # each honest learner keeps its share of the rest
    assert all(honest > 0.9 for _, honest in shares), shares


def test_negative_control_with_the_weighting_off_the_noise_holds_its_share() -> None:
    shares = noise_shares(ScreeningConfig(evidence_weighting=False))
    assert all(noise_share > 0.2 for noise_share, _ in shares), shares  # an even share of 4 is 0.25
