"""A contribution less its projection on the recent merged direction (issue 18, cosine gaming; node.diloco.evidence).

The recent merged direction is public: every learner fetches the merged versions, so it can compute the updates
between them. Noise at an honest norm plus a fraction of that direction agrees with it (an honest-looking cosine)
and the public part adds held-out descent: the direction averages many learners' private noise away, so per unit of
norm it descends the held-out loss faster than one honest delta, and 0.2 of it was enough to earn a full factor.
What a contribution adds beyond the public direction is its residual, d - (d . u) u with u the unit direction: the
evidence judges the residual's held-out slope (`LossProbe.measure`'s `residual`), which for that attack is the
noise's (about 1/sqrt(n) of an honest slope, either sign), and for honest work its own private descent.

`PublicResidual` is the residual contribution as parameters (base - residual delta), computed a chunk at a time
when read (`chunk`), never held whole (issue 17), like the spilled mappings it reads from.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping

import torch

from node.diloco import chunked


class PublicResidual(Mapping[str, torch.Tensor]):
    """`params` + `coefficient` x `direction` over `params`' tensors: the contribution whose delta (base - params) is
    the original delta less `coefficient` x `direction` (its projection when `coefficient` = (d . E) / |E|^2)."""

    def __init__(
        self, params: Mapping[str, torch.Tensor], direction: Mapping[str, torch.Tensor], coefficient: float
    ) -> None:
        self.params, self.direction, self.coefficient = params, direction, coefficient

    def shape_of(self, name: str) -> tuple[int, ...]:
        return chunked.shape(self.params, name)

    def chunk(self, name: str, start: int, stop: int) -> torch.Tensor:
        out = chunked.piece(self.params, name, start, stop).to(torch.float32, copy=True)
        if name in self.direction:
            out.add_(
                chunked.piece(self.direction, name, start, stop).to(torch.float32), alpha=self.coefficient
            )
        return out

    def __getitem__(self, name: str) -> torch.Tensor:
        flat = torch.empty(chunked.numel(self.params, name), dtype=torch.float32)
        for start, stop in chunked.ranges(flat.numel()):
            flat[start:stop] = self.chunk(name, start, stop)
        return flat.view(self.shape_of(name))

    def __contains__(self, name: object) -> bool:
        return name in self.params  # Mapping's own would compute the tensor whole

    def __iter__(self) -> Iterator[str]:
        return iter(self.params)

    def __len__(self) -> int:
        return len(self.params)


def public_residual(
    base: Mapping[str, torch.Tensor],
    params: Mapping[str, torch.Tensor],
    direction: Mapping[str, torch.Tensor],
) -> PublicResidual | None:
    """The contribution (`params` built on `base`) less its projection on `direction` (any length); None when the
    direction is zero or a product is not finite (nothing to remove: the caller scores the delta itself)."""
    dot, length = [], []
    for name in params:
        if name not in direction:
            continue
        for start, stop in chunked.ranges(chunked.numel(params, name)):
            e = chunked.piece(direction, name, start, stop).to(torch.float32)
            dot.append(float(torch.dot(chunked.delta_piece(base, params, name, start, stop), e)))
            length.append(chunked.squared(e))
    squared = math.fsum(length)
    coefficient = math.fsum(dot) / squared if squared > 0 else math.nan
    # d - c E as parameters: base - (d - c E) = params + c E
    return PublicResidual(params, direction, coefficient) if math.isfinite(coefficient) else None
