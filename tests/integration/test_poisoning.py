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
# the defended share is a mean over the merges after the attacker's first refusal: stopping at the ban made it
# a mean over however few merges happened before the ban (a faster ban read as a larger share: 0.13-0.14 in stop
# 28's loaded CI runs, 6-8 merges at probation weight); a fixed count makes runs comparable
MERGES_AFTER_DETECTION = 16


def _defence_shown(summary: dict) -> bool:
    return (
        summary["attackers_banned"] >= 1
        and summary["merges"] >= MERGES
        and summary["merges_after_detection"] >= MERGES_AFTER_DETECTION
    )


def _attack_merged(summary: dict) -> bool:
    # the attacker may start training after the honest learners: wait for its work, not just for merges
    return summary["merges"] >= MERGES and summary["attacker_merges"] >= ATTACKER_MERGES


# Not strict, though the burst that banned an honest learner in 2 of 5 runs on 2026-12-07 now weighs once
# (learner_ledger.ONCE_PER_WORK; tests/unit/test_loss_blame_burst.py shows it, with the old count as its control):
# 14 runs since (8 with the fix, 6 without) never reproduced the burst, so no live run has shown the fix at work, and
# honest work judged an ascent step on different bases still weighs each time. The test still runs and asserts
# everything when it passes (XPASS); a failure is reported, not hidden.
@pytest.mark.xfail(
    strict=False,
    reason="honest ascent judgements on different bases can still ban under load (not reproduced since)",
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
    # weight: the benchmark reports that share against the 5 % goal (2.9 % quiet, 5.9 % beside two busy
    # loops in this test); here, well under its fair third
    assert defended["merges_after_detection"] >= MERGES_AFTER_DETECTION
    assert defended["attacker_weight_share"] < 0.1

    undefended = run_arm(
        tmp_path / "undefended", ARM, duration_s=DEADLINE_S, defended=False, until=_attack_merged
    )
    print(f"\nundefended: {undefended}")
    assert undefended["merges"] > 0 and undefended["attackers_banned"] == 0
    assert undefended["attacker_merges"] >= ATTACKER_MERGES  # its ascent steps entered the model
    # its share from its first merged push on: near its fair third (0.15-0.44 of all merges in stop 29's runs,
    # diluted by the merges before it started)
    assert undefended["attacker_weight_share_since_joined"] > 0.2
    assert undefended["attacker_weight_share_since_joined"] > 2 * defended["attacker_weight_share"]
