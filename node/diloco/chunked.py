"""Fragment tensors a chunk at a time (issue 17: the syncer's peak memory ~ the model).

A llama-1b embedding is one 65 M-value tensor, a whole fragment: any full-tensor temporary of it (a delta, a float32
cast, a clipped copy) is a fragment more in memory. The syncer's checks and its merge work on `CHUNK`-value slices
of the flattened tensors instead, whether a tensor is in memory or in a spill file (node.diloco.spill
`SpilledTensors`, which reads just the slice asked for). The chunks are `norms.CHUNK` long and start at a tensor's
first value, so a norm summed over them adds the same float64 terms as `norms.squared_norm` of the whole tensor."""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping

import torch

from node.diloco import norms

CHUNK = norms.CHUNK


def ranges(numel: int) -> Iterator[tuple[int, int]]:
    """(start, stop) of each chunk of a tensor of `numel` values."""
    for start in range(0, numel, CHUNK):
        yield start, min(start + CHUNK, numel)


def piece(tensors: Mapping[str, torch.Tensor], name: str, start: int, stop: int) -> torch.Tensor:
    """Values [start, stop) of the flattened tensor `name`: a view of an in-memory tensor, or read from a spill file
    (a mapping with a `chunk` method), never the whole tensor."""
    reader = getattr(tensors, "chunk", None)
    if reader is not None:
        return reader(name, start, stop)  # type: ignore[no-any-return]
    return tensors[name].detach().reshape(-1)[start:stop]


def shape(tensors: Mapping[str, torch.Tensor], name: str) -> tuple[int, ...]:
    """The shape of tensor `name`, without reading a spilled one."""
    reader = getattr(tensors, "shape_of", None)
    if reader is not None:
        return reader(name)  # type: ignore[no-any-return]
    return tuple(tensors[name].shape)


def is_float(tensors: Mapping[str, torch.Tensor], name: str) -> bool:
    """Whether tensor `name` has a floating dtype (a spilled one is float32)."""
    if getattr(tensors, "shape_of", None) is not None:
        return True
    return tensors[name].is_floating_point()


def delta_piece(
    base: Mapping[str, torch.Tensor], params: Mapping[str, torch.Tensor], name: str, start: int, stop: int
) -> torch.Tensor:
    """base - params over [start, stop) of `name`, in float32 (the merge's sign: the pseudo-gradient)."""
    return piece(base, name, start, stop).to(torch.float32) - piece(params, name, start, stop).to(
        torch.float32
    )


def squared(chunk: torch.Tensor) -> float:
    """The float64 sum of squares of one chunk (one term of `norms.squared_norm`)."""
    return float(torch.linalg.vector_norm(chunk, dtype=torch.float64)) ** 2


class Delta(Mapping[str, torch.Tensor]):
    """base - params as a mapping that computes a chunk when asked (`chunk`), never held whole; `[name]` computes
    the whole tensor (for callers that need one)."""

    def __init__(self, base: Mapping[str, torch.Tensor], params: Mapping[str, torch.Tensor]) -> None:
        self.base, self.params = base, params

    def shape_of(self, name: str) -> tuple[int, ...]:
        return shape(self.params, name)

    def chunk(self, name: str, start: int, stop: int) -> torch.Tensor:
        return delta_piece(self.base, self.params, name, start, stop)

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.base[name].detach().to(torch.float32) - self.params[name].detach().to(torch.float32)

    def __iter__(self) -> Iterator[str]:
        return iter(self.params)

    def __len__(self) -> int:
        return len(self.params)


def numel(tensors: Mapping[str, torch.Tensor], name: str) -> int:
    return math.prod(shape(tensors, name))


def norm(tensors: Mapping[str, torch.Tensor]) -> float:
    """`norms.norm(tensors.values())` a chunk at a time (the same float64 terms, summed the same way)."""
    return math.sqrt(
        math.fsum(
            math.fsum(squared(piece(tensors, n, s, e)) for s, e in ranges(numel(tensors, n))) for n in tensors
        )
    )


def distance(a: Mapping[str, torch.Tensor], b: Mapping[str, torch.Tensor]) -> float:
    """The L2 distance of `a` and `b` over `a`'s tensors, in float32 differences a chunk at a time (the same terms
    as a sum of `norms.distance` per tensor)."""
    terms = []
    for name in a:
        tensor = []
        for start, stop in ranges(numel(a, name)):
            gap = piece(a, name, start, stop).to(torch.float32) - piece(b, name, start, stop).to(
                torch.float32
            )
            tensor.append(squared(gap))
        terms.append(math.fsum(tensor))
    return math.sqrt(math.fsum(terms))
