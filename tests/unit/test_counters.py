"""Learner counters, token weights and the syncer's cap on self-reported counters."""

from __future__ import annotations

import pytest

from node.diloco.counters import CounterBank, Counters, cap_counters, token_weight


def test_token_weight_is_tokens_squared_over_steps() -> None:
    assert token_weight(100, 10) == 1000.0
    assert token_weight(200, 10) == 4000.0
    # Same tokens per step: weight proportional to steps, so half the steps is half the weight.
    assert token_weight(50 * 8, 8) == pytest.approx(token_weight(50 * 16, 16) / 2)


def test_token_weight_is_zero_without_progress() -> None:
    assert token_weight(0, 0) == 0.0
    assert token_weight(500, 0) == 0.0
    assert token_weight(0, 5) == 0.0
    with pytest.raises(ValueError):
        token_weight(-1, 3)


def test_counters_and_bank() -> None:
    bank = CounterBank(3)
    for _ in range(4):
        bank.record_step(tokens=16)
    bank.reset(1)
    bank.record_step(tokens=16)
    assert bank.snapshot() == [(5, 80), (1, 16), (5, 80)]
    assert bank[0].weight() == token_weight(80, 5)
    c = Counters()
    with pytest.raises(ValueError):
        c.record_step(-1)
    with pytest.raises(ValueError):
        CounterBank(0)


def test_cap_leaves_plausible_reports_alone() -> None:
    assert cap_counters(10, 160, 10.0, max_steps_per_s=2.0, tokens_per_step=16) == (10, 160, False)
    # An exact multiple is not lost to float rounding: 10 s at 2 steps/s allows 20 steps.
    assert cap_counters(20, 320, 10.0, max_steps_per_s=2.0, tokens_per_step=16) == (20, 320, False)


def test_cap_bounds_steps_by_time_and_tokens_by_batch() -> None:
    assert cap_counters(100, 1600, 10.0, max_steps_per_s=2.0, tokens_per_step=16) == (20, 320, True)
    assert cap_counters(10, 10_000, 10.0, max_steps_per_s=2.0, tokens_per_step=16) == (10, 160, True)
    steps, tokens, capped = cap_counters(10**9, 10**15, 1.0, max_steps_per_s=1.0, tokens_per_step=8)
    assert (steps, tokens, capped) == (1, 8, True)


def test_cap_treats_negative_and_nonsense_as_zero() -> None:
    assert cap_counters(-5, -7, 10.0, max_steps_per_s=1.0, tokens_per_step=4) == (0, 0, True)
    assert cap_counters(3, 12, -4.0, max_steps_per_s=1.0, tokens_per_step=4) == (0, 0, True)
    assert cap_counters(3, 12, float("nan"), max_steps_per_s=1.0, tokens_per_step=4) == (0, 0, True)


def test_cap_rejects_bad_configuration() -> None:
    with pytest.raises(ValueError):
        cap_counters(1, 1, 1.0, max_steps_per_s=0.0, tokens_per_step=4)
    with pytest.raises(ValueError):
        cap_counters(1, 1, 1.0, max_steps_per_s=1.0, tokens_per_step=0)
