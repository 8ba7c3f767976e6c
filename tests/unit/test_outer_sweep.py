"""benchmarks/outer_sweep.py: its in-process DiLoCo reduces to one process where it must, and bad variants fail."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from benchmarks.outer_sweep import Variant, gaps, parse_variant, run_diloco
from benchmarks.real_model_quality import QualityConfig, Setup
from node.ml import model as model_module
from node.ml.data import BatchSampler, evaluate, load_corpus, validation_batches
from node.ml.model import ModelConfig, build_model

pytestmark = pytest.mark.timeout(120)


def tiny_setup(root: Path) -> Setup:
    cfg = QualityConfig(preset="llama-tiny", context_len=16, batch_size=2, learners=2, eval_batches=2)
    text = (
        root / "corpus.txt"
    )  # bytes (vocabulary 256) of this repository's model code: small and always there
    text.write_bytes(
        b"\n".join(path.read_bytes() for path in sorted(Path(model_module.__file__).parent.glob("*.py")))
    )
    corpus = load_corpus(str(text))
    model_cfg = ModelConfig.from_dict({"preset": "llama-tiny", "context_len": 16, "vocab_size": 256})
    held = validation_batches(corpus, batch_size=2, context_len=16, num_batches=2)
    return Setup(cfg=cfg, corpus=corpus, model_cfg=model_cfg, held=held)


def test_one_replica_at_h1_with_plain_averaging_is_one_process(tmp_path: Path) -> None:
    setup = tiny_setup(tmp_path)
    torch.manual_seed(0)
    one = Variant(sync_every_steps=1, outer_lr=1.0, momentum=0.0, replicas=1)
    curve = run_diloco(setup, one, tokens=6 * 32, batch_size=2, eval_every_tokens=3 * 32)

    model = build_model(setup.model_cfg, setup.cfg.seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=setup.cfg.lr, weight_decay=0.01)
    sampler = BatchSampler(
        setup.corpus.train_stream(),
        batch_size=2,
        context_len=16,
        generator=torch.Generator().manual_seed(setup.cfg.seed),
    )
    plain = [(0, evaluate(model, setup.held))]
    for step in range(1, 7):
        model.train()
        inputs, targets = sampler.next_batch()
        optimizer.zero_grad(set_to_none=True)
        model(inputs, targets)[1].backward()
        optimizer.step()
        if step % 3 == 0:
            plain.append((step * 32, evaluate(model, setup.held)))
    assert [t for t, _ in curve] == [t for t, _ in plain] == [0, 96, 192]
    for (_, ours), (_, reference) in zip(curve, plain, strict=True):
        assert ours == pytest.approx(reference, rel=1e-4)
    assert curve[-1][1] < curve[0][1]  # it trained


def test_momentum_changes_the_outcome(tmp_path: Path) -> None:
    """The variants are not all the same run: Nesterov momentum moves the global model differently."""
    setup = tiny_setup(tmp_path)
    runs = [
        run_diloco(
            setup, Variant(sync_every_steps=2, outer_lr=1.0, momentum=m, replicas=2), 8 * 32, 2, 4 * 32
        )
        for m in (0.0, 0.9)
    ]
    assert runs[0][-1][1] != pytest.approx(runs[1][-1][1], rel=1e-6)


def test_parse_variant_names_the_valid_keys() -> None:
    assert parse_variant("H=5,outer_lr=1.0,momentum=0.0", 4) == Variant(
        sync_every_steps=5, outer_lr=1.0, momentum=0.0, replicas=4
    )
    with pytest.raises(ValueError, match="valid: H, outer_lr, momentum"):
        parse_variant("H=5,lr=1.0", 4)


def test_gaps_compare_at_the_tokens_both_reached() -> None:
    curves = {"one_process": [(0, 10.0), (100, 5.0)], "v": [(0, 10.0), (50, 6.0), (200, 4.0)]}
    assert gaps(curves) == {"v": {"tokens": 100, "loss": 5.3333, "reference": 5.0, "gap": 0.0667}}
