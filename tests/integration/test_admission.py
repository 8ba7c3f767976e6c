"""Admission in a live swarm (issue 18, Sybil resistance): a real syncer, an honest learner and a learner that
pushes honest work without the run's proof-of-work (`HIVENODE_UNSAFE_LEARNER_ATTACK=no_admission`, as a Sybil
that did not pay). In a pow run the syncer refuses every push of the unpaid identity with reason "admission" and
merges only the honest learner; the negative control runs the same swarm with `[admission] mode = "open"` (the
defence off, everything else on): the same pushes are merged with a real share of the weight."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest

from benchmarks.poisoning import Arm, run_arm

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

ARM = Arm(name="no_admission", attack="no_admission", attackers=1, honest=1, control="clean_k1")
DEADLINE_S = (
    90.0  # each arm runs until what it must show happened, or this (the assertions then say what not)
)
MERGES = 4


def _refused(summary: dict[str, Any]) -> bool:
    return summary["refusals"].get("admission", 0) >= 2 and summary["merges"] >= MERGES


def _merged(summary: dict[str, Any]) -> bool:
    return summary["attacker_weight_share_all"] > 0 and summary["merges"] >= MERGES


def test_a_learner_without_a_valid_proof_is_refused_and_an_open_run_merges_it(tmp_path: Path) -> None:
    defended = run_arm(tmp_path / "pow", ARM, duration_s=DEADLINE_S, until=_refused)
    print(f"\npow: {defended}")
    assert defended["merges"] >= 1  # the honest learner's work goes on
    assert defended["refusals"].get("admission", 0) >= 2, defended["refusals"]
    # and on the syncer's /metrics, by cause: the unpaid learner sends no proof at all
    assert defended["admission_refused_metric"].get("no_proof", 0) >= 2, defended["admission_refused_metric"]
    assert defended["attacker_weight_share_all"] == 0.0  # not one merge took the unpaid identity
    assert defended["honest_banned"] == 0 and defended["honest_refused"] == 0

    open_run = dataclasses.replace(ARM, admission="open")
    undefended = run_arm(tmp_path / "open", open_run, duration_s=DEADLINE_S, until=_merged)
    print(f"\nopen: {undefended}")
    assert undefended["refusals"].get("admission", 0) == 0
    assert undefended["admission_refused_metric"].get("no_proof") == 0.0  # exported, and nothing counted
    assert undefended["attacker_weight_share_all"] > 0.0  # without the cost, the same pushes are merged
