"""The two readings of a boundary codec's held-out loss (benchmarks/bandwidth_activations.py, issue 20): through
the pipeline and its codec (`drive`'s loss) and the trained stage weights assembled into one model run in fp32
(`tools.pipeline_harness.model_held_out_loss`).

fp32: both readings are the same number. A codec that decodes every boundary tensor to zeros: the pipeline's
reading collapses (the negative control: the codec does reach the evaluation's forward) while the model reading
stays that of the weights, equal to an fp32 arm's with the same weights.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch

from benchmarks.bandwidth_activations import (
    NOISE_ARM,
    SeedProgress,
    check_fp32_readings,
    headline,
    meets_goal,
    summarize,
)
from protocol import boundary_codec
from protocol.envelope import Opened
from tools.pipeline_harness import (
    HarnessConfig,
    assembled_model,
    build_arm,
    drive,
    model_held_out_loss,
    pretrained_state,
)

MODEL = {"vocab_size": 256, "context_len": 16, "num_layers": 3, "width": 32, "num_heads": 2}


def config(codec: str) -> HarnessConfig:
    return HarnessConfig(
        model=MODEL,
        replicas=(1, 1, 1),
        attackers=0,
        lr=3e-3,
        concurrency=1,
        batch_size=4,
        activation_codec=codec,  # type: ignore[arg-type]
        held_out_batches=2,
    )


def test_fp32_the_pipeline_and_the_assembled_model_read_the_same_loss() -> None:
    arm = build_arm(config("fp32"), attack=None, verify=False, seed=3)
    through = drive(arm, 6, 3, eval_every=0)["loss"]
    model_loss = model_held_out_loss(arm)
    assert math.isfinite(through)
    assert model_loss == pytest.approx(through, rel=1e-6, abs=0.0)
    check_fp32_readings({"loss": through, "model_loss": model_loss})  # the benchmark's own guard passes


def test_the_assembled_model_holds_the_trained_stage_weights() -> None:
    arm = build_arm(config("fp32"), attack=None, verify=False, seed=3)
    before = {k: v.clone() for k, v in assembled_model(arm).state_dict().items()}
    drive(arm, 4, 3, eval_every=0)
    after = assembled_model(arm).state_dict()
    for service in arm.services.values():
        for name, tensor in service.core.module.state_dict().items():
            assert torch.equal(after[name], tensor)
    assert any(not torch.equal(before[k], after[k]) for k in before)  # training moved them


def test_the_fp32_guard_refuses_readings_that_differ() -> None:
    with pytest.raises(RuntimeError, match="fp32 arm"):
        check_fp32_readings({"loss": 3.0, "model_loss": 3.0 * (1 + 1e-4)})


def test_the_model_reading_does_not_pass_through_the_codec(monkeypatch: pytest.MonkeyPatch) -> None:
    decode = boundary_codec.decode_opened

    def zeroing(opened: Opened, *args: Any) -> Opened:
        out = decode(opened, *args)
        if out is opened:  # not an encoded boundary tensor (tokens, targets, losses)
            return out
        return Opened(out.header, {**out.tensors, "": torch.zeros_like(out.tensors[""])})

    # weights past their first steps: at init the model predicts near uniform with or without its activations
    weights = pretrained_state(config("fp32"), steps=40, seed=5)
    reference = build_arm(config("fp32"), attack=None, verify=False, seed=5, weights=weights)
    reference_loss = drive(reference, 0, 5)["loss"]  # evaluated only: nothing trained
    monkeypatch.setattr(boundary_codec, "decode_opened", zeroing)
    arm = build_arm(config("int8"), attack=None, verify=False, seed=5, weights=weights)
    through = drive(arm, 0, 5)["loss"]
    model_loss = model_held_out_loss(arm)
    assert model_loss == pytest.approx(reference_loss, rel=1e-6, abs=0.0)
    # negative control: the zeroing codec reaches the pipeline's evaluation (every stage sees zeros)
    assert through > 1.2 * model_loss


def arms(gap: float, model_gap: float) -> dict[str, dict[str, Any]]:
    def arm(ratio: float, g: float, mg: float) -> dict[str, Any]:
        return {
            "frame_ratio": ratio,
            "frame_bytes_per_microbatch": 1000 / ratio,
            "boundary_ratio": ratio,
            "loss_gap": g,
            "loss_gap_model": mg,
        }

    return {"fp32": arm(1, 0, 0), "a4g2": arm(8.8, gap, model_gap), NOISE_ARM: arm(1, 0.01, 0.01)}


def test_the_model_reading_has_its_own_keys_and_never_changes_the_recommendation() -> None:
    # a codec at 8.8x whose gap is 2 % through the codec and 0.3 % as the assembled model
    summary = summarize({0: arms(0.02, 0.002), 1: arms(0.02, 0.004)})
    assert summary["a4g2"]["loss_gap_model_mean"] == pytest.approx(0.003)
    assert summary["a4g2"]["loss_gaps_model"] == [0.002, 0.004]
    assert not meets_goal(summary["a4g2"]) and meets_goal(summary["a4g2"], "loss_gap_model")
    result = {
        "recommended": "fp32",
        "meets_goal": [],
        "meets_goal_model": ["a4g2"],
        "seeds": [0, 1],
        "summary": summary,
    }
    keys = headline(result)
    assert keys["activation_codec"] == "fp32" and keys["activation_goal_met"] is False
    assert keys["activation_goal_met_model"] is True
    assert keys["activation_codecs_meeting_goal_model"] == ["a4g2"]
    assert keys["activation_a4g2_loss_gap"] == 0.02
    assert keys["activation_a4g2_model_loss_gap"] == 0.003
    assert keys["activation_noise_model_loss_gap"] == 0.01


def test_kept_seeds_are_reused_only_for_the_same_run(tmp_path: Path) -> None:
    path = tmp_path / "progress.json"
    names = ["fp32", "a4g2", NOISE_ARM]
    SeedProgress(path, 600, 3e-3, names).add(0, {"fp32": {"loss": 2.3}})
    assert SeedProgress(path, 600, 3e-3, names).get(0) == {"fp32": {"loss": 2.3}}
    assert SeedProgress(path, 600, 3e-3, names).get(1) is None
    # negative controls: another length, learning rate or set of arms measures the seed anew
    assert SeedProgress(path, 300, 3e-3, names).get(0) is None
    assert SeedProgress(path, 600, 1e-3, names).get(0) is None
    assert SeedProgress(path, 600, 3e-3, ["fp32", "a3g3", NOISE_ARM]).get(0) is None
