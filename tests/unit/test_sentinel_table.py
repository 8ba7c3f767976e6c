"""The accounting of benchmarks/sentinel_table.py: ban precision/recall/F1, loss at equal tokens, ban latency."""

from __future__ import annotations

import pytest

from benchmarks.sentinel_table import (
    ATTACKS,
    TableConfig,
    attack_spec,
    ban_scores,
    headline_of,
    loss_at_tokens,
    loss_gap,
    microbatches_to_ban,
)
from verification.attacks import parse_attack

REPLICAS = {f"r{i}" for i in range(14)}
ATTACKERS = {"r3", "r4", "r5"}


def test_all_attackers_banned_and_nobody_else_is_perfect() -> None:
    s = ban_scores({"r3", "r4", "r5"}, ATTACKERS, REPLICAS)
    assert (s["tp"], s["fp"], s["fn"]) == (3, 0, 0)
    assert s["precision"] == s["recall"] == s["f1"] == 1.0


def test_partial_recall_and_a_false_ban() -> None:
    s = ban_scores({"r3", "r4", "r0"}, ATTACKERS, REPLICAS)  # two of three attackers, one honest
    assert (s["tp"], s["fp"], s["fn"]) == (2, 1, 1)
    assert s["precision"] == pytest.approx(2 / 3)
    assert s["recall"] == pytest.approx(2 / 3)
    assert s["f1"] == pytest.approx(2 / 3)


def test_f1_is_the_harmonic_mean() -> None:
    s = ban_scores({"r3", "r0", "r1", "r2"}, ATTACKERS, REPLICAS)  # P 1/4, R 1/3
    assert s["f1"] == pytest.approx(2 * (1 / 4) * (1 / 3) / (1 / 4 + 1 / 3))


def test_no_ban_under_attack_scores_zero_f1_but_accuses_nobody() -> None:
    s = ban_scores(set(), ATTACKERS, REPLICAS)
    assert s["f1"] == 0.0 and s["recall"] == 0.0 and s["precision"] == 1.0


def test_only_honest_bans_score_zero() -> None:
    s = ban_scores({"r0"}, ATTACKERS, REPLICAS)
    assert s["f1"] == 0.0 and s["precision"] == 0.0 and s["fp"] == 1


def test_clean_run_conventions() -> None:
    assert ban_scores(set(), set(), REPLICAS)["f1"] == 1.0
    clean_false = ban_scores({"r7"}, set(), REPLICAS)
    assert clean_false["f1"] == 0.0 and clean_false["fp"] == 1 and clean_false["recall"] == 1.0


def test_bans_of_unknown_peers_are_ignored() -> None:
    assert ban_scores({"r3", "r4", "r5", "stranger"}, ATTACKERS, REPLICAS)["fp"] == 0


def test_loss_at_tokens_interpolates_and_extrapolates() -> None:
    curve = [(300, 2.0), (100, 3.0), (200, 2.5)]  # unsorted on purpose
    assert loss_at_tokens(curve, 200) == pytest.approx(2.5)
    assert loss_at_tokens(curve, 150) == pytest.approx(2.75)
    assert loss_at_tokens(curve, 50) == pytest.approx(3.25)  # before the first checkpoint: the first slope
    assert loss_at_tokens(curve, 400) == pytest.approx(1.5)  # after the last: the last slope
    assert loss_at_tokens([(10, 4.0)], 99) == 4.0
    with pytest.raises(ValueError):
        loss_at_tokens([], 1)


def test_loss_gap_is_relative_and_signed() -> None:
    assert loss_gap(2.04, 2.0) == pytest.approx(0.02)
    assert loss_gap(1.98, 2.0) == pytest.approx(-0.01)


def test_microbatches_to_ban_is_per_attacker_and_none_when_never_banned() -> None:
    attacked_at_ban = {"a": 12, "b": 0, "honest": 10}
    assert microbatches_to_ban(attacked_at_ban, ["a", "b", "c"]) == [12, 0, None]


def test_headline_aggregates() -> None:
    attacks = {
        "random": {"f1": 1.0, "adaptive": False, "loss_gap": 0.004, "loss_gap_unverified": 0.3,
                   "false_bans": 0, "goal_met": True},
        "mimic": {"f1": 0.5, "adaptive": True, "loss_gap": 0.01, "loss_gap_unverified": 0.02,
                  "false_bans": 1, "goal_met": False},
    }  # fmt: skip
    clean = [{"false_bans": 0}, {"false_bans": 2}]
    h = headline_of(attacks, clean, {"check_cost_share": 0.03})
    assert h["min_f1"] == 0.5 and h["min_f1_non_adaptive"] == 1.0
    assert h["false_bans"] == 3 and h["clean_false_bans"] == 2
    assert h["max_loss_gap"] == 0.01 and h["max_loss_gap_unverified"] == 0.3
    assert h["attacks_meeting_goal"] == 1 and h["check_cost_share"] == 0.03


def test_every_attack_spec_parses() -> None:
    config = TableConfig()
    for name in ATTACKS:
        parsed = parse_attack(attack_spec(name, config))
        assert parsed.start_after == config.attack_start and parsed.direction == config.direction
    assert parse_attack(attack_spec("delay", config)).delay_steps == config.attack_start
