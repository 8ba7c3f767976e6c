"""benchmarks/syncer_floor.py on llama-tiny (the real run is llama-124m, docs/scale.md): the held-out loss with every
tensor of the model streamed from a spill file equals the loss with the model in memory, bit for bit (what a syncer
keeping its global parameters on disk would score with), and the breakdown names every step it measures."""

from __future__ import annotations

from functools import partial
from pathlib import Path

import pytest

from benchmarks import scale
from benchmarks.syncer_floor import breakdown, floor, streamed_file
from node.diloco.spill import SpillDir
from node.ml.model import ModelConfig, build_model
from node.roles.syncer import model_skeleton, skeleton_loss

pytestmark = pytest.mark.timeout(120)


def test_the_loss_streamed_from_a_spill_file_equals_the_loss_in_memory() -> None:
    result = floor("llama-tiny")
    assert result["bit_equal"] is True and result["loss_streamed"] == result["loss_in_memory"]
    assert result["loss_in_memory"] > 0
    assert "probe's loss, every tensor streamed from the file" in result["marks"]


def test_the_streamed_loss_reads_the_file(tmp_path: Path) -> None:
    """Negative control: one value changed in the file changes the streamed loss (the pass reads the file, not the
    skeleton's own values or a cached copy)."""
    run = scale.manifest("llama-tiny")
    cfg = ModelConfig.from_dict(run.model)
    params = {n: p.detach().clone() for n, p in build_model(cfg, run.seed).named_parameters()}
    loss = partial(
        skeleton_loss, model_skeleton(cfg), batches=[scale.learnable_batch(cfg.vocab_size, 2, seed=1000)]
    )
    spill = SpillDir(tmp_path / "spill")
    spill.write("same", params)
    name = next(n for n, t in params.items() if t.dim() == 2 and "embed" not in n)
    changed = dict(params)
    changed[name] = params[name].clone()
    changed[name].view(-1)[0] += 1.0
    spill.write("changed", changed)
    assert loss(streamed_file(spill, "same")) == loss(params)
    assert loss(streamed_file(spill, "changed")) != loss(params)
    assert loss(streamed_file(spill, "changed")) == loss(changed)


def test_the_breakdown_names_each_step() -> None:
    result = breakdown("llama-tiny")
    assert result["fragments_merged"] == result["sizes"]["num_fragments"]  # the round merged every fragment
    for what in ("import torch", "seed model built", "round: the push scored by the probe"):
        assert result["marks"][what]["peak_gib"] > 0
