"""The fragment merge: token weights, RDA vs plain mean, degenerate fallback, clipping, rejections."""

from __future__ import annotations

import math

import pytest
import torch

from node.diloco.merge import Contribution, NothingToMerge, merge_fragment

EMB = "tok_emb.weight"


def contribution(
    peer: str,
    base: dict[str, torch.Tensor],
    deltas: dict[str, torch.Tensor],
    *,
    steps: int = 10,
    tokens: int = 100,
) -> Contribution:
    """A learner whose params sit at `base - delta`, so its pseudo-gradient is `delta`."""
    return Contribution(peer, {n: base[n] - deltas[n] for n in base}, 0, steps, tokens)


def orthogonal_deltas(count: int, dim: int, norm: float) -> list[torch.Tensor]:
    q, _ = torch.linalg.qr(
        torch.randn(dim, dim, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    )
    return [(q[:, i] * norm).to(torch.float32) for i in range(count)]


@pytest.mark.parametrize("m", [2, 4, 8, 16])
def test_rda_norm_does_not_shrink_with_m_for_orthogonal_inputs(m: int) -> None:
    base = {"w": torch.zeros(64), EMB: torch.zeros(64)}
    vectors = orthogonal_deltas(m, 64, norm=3.0)
    contribs = [contribution(f"p{i}", base, {"w": v, EMB: v}) for i, v in enumerate(vectors)]
    result = merge_fragment(base, contribs, embedding_names={EMB}, clip_factor=None)
    assert float(result.outer_grad["w"].norm()) == pytest.approx(3.0, rel=1e-5)
    # The embedding is averaged plainly, and a plain mean of M orthogonal vectors shrinks like 1/sqrt(M).
    assert float(result.outer_grad[EMB].norm()) == pytest.approx(3.0 / math.sqrt(m), rel=1e-5)
    # RDA keeps the mean's direction.
    cos = torch.nn.functional.cosine_similarity(result.outer_grad["w"], result.outer_grad[EMB], dim=0)
    assert float(cos) == pytest.approx(1.0, abs=1e-5)
    assert result.fallback_tensors == ()


def test_single_contribution_passes_through() -> None:
    base = {"w": torch.randn(4, 3), EMB: torch.randn(5, 3)}
    delta = {"w": torch.randn(4, 3), EMB: torch.randn(5, 3)}
    result = merge_fragment(base, [contribution("a", base, delta)], embedding_names={EMB}, clip_factor=3.0)
    for name in base:
        torch.testing.assert_close(result.outer_grad[name], delta[name], rtol=1e-5, atol=1e-6)
    assert result.weights == {"a": 1.0}
    assert result.participants == ("a",)


def test_weights_are_normalised_token_weights() -> None:
    base = {EMB: torch.zeros(3)}
    d1, d2 = torch.tensor([1.0, 0.0, 0.0]), torch.tensor([0.0, 1.0, 0.0])
    contribs = [
        contribution("slow", base, {EMB: d1}, steps=10, tokens=100),  # w = 1000
        contribution("fast", base, {EMB: d2}, steps=10, tokens=200),  # w = 4000
    ]
    result = merge_fragment(base, contribs, embedding_names={EMB}, clip_factor=None)
    assert result.weights == pytest.approx({"slow": 0.2, "fast": 0.8})
    torch.testing.assert_close(result.outer_grad[EMB], 0.2 * d1 + 0.8 * d2)


def test_rda_direction_and_radius_with_unequal_weights() -> None:
    base = {"w": torch.zeros(2)}
    a, b = torch.tensor([2.0, 0.0]), torch.tensor([0.0, 6.0])
    contribs = [
        contribution("a", base, {"w": a}, steps=1, tokens=1),  # w = 1**2 / 1 = 1
        contribution("b", base, {"w": b}, steps=3, tokens=3),  # w = 3**2 / 3 = 3
    ]
    result = merge_fragment(base, contribs, embedding_names=(), clip_factor=None)
    radius = 0.25 * 2.0 + 0.75 * 6.0
    direction = torch.tensor([0.25, 0.75]) / math.hypot(0.25, 0.75)
    torch.testing.assert_close(result.outer_grad["w"], radius * direction)


def test_zero_steps_means_zero_weight() -> None:
    base = {"w": torch.zeros(3)}
    good = contribution("good", base, {"w": torch.ones(3)}, steps=4, tokens=40)
    idle = contribution("idle", base, {"w": torch.full((3,), 50.0)}, steps=0, tokens=0)
    result = merge_fragment(base, [good, idle], embedding_names=(), clip_factor=None)
    assert result.weights == {"good": 1.0, "idle": 0.0}
    torch.testing.assert_close(result.outer_grad["w"], torch.ones(3))
    assert result.participants == ("good",)


def test_nothing_to_merge_is_a_typed_error() -> None:
    base = {"w": torch.zeros(3)}
    idle = contribution("idle", base, {"w": torch.ones(3)}, steps=0, tokens=0)
    with pytest.raises(NothingToMerge):
        merge_fragment(base, [idle], embedding_names=(), clip_factor=None)
    with pytest.raises(NothingToMerge):
        merge_fragment(base, [], embedding_names=(), clip_factor=None)
    broken = Contribution("nan", {"w": torch.tensor([float("nan"), 0.0, 0.0])}, 0, 5, 50)
    with pytest.raises(NothingToMerge) as info:
        merge_fragment(base, [broken], embedding_names=(), clip_factor=None)
    assert "nan" in info.value.rejected


def test_degenerate_direction_falls_back_to_plain_mean() -> None:
    base = {"w": torch.zeros(4), "v": torch.zeros(4)}
    d = torch.tensor([1.0, 2.0, 0.0, -1.0])
    contribs = [
        contribution("a", base, {"w": d, "v": d}),
        contribution("b", base, {"w": -3.0 * d, "v": d * 2.0}),  # w: unit vectors cancel exactly
    ]
    result = merge_fragment(base, contribs, embedding_names=(), clip_factor=None)
    assert result.fallback_tensors == ("w",)
    torch.testing.assert_close(result.outer_grad["w"], 0.5 * d + 0.5 * (-3.0 * d))
    assert "fell back" in result.reason
    # "v" is a normal RDA merge: same direction, mean norm.
    torch.testing.assert_close(result.outer_grad["v"], 1.5 * d)


def test_outlier_is_clipped_to_a_multiple_of_the_median() -> None:
    base = {"w": torch.zeros(3)}
    deltas = {
        "a": torch.tensor([1.0, 0.0, 0.0]),
        "b": torch.tensor([0.0, 1.1, 0.0]),
        "evil": torch.tensor([0.0, 0.0, 100.0]),
    }
    contribs = [contribution(p, base, {"w": d}) for p, d in deltas.items()]
    result = merge_fragment(base, contribs, embedding_names=(), clip_factor=3.0)
    bound = 3.0 * 1.1  # lower median of (1, 1.1, 100) is 1.1
    assert result.clipped_peers == ("evil",)
    assert result.clipped["evil"] == pytest.approx(bound / 100.0)
    assert result.delta_norms["evil"] == pytest.approx(100.0)
    reference = [contribution(p, base, {"w": d}) for p, d in deltas.items() if p != "evil"]
    reference.append(contribution("evil", base, {"w": deltas["evil"] * (bound / 100.0)}))
    expected = merge_fragment(base, reference, embedding_names=(), clip_factor=None)
    torch.testing.assert_close(result.outer_grad["w"], expected.outer_grad["w"])


def test_two_contributions_one_outlier_cannot_raise_its_own_bound() -> None:
    base = {"w": torch.zeros(2)}
    contribs = [
        contribution("a", base, {"w": torch.tensor([1.0, 0.0])}),
        contribution("evil", base, {"w": torch.tensor([0.0, 1000.0])}),
    ]
    result = merge_fragment(base, contribs, embedding_names=(), clip_factor=4.0)
    assert result.clipped_peers == ("evil",)
    assert float(result.outer_grad["w"].norm()) == pytest.approx(0.5 * 1.0 + 0.5 * 4.0, rel=1e-5)


def test_malformed_contributions_are_rejected_with_reasons() -> None:
    base = {"w": torch.zeros(3), "b": torch.zeros(2)}
    good = contribution("good", base, {"w": torch.ones(3), "b": torch.ones(2)})
    contribs = [
        good,
        Contribution("shape", {"w": torch.zeros(4), "b": torch.zeros(2)}, 0, 5, 50),
        Contribution("missing", {"w": torch.zeros(3)}, 0, 5, 50),
        Contribution("inf", {"w": torch.tensor([0.0, float("inf"), 0.0]), "b": torch.zeros(2)}, 0, 5, 50),
        Contribution("ints", {"w": torch.zeros(3, dtype=torch.int64), "b": torch.zeros(2)}, 0, 5, 50),
        Contribution("liar", {"w": torch.zeros(3), "b": torch.zeros(2)}, 0, -1, 50),
    ]
    result = merge_fragment(base, contribs, embedding_names=(), clip_factor=None)
    assert set(result.rejected) == {"shape", "missing", "inf", "ints", "liar"}
    assert result.weights == {"good": 1.0}
    torch.testing.assert_close(result.outer_grad["w"], torch.ones(3))


def test_stale_base_versions_are_rejected_when_asked() -> None:
    base = {"w": torch.zeros(2)}
    fresh = Contribution("fresh", {"w": torch.ones(2)}, 7, 5, 50)
    stale = Contribution("stale", {"w": torch.ones(2)}, 3, 5, 50)
    future = Contribution("future", {"w": torch.ones(2)}, 9, 5, 50)
    result = merge_fragment(
        base, [fresh, stale, future], embedding_names=(), clip_factor=None, current_version=8, max_staleness=2
    )
    assert set(result.rejected) == {"stale", "future"}
    assert result.participants == ("fresh",)


def test_bf16_learner_params_merge_in_float32() -> None:
    base = {"w": torch.zeros(8)}
    learner = Contribution("a", {"w": torch.full((8,), -0.5, dtype=torch.bfloat16)}, 0, 2, 20)
    result = merge_fragment(base, [learner], embedding_names=(), clip_factor=None)
    assert result.outer_grad["w"].dtype == torch.float32
    torch.testing.assert_close(result.outer_grad["w"], torch.full((8,), 0.5))


def test_argument_errors() -> None:
    base = {"w": torch.zeros(2)}
    c = contribution("a", base, {"w": torch.ones(2)})
    with pytest.raises(ValueError, match="duplicate"):
        merge_fragment(base, [c, c], embedding_names=(), clip_factor=None)
    with pytest.raises(ValueError, match="clip_factor"):
        merge_fragment(base, [c], embedding_names=(), clip_factor=0.5)
    with pytest.raises(ValueError, match="empty"):
        merge_fragment({}, [c], embedding_names=(), clip_factor=None)


@pytest.mark.parametrize("chunk", [1, 5, 64])
def test_a_merge_a_chunk_at_a_time_equals_the_whole_tensor_merge(
    monkeypatch: pytest.MonkeyPatch, chunk: int
) -> None:
    """The merge never holds a delta whole: norms, clipping, the winsorized clamp and RDA work on chunks of
    `chunked.CHUNK` values (issue 17). Split at every value, or mid-tensor, it merges as one chunk per tensor does
    (up to float rounding of the float64 norms), an outlier's clip included."""
    gen = torch.Generator().manual_seed(4)
    base = {
        "w": torch.randn(6, 7, generator=gen),
        EMB: torch.randn(9, 3, generator=gen),
        "v": torch.zeros(11),
    }
    deltas = [{n: 0.1 * torch.randn(t.shape, generator=gen) for n, t in base.items()} for _ in range(4)]
    deltas.append({n: 50.0 * torch.ones(t.shape) for n, t in base.items()})  # clipped, then winsorized
    for d in deltas[1:]:
        d["v"] = -deltas[0]["v"]  # v: p0 against the rest, clamped by the winsorized range chunk by chunk
    deltas[2]["v"] = torch.zeros(11)  # a zero delta, skipped by RDA
    contributions = [
        contribution(f"p{i}", base, d, steps=5 + i, tokens=300 + 7 * i) for i, d in enumerate(deltas)
    ]
    options = {"embedding_names": {EMB}, "clip_factor": 2.0, "trim_fraction": 0.25}
    whole = merge_fragment(base, contributions, **options)  # type: ignore[arg-type]
    monkeypatch.setattr("node.diloco.chunked.CHUNK", chunk)
    split = merge_fragment(base, contributions, **options)  # type: ignore[arg-type]
    assert split.clipped.keys() == whole.clipped.keys() == {"p4"}
    assert split.fallback_tensors == whole.fallback_tensors
    assert split.reason == whole.reason and "winsorized at 1 of 5" in split.reason
    for name, grad in whole.outer_grad.items():
        torch.testing.assert_close(split.outer_grad[name], grad, rtol=1e-5, atol=1e-6)
    assert split.delta_norms == pytest.approx(whole.delta_norms, rel=1e-9)
