"""A forward pass through a parameterless skeleton (node.roles.syncer.model_skeleton) in which some tensors are never
held whole: they are computed a block of rows at a time while the pass reaches the module that owns them (issue 17).

Why: the syncer's held-out loss probe (node.diloco.loss_probe) scores a contribution applied alone, the fragment's
tensors as current - (base - params). Built whole, that is one fragment more in the syncer's memory for every push
(llama-1b: 0.25 GiB at 16 fragments a stage, 0.96 GiB at 4), over its goal of model + 2 fragments (docs/scale.md).

How: the parameter mapping handed to `skeleton_loss` names the tensors it streams (`streamed`) and gives their
values by flat range (`chunk(name, start, stop)`, `shape_of(name)`), as node.diloco.chunked's mappings do. For the
call, the module owning such a tensor computes with it a block at a time:
* `nn.Linear`: its output features a block of weight rows at a time, written into the output;
* `nn.Embedding`: the rows its inputs look up, gathered a block of rows at a time (blocks no input falls in are
  not read);
* any other module (a norm's vector, GPT-2's `Conv1D`): its streamed tensors whole, for its own call only.
A block is about `block_values` values; what the pass holds beyond the skeleton's other tensors is one block and
the modules' outputs, whatever the fragment's size.

Safety: inside `streaming`, a streamed tensor's parameter slot holds a guard (`_Guard`) that raises on any
computation: code that reads it outside its module's own forward fails instead of scoring something else. (The
skeleton's meta parameter would not do: a CPU tensor times a meta one returned garbage values, torch 2.x.) The
modules are patched only inside `streaming` (the probe's skeleton is its own, used one call at a time).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

BLOCK_VALUES = 1 << 20  # values per block of rows (4 MiB of float32), as node.diloco.chunked's chunks


class _Guard(torch.Tensor):
    """Stands in a streamed tensor's parameter slot: reading its shape or dtype is allowed, computing with it
    raises."""

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if getattr(func, "__name__", "") == "__get__":  # a property: .shape, .dtype, .device
            return super().__torch_function__(func, types, args, kwargs or {})
        name = getattr(func, "__name__", str(func))
        raise RuntimeError(f"a streamed tensor was used outside its module's own forward ({name})")


def _guard(shape: tuple[int, ...]) -> torch.Tensor:
    return torch.empty(shape, device="meta").as_subclass(_Guard)


def streamed_names(params: Mapping[str, torch.Tensor]) -> frozenset[str]:
    """The tensors of `params` given a block at a time (empty for a plain mapping of tensors)."""
    names = getattr(params, "streamed", None)
    return frozenset(names) if names is not None else frozenset()


class _Rows:
    """Rows [start, stop) of one streamed 2-D tensor, read from the mapping's flat ranges."""

    def __init__(self, params: Any, name: str, device: torch.device | str, block_values: int) -> None:
        shape = tuple(params.shape_of(name))
        if len(shape) != 2:
            raise ValueError(f"{name}: rows of a {len(shape)}-D tensor")
        self.params, self.name, self.device = params, name, device
        self.num_rows, self.cols = shape
        self.step = max(1, block_values // max(1, self.cols))

    def blocks(self) -> Iterator[tuple[int, int]]:
        for start in range(0, self.num_rows, self.step):
            yield start, min(start + self.step, self.num_rows)

    def read(self, start: int, stop: int) -> torch.Tensor:
        flat = self.params.chunk(self.name, start * self.cols, stop * self.cols)
        return flat.reshape(stop - start, self.cols).to(device=self.device, dtype=torch.float32)


def _linear_forward(module: nn.Linear, rows: _Rows, bias: Callable[[], torch.Tensor | None]) -> Any:
    def forward(x: torch.Tensor) -> torch.Tensor:
        out = x.new_empty((*x.shape[:-1], rows.num_rows))
        b = bias()
        for start, stop in rows.blocks():
            piece = None if b is None else b[start:stop]
            out[..., start:stop] = F.linear(x, rows.read(start, stop), piece)
        return out

    return forward


def _embedding_forward(rows: _Rows) -> Any:
    def forward(ids: torch.Tensor) -> torch.Tensor:
        flat = ids.reshape(-1)
        out = torch.empty((flat.numel(), rows.cols), dtype=torch.float32, device=rows.device)
        wanted = torch.unique(flat)
        for start, stop in rows.blocks():
            if not bool(((wanted >= start) & (wanted < stop)).any()):
                continue  # no input looks a row of this block up: not read
            where = ((flat >= start) & (flat < stop)).nonzero().squeeze(1)
            out[where] = rows.read(start, stop)[flat[where] - start]
        return out.reshape(*ids.shape, rows.cols)

    return forward


def _whole_hooks(module: nn.Module, own: dict[str, str], params: Any, device: Any) -> Callable[[], None]:
    """Hooks giving `module` its streamed tensors (local name -> full name) whole for its own call; the undo."""
    saved: dict[str, Any] = {}

    def before(mod: nn.Module, args: Any) -> None:
        for local, full in own.items():
            saved[local] = mod._parameters[local]
            mod._parameters[local] = params[full].to(device)

    def after(mod: nn.Module, args: Any, out: Any) -> None:
        for local in own:
            mod._parameters[local] = saved.pop(local)

    handles = [module.register_forward_pre_hook(before), module.register_forward_hook(after)]

    def undo() -> None:
        for handle in handles:
            handle.remove()

    return undo


def _patch(
    module: nn.Module, own: dict[str, str], params: Any, device: Any, block: int
) -> Callable[[], None]:
    """Make `module` compute with its streamed tensors `own` (local name -> full name), guards in their slots;
    the undo."""
    originals = {local: module._parameters[local] for local in own}
    for local, full in own.items():
        module._parameters[local] = _guard(tuple(params.shape_of(full)))  # type: ignore[assignment]
    unpatch = _patch_forward(module, own, params, device, block)

    def undo() -> None:
        unpatch()
        module._parameters.update(originals)

    return undo


def _patch_forward(
    module: nn.Module, own: dict[str, str], params: Any, device: Any, block: int
) -> Callable[[], None]:
    streamed_bias = own.get("bias")
    if isinstance(module, nn.Linear) and "weight" in own:
        rows = _Rows(params, own["weight"], device, block)

        def bias() -> torch.Tensor | None:
            if streamed_bias is not None:
                return params[streamed_bias].to(device)
            return module.bias

        module.forward = _linear_forward(module, rows, bias)  # type: ignore[method-assign]
    elif isinstance(module, nn.Embedding) and set(own) == {"weight"} and module.max_norm is None:
        module.forward = _embedding_forward(_Rows(params, own["weight"], device, block))  # type: ignore[method-assign]
    else:
        return _whole_hooks(module, own, params, device)

    def undo() -> None:
        del module.forward

    return undo


@contextlib.contextmanager
def streaming(
    model: nn.Module,
    params: Mapping[str, torch.Tensor],
    device: Any = "cpu",
    block_values: int = BLOCK_VALUES,
) -> Iterator[None]:
    """Inside, `model`'s modules compute with `params`' streamed tensors (`streamed_names`) a block at a time;
    the modules as they were after."""
    names = streamed_names(params)
    undo: list[Callable[[], None]] = []
    found: set[str] = set()
    try:
        for prefix, module in model.named_modules():
            own = {
                local: f"{prefix}.{local}" if prefix else local
                for local, _ in module.named_parameters(recurse=False)
            }
            own = {local: full for local, full in own.items() if full in names}
            if own:
                undo.append(_patch(module, own, params, device, block_values))
                found.update(own.values())
        if found != names:
            raise KeyError(f"streamed tensors not in the model: {sorted(names - found)[:3]}")
        yield
    finally:
        for step in reversed(undo):
            step()


class ChunkedHeadLoss(nn.Module):
    """`model`'s mean next-token loss (node.ml.model.lm_loss) with its logits computed for a few token positions at a
    time, about `block_values` logits each (the loss summed over them), never for the whole batch: the logits and
    the cross-entropy's log-probabilities of 64 tokens of a 32 K vocabulary were 16 MiB at once, over the syncer's
    memory goal while the loss probe scored (llama-1b, docs/scale.md). `model` is a `node.ml.model.CausalLM` (or its
    skeleton); its parameters are this module's under `model.`."""

    def __init__(self, model: nn.Module, block_values: int = BLOCK_VALUES) -> None:
        super().__init__()
        self.model, self.block_values = model, block_values

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        model: Any = self.model
        hidden = model.run_layers(model.embed(tokens))
        hidden = hidden.reshape(-1, hidden.shape[-1])
        flat = targets.reshape(-1)
        step = max(1, self.block_values // model.cfg.vocab_size)
        total = hidden.new_zeros((), dtype=torch.float32)
        for start in range(0, flat.numel(), step):
            logits = model.logits(hidden[start : start + step]).float()
            total += F.cross_entropy(logits, flat[start : start + step], reduction="sum")
        return total / flat.numel()
