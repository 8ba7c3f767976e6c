"""Outer Nesterov: identical to torch.optim.SGD(nesterov=True), per-fragment buffers, flat state."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load, save

from node.diloco.outer import STATE_PREFIX, OuterNesterov


def _reference_step(
    opt: torch.optim.SGD, params: dict[str, torch.nn.Parameter], grads: dict[str, torch.Tensor]
) -> None:
    for name, p in params.items():
        p.grad = grads[name].clone()
    opt.step()


def test_matches_torch_sgd_nesterov_over_several_steps() -> None:
    gen = torch.Generator().manual_seed(0)
    init = {"a": torch.randn(4, 3, generator=gen), "b": torch.randn(7, generator=gen)}
    ref = {n: torch.nn.Parameter(t.clone()) for n, t in init.items()}
    opt = torch.optim.SGD(list(ref.values()), lr=0.7, momentum=0.9, nesterov=True)
    ours = OuterNesterov(lr=0.7, momentum=0.9)
    current = {n: t.clone() for n, t in init.items()}
    for _ in range(6):
        grads = {n: torch.randn(t.shape, generator=gen) for n, t in init.items()}
        _reference_step(opt, ref, grads)
        current = ours.step(current, grads)
        for name in init:
            torch.testing.assert_close(current[name], ref[name].detach(), rtol=1e-6, atol=1e-6)


def test_buffers_are_per_fragment_and_only_move_when_stepped() -> None:
    gen = torch.Generator().manual_seed(1)
    frag_a = {"a": torch.randn(5, generator=gen)}
    frag_b = {"b": torch.randn(3, generator=gen)}
    ref_a = {"a": torch.nn.Parameter(frag_a["a"].clone())}
    ref_b = {"b": torch.nn.Parameter(frag_b["b"].clone())}
    opt_a = torch.optim.SGD(list(ref_a.values()), lr=0.7, momentum=0.9, nesterov=True)
    opt_b = torch.optim.SGD(list(ref_b.values()), lr=0.7, momentum=0.9, nesterov=True)
    ours = OuterNesterov()
    params = {**frag_a, **frag_b}
    schedule = ["a", "a", "b", "a", "b", "b", "a"]  # fragments merge at different times
    for which in schedule:
        grad = {which: torch.randn(params[which].shape, generator=gen)}
        if which == "a":
            _reference_step(opt_a, ref_a, grad)
        else:
            _reference_step(opt_b, ref_b, grad)
        params |= ours.step(params, grad)
    torch.testing.assert_close(params["a"], ref_a["a"].detach())
    torch.testing.assert_close(params["b"], ref_b["b"].detach())


def test_state_round_trips_through_safetensors() -> None:
    gen = torch.Generator().manual_seed(2)
    params = {"x.weight": torch.randn(3, 2, generator=gen)}
    grads = [{"x.weight": torch.randn(3, 2, generator=gen)} for _ in range(4)]
    straight = OuterNesterov()
    p1 = straight.step(params, grads[0])
    p1 = straight.step(p1, grads[1])
    blob = save(straight.state_dict())
    restored = OuterNesterov()
    restored.load_state_dict(load(blob))
    assert set(load(blob)) == {STATE_PREFIX + "x.weight"}
    a = straight.step(straight.step(p1, grads[2]), grads[3])
    b = restored.step(restored.step(p1, grads[2]), grads[3])
    torch.testing.assert_close(a["x.weight"], b["x.weight"])


def test_inputs_untouched_and_dtype_kept() -> None:
    params = {"w": torch.ones(4, dtype=torch.bfloat16)}
    grad = {"w": torch.full((4,), 0.5)}
    before = params["w"].clone()
    out = OuterNesterov(lr=1.0, momentum=0.5).step(params, grad)
    assert torch.equal(params["w"], before)
    assert out["w"].dtype == torch.bfloat16
    # first step: buf = g, update = g + 0.5 g
    torch.testing.assert_close(out["w"].float(), torch.full((4,), 1.0 - 0.75))


def test_errors() -> None:
    ours = OuterNesterov()
    with pytest.raises(ValueError, match="unknown"):
        ours.step({"w": torch.zeros(2)}, {"v": torch.zeros(2)})
    with pytest.raises(ValueError, match="shape"):
        ours.step({"w": torch.zeros(2)}, {"w": torch.zeros(3)})
    with pytest.raises(ValueError):
        OuterNesterov(lr=0.0)
    with pytest.raises(ValueError):
        OuterNesterov(momentum=1.0)
    with pytest.raises(ValueError, match="unexpected key"):
        ours.load_state_dict({"w": torch.zeros(2)})
    with pytest.raises(ValueError, match="non-finite"):
        ours.load_state_dict({STATE_PREFIX + "w": torch.tensor([float("nan")])})
    ours.load_state_dict({STATE_PREFIX + "w": torch.zeros(2)})
    with pytest.raises(ValueError, match="buffer shape"):
        ours.step({"w": torch.zeros(3)}, {"w": torch.zeros(3)})
