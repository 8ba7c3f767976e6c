"""Spot checks: sampling rates, fp32-tolerant comparison, and the two-against-one adjudication."""

from __future__ import annotations

import random

import pytest
import torch

from verification.spotcheck import SpotCheckConfig, SpotCheckPolicy, compare_outputs


def stage(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 64))


def test_rates_by_peer_state() -> None:
    policy = SpotCheckPolicy()
    cfg = policy.config
    assert policy.rate(microbatches_seen=1000, recent_flags=0, quarantined=False)[0] == cfg.base_rate
    assert policy.rate(microbatches_seen=3, recent_flags=0, quarantined=False)[0] == cfg.new_peer_rate
    assert policy.rate(microbatches_seen=1000, recent_flags=1, quarantined=False)[0] == cfg.flagged_rate
    rate, why = policy.rate(microbatches_seen=1000, recent_flags=1, quarantined=True)
    assert rate == cfg.quarantined_rate and why == "quarantined"


def test_draws_are_seeded_and_match_the_rate() -> None:
    policy = SpotCheckPolicy()

    def draws(seed: int) -> list[bool]:
        rng = random.Random(seed)
        return [
            policy.should_check(rng, microbatches_seen=1000, recent_flags=0, quarantined=False).check
            for _ in range(20_000)
        ]

    assert draws(1) == draws(1)
    assert abs(sum(draws(2)) / 20_000 - policy.config.base_rate) < 0.005


def test_cpu_fp32_recomputation_matches_within_the_floor_tolerance() -> None:
    # Same weights, different batch composition and thread count: reduction order changes, the
    # elements wobble, and the norm-wise comparison still matches at rtol 1e-4.
    model = stage()
    x = torch.randn(16, 32, 64)
    threads = torch.get_num_threads()
    with torch.no_grad():
        full = model(x)
        torch.set_num_threads(1)
        try:
            alone = torch.cat([model(x[i : i + 1]) for i in range(16)])
        finally:
            torch.set_num_threads(threads)
    result = compare_outputs(alone, full, rtol=SpotCheckConfig().rtol, atol=0.0)
    assert result.match and result.rel_diff < 1e-5


def test_compare_outputs_rejects_corrupted_or_malformed_tensors() -> None:
    a = torch.randn(4, 8, 16)
    assert compare_outputs(a, a.clone(), 1e-4, 0.0) == compare_outputs(a, a, 1e-4, 0.0)
    assert compare_outputs(a, a, 1e-4, 0.0).rel_diff == 0.0
    noisy = compare_outputs(a + 0.1 * torch.randn_like(a), a, 1e-4, 0.0)
    assert not noisy.match and 0.05 < noisy.rel_diff < 0.2 and noisy.max_abs_diff > 0.1
    assert compare_outputs(-a, a, 1e-4, 0.0).rel_diff == pytest.approx(2.0)
    assert compare_outputs(torch.zeros_like(a), a, 1e-4, 0.0).rel_diff == pytest.approx(1.0)
    assert not compare_outputs(a[:2], a, 1.0, 1.0).match
    bad = a.clone()
    bad[0, 0, 0] = float("nan")
    assert not compare_outputs(bad, a, 1.0, 1.0).match
    assert compare_outputs(torch.zeros(3), torch.zeros(3), 0.0, 1e-6).match


def test_symmetric_rel_diff() -> None:
    a, b = torch.randn(100), torch.randn(100)
    assert compare_outputs(a, 10 * b, 0, 0).rel_diff == compare_outputs(10 * b, a, 0, 0).rel_diff


def honest_triplet(
    divergence: float, gen: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Three honest recomputations that differ like replicas whose weights drifted apart."""
    base = torch.randn(8, 16, 32, generator=gen)
    return tuple(base + divergence * torch.randn(base.shape, generator=gen) for _ in range(3))  # type: ignore[return-value]


def calibrate(policy: SpotCheckPolicy, gen: torch.Generator) -> None:
    """Feed the policy the honest matches its adaptive tolerance needs (replicas drifted by 0.05)."""
    for _ in range(policy.config.tolerance_samples):
        o, c, _ = honest_triplet(0.05, gen)
        policy.adjudicate(o, c)


def test_adjudication_two_against_one() -> None:
    policy = SpotCheckPolicy(SpotCheckConfig(adaptive_tolerance=False, rtol=0.05))
    gen = torch.Generator().manual_seed(0)
    o, c, t = honest_triplet(0.01, gen)
    assert policy.adjudicate(o, c).outcome == "match"
    first = policy.adjudicate(-o, c)
    assert first.outcome == "need_third" and not first.ban_grade
    verdict = policy.adjudicate(-o, c, t)
    assert verdict.outcome == "original_faulty" and verdict.ban_grade
    assert "odd one out" in verdict.reason
    assert verdict.culprit == "original"
    against_checker = policy.adjudicate(o, -c, t)
    assert against_checker.outcome == "checker_faulty" and against_checker.culprit == "checker"
    assert policy.adjudicate(o, -c, 3 * t).outcome == "inconclusive"  # nobody is the odd one out


def test_adaptive_tolerance_follows_honest_divergence_and_stays_capped() -> None:
    gen = torch.Generator().manual_seed(1)
    policy = SpotCheckPolicy()
    cfg = policy.config
    assert policy.tolerance == cfg.tolerance_max  # uncalibrated: convict only the blatant
    for _ in range(cfg.tolerance_samples):
        o, c, _ = honest_triplet(0.05, gen)
        assert policy.adjudicate(o, c).outcome == "match"
    # rel_diff of these honest pairs is ~0.07: tolerance = 5 x median
    assert 0.25 < policy.tolerance < 0.45
    o, c, t = honest_triplet(0.05, gen)
    noisy = policy.adjudicate(o + 0.5 * torch.randn(o.shape, generator=gen), c, t)
    assert noisy.culprit == "original"  # the odd one out at ~6 x the honest median: dropped, quarantined
    assert policy.adjudicate(-o, c, t).ban_grade  # and a blatant one is ban-grade
    # honest pairs at the new tolerance still match: no false conviction
    for _ in range(50):
        o, c, t = honest_triplet(0.05, gen)
        assert policy.adjudicate(o, c, t).culprit is None


def test_a_minority_of_borderline_matches_cannot_ratchet_the_tolerance() -> None:
    gen = torch.Generator().manual_seed(2)
    policy = SpotCheckPolicy()
    for i in range(300):
        o, c, _ = honest_triplet(0.05, gen)
        if i % 3 == 0:  # an attacker keeps sending tensors just inside the tolerance
            tol = policy.tolerance
            o = c + (o - c) * (0.95 * tol / float((o - c).norm() / c.norm()))
        policy.adjudicate(o, c)
    assert policy.tolerance < 0.45  # 5 x the honest ~0.07, not ratcheted towards the maximum 0.5


def test_no_conviction_before_the_tolerance_is_calibrated() -> None:
    # From scratch, one replica's first optimizer step moved its output far while two replicas that had
    # not stepped yet were identical: the odd one out, and honest. Until honest pairs calibrate the
    # tolerance, a third opinion concludes nothing (and its matching pairs count as samples).
    gen = torch.Generator().manual_seed(3)
    policy = SpotCheckPolicy()
    o, c, _ = honest_triplet(0.0, gen)
    ahead = o + 0.8 * torch.randn(o.shape, generator=gen)
    verdict = policy.adjudicate(ahead, c, c.clone())
    assert verdict.outcome == "inconclusive" and "not calibrated" in verdict.reason
    assert not policy.calibrated
    for _ in range(policy.config.tolerance_samples):
        o, c, _ = honest_triplet(0.05, gen)
        policy.adjudicate(o, c)
    assert policy.calibrated and policy.adjudicate(-o, c, c.clone()).culprit == "original"


def test_two_identical_replicas_are_one_opinion_when_replicas_drift() -> None:
    # Right after a merge (and measured right after a learning-rate change) two replicas that have not
    # stepped since are identical, and an honest replica that has stepped once is "the odd one out", by
    # 0.19-0.73 relative at lr x10. Its tensor is still the odd one (dropped, the replica quarantined), but
    # two copies of one version are one opinion: not ban-grade. Two distinct replicas still convict, and
    # replicas that never drift (always identical) keep the plain rule.
    gen = torch.Generator().manual_seed(6)
    policy = SpotCheckPolicy()
    calibrate(policy, gen)
    tol = policy.tolerance
    _, c, t = honest_triplet(0.05, gen)
    for ahead in (c + c.norm() * 4 * tol * _unit(gen, c), -c):  # steps ahead, or a blatant lie
        alone = policy.adjudicate(ahead, c, c.clone())
        assert alone.culprit == "original" and not alone.corroborated and not alone.ban_grade
        assert "one opinion" in alone.reason
        checker = policy.adjudicate(c.clone(), ahead, c)
        assert checker.culprit == "checker" and not checker.ban_grade
        distinct = policy.adjudicate(ahead, c, t)
        assert distinct.culprit == "original" and distinct.corroborated and distinct.ban_grade
    synced = SpotCheckPolicy()
    for _ in range(32):
        synced.adjudicate(c.clone(), c)
    verdict = synced.adjudicate(c + c.norm() * 0.01 * _unit(gen, c), c, c.clone())
    assert verdict.culprit == "original" and verdict.ban_grade


def test_an_odd_one_out_near_the_tolerance_is_a_marginal_conviction() -> None:
    # Measured in test_sentinel: an honest replica a few steps ahead of two others was the odd one out at
    # 1.2 x the tolerance, twice, and was banned. Within `ban_margin` tolerances a conviction is marginal
    # (the ledger needs more of them); beyond it, it is a full one. Negative control: margin 1.
    gen = torch.Generator().manual_seed(7)
    for margin, marginal_bans in ((1.5, False), (1.0, True)):
        policy = SpotCheckPolicy(SpotCheckConfig(ban_margin=margin))
        calibrate(policy, gen)
        tol = policy.tolerance
        _, c, t = honest_triplet(0.05, gen)
        near = policy.adjudicate(c + c.norm() * 1.3 * tol * _unit(gen, c), c, t)
        assert near.culprit == "original" and near.corroborated and near.marginal is not marginal_bans
        assert near.ban_grade is marginal_bans
        if not marginal_bans:
            assert "marginal" in near.reason
        far = policy.adjudicate(c + c.norm() * 4 * tol * _unit(gen, c), c, t)
        assert far.culprit == "original" and far.ban_grade


def test_convictions_while_no_two_replicas_agree_are_not_ban_grade() -> None:
    # CI, lr x8 on every replica: honest pairs spread to 5.5 tolerances, and an honest replica one step ahead
    # of two peers was the odd one out at 4 tolerances (4.2 x their distance), three times, and was banned.
    # A three-way check where no two replicas agree shows the calibrated tolerance no longer describes the
    # honest spread: for `turbulence_checks` checks a conviction drops the tensor but is not ban-grade.
    # Negative control: turbulence_checks=0 bans on the same checks.
    gen = torch.Generator().manual_seed(8)
    for window, guarded in ((8, True), (0, False)):
        policy = SpotCheckPolicy(SpotCheckConfig(turbulence_checks=window))
        calibrate(policy, gen)
        tol = policy.tolerance
        _, c, t = honest_triplet(0.05, gen)
        spread = [c + c.norm() * 3 * tol * _unit(gen, c) for _ in range(3)]
        verdict = policy.adjudicate(*spread)
        assert verdict.outcome == "inconclusive" and policy.turbulent is guarded
        ahead = c + c.norm() * 4 * tol * _unit(gen, c)
        convicted = policy.adjudicate(ahead, c, t)
        assert convicted.culprit == "original" and convicted.turbulent is guarded
        assert convicted.ban_grade is not guarded
        if guarded:
            assert not convicted.corroborated and "honest spread beyond the tolerance" in convicted.reason
            for _ in range(window - 1):  # checks that agree: the stage calms down
                o, c, t = honest_triplet(0.05, gen)
                policy.adjudicate(o, c)
            assert not policy.turbulent
            again = policy.adjudicate(c + c.norm() * 4 * tol * _unit(gen, c), c, t)
            assert again.culprit == "original" and again.ban_grade and not again.turbulent
            # the stage's other direction (the same replicas' weights) can say it is turbulent
            elsewhere = policy.adjudicate(ahead, c, t, turbulent_elsewhere=True)
            assert elsewhere.culprit == "original" and elsewhere.turbulent and not elsewhere.ban_grade


def test_a_checker_odd_one_out_is_a_marginal_conviction() -> None:
    # The checker recomputes on its current weights, the original answered on those stashed at its forward:
    # an honest checker that stepped since is the odd one out (15 of 20 honest convictions in the lr x8
    # runs). Its conviction is marginal however far it is (the ledger bans a persistent liar after more of
    # them); the original's, far from both others, stays a full one.
    gen = torch.Generator().manual_seed(9)
    policy = SpotCheckPolicy()
    calibrate(policy, gen)
    o, c, t = honest_triplet(0.05, gen)
    lying_checker = policy.adjudicate(o, -c, t)
    assert lying_checker.culprit == "checker" and lying_checker.corroborated and lying_checker.marginal
    assert not lying_checker.ban_grade and "checker's recomputation" in lying_checker.reason
    lying_original = policy.adjudicate(-o, c, t)
    assert lying_original.culprit == "original" and lying_original.ban_grade


def _unit(gen: torch.Generator, like: torch.Tensor) -> torch.Tensor:
    direction = torch.randn(like.shape, generator=gen)
    return direction / direction.norm()


def test_identical_pairs_do_not_shrink_the_tolerance_when_replicas_drift() -> None:
    # Right after a merge replicas that have not stepped are identical; those zeros must not drag the
    # median down (3 x the median convicted an honest replica one step ahead, measured from scratch).
    gen = torch.Generator().manual_seed(4)
    policy = SpotCheckPolicy()
    for i in range(64):
        o, c, _ = honest_triplet(0.05, gen)
        policy.adjudicate(c.clone() if i % 2 else o, c)  # half the pairs identical
    assert 0.25 < policy.tolerance < 0.45
    # replicas that are always identical keep the tight tolerance (clamped to rtol)
    synced = SpotCheckPolicy()
    for _ in range(32):
        _, c, _ = honest_triplet(0.05, gen)
        synced.adjudicate(c.clone(), c)
    assert synced.tolerance == synced.config.rtol


def test_clears_only_typical_honest_matches_and_flagged_tensors_are_always_checked() -> None:
    gen = torch.Generator().manual_seed(5)
    policy = SpotCheckPolicy()
    o, c, _ = honest_triplet(0.05, gen)
    assert not policy.clears(policy.adjudicate(o, c))  # nothing cleared before calibration
    for _ in range(32):
        o, c, _ = honest_triplet(0.05, gen)
        policy.adjudicate(o, c)
    o, c, _ = honest_triplet(0.05, gen)
    assert policy.clears(policy.adjudicate(o, c))
    scaled = policy.adjudicate(1.3 * c, c)  # within the tolerance (a match) but not a typical pair
    assert scaled.outcome == "match" and not policy.clears(scaled)
    rate, why = policy.rate(microbatches_seen=1000, recent_flags=0, quarantined=False, flagged_now=True)
    assert rate == policy.config.flagged_tensor_rate == 1.0 and "flagged" in why


@pytest.mark.parametrize(
    "kwargs",
    [
        {"base_rate": 1.5},
        {"rtol": -1.0},
        {"tolerance_factor": 0.5},
        {"tolerance_samples": 0},
        {"rtol": 0.9},
        {"flagged_tensor_rate": 2.0},
        {"clear_factor": 0.0},
        {"ban_margin": 0.5},
        {"turbulence_checks": -1},
    ],
)
def test_config_validation(kwargs: dict[str, object]) -> None:
    with pytest.raises(ValueError):
        SpotCheckConfig(**kwargs)  # type: ignore[arg-type]
