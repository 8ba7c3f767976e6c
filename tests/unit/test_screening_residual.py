"""The contribution less its public part (node.diloco.screening_residual), the screen's gate on it, and the probe's
residual slope (node.diloco.loss_probe)."""

from __future__ import annotations

import functools
import time

import torch

from node.diloco import chunked
from node.diloco.loss_probe import LossProbe
from node.diloco.merge import MergeResult
from node.diloco.screening import ContributionScreen, ScreeningConfig
from node.diloco.screening_residual import public_residual

BASE = {"a": torch.zeros(3), "b": torch.zeros(2, 2)}


def test_the_residual_is_orthogonal_to_the_direction_and_read_by_chunks() -> None:
    gen = torch.Generator().manual_seed(0)
    params = {n: torch.randn(t.shape, generator=gen) for n, t in BASE.items()}
    direction = {n: 3.0 * torch.randn(t.shape, generator=gen) for n, t in BASE.items()}
    residual = public_residual(BASE, params, direction)
    assert residual is not None
    d = {n: BASE[n] - residual[n] for n in BASE}
    dot = sum(float((d[n] * direction[n]).sum()) for n in BASE)
    assert abs(dot) < 1e-5  # nothing left along the direction
    # what is removed is along the direction: original delta - residual delta = c x direction
    removed = torch.cat([((BASE[n] - params[n]) - d[n]).flatten() for n in BASE])
    along = torch.cat([direction[n].flatten() for n in BASE])
    assert torch.allclose(removed, (removed @ along / (along @ along)) * along, atol=1e-6)
    assert torch.equal(residual.chunk("b", 1, 3), residual["b"].flatten()[1:3])
    assert chunked.shape(residual, "b") == (2, 2) and list(residual) == ["a", "b"]
    assert public_residual(BASE, params, {n: torch.zeros_like(t) for n, t in BASE.items()}) is None


def merge_once(screen: ContributionScreen, grad: dict[str, torch.Tensor]) -> None:
    result = MergeResult(
        outer_grad=grad,
        weights={"p": 1.0},
        clipped={},
        fallback_tensors=(),
        rejected={},
        delta_norms={"p": 1.0},
        reason="",
    )
    screen.commit(0, screen.prepare_commit(0, result))


def test_the_screen_gives_a_residual_only_past_the_directions_warm_up_and_when_on() -> None:
    params = {n: t - 1.0 for n, t in BASE.items()}
    grad = {n: torch.ones_like(t) for n, t in BASE.items()}
    on, off = (
        ContributionScreen(ScreeningConfig(min_history=2, evidence_public_residual=flag))
        for flag in (True, False)
    )
    for screen in (on, off):
        merge_once(screen, grad)
    assert on.public_residual(0, BASE, params) is None  # one merge: no direction to judge against yet
    for screen in (on, off):
        merge_once(screen, grad)
    residual = on.public_residual(0, BASE, params)
    assert residual is not None and all(float(residual[n].sub(BASE[n]).abs().max()) < 1e-6 for n in BASE)
    assert off.public_residual(0, BASE, params) is None  # off: the delta's own slope is judged
    assert not off.evidence.config.cosine_needs_slope and on.evidence.config.cosine_needs_slope


def test_the_probe_measures_the_residuals_slope_in_the_same_score() -> None:
    """A linear held-out loss g . w: the slope of a delta along g is |g|; with its residual given, the score carries
    the residual's slope (the part orthogonal to the public direction), counted as one measurement."""
    g = torch.tensor([1.0, 0.0, 0.0])
    probe = LossProbe(lambda p: float(torch.dot(g, p["a"])))
    base = {"a": torch.zeros(3)}
    params = {"a": -torch.tensor([1.0, 1.0, 0.0])}  # delta (1, 1, 0): slope 1 / sqrt(2)
    public = {"a": torch.tensor([0.0, 1.0, 0.0])}
    residual = functools.partial(public_residual, base, params, public)
    score = probe.measure(base, (0,), base, params, time.perf_counter, True, residual)
    assert score is not None and score.slope is not None
    assert abs(score.slope - 2**-0.5) < 1e-6
    assert (
        score.residual_slope is not None and abs(score.residual_slope - 1.0) < 1e-6
    )  # the residual is (1, 0, 0)
    assert score.evidence_slope == score.residual_slope and probe.measured == 1
    # all public: nothing left to judge but a zero residual, slope 0 (no evidence); none given: the delta's own
    along = functools.partial(public_residual, base, {"a": -public["a"]}, public)
    assert (
        probe.measure(base, (0,), base, {"a": -public["a"]}, time.perf_counter, True, along).evidence_slope
        == 0.0
    )
    plain = probe.measure(base, (0,), base, params, time.perf_counter, True)
    assert plain is not None and plain.residual_slope is None and plain.evidence_slope == plain.slope
