"""The syncer's merge of one fragment: learner parameters in, one outer gradient out.

For each contribution the pseudo-gradient (delta) is global - learner, computed in float32 against the
syncer's current global fragment. Weights are the token weights tokens**2 / steps, normalised. Then,
per tensor:

* embedding tensors: the plain weighted mean of the deltas;
* every other tensor: weighted Radial-Directional Averaging (RDA),
  ``(sum_m w_m |d_m|) * unit(sum_m w_m unit(d_m))``, i.e. the direction of the weighted mean of unit
  vectors with the weighted mean of the norms. Learner deltas are nearly orthogonal, so a plain mean of
  M of them shrinks like 1/sqrt(M); RDA keeps the merged norm at the typical learner norm, so the outer
  learning rate need not be retuned for M. (The digest's Q2: the printed radial factor is a vector; we
  use the weighted mean of norms, as yeto does.) When the unit vectors cancel (their weighted mean has
  norm <= degenerate_tol times its maximum), the direction is noise, so that tensor falls back to the
  plain weighted mean and the result says so.

Before weighting, a contribution whose whole-fragment delta norm exceeds clip_factor x the (lower)
median norm of the weighted contributions is scaled down to that bound: nothing else checks the
data-parallel axis (SENTINEL watches pipeline boundaries), and RDA alone would let one huge delta keep
its full norm in the radial factor. Malformed contributions (wrong tensor set or shape, non-finite
values, negative counters, stale base version) are rejected with a reason, not raised: they are remote
data. If no contribution carries weight, `NothingToMerge` is raised; the syncer must then skip the outer
step (a zero outer gradient would still move the parameters through Nesterov momentum).

Memory (issue 17): the deltas are never held: each pass over a tensor (norms, then the weighted sum) recomputes them
from the contributions a chunk at a time (node.diloco.chunked; a contribution may be a spill file), clipped by a
scale and winsorized chunk by chunk, which needs the K contributions' values of one chunk at once, not K deltas. The
outer gradient is put together a chunk at a time too: in memory (one fragment), or with a spill directory in a file
whose RDA factor is applied as it is read, so that a syncer with its state on disk holds nothing fragment-sized.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass, field

import torch

from node.diloco import chunked
from node.diloco.counters import token_weight
from node.diloco.spill import ScaledTensors, SpillDir, SpilledTensors

logger = logging.getLogger(__name__)

DEFAULT_DEGENERATE_TOL = 1e-3


@dataclass(frozen=True, slots=True)
class Contribution:
    """One learner's copy of a fragment plus the counters that weigh it."""

    peer_id: str
    params: Mapping[str, torch.Tensor]  # the learner's current values of the fragment's tensors
    base_version: int  # version of the global fragment the learner last overwrote with
    steps: int  # inner steps since that overwrite (already capped by the syncer)
    tokens: int  # tokens since that overwrite (already capped by the syncer)


@dataclass(frozen=True, kw_only=True, slots=True)
class MergeResult:
    """What the merge did, for the outer step and for the event tape."""

    # float32 pseudo-gradient per tensor, to feed OuterNesterov: tensors, or a spill file read a chunk at a time
    outer_grad: Mapping[str, torch.Tensor]
    weights: dict[str, float]  # normalised weight per accepted peer (0.0 for no progress)
    clipped: dict[str, float]  # peer -> scale applied to its delta (< 1)
    fallback_tensors: tuple[str, ...]  # non-embedding tensors merged by plain mean (degenerate direction)
    rejected: dict[str, str]  # peer -> why its contribution was not used
    delta_norms: dict[str, float]  # whole-fragment delta norm per accepted peer, before clipping
    reason: str  # one line summary

    @property
    def clipped_peers(self) -> tuple[str, ...]:
        return tuple(sorted(self.clipped))

    @property
    def participants(self) -> tuple[str, ...]:
        """Peers whose delta entered the merge with positive weight."""
        return tuple(sorted(p for p, w in self.weights.items() if w > 0))


class NothingToMerge(ValueError):  # noqa: N818 - reads as the condition it reports
    """No contribution has positive weight (none given, all rejected, or all without progress)."""

    def __init__(self, message: str, rejected: Mapping[str, str] | None = None) -> None:
        super().__init__(message)
        self.rejected: dict[str, str] = dict(rejected or {})


@dataclass(slots=True)
class _Accepted:
    """A contribution taken into the merge: its deltas are never held whole (node.diloco.chunked), only its norm
    and the clipping scale they are multiplied by."""

    peer_id: str
    params: Mapping[str, torch.Tensor]
    weight: float
    norm: float = field(default=0.0)
    scale: float = 1.0  # < 1: clipped (`_clip`)


def merge_fragment(
    global_params: Mapping[str, torch.Tensor],
    contributions: Sequence[Contribution],
    *,
    embedding_names: Collection[str],
    clip_factor: float | None,
    degenerate_tol: float = DEFAULT_DEGENERATE_TOL,
    current_version: int | None = None,
    max_staleness: int | None = None,
    trim_fraction: float = 0.0,
    reweight: Callable[[Mapping[str, float]], Mapping[str, float]] | None = None,
    sparse: bool = False,
    spill: SpillDir | None = None,
) -> MergeResult:
    """Merge `contributions` to one fragment into an outer gradient (see the module docstring).

    `global_params` is the syncer's current value of the fragment; every contribution must carry exactly
    its tensor names and shapes. `clip_factor` None disables clipping, otherwise it must be >= 1. With
    `current_version` and `max_staleness` given, contributions built on a version older than
    current_version - max_staleness (or newer than current_version) are rejected.
    With `trim_fraction` > 0 and at least three weighted contributions, each coordinate of each delta is first
    clamped to the range of the values left after dropping the max(1, floor(trim_fraction x n)) highest and
    lowest (a winsorized merge: one or a few contributions cannot pull any coordinate past the honest ones'),
    among the contributions that sent it with `sparse` (a top-k codec's, `_winsorized`). `reweight` maps the raw
    token weights to the ones used (the seniority cap, node.diloco.seniority); a weight it leaves out is kept.
    `spill`: the outer gradient goes to a file there (`_Grad`). Raises NothingToMerge if no contribution is weighted,
    ValueError on bad arguments (duplicate peer ids, bad clip_factor or tolerance, empty fragment)."""
    _check_arguments(global_params, contributions, clip_factor, degenerate_tol)
    accepted, rejected = _screen(global_params, contributions, current_version, max_staleness)
    if reweight is not None:
        scaled = reweight({a.peer_id: a.weight for a in accepted})
        for a in accepted:
            a.weight = max(0.0, float(scaled.get(a.peer_id, a.weight)))
    total = math.fsum(a.weight for a in accepted)
    if total <= 0:
        raise NothingToMerge(
            f"no weighted contribution among {len(contributions)} ({len(rejected)} rejected)", rejected
        )
    weighted = [a for a in accepted if a.weight > 0]
    delta_norms = {a.peer_id: a.norm for a in accepted}
    clipped = _clip(weighted, clip_factor)
    trimmed = _trim_count(len(weighted), trim_fraction)
    weights = {a.peer_id: a.weight / total for a in accepted}
    args = (embedding_names, degenerate_tol, trimmed, sparse, spill)
    outer_grad, fallback = _merge_tensors(global_params, weighted, weights, *args)
    reason = (
        f"merged {len(weighted)}/{len(contributions)} contributions"
        f"; {len(rejected)} rejected, {len(accepted) - len(weighted)} without progress"
        f", {len(clipped)} clipped, {len(fallback)} tensors fell back to the mean"
        + (f", winsorized at {trimmed} of {len(weighted)} per coordinate" if trimmed else "")
    )
    return MergeResult(
        outer_grad=outer_grad,
        weights=weights,
        clipped=clipped,
        fallback_tensors=tuple(fallback),
        rejected=rejected,
        delta_norms=delta_norms,
        reason=reason,
    )


def _screen(
    global_params: Mapping[str, torch.Tensor],
    contributions: Sequence[Contribution],
    current_version: int | None,
    max_staleness: int | None,
) -> tuple[list[_Accepted], dict[str, str]]:
    """Split contributions into accepted ones (with their float32 delta norm and token weight) and peer -> reason."""
    rejected: dict[str, str] = {}
    accepted: list[_Accepted] = []
    for contribution in contributions:
        problem = _problem(contribution, global_params, current_version, max_staleness)
        norm = 0.0
        if problem is None:
            norm, problem = _delta_norm(contribution, global_params)
        if problem is not None:
            rejected[contribution.peer_id] = problem
            logger.info("rejected contribution from %s: %s", contribution.peer_id, problem)
            continue
        weight = token_weight(contribution.tokens, contribution.steps)
        accepted.append(_Accepted(contribution.peer_id, contribution.params, weight, norm))
    return accepted, rejected


def _merge_tensors(
    global_params: Mapping[str, torch.Tensor],
    weighted: Sequence[_Accepted],
    weights: Mapping[str, float],
    embedding_names: Collection[str],
    degenerate_tol: float,
    trim: int,
    sparse: bool = False,
    spill: SpillDir | None = None,
) -> tuple[Mapping[str, torch.Tensor], list[str]]:
    """Per tensor: the weighted mean for embeddings, RDA otherwise; also the tensors where RDA fell back. The
    deltas are recomputed a chunk at a time for each pass; the outer gradient is in memory (one fragment), or with
    `spill` in a file written a chunk at a time (`_Grad`): no fragment-sized buffer at all."""
    names = sorted(global_params)
    grad = _Grad(global_params, names, spill)
    fallback: list[str] = []
    for name in names:
        parts = _Parts(global_params, weighted, name, trim, sparse)
        alphas = [weights[a.peer_id] for a in weighted]
        if name in embedding_names:
            parts.accumulate(alphas, grad, name)
            continue
        if _rda(parts, alphas, degenerate_tol, grad, name):
            fallback.append(name)
    return grad.tensors, fallback


class _Grad:
    """Where the outer gradient goes, a chunk at a time: in-memory tensors, or a spill file
    (node.diloco.spill `SpillDir.create`) read through `ScaledTensors`, which applies a tensor's factors as it is read
    (`scale`); the values are the same either way."""

    def __init__(
        self, global_params: Mapping[str, torch.Tensor], names: Sequence[str], spill: SpillDir | None
    ) -> None:
        layout = [(n, chunked.shape(global_params, n)) for n in names]
        self.file: SpilledTensors | None = None
        self.tensors: Mapping[str, torch.Tensor]
        if spill is None:
            self.tensors = {n: torch.empty(shape, dtype=torch.float32) for n, shape in layout}
        else:
            self.file = spill.create(spill.new_key("outer-grad"), layout)
            self.tensors = ScaledTensors(self.file)

    def put(self, name: str, start: int, values: torch.Tensor) -> None:
        if self.file is not None:
            self.file.put(name, start, values)
        else:
            self.tensors[name].view(-1)[start : start + values.numel()].copy_(values)

    def scale(self, name: str, factor: float) -> None:
        if isinstance(self.tensors, ScaledTensors):
            self.tensors.scale(name, factor)
        else:
            self.tensors[name].mul_(factor)


class _Parts:
    """One tensor's deltas of the weighted contributions, clipped and winsorized, a chunk at a time."""

    def __init__(
        self,
        global_params: Mapping[str, torch.Tensor],
        weighted: Sequence[_Accepted],
        name: str,
        trim: int,
        sparse: bool = False,
    ) -> None:
        self.global_params, self.weighted, self.name, self.trim = global_params, weighted, name, trim
        self.sparse = sparse
        self.shape = chunked.shape(global_params, name)

    def chunks(self) -> Iterator[tuple[int, int, list[torch.Tensor]]]:
        """(start, stop, the contributions' delta values there) for each chunk of the tensor."""
        for start, stop in chunked.ranges(math.prod(self.shape)):
            deltas = []
            for a in self.weighted:
                delta = chunked.delta_piece(self.global_params, a.params, self.name, start, stop)
                deltas.append(delta.mul_(a.scale) if a.scale != 1.0 else delta)
            yield start, stop, _winsorized(deltas, self.trim, sparse=self.sparse)

    def accumulate(self, alphas: Sequence[float | None], grad: _Grad, name: str) -> float:
        """sum_m alphas[m] x delta_m, added in contribution order (a zero alpha skips that delta) into a zeroed
        chunk, put into `grad` chunk by chunk; returns the norm of the sum (float64 chunk sums)."""
        terms: list[float] = []
        for start, stop, deltas in self.chunks():
            out = torch.zeros(stop - start, dtype=torch.float32)
            for alpha, delta in zip(alphas, deltas, strict=True):
                if alpha is not None:
                    out.add_(delta, alpha=alpha)
            terms.append(chunked.squared(out))
            grad.put(name, start, out)
        return math.sqrt(math.fsum(terms))

    def norms(self) -> list[float]:
        """Each contribution's delta norm over the whole tensor (float64 chunk sums)."""
        sums: list[list[float]] = [[] for _ in self.weighted]
        for _, _, deltas in self.chunks():
            for into, delta in zip(sums, deltas, strict=True):
                into.append(chunked.squared(delta))
        return [math.sqrt(math.fsum(terms)) for terms in sums]


def _check_arguments(
    global_params: Mapping[str, torch.Tensor],
    contributions: Sequence[Contribution],
    clip_factor: float | None,
    degenerate_tol: float,
) -> None:
    if not global_params:
        raise ValueError("global_params is empty")
    if clip_factor is not None and not (clip_factor >= 1.0):
        raise ValueError(f"clip_factor must be None or >= 1, got {clip_factor!r}")
    if not 0.0 <= degenerate_tol < 1.0:
        raise ValueError(f"degenerate_tol must be in [0, 1), got {degenerate_tol!r}")
    peers = [c.peer_id for c in contributions]
    if len(set(peers)) != len(peers):
        raise ValueError("duplicate peer_id among contributions")


def _problem(
    contribution: Contribution,
    global_params: Mapping[str, torch.Tensor],
    current_version: int | None,
    max_staleness: int | None,
) -> str | None:
    if contribution.steps < 0 or contribution.tokens < 0:
        return f"negative counters (steps={contribution.steps}, tokens={contribution.tokens})"
    if set(contribution.params) != set(global_params):
        missing = sorted(set(global_params) - set(contribution.params))
        extra = sorted(set(contribution.params) - set(global_params))
        return f"tensor names differ (missing {missing[:3]}, extra {extra[:3]})"
    if current_version is not None and max_staleness is not None:
        age = current_version - contribution.base_version
        if age < 0 or age > max_staleness:
            return f"base version {contribution.base_version} vs current {current_version}"
    return None


def _delta_norm(
    contribution: Contribution, global_params: Mapping[str, torch.Tensor]
) -> tuple[float, str | None]:
    """The norm of the contribution's whole-fragment delta (float64, as `norms.norm`), or why it is malformed."""
    terms: list[float] = []
    # (the global parameters may be files: their shapes only, their values a chunk at a time)
    for name in global_params:
        theirs, shape = chunked.shape(contribution.params, name), chunked.shape(global_params, name)
        if theirs != shape:
            return 0.0, f"{name}: shape {theirs} != {shape}"
        if not chunked.is_float(contribution.params, name):
            return 0.0, f"{name}: dtype {contribution.params[name].dtype} is not floating point"
        tensor: list[float] = []
        for start, stop in chunked.ranges(math.prod(shape)):
            delta = chunked.delta_piece(global_params, contribution.params, name, start, stop)
            if not bool(torch.isfinite(delta).all()):
                return 0.0, f"{name}: non-finite values"
            tensor.append(chunked.squared(delta))
        terms.append(math.fsum(tensor))  # as norms.norm: per tensor, then over tensors
    return math.sqrt(math.fsum(terms)), None


def _clip(weighted: list[_Accepted], clip_factor: float | None) -> dict[str, float]:
    """Scale down deltas above clip_factor x the lower median norm; returns peer -> scale."""
    if clip_factor is None or len(weighted) < 2:
        return {}
    norms = sorted(a.norm for a in weighted)
    # Lower median: with two contributions the smaller norm sets the bound, so one outlier of two
    # cannot raise its own limit.
    median = norms[(len(norms) - 1) // 2]
    if median <= 0:
        return {}
    bound = clip_factor * median
    clipped: dict[str, float] = {}
    for a in weighted:
        if a.norm > bound:
            a.scale = scale = bound / a.norm  # applied as its deltas are read (`_Parts`)
            clipped[a.peer_id] = scale
            logger.info("clipped %s delta norm %.4g to %.4g", a.peer_id, a.norm, bound)
    return clipped


def _trim_count(n: int, trim_fraction: float) -> int:
    """k of the winsorized merge: max(1, floor(trim_fraction x n)) with k < n / 2, for n >= 3; 0: not applied."""
    if trim_fraction <= 0 or n < 3:
        return 0
    return min(max(1, math.floor(trim_fraction * n)), (n - 1) // 2)


def _winsorized(deltas: list[torch.Tensor], k: int, *, sparse: bool = False) -> list[torch.Tensor]:
    """Each delta chunk clamped to [k-th lowest, k-th highest] of the chunks' values at each coordinate (k = 0:
    as they are). Needs every contribution's chunk at once: K chunks, not K fragments.

    `sparse` (a top-k outer codec: each learner sends a few coordinates, the rest decode to exact zeros): ranked
    among the contributions that sent the coordinate (non-zero) only, a zero stays zero, and a coordinate fewer
    than 2k + 1 sent is left alone. Ranked among the others' zeros, every value fewer than k + 1 learners sent
    would be clamped to zero: nearly the whole update (+11 % held-out loss in benchmarks/codec_sweep.py)."""
    if k <= 0:
        return deltas
    stacked = torch.stack(deltas)
    if sparse:
        low, high = _sparse_bounds(stacked, k)
        # a coordinate this learner did not send stays unsent (a bound of the senders' would invent one)
        return [torch.where(d != 0, torch.minimum(torch.maximum(d, low), high), 0.0) for d in deltas]
    ordered = stacked.sort(dim=0).values
    low, high = ordered[k], ordered[len(deltas) - 1 - k]
    return [torch.minimum(torch.maximum(d, low), high) for d in deltas]


def _sparse_bounds(stacked: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per coordinate, the k-th lowest and k-th highest of the non-zero values of `stacked` ([n, ...]), or
    -inf/+inf (no clamp) where fewer than 2k + 1 are non-zero. Such a coordinate stays bounded by the sender's
    codec scale and the norm clipping; robust statistics need more senders than that."""
    sent = stacked != 0
    inf = torch.tensor(math.inf, dtype=stacked.dtype)
    low = torch.where(sent, stacked, inf).sort(dim=0).values[k]
    high = torch.where(sent, stacked, -inf).sort(dim=0, descending=True).values[k]
    few = sent.sum(dim=0) < 2 * k + 1
    return torch.where(few, -inf, low), torch.where(few, inf, high)


def _rda(parts: _Parts, weights: Sequence[float], tol: float, grad: _Grad, name: str) -> bool:
    """Weighted RDA of one tensor into `grad`; returns whether it fell back to the plain mean. Weights sum to 1.
    The direction's length is summed a chunk at a time in float64 (it was a float32 norm of the whole tensor,
    which a chunked merge does not hold: the two differ by rounding)."""
    lengths = parts.norms()
    alphas: list[float | None] = []
    radial = reach = 0.0  # reach: the norm the direction would have if all unit vectors agreed
    for weight, norm in zip(weights, lengths, strict=True):
        alphas.append(weight / norm if norm != 0.0 else None)
        if norm != 0.0:
            radial += weight * norm
            reach += weight
    length = parts.accumulate(alphas, grad, name)
    if reach == 0.0:
        return False  # every delta is zero; so is the merge
    if length <= tol * reach:
        parts.accumulate(list(weights), grad, name)
        return True
    grad.scale(name, radial / length)
    return False
