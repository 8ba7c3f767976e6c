"""The learner's inner step: gradient accumulation equals one larger batch, clipping bounds the gradient norm,
and the scheduled learning rate is the one the optimizer steps with."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch

from node.ml.model import ModelConfig, build_model
from node.roles.learner import LearnerRole
from protocol.manifest import InnerOptimizerSpec

CFG = ModelConfig(context_len=16, num_layers=2, width=32, num_heads=4)


class _Batches:
    def __init__(self, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        self.batches = list(batches)

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.batches.pop(0)


def _step(inner: InnerOptimizerSpec, batches: list[tuple[torch.Tensor, torch.Tensor]], step: int = 1) -> Any:
    model = build_model(CFG, seed=0)
    learner: Any = SimpleNamespace(
        _model=model,
        _optimizer=torch.optim.AdamW(model.parameters(), lr=inner.lr, weight_decay=inner.weight_decay),
        _sampler=_Batches(batches),
        sync=SimpleNamespace(after_inner_step=lambda step, tokens: None),
        ctx=SimpleNamespace(manifest=SimpleNamespace(inner=inner), device="cpu"),
    )
    loss, tokens = LearnerRole._inner_step(learner, step)
    return learner, loss, tokens


def _window(seed: int, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    w = torch.randint(0, 256, (batch, CFG.context_len + 1), generator=torch.Generator().manual_seed(seed))
    return w[:, :-1], w[:, 1:]


def test_accumulating_two_halves_is_one_step_on_the_whole_batch() -> None:
    inputs, targets = _window(1, 8)
    whole, loss_whole, tokens_whole = _step(InnerOptimizerSpec(batch_size=8), [(inputs, targets)])
    halves = [(inputs[:4], targets[:4]), (inputs[4:], targets[4:])]
    acc, loss_acc, tokens_acc = _step(InnerOptimizerSpec(batch_size=4, accumulation=2), halves)
    assert tokens_acc == tokens_whole == 8 * CFG.context_len
    assert abs(loss_acc - loss_whole) < 1e-5
    for (name, a), b in zip(whole._model.named_parameters(), acc._model.parameters(), strict=True):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-4, atol=1e-6, msg=name)
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6, msg=name)


def test_clipping_bounds_the_gradient_norm_and_the_schedule_sets_the_lr() -> None:
    batch = [_window(2, 4)]
    unclipped, _, _ = _step(InnerOptimizerSpec(batch_size=4), list(batch))
    norm = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in unclipped._model.parameters()]))
    inner = InnerOptimizerSpec(batch_size=4, clip_norm=float(norm) / 10, warmup_steps=10, decay_steps=10)
    clipped, _, _ = _step(inner, list(batch), step=3)
    clipped_norm = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in clipped._model.parameters()]))
    assert float(clipped_norm) <= inner.clip_norm * 1.001 < float(norm)
    assert clipped._optimizer.param_groups[0]["lr"] == inner.lr_at(3) == pytest.approx(inner.lr * 0.3)
