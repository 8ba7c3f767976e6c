"""The paired multi-seed codec benchmark's arithmetic: seeds parsed, gaps summarized with a one-sided t bound, and
the goal met only when that bound (not the mean) is within 1 %."""

from __future__ import annotations

import math

import pytest

from benchmarks.codec_seeds import NOISE_LABEL, headline, parse_seeds, seed_arms, summarize
from benchmarks.codec_sweep import parse_variant


def test_seeds_parse_ranges_and_lists() -> None:
    assert parse_seeds("0-3,7") == [0, 1, 2, 3, 7]
    assert parse_seeds("5") == [5]


def test_summary_is_mean_std_se_and_a_one_sided_t_bound() -> None:
    gaps = [0.01, 0.03, 0.02, 0.00]
    s = summarize(gaps)
    std = math.sqrt(sum((g - 0.015) ** 2 for g in gaps) / 3)
    assert s["mean"] == pytest.approx(0.015) and s["std"] == pytest.approx(std)
    assert s["se"] == pytest.approx(std / 2)
    # t(0.95, 3) = 2.35336
    assert s["upper95"] == pytest.approx(0.015 + 2.35336 * std / 2, abs=1e-7)
    assert s["lower95"] == pytest.approx(0.015 - 2.35336 * std / 2, abs=1e-7)


def test_every_arm_of_a_seed_shares_its_init_and_the_noise_arm_only_changes_the_data() -> None:
    variant = parse_variant("codec=topk,k=32,bits=2,scale_bits=16,decay=0.9")
    fp32, noise, arm = seed_arms([variant], 3)
    assert (fp32.init, fp32.seed) == (3, 3) and (arm.init, arm.seed) == (3, 3)
    assert noise.label == NOISE_LABEL and noise.init == 3 and noise.seed != 3
    assert arm.spec == variant.spec
    assert [a.label for a in seed_arms([variant], 3, noise=False)] == ["fp32", variant.label]


def _row(ratio: float, mean: float, upper: float) -> dict[str, object]:
    return {"ratio": ratio, "gap": {"mean": mean, "se": 0.0, "upper95": upper}}


def test_the_goal_needs_the_upper_bound_within_1_percent_at_150x() -> None:
    labels = ["a", "b", "c"]
    variants = [parse_variant("codec=topk,k=32") for _ in labels]
    variants = [type(v)(label=x, spec=v.spec) for v, x in zip(variants, labels, strict=True)]
    result = {
        "seeds": [0, 1],
        NOISE_LABEL: _row(1.0, 0.0, 0.01),
        "a": _row(270.0, 0.005, 0.009),  # meets it
        "b": _row(270.0, 0.008, 0.02),  # mean within, bound not
        "c": _row(140.0, 0.0, 0.005),  # within, but below 150x
    }
    head = headline(result, variants, rounds=30)
    assert head["goal_met"] == ["a"]
    assert head["mean_within_goal"] == ["a", "b"]
