"""SENTINEL boundary monitor: scores every tensor crossing a pipeline-stage boundary.

This module owns the statistics of one verifier: per boundary (stage, direction) an EMA baseline of the
batch-mean tensor, the distances of each incoming tensor to it, the cross-replica comparison and the
adaptive fences that turn distances into a flag. It owns no policy about what a flag costs the sender
(that is `verification.ledger`) and it never touches the network: the clock is passed in.

How a tensor is judged (docs/sentinel.md has the measurements behind every number):

1. Validity: non-finite values or a shape that differs from the boundary's baseline are flagged at once.
2. Scores, eight per tensor, in log or cosine units:
   - the paper's four, against an EMA of the batch mean (updated only with accepted tensors): L1 and
     L2 distance (divided by a running RMS scale rather than by the norm of the EMA, which is tiny and
     unstable for gradients, and by 1/sqrt(batch) so batch size does not matter), a sign-flip ratio
     weighted by |EMA|, and a sliced Wasserstein distance over token rows;
   - the tensor's RMS level and its within-batch spread (zero for a free-rider that sends the
     expected value);
   - when the caller passes `context` (what the verifier itself sent the stage for this microbatch),
     the token-wise cosine between tensor and context ("align") and their RMS ratio ("gain"). For
     residual stages these remove the data variation that hides replay, matched-scale random,
     sign-flip and free-riding attacks, in both directions.
3. Cross-replica centre: every replica's last few scores are kept; with at least two replicas seen
   recently, a score is judged as a residual against the lower median over replicas of their recent
   medians. A shift shared by the replicas (a merged version, a learning-rate change) moves the centre
   with it, so it stops being flagged after a few checks and the EMA keeps learning: no lock-out.
4. Fences: robust two-sided fences, median +- k * 1.4826 * MAD (or Tukey's Q1 - k IQR, Q3 + k IQR on
   request), over a window of the residuals (raw scores while fewer than two replicas are known) of
   accepted tensors only. Two-sided, so a tensor that is too close to the baseline is flagged too.
5. Combination: a tensor is flagged when any metric is outside its fence (k = 6 by default).
6. Lock-out: judged against history alone, a boundary that refuses nearly every check for `lockout_s`, sent by
   replicas that wrote little of that history (their peers who wrote it left), starts a new one.
"""

from __future__ import annotations

import logging
import math
from collections import deque
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field, replace
from typing import Any, Literal

import numpy as np
import torch

logger = logging.getLogger(__name__)

Direction = Literal["forward", "backward"]
Mode = Literal["invalid", "warmup", "solo", "peer", "rewarm"]

METRICS: tuple[str, ...] = ("l1", "l2", "sfr", "sw", "level", "spread", "align", "gain")
_EPS = 1e-30
_ALIGN, _GAIN = METRICS.index("align"), METRICS.index("gain")
_MAD_TO_SIGMA = 1.4826  # MAD of a normal sample times this estimates its sigma
_IQR_TO_SIGMA = 1.349  # likewise for the inter-quartile range


@dataclass(frozen=True, kw_only=True, slots=True)
class SentinelConfig:
    """Settings of one boundary monitor; defaults are the tuned values in docs/sentinel.md."""

    ema_beta_forward: float = 0.9  # EMA momentum of the batch-mean activation (paper: beta_h)
    ema_beta_backward: float = 0.8  # EMA momentum of the batch-mean gradient (paper: beta_g)
    metrics: tuple[str, ...] = METRICS  # which metrics vote (a subset is for ablations)
    sw_projections: int = 32  # sliced-Wasserstein directions, drawn once from sw_seed
    sw_seed: int = 0x5E17
    fence_kind: Literal["mad", "tukey"] = "mad"
    fence_k: float = 6.0  # mad: half-width in robust sigmas; tukey: multiplier of the IQR
    blatant_k: float = 25.0  # during a re-warm only deviations this large are flagged
    min_fence_width: float = 0.01  # floor on the robust sigma (log units: about 1 %)
    window_checks: int = 256  # accepted scores kept per fence
    min_window_checks: int = 32  # a fence needs this many before it may flag
    warmup_checks: int = 100  # accepted tensors before the first flag
    rewarm_checks: int = 16  # checks with only blatant flags after `rewarm()`
    peer_recent_checks: int = 3  # each replica is summarised by the median of its last N scores
    peer_horizon_checks: int = 64  # a replica counts as current if seen within the last N checks here
    min_peer_replicas: int = 2  # replicas needed for the cross-replica centre (else: history only)
    # Lock-out: at least `lockout_fraction` of a boundary's last `lockout_checks` checks flagged against its
    # history (no cross-replica centre), continuously for `lockout_s` (in the caller's clock units: longer
    # than a routing cooldown, so a peer that sits one out is not taken for gone), sent by replicas that wrote
    # less than `lockout_max_share` of the history's recent accepted tensors (its writers left): the history
    # starts again on them. 0 checks turns the rule off.
    lockout_checks: int = 64
    lockout_fraction: float = 0.9
    lockout_s: float = 10.0
    lockout_max_share: float = 0.25

    def __post_init__(self) -> None:
        for name in ("ema_beta_forward", "ema_beta_backward"):
            beta = getattr(self, name)
            if not 0.0 <= beta < 1.0:
                raise ValueError(f"{name} must be in [0, 1), got {beta}")
        unknown = set(self.metrics) - set(METRICS)
        if unknown or not self.metrics:
            raise ValueError(f"metrics must be a non-empty subset of {METRICS}, got {self.metrics}")
        if self.fence_kind not in ("mad", "tukey"):
            raise ValueError(f"fence_kind must be 'mad' or 'tukey', got {self.fence_kind!r}")
        if self.fence_k <= 0 or self.blatant_k < self.fence_k:
            raise ValueError("need 0 < fence_k <= blatant_k")
        if self.min_fence_width <= 0:
            raise ValueError("min_fence_width must be positive")
        if self.sw_projections < 1:
            raise ValueError("sw_projections must be >= 1")
        if not 1 <= self.min_window_checks <= self.window_checks:
            raise ValueError("need 1 <= min_window_checks <= window_checks")
        for name in ("warmup_checks", "rewarm_checks"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0")
        if self.peer_recent_checks < 1 or self.peer_horizon_checks < 1:
            raise ValueError("peer_recent_checks and peer_horizon_checks must be >= 1")
        if self.min_peer_replicas < 2:
            raise ValueError("min_peer_replicas must be >= 2: one replica has no peers to compare with")
        if self.lockout_checks < 0 or self.lockout_s < 0:
            raise ValueError("need lockout_checks >= 0 and lockout_s >= 0")
        if not (0.0 < self.lockout_fraction <= 1.0 and 0.0 <= self.lockout_max_share <= 1.0):
            raise ValueError("need 0 < lockout_fraction <= 1 and 0 <= lockout_max_share <= 1")

    def beta(self, direction: Direction) -> float:
        return self.ema_beta_forward if direction == "forward" else self.ema_beta_backward


@dataclass(slots=True)  # not frozen: a frozen dataclass's __init__ costs a setattr call per field
class _Summary:
    """What accept() needs from a scored tensor, so it is not recomputed."""

    batch_mean: np.ndarray  # [tokens, features] float32
    projected: np.ndarray  # sliced-Wasserstein projections of the token rows: [projections, tokens]
    log_rms: float
    scores: np.ndarray | None  # [len(METRICS)] log-domain scores; None before a baseline exists
    residual: np.ndarray | None  # scores minus the cross-replica centre, in peer mode


@dataclass(frozen=True, slots=True)
class Verdict:
    """The monitor's judgement of one boundary tensor; `reason` is meant for logs and ban evidence."""

    flagged: bool
    reason: str
    mode: Mode
    signer: str
    microbatch_id: int
    scores: dict[str, float]  # log-domain score per metric (what the fences see before centring)
    deviations: dict[str, float]  # robust z of the fenced value per metric (absent when not judged)
    fences: dict[str, tuple[float, float]]  # (low, high) per metric in the fenced value's domain
    _summary: _Summary | None = field(default=None, repr=False, compare=False)
    reanchored: bool = False  # this check found the boundary locked out: its history starts again after it


def _as_batch_tokens_features(tensor: torch.Tensor) -> torch.Tensor:
    """View any [B, ..., D] tensor as [B, tokens, D] float32 on the CPU, without copying when possible."""
    x = tensor.detach()
    if x.dtype is not torch.float32 or not x.is_cpu or not x.is_contiguous():
        x = x.to("cpu", torch.float32).contiguous()
    if x.dim() == 1:
        return x.view(1, 1, -1)
    return x.view(x.shape[0], -1, x.shape[-1])


def _row_dots(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Per-row dot products of two [rows, features] arrays in one pass and without a temporary: passes
    over the full boundary tensor are what a check costs (torch's (a * b).sum(-1) writes and rereads a
    copy of it, and torch's small ops cost more dispatch than the arithmetic)."""
    dots: np.ndarray = np.einsum("ij,ij->i", a, b)
    return dots


def _paired(
    x_norms: np.ndarray, xc: np.ndarray, c_norms: np.ndarray, rms: float, numel: int
) -> tuple[float, float]:
    """(align, gain) from per-token norms and dot products: mean token-wise cosine between tensor and
    context, and log of their RMS ratio."""
    cosine = x_norms * c_norms
    cosine += _EPS
    np.divide(xc, cosine, out=cosine)
    align = float(cosine.sum()) / max(1, cosine.size)
    rms_c = math.sqrt(float(np.vdot(c_norms, c_norms)) / max(1, numel))
    if not (math.isfinite(align) and math.isfinite(rms_c)) or rms_c == 0.0:
        return math.nan, math.nan
    return align, math.log(rms + _EPS) - math.log(rms_c)


def _sorted_quantile(ordered: np.ndarray, count: np.ndarray, q: float) -> np.ndarray:
    """Per-column quantile (linear interpolation) of columns sorted ascending whose first `count[j]`
    entries are the finite ones (np.sort puts NaN, the paired metrics' value where no context was
    passed, last); NaN for a column without finite entries."""
    position = q * np.maximum(count - 1, 0)
    low = np.floor(position).astype(np.intp)
    high = np.ceil(position).astype(np.intp)
    columns = np.arange(ordered.shape[1])
    at_low, at_high = ordered[low, columns], ordered[high, columns]
    return np.where(count > 0, at_low + (at_high - at_low) * (position - low), np.nan)


def _segment_median(ordered: np.ndarray, start: np.ndarray, stop: np.ndarray) -> np.ndarray:
    """Per-column median of ordered[start[j]:stop[j], j] (non-empty sorted segments)."""
    position = start + (stop - start - 1) / 2
    low = np.clip(np.floor(position).astype(np.intp), 0, ordered.shape[0] - 1)
    high = np.clip(np.ceil(position).astype(np.intp), 0, ordered.shape[0] - 1)
    columns = np.arange(ordered.shape[1])
    at_low, at_high = ordered[low, columns], ordered[high, columns]
    median: np.ndarray = at_low + (at_high - at_low) * (position - low)
    return median


def _sliced_wasserstein(projected_a: np.ndarray, projected_b: np.ndarray) -> float:
    """Mean 1-D Wasserstein-1 distance between two sets of projected token rows ([projections, tokens]:
    each projection's values are contiguous, so the sorts run on contiguous rows). The sort is numpy's:
    about 20x faster than torch's CPU sort for rows this short."""
    gap = np.sort(projected_a, axis=-1)
    gap -= np.sort(projected_b, axis=-1)
    return float(np.abs(gap, out=gap).sum()) / projected_a.size


def _small_median(rows: list[np.ndarray]) -> np.ndarray:
    """Per-column median of a few score vectors (np.median's machinery costs more than the data here)."""
    if len(rows) == 1:
        return rows[0]
    if len(rows) == 2:
        mean: np.ndarray = (rows[0] + rows[1]) / 2
        return mean
    stacked = np.sort(np.array(rows), axis=0)
    middle = len(rows) // 2
    median: np.ndarray = stacked[middle] if len(rows) % 2 else (stacked[middle - 1] + stacked[middle]) / 2
    return median


class _ScoreWindow:
    """Ring buffer of accepted score vectors with robust two-sided fences.

    The fences are recomputed after every `refresh` appends rather than per check: one more score in a
    window of hundreds moves a median by a negligible amount, and the medians dominate the check's cost."""

    def __init__(self, capacity: int, width: int, refresh: int = 8) -> None:
        self._data = np.zeros((capacity, width), dtype=np.float64)
        self._count = 0
        self._next = 0
        self._refresh = refresh
        self._stale = 0
        self._cache: tuple[str, _Fences] | None = None

    def __len__(self) -> int:
        return self._count

    def append(self, values: np.ndarray) -> None:
        self._data[self._next] = values
        self._next = (self._next + 1) % self._data.shape[0]
        self._count = min(self._count + 1, self._data.shape[0])
        self._stale += 1

    def fences(self, cfg: SentinelConfig) -> _Fences:
        if self._cache is None or self._stale >= self._refresh or self._cache[0] != cfg.fence_kind:
            self._cache = (cfg.fence_kind, _compute_fences(self._data[: self._count], cfg))
            self._stale = 0
        return self._cache[1]

    def state(self) -> dict[str, Any]:
        return {"data": torch.from_numpy(self._data.copy()), "count": self._count, "next": self._next}

    def load(self, state: dict[str, Any]) -> None:
        data = state["data"].detach().cpu().numpy().astype(np.float64)
        if data.shape != self._data.shape:
            raise ValueError(f"window shape {data.shape} != {self._data.shape}")
        self._data = data
        self._count = int(state["count"])
        self._next = int(state["next"])
        self._cache = None


@dataclass(frozen=True, slots=True)
class _Fences:
    """Per-metric robust location and one scale per side; `bounds(k)` gives the fences."""

    kind: str
    centre: np.ndarray
    sigma_low: np.ndarray
    sigma_high: np.ndarray
    q1: np.ndarray
    q3: np.ndarray
    _bounds: dict[float, tuple[np.ndarray, np.ndarray]] = field(default_factory=dict, compare=False)

    def bounds(self, k: float) -> tuple[np.ndarray, np.ndarray]:
        if k not in self._bounds:  # the same fences judge every check until the next refresh
            if self.kind == "mad":
                self._bounds[k] = (self.centre - k * self.sigma_low, self.centre + k * self.sigma_high)
            else:
                iqr = self.q3 - self.q1
                self._bounds[k] = (self.q1 - k * iqr, self.q3 + k * iqr)
        return self._bounds[k]


def _compute_fences(data: np.ndarray, cfg: SentinelConfig) -> _Fences:
    """Robust fences per column. "mad": median +- k robust sigmas, one sigma per side (1.4826 x the
    median deviation of the values on that side), because several honest metrics are skewed (the
    gradient's gain has q01 -3 and q99 +6.6 in symmetric units) and one symmetric width either flags
    the long side or goes blind on the short one. "tukey": Q1 - k IQR, Q3 + k IQR.

    Everything comes from one sort per column (np.quantile, np.nanmedian and per-column partitions cost
    more than the rest of a check): the values on the upper side of the median are a suffix of the
    sorted finite values, those on the lower side a prefix, and a median of deviations from the centre
    is the median of that segment minus the centre."""
    ordered = np.sort(data, axis=0)
    count = np.count_nonzero(~np.isnan(ordered), axis=0)
    centre = _sorted_quantile(ordered, count, 0.5)
    q1, q3 = _sorted_quantile(ordered, count, 0.25), _sorted_quantile(ordered, count, 0.75)
    floor = cfg.min_fence_width
    if cfg.fence_kind == "tukey":
        sigma = np.maximum((q3 - q1) / _IQR_TO_SIGMA, floor)
        return _Fences("tukey", centre, sigma, sigma, q1, q3)
    with np.errstate(invalid="ignore"):  # NaN centres of columns without data compare False
        above_from = np.count_nonzero(ordered < centre, axis=0)  # values >= centre: [above_from, count)
        below_to = np.count_nonzero(ordered <= centre, axis=0)  # values <= centre: [0, below_to)
    empty = count == 0
    upper = _segment_median(ordered, above_from, np.where(empty, above_from + 1, count))
    lower = _segment_median(ordered, np.zeros_like(count), np.where(empty, 1, below_to))
    sigma_high = np.where(empty, np.nan, np.maximum((upper - centre) * _MAD_TO_SIGMA, floor))
    sigma_low = np.where(empty, np.nan, np.maximum((centre - lower) * _MAD_TO_SIGMA, floor))
    return _Fences("mad", centre, sigma_low, sigma_high, q1, q3)


@dataclass(slots=True)
class _Replica:
    last_check: int
    recent: deque[np.ndarray]
    median: np.ndarray
    flagged: bool = False  # its latest check was flagged


class _Peers:
    """The stage's replicas as the cross-replica centre sees them: each one's recent scores and their median."""

    def __init__(self, config: SentinelConfig) -> None:
        self.config = config
        self.replicas: dict[str, _Replica] = {}

    def remember(self, signer: str, scores: np.ndarray, flagged: bool, check: int) -> None:
        entry = self.replicas.get(signer)
        if entry is None:
            entry = _Replica(check, deque(maxlen=self.config.peer_recent_checks), scores)
            self.replicas[signer] = entry
        entry.recent.append(scores)
        entry.last_check = check
        entry.flagged = flagged
        entry.median = _small_median(list(entry.recent))
        if len(self.replicas) > 4 * self.config.peer_horizon_checks:
            horizon = check - self.config.peer_horizon_checks
            for gone in [s for s, r in self.replicas.items() if r.last_check < horizon]:
                del self.replicas[gone]

    def mark_flagged(self, signer: str) -> None:
        if signer in self.replicas:
            self.replicas[signer].flagged = True

    def forget(self, signer: str) -> None:
        self.replicas.pop(signer, None)

    def centre(self, check: int) -> np.ndarray | None:
        """Lower median over current replicas of their recent-median scores; None with too few replicas.

        The lower median keeps the centre on the calmer replica when there are only two. (Leaving
        replicas flagged at their latest check out of the centre was tried: during an lr spike the
        set of "calm" replicas churned and the centre lagged, doubling honest flags.)"""
        horizon = check - self.config.peer_horizon_checks
        medians = [r.median for r in self.replicas.values() if r.last_check >= horizon]
        if len(medians) < self.config.min_peer_replicas:
            return None
        centre: np.ndarray
        if len(medians) == 2:  # the sort's answer (NaN last, so a NaN loses) in one ufunc
            centre = np.fmin(medians[0], medians[1])
        else:
            centre = np.sort(np.array(medians), axis=0)[(len(medians) - 1) // 2]
        return centre

    def state(self) -> dict[str, Any]:
        return {
            signer: {
                "last": r.last_check,
                "recent": torch.from_numpy(np.stack(tuple(r.recent))),
                "flagged": r.flagged,
            }
            for signer, r in self.replicas.items()
        }

    def load(self, state: dict[str, Any]) -> None:
        self.replicas = {}
        for signer, entry in state.items():
            rows = entry["recent"].detach().cpu().numpy().astype(np.float64)
            recent = deque(list(rows), maxlen=self.config.peer_recent_checks)
            self.replicas[signer] = _Replica(
                int(entry["last"]), recent, _small_median(list(recent)), bool(entry.get("flagged", False))
            )


class _Lockout:
    """The lock-out rule's memory (SentinelConfig.lockout_checks): who wrote a boundary's history, and which of
    its latest checks were refused against that history alone, since when.

    With a cross-replica centre a shift shared by the replicas re-anchors by itself. Without one (a
    replica left alone on its stage) only accepted tensors move the history, so a survivor whose
    outputs differ from those of the replicas that wrote it (it sat out a routing cooldown, or was the
    odd one of two, while they trained on; then they died) is refused for good, or nearly: the odd
    tensor it gets accepted moves the EMA very little (test_pipeline: 97-99 % of its microbatches dropped
    for 21 s in one run; in another every one for 18 s, until the test gave up). Replicas that wrote the
    history themselves are not helped: a sudden change of their own outputs is what it is there to
    catch."""

    def __init__(self, config: SentinelConfig) -> None:
        self.config = config
        self.writers: deque[str] = deque(maxlen=config.window_checks)  # signers of accepted tensors
        # the last lockout_checks checks: the signer of each one flagged against the history alone, else None
        self.recent: deque[str | None] = deque(maxlen=max(1, config.lockout_checks))
        self.refusals = 0  # how many of them are not None
        self.since: float | None = None  # since when they have been a lock-out's share

    def wrote(self, signer: str) -> None:
        self.writers.append(signer)

    def refused_signers(self) -> set[str]:
        return {s for s in self.recent if s is not None}

    def observe(self, verdict: Verdict, now: float) -> bool:
        """Count `verdict`; True when `lockout_fraction` of the last `lockout_checks` checks were refused against
        the history alone, continuously for `lockout_s`, by replicas that wrote under `lockout_max_share` of
        its recent accepted tensors."""
        cfg = self.config
        if cfg.lockout_checks == 0:
            return False
        refused = verdict.flagged and verdict.mode in ("solo", "rewarm")
        if len(self.recent) == self.recent.maxlen and self.recent[0] is not None:
            self.refusals -= 1
        self.recent.append(verdict.signer if refused else None)
        self.refusals += refused
        full = len(self.recent) == self.recent.maxlen
        if not (full and self.refusals >= cfg.lockout_fraction * len(self.recent)):
            self.since = None
            return False
        if self.since is None:
            self.since = now
        if now - self.since < cfg.lockout_s:
            return False
        signers = self.refused_signers()
        written = sum(1 for w in self.writers if w in signers)
        if not self.writers or written < cfg.lockout_max_share * len(self.writers):
            return True
        self.since = now  # their own history: judged again after another lockout_s
        return False


class BoundaryMonitor:
    """SENTINEL state of one boundary (stage, direction); see the module docstring for the rule."""

    def __init__(self, config: SentinelConfig, *, stage: int, direction: Direction) -> None:
        if direction not in ("forward", "backward"):
            raise ValueError(f"direction must be 'forward' or 'backward', got {direction!r}")
        self.config = config
        self.stage = stage
        self.direction: Direction = direction
        self._beta = config.beta(direction)
        self._metric_index = np.array([METRICS.index(m) for m in config.metrics], dtype=np.intp)
        self._metric_names = [METRICS[i] for i in self._metric_index.tolist()]
        self._projections: torch.Tensor | None = None  # [sw_projections, features]
        self._scratch: np.ndarray | None = None  # see _work_buffer
        self._checks = 0
        self.reanchors = 0  # histories started again after a lock-out (see SentinelConfig.lockout_checks)
        # Windows only collect once the EMA has had time to settle on real traffic.
        self._settle_checks = math.ceil(3.0 / (1.0 - self._beta)) if self._beta > 0 else 1
        self._start_history()

    def _start_history(self) -> None:
        """Everything learnt from traffic: empty at first, and again after a lock-out."""
        width = len(METRICS)
        self._raw_window = _ScoreWindow(self.config.window_checks, width)
        self._residual_window = _ScoreWindow(self.config.window_checks, width)
        self._ema: np.ndarray | None = None  # [tokens, features] float32
        self._log_scale: float = 0.0  # EMA of log RMS of accepted tensors
        self._ema_projected: np.ndarray | None = None  # EMA @ projections, kept by linearity
        self._accepted = 0
        self._rewarm_left = 0
        self._peers = _Peers(self.config)
        self._lockout = _Lockout(self.config)

    # ----------------------------------------------------------------- queries

    @property
    def accepted_count(self) -> int:
        return self._accepted

    @property
    def in_warmup(self) -> bool:
        return self._accepted < self.config.warmup_checks

    def baseline(self) -> torch.Tensor | None:
        """The EMA of the batch-mean tensor ([tokens, features]); None before the first acceptance."""
        return None if self._ema is None else torch.from_numpy(self._ema.copy())

    def replacement_for(self, tensor: torch.Tensor) -> torch.Tensor:
        """What a flagged gradient is replaced with: the EMA broadcast to the tensor's shape (zeros
        before a baseline exists), so the contamination stops at this boundary."""
        if self._ema is None or tensor.dim() == 0 or self._ema.size * tensor.shape[0] != tensor.numel():
            return torch.zeros_like(tensor)
        ema = torch.from_numpy(self._ema.copy())
        return (
            ema.unsqueeze(0)
            .expand(tensor.shape[0], *ema.shape)
            .reshape(tensor.shape)
            .to(tensor.dtype)
            .clone()
        )

    # ----------------------------------------------------------------- scoring

    def score(
        self,
        tensor: torch.Tensor,
        signer: str,
        microbatch_id: int,
        now: float,
        *,
        context: torch.Tensor | None = None,
    ) -> Verdict:
        """Judge one tensor; pure (state changes only in `accept`).

        `context` is what the verifier itself sent the stage for this microbatch: forward, the stage's
        input activation; backward, the output gradient it was given. When it has the tensor's shape
        (residual stages) the paired metrics compare the tensor with it, which removes the data
        variation that hides replay, random-but-matched-scale, sign and free-riding attacks."""
        del now  # scoring counts checks, not seconds (only the lock-out rule in accept() looks at time)
        # No torch.no_grad() needed: both tensors are detached and the rest is numpy.
        return self._score(tensor, signer, microbatch_id, context)

    def _score(
        self, tensor: torch.Tensor, signer: str, microbatch_id: int, context: torch.Tensor | None
    ) -> Verdict:
        if tensor.numel() == 0 or tensor.dim() == 0:
            return self._invalid(signer, microbatch_id, f"no batch to judge (shape {tuple(tensor.shape)})")
        x = _as_batch_tokens_features(tensor)
        # What a check costs is mostly passes over the full tensor (it arrives cold from the network or
        # from the stage's compute), so each is read as few times as possible: without a context one
        # norm and the batch mean; with one the token norms of x and of the context, their per-token
        # dot products (no temporary) and the batch mean, taken while x is still in cache. The norms
        # give the RMS level and, being non-finite iff some element is (or the tensor is absurdly
        # large), replace a separate isfinite pass.
        paired = context is not None and context.shape == tensor.shape
        products: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None
        if paired:
            assert context is not None
            c = _as_batch_tokens_features(context)
            x_norms = torch.linalg.vector_norm(x, dim=-1).numpy().ravel()
            batch_mean = x.sum(dim=0).numpy()  # while x is in cache
            batch_mean *= 1.0 / x.shape[0]
            dots = _row_dots(x.numpy().reshape(-1, x.shape[-1]), c.numpy().reshape(-1, x.shape[-1]))
            products = (x_norms, dots, torch.linalg.vector_norm(c, dim=-1).numpy().ravel())
            rms = math.sqrt(float(np.vdot(x_norms, x_norms)) / max(1, x.numel()))
        else:
            rms = float(torch.linalg.vector_norm(x)) / math.sqrt(max(1, x.numel()))
            batch_mean = x.sum(dim=0).numpy()
            batch_mean *= 1.0 / x.shape[0]
        if not math.isfinite(rms):
            return self._invalid(signer, microbatch_id, "non-finite values")
        if self._ema is not None and tuple(x.shape[1:]) != self._ema.shape:
            return self._invalid(
                signer, microbatch_id, f"shape {tuple(x.shape[1:])} != baseline {self._ema.shape}"
            )
        projected = self._project(batch_mean)
        log_rms = math.log(rms + _EPS)
        if self._ema is None:
            summary = _Summary(batch_mean, projected, log_rms, None, None)
            return Verdict(False, "first tensor: baseline starts here", "warmup", signer, microbatch_id,
                           {}, {}, {}, summary)  # fmt: skip
        scores = self._metric_scores(x.shape[0], batch_mean, projected, rms)
        if products is not None:
            scores[_ALIGN], scores[_GAIN] = _paired(*products, rms, x.numel())
        centre = self._peers.centre(self._checks)
        residual = None if centre is None else scores - centre
        summary = _Summary(batch_mean, projected, log_rms, scores, residual)
        named = dict(zip(self._metric_names, scores[self._metric_index].tolist(), strict=True))
        if self.in_warmup:
            return Verdict(False, "warm-up", "warmup", signer, microbatch_id, named, {}, {}, summary)
        use_peer = residual is not None and len(self._residual_window) >= self.config.min_window_checks
        window = self._residual_window if use_peer else self._raw_window
        if len(window) < self.config.min_window_checks:
            return Verdict(False, "fence window still filling", "warmup", signer, microbatch_id, named, {}, {},
                           summary)  # fmt: skip
        value = residual if use_peer else scores
        assert value is not None
        rewarm = self._rewarm_left > 0
        k = self.config.blatant_k if rewarm else self.config.fence_k
        mode: Mode = "rewarm" if rewarm else ("peer" if use_peer else "solo")
        return self._fence_verdict(value, window, k, mode, signer, microbatch_id, named, summary)

    def _fence_verdict(
        self,
        value: np.ndarray,
        window: _ScoreWindow,
        k: float,
        mode: Mode,
        signer: str,
        microbatch_id: int,
        named: dict[str, float],
        summary: _Summary,
    ) -> Verdict:
        fence = window.fences(self.config)
        low, high = fence.bounds(k)
        idx = self._metric_index
        v, c = value[idx], fence.centre[idx]
        judged = ~(np.isnan(v) | np.isnan(c))  # NaN: a paired metric without context, not judged
        upper = v >= c
        z = (v - c) / np.where(upper, fence.sigma_high[idx], fence.sigma_low[idx])
        lo, hi = low[idx], high[idx]
        outside = judged & ~((lo <= v) & (v <= hi))
        z_list, lo_list, hi_list = z.tolist(), lo.tolist(), hi.tolist()
        keep = [i for i, j in enumerate(judged.tolist()) if j]
        names = self._metric_names
        deviations = {names[i]: z_list[i] for i in keep}
        fences = {names[i]: (lo_list[i], hi_list[i]) for i in keep}
        flagged = True in outside.tolist()  # ndarray.any() goes through Python wrappers
        if not flagged:
            return Verdict(
                False, "within fences", mode, signer, microbatch_id, named, deviations, fences, summary
            )
        offenders = [f"{names[i]} z={z_list[i]:+.1f}" for i in np.flatnonzero(outside).tolist()]
        basis = "vs stage peers" if mode == "peer" else "vs history"
        reason = f"{', '.join(offenders)} ({basis}, k={k:g})"
        return Verdict(True, reason, mode, signer, microbatch_id, named, deviations, fences, summary)

    def _invalid(self, signer: str, microbatch_id: int, why: str) -> Verdict:
        return Verdict(True, why, "invalid", signer, microbatch_id, {}, {}, {}, None)

    def _metric_scores(
        self, batch: int, batch_mean: np.ndarray, projected: np.ndarray, rms: float
    ) -> np.ndarray:
        assert self._ema is not None and self._ema_projected is not None
        ema = self._ema
        scale = math.exp(self._log_scale)
        size = ema.size
        diff = np.subtract(batch_mean, ema, out=self._work_buffer())
        l2 = math.sqrt(float(np.vdot(diff, diff)) / size) / scale
        l1 = float(np.abs(diff, out=diff).sum()) / size / scale
        # Sign flips weighted by |EMA|: elements whose baseline is ~0 flip at random and only add noise.
        weight = np.abs(ema, out=diff)
        flipped = np.multiply(batch_mean, ema) < 0
        sfr = float(np.vdot(weight, flipped)) / (float(weight.sum()) + _EPS)  # sum(where=) is 20x slower
        sw = _sliced_wasserstein(projected, self._ema_projected) / scale
        spread = math.nan
        if batch > 1:
            # mean((x - mean_b x)^2) = mean(x^2) - mean((mean_b x)^2): no second pass over the tensor;
            # B / (B - 1) makes it unbiased so that a short last microbatch is not "too quiet".
            mean_sq = float(np.vdot(batch_mean, batch_mean)) / batch_mean.size
            var = max(rms * rms - mean_sq, 0.0) * batch / (batch - 1)
            spread = 0.5 * math.log(var + _EPS) - math.log(rms + _EPS)
        level = math.log(rms + _EPS) - self._log_scale
        # Honest distances of a batch mean to the baseline are mostly sampling noise, which shrinks
        # as 1/sqrt(B): scaling by sqrt(B) keeps them comparable across batch sizes.
        root_b = 0.5 * math.log(batch)
        logs = [
            math.log(l1 + _EPS) + root_b,
            math.log(l2 + _EPS) + root_b,
            sfr,
            math.log(sw + _EPS) + root_b,
            level,
            spread,
        ]
        return np.array([*logs, math.nan, math.nan])

    def _work_buffer(self) -> np.ndarray:
        """One [tokens, features] scratch array, reused: a check is a handful of passes over arrays of
        that size, and fresh allocations (cold memory) cost about as much as the arithmetic."""
        assert self._ema is not None
        if self._scratch is None or self._scratch.shape != self._ema.shape:
            self._scratch = np.empty_like(self._ema)
        return self._scratch

    def _project(self, rows: np.ndarray) -> np.ndarray:
        """Token rows onto the fixed sliced-Wasserstein directions: [projections, tokens]."""
        if self._projections is None or self._projections.shape[1] != rows.shape[1]:
            gen = torch.Generator().manual_seed(self.config.sw_seed)
            proj = torch.randn(rows.shape[1], self.config.sw_projections, generator=gen)
            self._projections = (proj / proj.norm(dim=0, keepdim=True)).T.contiguous()
        # The matmul stays in torch: numpy's BLAS threads spin against torch's and slow both tenfold.
        return (self._projections @ torch.from_numpy(rows).T).numpy()

    # ----------------------------------------------------------------- updates

    def accept(self, tensor: torch.Tensor, verdict: Verdict, now: float) -> bool:
        """Fold a scored tensor into the state: the replica's recent scores always, the EMA and the
        fence windows only when the verdict was not flagged. True when this check found the boundary
        locked out and its history was started again (the next checks warm up a new one)."""
        del tensor  # everything needed was summarised by score()
        summary = verdict._summary
        self._checks += 1
        if self._lockout.observe(verdict, now):
            self.reanchors += 1
            logger.warning(
                "boundary %s/%s: %d of the last %d checks refused for %.0f s against a history that %s did not "
                "write; it starts again on their traffic",
                self.stage,
                self.direction,
                self._lockout.refusals,
                len(self._lockout.recent),
                now - self._lockout.since if self._lockout.since is not None else 0.0,
                ", ".join(sorted(s[-8:] for s in self._lockout.refused_signers())),
            )
            self._start_history()
            return True
        if self._rewarm_left > 0:
            self._rewarm_left -= 1
        if summary is None:
            if verdict.flagged:
                self._peers.mark_flagged(verdict.signer)
            return False
        if summary.scores is not None:
            self._peers.remember(verdict.signer, summary.scores, verdict.flagged, self._checks)
        if verdict.flagged:
            return False
        self._lockout.wrote(verdict.signer)
        self._update_baseline(summary)
        if summary.scores is not None and verdict.mode != "rewarm" and self._accepted > self._settle_checks:
            self._raw_window.append(summary.scores)
            if summary.residual is not None:
                self._residual_window.append(summary.residual)
        return False

    def check(
        self,
        tensor: torch.Tensor,
        signer: str,
        microbatch_id: int,
        now: float,
        *,
        context: torch.Tensor | None = None,
    ) -> Verdict:
        """score() then accept(): the call a verifier makes once per boundary tensor."""
        verdict = self.score(tensor, signer, microbatch_id, now, context=context)
        if self.accept(tensor, verdict, now):
            verdict = replace(
                verdict, reanchored=True, reason=f"{verdict.reason}; locked out: history starts again"
            )
        if verdict.flagged:
            logger.info(
                "boundary %s/%s flagged %s mb=%s: %s",
                self.stage,
                self.direction,
                verdict.signer,
                verdict.microbatch_id,
                verdict.reason,
            )
        return verdict

    def rewarm(self) -> None:
        """After a stage-wide flag storm: for the next `rewarm_checks` checks flag only blatant
        deviations and keep elevated scores out of the fence windows while the EMA catches up."""
        self._rewarm_left = self.config.rewarm_checks
        logger.warning(
            "boundary %s/%s re-warming for %d checks", self.stage, self.direction, self._rewarm_left
        )

    def forget_replica(self, signer: str) -> None:
        """Drop a banned or departed replica from the cross-replica centre."""
        self._peers.forget(signer)

    def _update_baseline(self, summary: _Summary) -> None:
        if self._ema is None or self._ema_projected is None:
            self._ema = summary.batch_mean.copy()
            self._ema_projected = summary.projected.copy()
            self._log_scale = summary.log_rms
        else:
            # in place and through the scratch buffer: no fresh allocation per check
            self._ema *= self._beta
            self._ema += np.multiply(summary.batch_mean, 1.0 - self._beta, out=self._work_buffer())
            self._ema_projected *= self._beta
            self._ema_projected += (1.0 - self._beta) * summary.projected
            self._log_scale = self._beta * self._log_scale + (1.0 - self._beta) * summary.log_rms
        self._accepted += 1

    # ----------------------------------------------------------------- persistence

    def state_dict(self) -> dict[str, Any]:
        """Plain tensors and numbers; restoring it means a restarted verifier need not re-warm."""
        return {
            "stage": self.stage,
            "direction": self.direction,
            "ema": None if self._ema is None else torch.from_numpy(self._ema.copy()),
            "log_scale": self._log_scale,
            "accepted": self._accepted,
            "checks": self._checks,
            "rewarm_left": self._rewarm_left,
            "raw_window": self._raw_window.state(),
            "residual_window": self._residual_window.state(),
            "replicas": self._peers.state(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state["stage"] != self.stage or state["direction"] != self.direction:
            raise ValueError(
                f"state of boundary {state['stage']}/{state['direction']} loaded into {self.stage}/{self.direction}"
            )
        ema = state["ema"]
        self._ema = None if ema is None else ema.detach().cpu().float().numpy().copy()
        self._ema_projected = None if self._ema is None else self._project(self._ema)
        self._log_scale = float(state["log_scale"])
        self._accepted = int(state["accepted"])
        self._checks = int(state["checks"])
        self._rewarm_left = int(state["rewarm_left"])
        self._raw_window.load(state["raw_window"])
        self._residual_window.load(state["residual_window"])
        # Who wrote the history is not saved: a restored one counts as written by others (lock-out rule).
        self._lockout = _Lockout(self.config)
        self._peers.load(state["replicas"])


class StageTurnover:
    """Which stages had every replica replaced since their SENTINEL history was built.

    A stage's history (EMA, fences, peer summaries) describes the replicas that sent its traffic. When none of
    them is left and others serve the stage (its only replica killed and another moved in from a neighbour
    stage, holding the global version rather than the dead one's local weights), judging the newcomers against
    it flags nearly every tensor they send, and with fewer than `min_peer_replicas` there is no cross-replica
    centre to re-anchor it: the stage is locked out for good (seen: 5,351 microbatches dropped in a row, the
    pipeline stalled). Such a stage starts a fresh history instead (`SentinelMonitor.reset_stage`).

    Feed it the live replicas of every stage after each refresh; a stage that is empty for a while keeps the
    replicas it last had."""

    def __init__(self) -> None:
        self._last: dict[int, frozenset[str]] = {}

    def observe(self, members: Mapping[int, Collection[str]]) -> list[int]:
        """Stages whose replicas now share none with the ones they last had (not on first sight)."""
        replaced = []
        for stage, peers in members.items():
            now = frozenset(peers)
            if not now:
                continue
            before = self._last.get(stage)
            if before is not None and not before & now:
                replaced.append(stage)
            self._last[stage] = now
        return replaced


class SentinelMonitor:
    """All boundaries one verifier watches, created on first use: the integration entry point."""

    def __init__(self, config: SentinelConfig | None = None) -> None:
        self.config = config or SentinelConfig()
        self._boundaries: dict[tuple[int, str], BoundaryMonitor] = {}

    def boundary(self, stage: int, direction: Direction) -> BoundaryMonitor:
        key = (stage, direction)
        if key not in self._boundaries:
            self._boundaries[key] = BoundaryMonitor(self.config, stage=stage, direction=direction)
        return self._boundaries[key]

    def check(
        self,
        stage: int,
        direction: Direction,
        replica_peer_id: str,
        microbatch_id: int,
        tensor: torch.Tensor,
        now: float,
        *,
        context: torch.Tensor | None = None,
    ) -> Verdict:
        """Score a tensor sent by `replica_peer_id` of `stage` and fold it in unless flagged;
        `context` as in BoundaryMonitor.score."""
        return self.boundary(stage, direction).check(
            tensor, replica_peer_id, microbatch_id, now, context=context
        )

    def rewarm(self, stage: int) -> None:
        """Re-warm both directions of a stage (the ledger's answer to a stage-wide flag storm)."""
        for direction in ("forward", "backward"):
            if (stage, direction) in self._boundaries:
                self._boundaries[(stage, direction)].rewarm()

    def reset_stage(self, stage: int) -> None:
        """Drop both directions' history of a stage: the next checks warm up a fresh one (see StageTurnover)."""
        for direction in ("forward", "backward"):
            self._boundaries.pop((stage, direction), None)

    def forget_replica(self, signer: str) -> None:
        for monitor in self._boundaries.values():
            monitor.forget_replica(signer)

    def state_dict(self) -> dict[str, Any]:
        return {f"{stage}/{direction}": m.state_dict() for (stage, direction), m in self._boundaries.items()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for key, sub in state.items():
            stage_text, direction = key.split("/")
            if direction not in ("forward", "backward"):
                raise ValueError(f"bad boundary key {key!r}")
            self.boundary(int(stage_text), direction).load_state_dict(sub)  # type: ignore[arg-type]
