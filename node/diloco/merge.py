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
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field

import torch

from node.diloco import norms
from node.diloco.counters import token_weight

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

    outer_grad: dict[str, torch.Tensor]  # float32 pseudo-gradient per tensor, to feed OuterNesterov
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
    peer_id: str
    deltas: dict[str, torch.Tensor]
    weight: float
    norm: float = field(default=0.0)


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
) -> MergeResult:
    """Merge `contributions` to one fragment into an outer gradient (see the module docstring).

    `global_params` is the syncer's current value of the fragment; every contribution must carry exactly
    its tensor names and shapes. `clip_factor` None disables clipping, otherwise it must be >= 1. With
    `current_version` and `max_staleness` given, contributions built on a version older than
    current_version - max_staleness (or newer than current_version) are rejected.
    With `trim_fraction` > 0 and at least three weighted contributions, each coordinate of each delta is first
    clamped to the range of the values left after dropping the max(1, floor(trim_fraction x n)) highest and
    lowest (a winsorized merge: one or a few contributions cannot pull any coordinate past the honest ones'),
    among the contributions that sent it with `sparse` (a top-k codec's, `_winsorize`). `reweight` maps the raw
    token weights to the ones used (the seniority cap, node.diloco.seniority); a weight it leaves out is kept.
    Raises NothingToMerge if no accepted contribution has positive weight, ValueError on bad arguments
    (duplicate peer ids, bad clip_factor or tolerance, empty fragment)."""
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
    trimmed = _winsorize(weighted, trim_fraction, sparse=sparse)
    weights = {a.peer_id: a.weight / total for a in accepted}
    outer_grad, fallback = _merge_tensors(
        sorted(global_params), weighted, weights, embedding_names, degenerate_tol
    )
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
    """Split contributions into accepted ones (with their float32 deltas and token weight) and peer -> reason."""
    rejected: dict[str, str] = {}
    accepted: list[_Accepted] = []
    for contribution in contributions:
        problem = _problem(contribution, global_params, current_version, max_staleness)
        if problem is None:
            deltas, problem = _deltas(contribution, global_params)
        if problem is not None:
            rejected[contribution.peer_id] = problem
            logger.info("rejected contribution from %s: %s", contribution.peer_id, problem)
            continue
        weight = token_weight(contribution.tokens, contribution.steps)
        accepted.append(_Accepted(contribution.peer_id, deltas, weight, _norm(deltas.values())))
    return accepted, rejected


def _merge_tensors(
    names: Sequence[str],
    weighted: Sequence[_Accepted],
    weights: Mapping[str, float],
    embedding_names: Collection[str],
    degenerate_tol: float,
) -> tuple[dict[str, torch.Tensor], list[str]]:
    """Per tensor: the weighted mean for embeddings, RDA otherwise; also the tensors where RDA fell back."""
    outer_grad: dict[str, torch.Tensor] = {}
    fallback: list[str] = []
    for name in names:
        items = [(weights[a.peer_id], a.deltas[name]) for a in weighted]
        if name in embedding_names:
            outer_grad[name] = _weighted_mean(items)
            continue
        merged, degenerate = _rda(items, degenerate_tol)
        outer_grad[name] = merged
        if degenerate:
            fallback.append(name)
    return outer_grad, fallback


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


def _deltas(
    contribution: Contribution, global_params: Mapping[str, torch.Tensor]
) -> tuple[dict[str, torch.Tensor], str | None]:
    deltas: dict[str, torch.Tensor] = {}
    for name, base in global_params.items():
        theirs = contribution.params[name]
        if tuple(theirs.shape) != tuple(base.shape):
            return {}, f"{name}: shape {tuple(theirs.shape)} != {tuple(base.shape)}"
        if not theirs.is_floating_point():
            return {}, f"{name}: dtype {theirs.dtype} is not floating point"
        delta = base.detach().to(torch.float32) - theirs.detach().to(torch.float32)
        if not bool(torch.isfinite(delta).all()):
            return {}, f"{name}: non-finite values"
        deltas[name] = delta
    return deltas, None


def _norm(tensors: Collection[torch.Tensor]) -> float:
    return norms.norm(tensors)  # float64, a chunk at a time (a float64 copy of the tensor was 2 of its size)


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
            scale = bound / a.norm
            a.deltas = {name: d * scale for name, d in a.deltas.items()}
            clipped[a.peer_id] = scale
            logger.info("clipped %s delta norm %.4g to %.4g", a.peer_id, a.norm, bound)
    return clipped


def _winsorize(weighted: list[_Accepted], trim_fraction: float, *, sparse: bool = False) -> int:
    """Clamp each coordinate of each delta to [k-th lowest, k-th highest] of the weighted deltas' values there
    (k = max(1, floor(trim_fraction x n)), n >= 3, k < n / 2); returns k (0: not applied).

    `sparse` (a top-k outer codec: each learner sends a few coordinates, the rest decode to exact zeros): ranked
    among the contributions that sent the coordinate (non-zero) only, a zero stays zero, and a coordinate fewer
    than 2k + 1 sent is left alone. Ranked among the others' zeros, every value fewer than k + 1 learners sent
    would be clamped to zero: nearly the whole update (+11 % held-out loss in benchmarks/codec_sweep.py)."""
    n = len(weighted)
    if trim_fraction <= 0 or n < 3:
        return 0
    k = min(max(1, math.floor(trim_fraction * n)), (n - 1) // 2)
    for name in weighted[0].deltas:
        stacked = torch.stack([a.deltas[name] for a in weighted])
        if sparse:
            low, high = _sparse_bounds(stacked, k)
        else:
            ordered = stacked.sort(dim=0).values
            low, high = ordered[k], ordered[n - 1 - k]
        for a in weighted:
            clamped = torch.minimum(torch.maximum(a.deltas[name], low), high)
            # a coordinate this learner did not send stays unsent (a bound of the senders' would invent one)
            a.deltas[name] = torch.where(a.deltas[name] != 0, clamped, 0.0) if sparse else clamped
    return k


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


def _weighted_mean(items: list[tuple[float, torch.Tensor]]) -> torch.Tensor:
    out = torch.zeros_like(items[0][1])
    for weight, delta in items:
        out.add_(delta, alpha=weight)
    return out


def _rda(items: list[tuple[float, torch.Tensor]], tol: float) -> tuple[torch.Tensor, bool]:
    """Weighted RDA of one tensor; returns (merged, fell_back). Weights sum to 1."""
    direction = torch.zeros_like(items[0][1])
    radial = 0.0
    reach = 0.0  # the norm `direction` would have if all unit vectors agreed
    for weight, delta in items:
        norm = float(delta.norm())
        if norm == 0.0:
            continue
        direction.add_(delta, alpha=weight / norm)
        radial += weight * norm
        reach += weight
    if reach == 0.0:
        return direction, False  # every delta is zero; so is the merge
    length = float(direction.norm())
    if length <= tol * reach:
        return _weighted_mean(items), True
    return direction.mul_(radial / length), False
