"""The syncer's outer optimiser: SGD with Nesterov momentum, one momentum buffer per tensor.

Same update as ``torch.optim.SGD(lr, momentum, nesterov=True)`` with no dampening or weight decay:

    buf <- momentum * buf + g          (buf starts at g)
    theta <- theta - lr * (g + momentum * buf)

where g is the merged pseudo-gradient of a fragment. Buffers are keyed by parameter name, so they are
per fragment by construction (a name lives in exactly one fragment) and a fragment's buffers only move
when that fragment is merged. State is kept in float32 whatever the parameter dtype, and is exported as
a flat name -> tensor dict so it can be written with safetensors next to the global parameters.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterator, Mapping

import torch

from node.diloco import chunked

logger = logging.getLogger(__name__)

STATE_PREFIX = "outer_momentum/"


class NonFiniteStep(ArithmeticError):
    """The outer step gave a non-finite parameter or momentum value; nothing was changed."""


class OuterNesterov:
    """Nesterov outer step over named tensors; pure apart from its momentum buffers."""

    def __init__(self, lr: float = 0.7, momentum: float = 0.9) -> None:
        if not math.isfinite(lr) or lr <= 0:
            raise ValueError(f"outer lr must be finite and > 0, got {lr!r}")
        if not 0.0 <= momentum < 1.0:
            raise ValueError(f"outer momentum must be in [0, 1), got {momentum!r}")
        self.lr = float(lr)
        self.momentum = float(momentum)
        self._buffers: dict[str, torch.Tensor] = {}

    def step(
        self,
        global_params: Mapping[str, torch.Tensor],
        outer_grad: Mapping[str, torch.Tensor],
        *,
        require_finite: bool = False,
    ) -> dict[str, torch.Tensor]:
        """Return new values for the tensors named in `outer_grad`; inputs are not modified.

        Every name in `outer_grad` must be in `global_params` with the same shape. The new tensors have
        the dtype of the corresponding global parameter. With `require_finite`, a non-finite new value or
        momentum raises NonFiniteStep and the momentum stays as it was (the round is rolled back): finite
        but huge pseudo-gradients (1e38) overflow here, and a published inf poisons the model for good.
        """
        updated, buffers = self.step_from(
            self._buffers, global_params, outer_grad, require_finite=require_finite
        )
        self._buffers.update(buffers)
        return updated

    def step_from(
        self,
        momentum: Mapping[str, torch.Tensor],
        global_params: Mapping[str, torch.Tensor],
        outer_grad: Mapping[str, torch.Tensor],
        *,
        require_finite: bool = False,
    ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """`step` on the buffers `momentum` (name -> buffer; absent: none yet) instead of this optimiser's own:
        (new values, new buffers of the names in `outer_grad`); nothing is modified (a syncer that keeps its
        momentum on disk, node.diloco.spill, steps a fragment with its buffers just read)."""
        for name, grad in outer_grad.items():
            if name not in global_params:
                raise ValueError(f"outer_grad names unknown parameter {name!r}")
            if tuple(grad.shape) != tuple(global_params[name].shape):
                raise ValueError(
                    f"{name}: outer_grad shape {tuple(grad.shape)} != {tuple(global_params[name].shape)}"
                )
            buf = momentum.get(name)
            if buf is not None and tuple(buf.shape) != tuple(grad.shape):
                raise ValueError(f"{name}: momentum buffer shape {tuple(buf.shape)} != {tuple(grad.shape)}")
        updated: dict[str, torch.Tensor] = {}
        buffers: dict[str, torch.Tensor] = {}
        for name, grad in outer_grad.items():
            g = grad.detach().to(torch.float32)
            buf = momentum.get(name)
            # out of place: the old buffers stay intact until the whole step is known to be good
            buf = buffers[name] = g.clone() if buf is None else buf.mul(self.momentum).add_(g)
            direction = g.add(buf, alpha=self.momentum)
            param = global_params[name]
            new = param.detach().to(torch.float32).sub(direction, alpha=self.lr)
            updated[name] = new.to(param.dtype)
        if require_finite:
            bad = [n for n in updated if not (_finite(updated[n]) and _finite(buffers[n]))]
            if bad:
                raise NonFiniteStep(f"outer step non-finite in {len(bad)} tensors, e.g. {bad[0]}")
        return updated, buffers

    def step_in_place(
        self,
        momentum: Mapping[str, torch.Tensor] | None,
        global_params: Mapping[str, torch.Tensor],
        outer_grad: Mapping[str, torch.Tensor],
        *,
        require_finite: bool = False,
        put: Callable[[str, int, torch.Tensor], None] | None = None,
    ) -> Iterator[torch.Tensor]:
        """`step_from` a chunk at a time (node.diloco.chunked) for a syncer that keeps its momentum on disk: each
        chunk of `outer_grad` (float32, owned by the caller) is overwritten with the new parameter values there,
        and the new momentum buffers are yielded chunk by chunk, in `outer_grad`'s order, to be written to a file.
        `put(name, start, values)`: where the new values go instead (`outer_grad` then may be a spill file read a
        chunk at a time, node.diloco.spill, and nothing fragment-sized is held). Fragment-sized memory: none beyond
        `outer_grad` itself (`momentum`, e.g. a spill file, is read a chunk at a time). The values are those of
        `step_from`; with `require_finite`, NonFiniteStep is raised after the last chunk (the caller drops what it
        wrote, and `outer_grad` holds no gradient any more)."""
        checked = momentum or {}
        self._check_in_place(checked, global_params, outer_grad, in_memory=put is None)
        bad: list[str] = []
        for name in outer_grad:
            finite = True
            for start, stop in chunked.ranges(chunked.numel(outer_grad, name)):
                g = chunked.piece(outer_grad, name, start, stop)
                buf = (
                    g.clone()
                    if name not in checked
                    else chunked.piece(checked, name, start, stop)
                    .to(torch.float32)
                    .mul(self.momentum)
                    .add_(g)
                )
                direction = g.add(buf, alpha=self.momentum)
                new = (
                    chunked.piece(global_params, name, start, stop)
                    .to(torch.float32)
                    .sub(direction, alpha=self.lr)
                )
                finite = finite and (not require_finite or (_finite(new) and _finite(buf)))
                if put is None:
                    g.copy_(new)
                else:
                    put(name, start, new)
                yield buf
            if not finite:
                bad.append(name)
        if bad:
            raise NonFiniteStep(f"outer step non-finite in {len(bad)} tensors, e.g. {bad[0]}")

    @staticmethod
    def _check_in_place(
        momentum: Mapping[str, torch.Tensor],
        global_params: Mapping[str, torch.Tensor],
        outer_grad: Mapping[str, torch.Tensor],
        *,
        in_memory: bool,
    ) -> None:
        for name in outer_grad:
            shape = chunked.shape(outer_grad, name)
            if name not in global_params or shape != chunked.shape(global_params, name):
                raise ValueError(f"outer_grad {name!r} is not a parameter of this shape")
            grad = outer_grad[name] if in_memory else None
            if grad is not None and (grad.dtype != torch.float32 or not grad.is_contiguous()):
                raise ValueError(f"{name}: outer_grad must be contiguous float32 to be stepped in place")
            if name in momentum and chunked.shape(momentum, name) != shape:
                raise ValueError(f"{name}: momentum buffer shape != {shape}")

    def state_dict(self, *, share: bool = False) -> dict[str, torch.Tensor]:
        """Flat copy of the momentum buffers, keys prefixed with STATE_PREFIX. With `share`, the buffers themselves
        (read-only: `step` puts new buffers in and never writes one in place, so they keep their values)."""
        return {
            STATE_PREFIX + name: buf if share else buf.clone() for name, buf in sorted(self._buffers.items())
        }

    def load_state_dict(self, state: Mapping[str, torch.Tensor]) -> None:
        """Replace all buffers from a dict produced by `state_dict` (ValueError on foreign keys or dtypes)."""
        self._buffers = checked_buffers(state, copy=True)

    def buffer(self, name: str) -> torch.Tensor | None:
        """The momentum buffer of one tensor (None before its first step); a view, do not modify."""
        return self._buffers.get(name)


def checked_buffers(state: Mapping[str, torch.Tensor], *, copy: bool) -> dict[str, torch.Tensor]:
    """name -> float32 buffer of a `state_dict`-shaped dict, checked (ValueError on foreign keys, a dtype that is not
    floating point, non-finite values); with `copy`, never the caller's tensors."""
    buffers: dict[str, torch.Tensor] = {}
    for key, tensor in state.items():
        if not key.startswith(STATE_PREFIX) or len(key) == len(STATE_PREFIX):
            raise ValueError(f"unexpected key in outer optimiser state: {key!r}")
        if not tensor.is_floating_point():
            raise ValueError(f"{key}: dtype {tensor.dtype} is not floating point")
        if not bool(torch.isfinite(tensor).all()):
            raise ValueError(f"{key}: non-finite values")
        buffer = tensor.detach().to(torch.float32)
        buffers[key[len(STATE_PREFIX) :]] = buffer.clone() if copy else buffer
    return buffers


def _finite(tensor: torch.Tensor) -> bool:
    return bool(torch.isfinite(tensor).all())
