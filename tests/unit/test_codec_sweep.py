"""benchmarks/codec_sweep.py: variants parse to what the syncer and the learner would run, bad ones fail, and a
lossless codec in the harness gives exactly the fp32 curve."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from benchmarks import codec_sweep
from benchmarks.codec_sweep import Setup, Variant, parse_variant, ratio, run
from node.diloco.fragments import plan_fragments
from node.ml import model as model_module
from node.ml.data import load_corpus, validation_batches
from node.ml.model import build_model, embedding_param_names
from protocol.compress import CodecSpec

pytestmark = pytest.mark.timeout(120)


def test_a_topk_variant_carries_the_decay_in_its_spec_and_winsorizes_sparsely_by_default() -> None:
    variant = parse_variant("codec=topk,k=32,bits=2,scale_bits=16,decay=0.9,lr=1,momentum=0")
    assert variant.spec == CodecSpec(codec="topk", k=32, bits=2, scale_bits=16, feedback_decay=0.9)
    assert variant.sparse_trim and variant.trim == 0.25 and (variant.outer_lr, variant.momentum) == (1.0, 0.0)
    assert not parse_variant("codec=topk,sparse=0").sparse_trim
    assert not parse_variant("codec=fp32").sparse_trim


def test_a_randk_variant_winsorizes_densely_and_rotates_unless_told() -> None:
    variant = parse_variant("codec=randk,k=410,bits=1,scale_bits=16,decay=0.8,rotate=0")
    assert variant.spec == CodecSpec(
        codec="randk", k=410, bits=1, scale_bits=16, feedback_decay=0.8, mask_rotate=False
    )
    assert not variant.sparse_trim  # every learner sends the same coordinates: the dense merge applies
    assert parse_variant("codec=randk,k=410").spec.mask_rotate


def test_the_randk_pairs_over_150x_on_the_live_fragments() -> None:
    sizes = {n: p.numel() for n, p in build_model(codec_sweep.MODEL, 0).named_parameters()}
    plan = plan_fragments(sizes, 2, embedding_param_names(codec_sweep.MODEL))
    for k, bits in ((410, 2), (819, 1), (205, 4)):
        assert 150 < ratio(CodecSpec(codec="randk", k=k, bits=bits, scale_bits=16), plan) < 160


@pytest.mark.parametrize("text", ["codec=zip", "codec=topk,bits=3", "codec=topk,decay=0", "H=5"])
def test_a_bad_variant_is_refused(text: str) -> None:
    with pytest.raises(ValueError):
        parse_variant(text)


def test_the_recommended_codec_clears_150x_on_the_live_fragments() -> None:
    sizes = {n: p.numel() for n, p in build_model(codec_sweep.MODEL, 0).named_parameters()}
    plan = plan_fragments(sizes, 2, embedding_param_names(codec_sweep.MODEL))
    assert ratio(CodecSpec(codec="topk", k=32, bits=2, scale_bits=16, feedback_decay=0.9), plan) > 150
    assert ratio(CodecSpec(), plan) == 1.0


def test_int8_in_the_harness_stays_within_a_hair_of_fp32(tmp_path: Path) -> None:
    text = tmp_path / "corpus.txt"  # bytes of this repository's model code: small and always there
    text.write_bytes(
        b"\n".join(path.read_bytes() for path in sorted(Path(model_module.__file__).parent.glob("*.py")))
    )
    corpus = load_corpus(str(text))
    sizes = {n: p.numel() for n, p in build_model(codec_sweep.MODEL, 0).named_parameters()}
    setup = Setup(
        plan=plan_fragments(sizes, 2, embedding_param_names(codec_sweep.MODEL)),
        streams=[corpus.train_stream(i, codec_sweep.LEARNERS) for i in range(codec_sweep.LEARNERS)],
        held=validation_batches(corpus, batch_size=2, context_len=32, num_batches=2),
    )
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the benchmark runs; many threads on a loaded box only slow it down
    try:
        plain = run(setup, Variant(label="fp32"), rounds=1)
        int8 = run(setup, parse_variant("codec=int8"), rounds=1)
    finally:
        torch.set_num_threads(threads)
    assert (
        len(plain) == 1 and plain[-1][0] == int8[-1][0] == 12 * 4 * 8 * 32
    )  # H x learners x batch x context
    assert abs(int8[-1][1] / plain[-1][1] - 1) < 0.01


def test_each_variant_is_compared_with_fp32_at_its_own_outer_step(monkeypatch: pytest.MonkeyPatch) -> None:
    ran: list[tuple[str, float, float]] = []

    def fake_run(setup: object, variant: Variant, rounds: int) -> list[tuple[int, float]]:
        ran.append((variant.spec.codec, variant.outer_lr, variant.momentum))
        return [(1, 2.0 + variant.outer_lr)]

    monkeypatch.setattr(codec_sweep, "run", fake_run)
    curves: dict[str, list[tuple[int, float]]] = {}
    rows: dict[str, object] = {}
    fast = parse_variant("codec=topk,lr=1,momentum=0")
    assert codec_sweep._reference(None, fast, 1, curves, rows) == "fp32,lr=1,momentum=0"  # type: ignore[arg-type]
    assert codec_sweep._reference(None, parse_variant("codec=topk"), 1, curves, rows) == "fp32"  # type: ignore[arg-type]
    assert codec_sweep._reference(None, fast, 1, curves, rows) == "fp32,lr=1,momentum=0"  # type: ignore[arg-type]
    assert ran == [("fp32", 1.0, 0.0), ("fp32", 0.7, 0.9)]  # each reference once, at the variant's step
