"""benchmarks/poisoning.py's bookkeeping, without a swarm: each arm's loss gap is against the control of its own
run, `--merge` keeps the results file's other arms (with their gaps) and the headline is over all arms present."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import tomllib

from benchmarks.poisoning import (
    ARMS,
    COPY_CHECK_OFF,
    EVIDENCE_OFF,
    EVIDENCE_STEP_OFF,
    SENIORITY_OFF,
    STEP_SCALE_OFF,
    after_scaled_steps,
    evidence_summary,
    headline,
    merged_with,
    step_and_streaks,
    with_gaps,
)
from node.diloco.evidence import NO_EVIDENCE


def arm(
    final_loss: float, *, attackers: int = 1, defended: bool = True, share: float = 0.0
) -> dict[str, Any]:
    return {
        "defended": defended,
        "attackers": attackers,
        "final_loss": final_loss,
        "loss_curve": [(1.0, final_loss + 0.5, 100), (30.0, final_loss, 1000)],
        "attacker_weight_share": share,
        "attacker_weight_share_max": share,
        "honest_banned": 0,
        "check_cost_share": 0.01,
    }


def test_the_copy_arms_exist_and_their_negative_control_turns_only_the_copy_check_off() -> None:
    assert ARMS["copycat"].copy_source and ARMS["copycat"].attackers == 1 and ARMS["copycat"].honest == 4
    assert ARMS["freeride"].attack == "freeride" and not ARMS["freeride"].copy_source
    assert ARMS["copycat"].undefended_screening == ARMS["freeride"].undefended_screening == COPY_CHECK_OFF
    assert ARMS["signflip"].undefended_screening == ""  # the others: the whole screening off


def test_the_noise_arms_negative_control_turns_only_the_evidence_weighting_off() -> None:
    assert ARMS["noise"].undefended_screening == EVIDENCE_OFF == "evidence_weighting = false"


def test_the_evidence_summary_splits_the_merge_events_factors_by_side() -> None:
    merges = [
        {"evidence": {"h1": [0.05, 0.3, 1.0], "n": [0.0, None, 0.0]}},
        {"evidence": {"h1": [0.01, 0.2, 0.5], "n": [0.002, 0.01, 0.25]}},
        {"weights": {}},  # a merge event without scores (probe off, or an older syncer)
    ]
    summary = evidence_summary(merges, honest={"h1"}, attackers={"n"})
    assert summary["honest"] == {
        "scored": 2,
        "factor_mean": 0.75,
        "scaled": 1,
        "zeroed": 0,
        "slope_quartiles": [0.01, 0.01, 0.01, 0.01, 0.05],
        "cosine_quartiles": [0.2, 0.2, 0.2, 0.2, 0.3],
        "zeroed_after": {"scaled": [0, 0], "full": [0, 2]},
    }
    assert summary["attackers"]["zeroed"] == 1 and summary["attackers"]["cosine_quartiles"] == [0.01] * 5


def test_merge_keeps_the_other_arms_with_their_own_controls_gaps(tmp_path: Path) -> None:
    old = {"clean": arm(2.0, attackers=0), "signflip": arm(2.2, share=0.03)}
    with_gaps(old)
    assert old["signflip"]["loss_gap"] == pytest.approx(0.1)
    path = tmp_path / "poisoning.json"
    path.write_text(json.dumps({"measured_at": "then", "config": {"command": "old"}, "arms": old}))

    new = {"clean": arm(1.0, attackers=0), "copycat": arm(1.01, share=0.0), "copycat@undefended": arm(1.0)}
    new["copycat@undefended"].update(defended=False, attacker_weight_share_max=0.2)
    with_gaps(new)
    merged, runs = merged_with(path, new)
    assert sorted(merged) == ["clean", "copycat", "copycat@undefended", "signflip"]
    assert merged["clean"]["final_loss"] == 1.0  # this run's control replaces the old one
    # the old arm keeps its gap against its own run's control (2.0), which it now names
    assert merged["signflip"]["loss_gap"] == pytest.approx(0.1)
    assert merged["signflip"]["control_final_loss"] == 2.0 and merged["signflip"]["measured_at"] == "then"
    assert (
        merged["copycat"]["loss_gap"] == pytest.approx(0.01)
        and merged["copycat"]["control_final_loss"] == 1.0
    )
    assert runs == [{"command": "old", "measured_at": "then"}]
    top = headline(merged)
    assert top["max_loss_gap"] == pytest.approx(0.1) and top["max_attacker_weight_share"] == 0.03
    assert top["honest_banned"] == 0 and top["max_attacker_merge_share_undefended"] == 0.2
    assert top["arms"] == sorted(merged)


def test_merge_without_a_results_file_is_this_run(tmp_path: Path) -> None:
    new = {"clean": arm(1.0, attackers=0)}
    assert merged_with(tmp_path / "absent.json", new) == (new, [])


def test_the_lone_noise_arms_negative_control_turns_only_the_step_scale_and_the_streak_off() -> None:
    noise_k1 = ARMS["noise_k1"]
    assert (noise_k1.attack, noise_k1.attackers, noise_k1.honest, noise_k1.control) == (
        "noise",
        1,
        1,
        "clean_k1",
    )
    assert noise_k1.undefended_screening == EVIDENCE_STEP_OFF
    assert tomllib.loads(EVIDENCE_STEP_OFF) == {
        "evidence_scales_step": False,
        "evidence_zero_violation_after": 0,
    }


def test_step_and_streaks_counts_scaled_steps_and_each_sides_no_evidence_violations() -> None:
    merges = [{"step_scale": 0.2}, {"step_scale": 1.0}, {}]  # an older syncer's event: a full step
    learners = {"a": {"refused_by_tag": {NO_EVIDENCE: 2, "screen: norm": 1}}, "h": {"refused_by_tag": {}}}
    summary = step_and_streaks(merges, learners, honest={"h", "h2"}, attackers={"a"})
    assert summary == {"scaled_steps": 1, "no_evidence_violations": {"honest": 0, "attackers": 2}}


def test_the_no_cap_lone_noise_arm_turns_the_seniority_cap_off_in_both_runs() -> None:
    arm = ARMS["noise_k1_nocap"]
    assert arm.screening == SENIORITY_OFF and tomllib.loads(SENIORITY_OFF) == {"young_weight_cap": 1.0}
    assert arm.undefended_screening == EVIDENCE_STEP_OFF and arm.control == "clean_k1"


def test_zeroed_after_splits_by_whether_the_fragments_previous_merge_was_scaled() -> None:
    merges = [
        {"fragment": 0, "step_scale": 0.3, "evidence": {"h": [0.0, 0.0, 0.3]}},  # first of fragment 0: "full"
        {"fragment": 1, "step_scale": 1.0, "evidence": {"h": [0.0, 0.0, 0.0]}},  # first of fragment 1
        {"fragment": 0, "step_scale": 1.0, "evidence": {"h": [0.0, 0.0, 0.0], "x": [0.0, 0.0, 0.0]}},
        {"fragment": 0, "evidence": {"h": [0.1, 0.2, 1.0]}},  # after a full step of fragment 0
    ]
    assert after_scaled_steps(merges, {"h"}) == {"scaled": [1, 1], "full": [1, 3]}


def test_the_embed_flip_arm_and_the_step_scale_ab_arm() -> None:
    assert ARMS["embed_flip"].attack == "embed_flip" and ARMS["embed_flip"].undefended_screening == ""
    nostep = ARMS["clean_nostep"]
    assert nostep.attack is None and nostep.honest == 4 and nostep.control == "clean"
    assert (
        tomllib.loads(nostep.screening) == {"evidence_scales_step": False}
        and nostep.screening == STEP_SCALE_OFF
    )


def test_the_aligned_arms_at_a_larger_a_differ_from_the_others_only_in_a() -> None:
    """`noise_aligned1_k1` / `noise_aligned1`: the cosine-gaming arms with 1.0 x the norm along the public direction,
    the same controls and the same negative control (only the public-direction rule off)."""
    for name in ("noise_aligned_k1", "noise_aligned"):
        base, big = ARMS[name], ARMS[name.replace("aligned", "aligned1")]
        assert (base.attack, big.attack) == ("aligned:0.2", "aligned:1.0")
        assert (big.honest, big.attackers, big.control) == (base.honest, base.attackers, base.control)
        assert tomllib.loads(big.undefended_screening) == {"evidence_public_residual": False}
        assert big.screening == base.screening == ""
