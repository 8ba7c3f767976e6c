"""The held-out loss-delta score of one contribution (issue 18; in the spirit of Templar's Gauntlet): the syncer
evaluates a private held-out batch on its copy of the model before and after applying that contribution alone,
and rejects one that raises the loss beyond what honest contributions do.

"Applied alone": the fragment's tensors become current - (base - params), i.e. the learner's own progress (its
pseudo-gradient against its own base, as the merge takes it) at outer learning rate 1, every other tensor as it
is, in the contribution's base context (node.diloco.syncer_core.probe_context, `loss_base_context`): the model as
it stood when the syncer published that base, the one its learner trained the fragment in; "current" is that
model, not today's global one, where the other fragments may have moved on and turn honest work into an apparent
ascent step. The score is `after - before` (nats); honest work lowers the loss or leaves it
within noise, an ascent step (a sign-flipped delta at an honest norm) raises it by about as much as honest work
lowers it.

The bound, per fragment: the larger of `loss_tolerance` x the loss before (a floor: the held-out batch is fixed,
so the score is deterministic and "noise" is how far honest contributions scatter) and, once `min_history` scores
were merged, their median plus `loss_mad_factor` x their median absolute deviation. Only merged scores enter the
history (as for the norms of node.diloco.screening), and only those that lowered the loss: an attacker that is
rejected never moves the bound, nor do ascent steps that slipped under the floor (a Sybil majority of them had
widened it).

`measure` is the heavy part (two forward passes, the first cached per version vector) and runs off the event loop
in the shell; the loss function and the clock are passed in. Pure: no sockets, no event loop.
"""

from __future__ import annotations

import logging
import math
from collections import deque
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass

import torch

from node.diloco import chunked

logger = logging.getLogger(__name__)

LOSS = "screen: loss"
BEFORE_CACHED = 16  # version vectors whose loss before is kept (one float each)
LossFn = Callable[[Mapping[str, torch.Tensor]], float]  # held-out loss of a full parameter set


@dataclass(frozen=True, kw_only=True, slots=True)
class LossScore:
    """The held-out loss before and after one contribution applied alone, and what measuring it cost."""

    before: float
    after: float
    cost_s: float  # seconds the measurement took (the clock passed to `measure`)
    # the loss with the contribution's delta reversed (measured only for a rise over the bound; None: not measured)
    opposite: float | None = None
    norm: float = math.nan  # the norm of the contribution's delta (base - params) that was applied
    # the slope of the delta less its projection on the recent merged direction (`measure`'s `residual`; None: not
    # measured), what the evidence judges when measured (node.diloco.screening_residual)
    residual_slope: float | None = None

    @property
    def delta(self) -> float:
        return self.after - self.before

    @property
    def descent(self) -> float | None:
        """How much lower the loss is with the delta applied than with it reversed (None: not measured). The
        second-order term of a step, the overshoot, is the same both ways and cancels: what is left is twice the
        first-order term, positive for a step down the held-out gradient whatever its size."""
        return None if self.opposite is None else self.opposite - self.after

    @property
    def slope(self) -> float | None:
        """The held-out loss's descent along the delta per unit of its norm (nats): `descent` / (2 x norm), the
        directional derivative; None when not measured or the delta is zero (node.diloco.evidence)."""
        descent = self.descent
        if descent is None or not (self.norm > 0 and math.isfinite(self.norm)):
            return None
        return descent / (2.0 * self.norm)

    @property
    def evidence_slope(self) -> float | None:
        """The slope node.diloco.evidence judges: the residual's when measured, else the delta's."""
        return self.residual_slope if self.residual_slope is not None else self.slope


class LossProbe:
    """Measures `LossScore`s with `loss` (the shell's model and private batches) and caches the loss before per
    version vector (the model a contribution is scored in only changes when a version is published)."""

    def __init__(self, loss: LossFn) -> None:
        self.loss = loss
        # the loss before, per version vector scored in: with base contexts (`probe_context` in
        # node.diloco.syncer_core) pushes of different fragments are scored in different vectors, in turn
        self._before: dict[tuple[int, ...], float] = {}
        self.measured = 0
        self.total_cost_s = 0.0
        self.max_cost_s = 0.0

    def measure(
        self,
        current: Mapping[str, torch.Tensor],
        versions: tuple[int, ...],
        base: Mapping[str, torch.Tensor],
        params: Mapping[str, torch.Tensor],
        clock: Callable[[], float],
        reverse: bool = False,
        residual: Callable[[], Mapping[str, torch.Tensor] | None] | None = None,
    ) -> LossScore | None:
        """Score `params` (one fragment's tensors, built on `base`) against `current` (every global tensor, at
        `versions`: today's global model, or the model as it stood when `base` was published, its base context).
        None when the contribution or a loss is not finite (the screen rejects those anyway).
        `reverse`: measure the loss with the delta reversed too (`LossScore.opposite`, one more forward pass).
        `residual`: gives the contribution less its public part (None: none), whose slope is measured too (two more
        passes, with `reverse`; `LossScore.residual_slope`)."""
        started = clock()
        norm = _checked_norm(current, base, params)
        if norm is None:
            return None
        before = self._before.get(versions)
        if before is None:
            before = self._before[versions] = self.loss(current)
            while len(self._before) > BEFORE_CACHED:  # the oldest vector first (dicts keep their order)
                del self._before[next(iter(self._before))]
        after = self.loss(Applied(current, base, params, sign=1.0))
        opposite = None
        if reverse and math.isfinite(after):
            opposite = self.loss(Applied(current, base, params, sign=-1.0))  # current + delta
        residual_slope = self._residual_slope(current, base, residual) if reverse and residual else None
        cost = max(0.0, clock() - started)
        self.measured += 1
        self.total_cost_s += cost
        self.max_cost_s = max(self.max_cost_s, cost)
        if not (math.isfinite(before) and math.isfinite(after)):
            return None
        opposite = opposite if opposite is not None and math.isfinite(opposite) else None
        return LossScore(
            before=before,
            after=after,
            cost_s=cost,
            opposite=opposite,
            norm=norm,
            residual_slope=residual_slope,
        )

    def _residual_slope(
        self,
        current: Mapping[str, torch.Tensor],
        base: Mapping[str, torch.Tensor],
        residual: Callable[[], Mapping[str, torch.Tensor] | None],
    ) -> float | None:
        """The held-out slope of the contribution `residual()` gives, as `LossScore.slope` (0 for a zero residual;
        None: none, or not finite; a spilled direction replaced meanwhile: not measured)."""
        try:
            params = residual()
            norm = _checked_norm(current, base, params) if params is not None else None
            if params is None or norm is None:
                return None
            if not norm > 0:
                return 0.0  # all of it along the public direction: no descent of its own
            after = self.loss(Applied(current, base, params, sign=1.0))
            opposite = self.loss(Applied(current, base, params, sign=-1.0))
        except OSError:
            return None
        slope = (opposite - after) / (2.0 * norm)
        return slope if math.isfinite(slope) else None

    def status(self) -> dict[str, float | int]:
        mean = self.total_cost_s / self.measured if self.measured else 0.0
        return {
            "measured": self.measured,
            "mean_cost_s": round(mean, 5),
            "max_cost_s": round(self.max_cost_s, 5),
        }


def _checked_norm(
    current: Mapping[str, torch.Tensor], base: Mapping[str, torch.Tensor], params: Mapping[str, torch.Tensor]
) -> float | None:
    """The norm of the delta (base - params), read a chunk at a time; None if a value of current - delta is not
    finite. Nothing fragment-sized is built (issue 17): the applied tensors are computed again, a block at a time,
    inside each forward pass (`Applied`)."""
    squares: list[float] = []
    for name in params:
        for start, stop in chunked.ranges(chunked.numel(params, name)):
            delta = _delta_block(base, params, name, start, stop)
            squares.append(chunked.squared(delta))
            # current - delta in the delta's place (a new tensor): one block less alive
            if not bool(torch.isfinite(delta.neg_().add_(chunked.piece(current, name, start, stop))).all()):
                return None
    return math.sqrt(math.fsum(squares))


def _delta_block(
    base: Mapping[str, torch.Tensor], params: Mapping[str, torch.Tensor], name: str, start: int, stop: int
) -> torch.Tensor:
    """base - params over [start, stop) of `name` in float32 (`chunked.delta_piece`), in a tensor of its own (never
    a view of `base`: callers work in it in place) with one range read alive at a time: the base's range copied,
    the push's subtracted from it in place."""
    delta = chunked.piece(base, name, start, stop).to(torch.float32, copy=True)
    return delta.sub_(chunked.piece(params, name, start, stop))


class Applied(Mapping[str, torch.Tensor]):
    """Every global tensor of `current`, those of `params` replaced by current - sign x (base - params): the
    contribution applied alone (sign 1) or reversed (sign -1). The replaced ones are `streamed`: a loss function
    that knows it (node.roles.syncer.skeleton_loss, through node.ml.streamed_forward) reads them a range at a time
    (`chunk`) while its forward pass needs them; `[name]` computes one whole (for loss functions that need it).
    Built whole, they were a fragment more in the syncer's memory for each push it scored (docs/scale.md)."""

    def __init__(
        self,
        current: Mapping[str, torch.Tensor],
        base: Mapping[str, torch.Tensor],
        params: Mapping[str, torch.Tensor],
        sign: float,
    ) -> None:
        self.current, self.base, self.params, self.sign = current, base, params, sign
        # `name in params` would read the tensor whole from a spill file (a Mapping without `__contains__` tries
        # `[name]`): once per block, a vocabulary-sized tensor at a time (docs/scale.md)
        self.applied = frozenset(params)
        # the applied tensors, and those `current` itself gives by range (a base context's spilled versions)
        self.streamed = self.applied | frozenset(getattr(current, "streamed", ()))

    def shape_of(self, name: str) -> tuple[int, ...]:
        return chunked.shape(self.current, name)

    def chunk(self, name: str, start: int, stop: int) -> torch.Tensor:
        if name not in self.applied:
            return chunked.piece(self.current, name, start, stop).to(torch.float32)
        # in place in the delta (`_delta_block`: its own tensor), each range read added and dropped in turn: two
        # blocks alive at most, where `now - sign x (base - params)` held four (docs/scale.md, issue 17)
        delta = _delta_block(self.base, self.params, name, start, stop)
        return delta.mul_(-self.sign).add_(chunked.piece(self.current, name, start, stop))

    def __getitem__(self, name: str) -> torch.Tensor:
        if name not in self.streamed:
            return self.current[name]
        shape = self.shape_of(name)
        out = torch.empty(shape, dtype=torch.float32)
        flat = out.view(-1)
        for start, stop in chunked.ranges(flat.numel()):
            flat[start:stop] = self.chunk(name, start, stop)
        return out

    def __iter__(self) -> Iterator[str]:
        return iter(self.current)

    def __len__(self) -> int:
        return len(self.current)


class LossBound:
    """Per fragment, the merged scores and the bound a new one must stay under (see the module docstring)."""

    def __init__(
        self,
        *,
        tolerance: float,
        mad_factor: float,
        history: int,
        min_history: int,
        reverse_tolerance: float = math.inf,
    ) -> None:
        self.tolerance, self.mad_factor, self.reverse_tolerance = tolerance, mad_factor, reverse_tolerance
        self.history, self.min_history = history, min_history
        self._scores: dict[int, deque[float]] = {}
        self._outcomes: dict[int, deque[tuple[str, bool]]] = {}  # per fragment: (peer, passed), recent scores

    def bound(self, fragment: int, before: float) -> tuple[float, str]:
        """(the highest loss delta accepted, what set it)."""
        return self._bound(tuple(self._scores.get(fragment, ())), before)

    def _bound(self, merged: tuple[float, ...], before: float) -> tuple[float, str]:
        floor = self.tolerance * abs(before)
        scores = sorted(merged)
        if len(scores) < self.min_history:
            return floor, f"{self.tolerance:g} x loss {before:.4g}"
        median = scores[(len(scores) - 1) // 2]
        deviations = sorted(abs(s - median) for s in scores)
        spread = median + self.mad_factor * deviations[(len(deviations) - 1) // 2]
        if spread > floor:
            return spread, f"merged scores' median {median:+.4g} + {self.mad_factor:g} MAD"
        return floor, f"{self.tolerance:g} x loss {before:.4g}"

    def check(self, fragment: int, score: LossScore) -> str | None:
        """The one-line reason `score` is refused, or None. Refused: a loss higher than with the delta reversed
        by more than `reverse_tolerance` x the loss (an ascent step, however small its rise: on a real model a
        sign-flipped delta raised the loss by less than the floor in 71 % of rounds,
        benchmarks/loss_screen_offline.py), and a rise over the bound unless the delta is a step down the held-out
        gradient by the same margin (its `descent`: an honest step that overshoots applied alone, as honest
        real-model work on its own data shard does)."""
        bound, basis = self.bound(fragment, score.before)
        descent = score.descent
        margin = self.reverse_tolerance * abs(score.before)
        if descent is not None and descent < -margin:
            return (
                f"held-out loss {score.before:.4g} -> {score.after:.4g}, {-descent:+.4g} above its reverse "
                f"(> {margin:.4g} = {self.reverse_tolerance:g} x loss): an ascent step"
            )
        if score.delta <= bound or (descent is not None and descent > margin):
            return None
        reversed_ = "" if descent is None else f", {descent:+.4g} below its reverse"
        return (
            f"held-out loss {score.before:.4g} -> {score.after:.4g} ({score.delta:+.4g} > {bound:+.4g}: {basis}"
            f"{reversed_})"
        )

    def judge(self, fragment: int, score: LossScore, peer: str) -> tuple[str | None, str | None]:
        """(`check`'s reason, why a failure is not blamed on `peer` or None when it is). Blamed only once the
        bound has learned from `min_history` merged scores of this fragment that lowered the loss (a syncer that
        just took over has none, and the outage work it receives first is many steps on an old base), and when
        the latest scores of at least half of the other peers seen lately on the fragment passed: when most
        honest work fails too (a learning rate too high for the batch, a model set back, or, our guess, a real model's
        fragments that no longer fit the global rest once learning speeds up: all four honest llama-20m learners
        were banned at ~288k tokens while other peers' occasional passes still counted as corroboration), the bound
        is wrong for this run, not the peer. Either way the contribution is still refused; only bans wait. An
        ascent attacker is blamed as soon as the bound has its history and the honest learners pass. A blamed refusal
        weighs once per (fragment, base version) in the learner ledger (node.diloco.learner_ledger, `ONCE_PER_WORK`):
        snapshots of one trajectory judged again are no new evidence."""
        reason = self.check(fragment, score)
        window = self._outcomes.setdefault(fragment, deque(maxlen=self.history))
        corroborated = _most_others_passed(window, peer)
        window.append((peer, reason is None))
        if reason is None:
            return None, None
        if len(self._scores.get(fragment, ())) < self.min_history:
            return reason, f"the bound has fewer than {self.min_history} merged scores to learn from"
        if score.delta <= self.bound(fragment, score.before)[0]:
            # refused by its reverse alone: honest work does that too now and then (3 honest learners of a byte-level
            # test swarm were banned for it within 30 s; 2 in 64 honest real-model contributions were refused), so
            # the contribution is not merged but nothing is held against its peer
            return (
                reason,
                "an ascent step whose rise stays under the bound (honest work is refused so at times)",
            )
        return reason, None if corroborated else "most other peers' work failed too lately"

    def commit(self, fragment: int, deltas: list[float]) -> None:
        """The scores of a published merge's participants."""
        window = self._scores.setdefault(fragment, deque(maxlen=self.history))
        # only contributions that lowered the loss teach the bound: ones that raised it (within the floor)
        # would let a majority of ascent steps widen the bound they are judged by (seen with 5 Sybils of 9)
        window.extend(d for d in deltas if math.isfinite(d) and d <= 0)


def _most_others_passed(window: deque[tuple[str, bool]], peer: str) -> bool:
    """Whether at least half of the peers other than `peer` in `window` (peer, passed) passed with their latest
    score (none: False)."""
    latest = {other: passed for other, passed in window if other != peer}
    return bool(latest) and 2 * sum(latest.values()) >= len(latest)
