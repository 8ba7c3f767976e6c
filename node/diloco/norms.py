"""Float64 norms of float32 tensors without a float64 copy of the tensor (issue 17: the syncer's memory).

`torch.linalg.vector_norm(t, dtype=torch.float64)` casts the whole tensor first: a llama-1b embedding (65 M values)
became a 0.5 GiB temporary at every screened push, and `t.double().pow(2)` two of them. Here the cast is done a
chunk at a time; the sums of the chunks are added with `math.fsum`, so the result differs from the one-call norm by
rounding only."""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch

CHUNK = 1 << 20  # values per float64 chunk: 8 MiB


def squared_norm(tensor: torch.Tensor) -> float:
    """The sum of squares of `tensor`'s values, accumulated in float64."""
    flat = tensor.detach().reshape(-1)
    return math.fsum(
        float(torch.linalg.vector_norm(flat[i : i + CHUNK], dtype=torch.float64)) ** 2
        for i in range(0, flat.numel(), CHUNK)
    )


def norm(tensors: Iterable[torch.Tensor]) -> float:
    """The L2 norm of several tensors taken as one vector, accumulated in float64."""
    return math.sqrt(math.fsum(squared_norm(t) for t in tensors))


def distance(a: torch.Tensor, b: torch.Tensor) -> float:
    """The squared L2 distance of two tensors of one shape, in float32 differences a chunk at a time."""
    flat_a, flat_b = a.detach().reshape(-1), b.detach().reshape(-1)
    return math.fsum(
        squared_norm(flat_a[i : i + CHUNK].float() - flat_b[i : i + CHUNK].float())
        for i in range(0, flat_a.numel(), CHUNK)
    )
