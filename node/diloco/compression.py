"""Learner-side error feedback for compressed outer gradients (issue 20; SparseLoCo's error feedback).

A lossy codec (top-k above all) drops most of every pseudo-gradient. Without feedback the small coordinates never
reach the syncer: each round they are dropped again. With it, the learner keeps what the codec lost in a residual
per fragment and adds it to the next delta before encoding::

    corrected = delta + residual
    encoded   = encode(corrected)
    residual  = corrected - decode(encoded)

so the decoded updates sum to the true deltas minus the current residual, which stays bounded (the codec keeps
each chunk's largest entries, so a coordinate cannot grow without being sent). Pure: no I/O, no clock.

A contribution the syncer refuses for good carried work that never arrived: `forget` drops the residual of that
fragment (the next delta, measured from the version the learner then loads, already holds the lost progress as
far as the learner still has it); a contribution merely deferred is re-sent as encoded, so the residual stands.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import torch

from protocol.codec import TensorLimits
from protocol.compress import CodecSpec, Encoded, decode, encode


class ErrorFeedback:
    """The residuals of one learner, one flat float32 tensor per fragment, for one codec."""

    def __init__(self, spec: CodecSpec, *, enabled: bool = True) -> None:
        self.spec = spec
        # fp32 is lossless, so a residual would stay zero: skip the decode and the copy
        self.enabled = enabled and spec.codec != "fp32"
        self._residuals: dict[int, torch.Tensor] = {}

    def encode(self, fragment: int, delta: torch.Tensor) -> Encoded:
        """Encode `delta + residual` for `fragment` and keep what the codec lost as its new residual.

        A delta of another shape than the residual (a new plan) starts the fragment afresh."""
        corrected = delta.detach().to("cpu", torch.float32)
        residual = self._residuals.get(fragment)
        if residual is not None and residual.shape == corrected.shape:
            corrected = corrected + residual
        encoded = encode(corrected, self.spec)
        if self.enabled:
            self._residuals[fragment] = corrected - decode(
                encoded.header, encoded.payload, _own_limits(corrected)
            )
        return encoded

    def residual(self, fragment: int) -> torch.Tensor | None:
        return self._residuals.get(fragment)

    def residual_norm(self, fragment: int) -> float:
        residual = self._residuals.get(fragment)
        return 0.0 if residual is None else float(residual.norm())

    def forget(self, fragment: int) -> None:
        """Drop the residual of `fragment` (its contribution was refused for good, or the learner reloaded)."""
        self._residuals.pop(fragment, None)

    def total_bytes(self) -> int:
        """Memory the residuals hold (one float32 copy of every fragment sent with a lossy codec)."""
        return sum(4 * r.numel() for r in self._residuals.values())


def _own_limits(tensor: torch.Tensor) -> TensorLimits:
    """Limits for decoding what we just encoded ourselves: exactly its size (the checks still run, cheaply)."""
    return TensorLimits(max_bytes=max(4 * tensor.numel(), 1), max_rank=max(tensor.dim(), 1), max_dim=1 << 62)


def relative_error(decoded: torch.Tensor, reference: torch.Tensor) -> float:
    """||decoded - reference|| / ||reference|| (0 for a zero reference that was decoded exactly)."""
    ref = float(reference.norm())
    err = float((decoded - reference).norm())
    return err / ref if ref > 0 else (0.0 if err == 0 else math.inf)


# ---- a fragment as one vector: what a compressed contribution would carry (see the report of issue 20 part 1)


def flatten_fragment(tensors: Mapping[str, torch.Tensor], names: Sequence[str]) -> torch.Tensor:
    """The fragment's tensors as one float32 vector, in plan order: one codec header per fragment, and chunks
    and blocks that run across tensor boundaries (so no tensor pays for a short last chunk)."""
    return torch.cat([tensors[name].detach().to("cpu", torch.float32).reshape(-1) for name in names])


def unflatten_fragment(
    flat: torch.Tensor, shapes: Mapping[str, tuple[int, ...]], names: Sequence[str]
) -> dict[str, torch.Tensor]:
    """Inverse of `flatten_fragment`; ValueError when `flat` does not have exactly the fragment's size."""
    sizes = [math.prod(shapes[name]) for name in names]
    if flat.dim() != 1 or flat.numel() != sum(sizes):
        raise ValueError(f"a vector of {flat.numel()} elements for a fragment of {sum(sizes)}")
    out, offset = {}, 0
    for name, size in zip(names, sizes, strict=True):
        out[name] = flat[offset : offset + size].reshape(shapes[name])
        offset += size
    return out


def fragment_delta(
    base: Mapping[str, torch.Tensor], params: Mapping[str, torch.Tensor], names: Sequence[str]
) -> torch.Tensor:
    """base - params, flat: the merge's sign (`merge._deltas`), so the syncer's params are base - decoded."""
    return flatten_fragment(base, names) - flatten_fragment(params, names)


def params_from_delta(
    base: Mapping[str, torch.Tensor], delta: torch.Tensor, names: Sequence[str]
) -> dict[str, torch.Tensor]:
    """The learner's params as the syncer sees them: its copy of the base version minus the decoded delta."""
    shapes = {name: tuple(base[name].shape) for name in names}
    return unflatten_fragment(flatten_fragment(base, names) - delta, shapes, names)
