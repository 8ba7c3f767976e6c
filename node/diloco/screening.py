"""The syncer's per-contribution screen (issue 18): every contribution is checked on its own before it enters a
round, so a lone one at quorum K = 1 is bounded too, not only against the peers of its round (`merge_fragment`
clips only when a round holds two or more).

Checks, in order, on the delta (base - learner, the pseudo-gradient, taken against the contribution's own base):

1. finite: a NaN or Inf anywhere (or a difference that overflows float32) rejects it;
2. norm: per fragment, the last `history` norms that were merged form a robust reference (their lower median,
   so an attacker holding half the window still does not set it). A delta above `reject_factor` x that median
   is rejected; above `clip_factor` x it is scaled down to the bound (an honest learner that carries more steps
   than usual, e.g. after an outage, loses a little, never its contribution). Until `min_history` norms were
   merged (warm-up, and after a restart) there is no median: the only bound is `max_relative_norm` x the norm of
   the fragment's current global parameters (at least 1.0, so a zero-initialised fragment can start); that
   ceiling also applies after warm-up. A pseudo-gradient many times the size of the weights is no training step;
   1e38 or x1e3 values are far above it;
3. direction: after `min_history` merges of the fragment, the cosine of the delta with an EMA of the unit merged
   updates; below `min_cosine` (an ascent step, a sign-flipped delta) rejects it.

4. held-out loss: the contribution applied alone must not raise a private held-out loss beyond noise
   (node.diloco.loss_probe; measured off the event loop by the shell, judged here).

Each check gives a `Verdict` with a short tag (the refusal reason the learner sees and the strikes count) and a
one-line reason for the log. What is recorded is what was merged (`prepare_commit` / `commit`), never what was
merely offered: a peer that pushes many contributions a round, or one whose round is rolled back, does not fill
the history. Limits: a peer that holds more than half the merged norms (a Sybil majority, or the only learner at
K = 1) can raise the median bound by `clip_factor` every half window; the learner ledger and the admission caps
(issue 18, parts 2 and 3) answer that, this bounds the step size and stops the overflow.

`rollback` belongs to the outer step (`OuterNesterov.step(require_finite=True)`): a round whose new parameters or
momentum are not finite is not published, its momentum is left as it was, and its contributions are rejected
with ROLLBACK. Pure: no sockets, no clock; the syncer core serialises the calls.
"""

from __future__ import annotations

import logging
import math
from collections import Counter, deque
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, replace

import torch

from node.diloco import chunked, norms
from node.diloco.evidence import EvidenceConfig, EvidenceWeight
from node.diloco.loss_probe import LOSS, LossBound, LossScore
from node.diloco.merge import MergeResult, NothingToMerge
from node.diloco.screening_residual import PublicResidual, public_residual
from node.diloco.spill import SpillDir

logger = logging.getLogger(__name__)

NON_FINITE = "screen: non-finite"
NORM = "screen: norm"
DIRECTION = "screen: direction"
ROLLBACK = "outer step non-finite"
LOSS_WAIVED = "loss over the bound, waived: outage work"
ACCEPTED, CLIPPED = "accepted", "clipped"


@dataclass(frozen=True, kw_only=True, slots=True)
class ScreeningConfig:
    """The syncer's contribution screen (node.toml `[syncer]`, `screening.*`)."""

    enabled: bool = True  # screen each contribution on accept; false: merged as sent (only for comparisons)
    history: int = 32  # merged delta norms kept per fragment for the median bound (a count)
    min_history: int = (
        4  # merged norms (for the median) and merges (for the direction) before those checks apply
    )
    clip_factor: float = 4.0  # a delta norm above this x the median merged norm is scaled down to that bound
    reject_factor: float = 100.0  # a delta norm above this x the median merged norm is rejected
    # a delta norm above this x the norm of the fragment's global parameters (at least 1.0) is rejected, always;
    # the only norm bound during warm-up
    max_relative_norm: float = 10.0
    # Off by default (-1): honest stage replicas' deltas were seen at cosine -0.54 to the merged direction in a
    # live pipeline run, so a threshold is a per-run choice (-0.5 rejects a sign-flipped learner delta).
    min_cosine: float = -1.0  # after warm-up, a delta whose cosine with the recent merged direction is below this is rejected (-1: off)
    direction_decay: float = (
        0.7  # the recent merged direction: EMA of unit merged updates, this kept per merge
    )
    rollback: bool = True  # a round whose outer step gives a non-finite parameter or momentum is rolled back
    # held-out loss-delta score (node.diloco.loss_probe): each contribution applied alone to the syncer's copy
    loss_probe: bool = True  # score each contribution on a private held-out batch (once the data is loaded)
    # held-out batches per score (CPU cost: two forward passes of these per contribution). 4, not 2: late in a run
    # an honest delta's held-out descent is small and 16 windows misjudged its sign (offline, the poisoning
    # benchmark's model: 1.9 % of honest scores refused as ascent steps with 2 batches, 0.6 % with 4; docs/security.md)
    loss_batches: int = 4
    loss_batch_size: int = 8  # sequences per held-out batch
    # tokens per held-out sequence, at most the model's context (0: the model's context). A score compares the loss
    # before and after on the same windows, so it needs no full context; at 2,048 tokens a 1B probe's pass takes
    # minutes on CPU and a cut pass still needs 0.195 GiB beyond the model (docs/scale.md)
    loss_sequence_tokens: int = 256
    loss_tolerance: float = 0.02  # a loss rise up to this x the loss before is noise (the bound's floor)
    # a contribution whose held-out loss is higher than with its delta reversed by more than this x the loss is an
    # ascent step, refused whatever its rise; one lower than its reverse by more than this passes a rise over the
    # bound (an overshoot down the gradient). inf: off. Honest llama-20m work was at worst 0.0036 x the loss above
    loss_reverse_tolerance: float = 0.005
    loss_mad_factor: float = 3.0  # after warm-up, the bound is also median + this x MAD of merged scores
    # score a contribution in the model as it stood when its base was published (its other fragments at their
    # versions then, if still held), not in today's global model, where an honest fragment's delta can meet other
    # fragments that moved on since and look like an ascent step (node.diloco.syncer_core.probe_context)
    loss_base_context: bool = True
    # at most this many MiB of a base context's older versions are read from the syncer's spill files per score
    # (the rest in today's tensors). They are read by range inside each forward pass, never held whole, so this
    # bounds the probe's reading time, not its memory
    loss_context_read_mib: float = 256.0
    # evidence of work (node.diloco.evidence): a contribution's weight x a factor from its held-out slope (descent
    # per unit norm) relative to the lower median of recent full-weight slopes: 0 at or below the zero fraction, 1
    # at or above the full fraction, linear between (noise at an honest norm shows none). false: off
    evidence_weighting: bool = True
    evidence_zero_fraction: float = 0.1  # of the median merged slope: at or below it, weight 0
    evidence_full_fraction: float = 0.3  # of the median merged slope: at or above it, the whole weight
    # a round's outer gradient x the largest evidence factor among its contributions (a lone contribution at K = 1
    # otherwise kept the whole step at any factor above 0); false: only the weights are scaled
    evidence_scales_step: bool = True
    # this many consecutive scored contributions of a learner at evidence factor 0 are one learner ledger violation
    # (with their slopes and cosines; forgiven like the others). 0: off
    evidence_zero_violation_after: int = 10
    # a learner's evidence factor is at most the lower median of its last this many judged factors (any fragment):
    # weight needs evidence in most of its recent contributions, not one lucky score (noise's lucky ones earned
    # weight in the `noise_k1` arm and, never 10 zeros in a row, no violation; docs/security.md). 0: off
    evidence_sustained_contributions: int = 16
    # judge what a contribution adds beyond the public recent merged direction: its slope is its residual's (the delta
    # less its projection on that direction, one more probe pass each way) and its cosine raises only a factor that
    # slope earned (noise + 0.2 x the public direction earned full weight by either; docs/security.md). false: off
    evidence_public_residual: bool = True
    # before a fragment has an evidence reference (its first merges), a contribution whose slope is at or below a
    # hundredth of the largest of the fragment's last this many scored slopes earns 0 (node.diloco.evidence
    # `_probation`: noise took whole warm-up merges at K = 1). 0: off, every warm-up factor 1 (docs/security.md)
    evidence_warmup_window: int = 0
    # claims and copies (node.diloco.claims)
    claim_rate_factor: float = 2.0  # steps claimed are capped at this x the peers' median measured step rate
    claim_min_peers: int = 2  # peers with a measured rate before that cap applies
    # a claim above this x the peers' median measured step rate is a violation in the learner ledger (still merged,
    # capped; 0: off). Above the hardware spread of honest learners: a peer that much faster is banned after
    # ban_after such claims within the forgiveness
    claim_violation_factor: float = 5.0
    # a delta within this x its norm of a peer's (copycat), or parameters within this x the larger of its norm and
    # the median merged norm of a published version (free-rider: a round's work is missing), are refused (0: off)
    copy_tolerance: float = 0.05
    # robust aggregation: with >= 3 contributions, each coordinate is clamped to the range left after dropping
    # this fraction (at least one) of the highest and of the lowest values (winsorized), then merged as before
    trim_fraction: float = 0.25
    # the learner ledger (node.diloco.learner_ledger): refused contributions add up to a ban
    ban_after: float = (
        3.0  # forgiven violations (each refused contribution: 1, a non-finite one: a ban) that ban (0: never)
    )
    forgive_half_life_s: float = 600.0  # a violation weighs half after this long
    ban_s: float = 3600.0  # a learner ban lasts this long (published through the signed ban gossip)
    # seniority (node.diloco.seniority): identities in fewer accepted merges than young_rounds are young, and
    # together hold at most young_weight_cap of any merge (1.0: off); a refused contribution makes its sender young
    young_rounds: int = 16
    young_weight_cap: float = 0.25
    # probation (node.diloco.probation): each identity's merge weight is multiplied by probation_start_fraction
    # before its first accepted merge, rising linearly to 1 at probation_merges merges (a refusal starts it over),
    # and a round's outer step by the largest multiplier in it (a merge of fresh identities only, a run's first
    # ones included, steps by probation_start_fraction). 0 merges: off
    probation_merges: int = 8
    probation_start_fraction: float = 0.25
    # a learner's reported inner-step time (which sizes the grace window) is raised to at least the seconds per
    # step the syncer measured for its work (from its base's publication to its push, over the steps credited to
    # it) divided by this: a report faster than its own pushes allow is clamped (node.diloco.quorum.PeerStepTimes).
    # 0: off
    step_time_slack_factor: float = 4.0

    def __post_init__(self) -> None:
        if not 1 <= self.min_history <= self.history:
            raise ValueError(
                "screening.history and min_history must be ints with 1 <= min_history <= history"
            )
        if not (1.0 <= self.clip_factor <= self.reject_factor < math.inf):
            raise ValueError("screening needs 1 <= clip_factor <= reject_factor (finite)")
        if not (0.0 < self.max_relative_norm < math.inf):
            raise ValueError("screening.max_relative_norm must be a positive number")
        if not (-1.0 <= self.min_cosine <= 1.0) or not (0.0 <= self.direction_decay < 1.0):
            raise ValueError("screening.min_cosine must be in [-1, 1] and direction_decay in [0, 1)")
        if not (self.claim_rate_factor >= 1.0 and math.isfinite(self.claim_rate_factor)):
            raise ValueError("screening.claim_rate_factor must be a finite number >= 1")
        if not (self.claim_violation_factor == 0.0 or 1.0 <= self.claim_violation_factor < math.inf):
            raise ValueError("screening.claim_violation_factor must be 0 (off) or a finite number >= 1")
        if self.claim_min_peers < 1 or not (0.0 <= self.copy_tolerance < 1.0):
            raise ValueError("screening.claim_min_peers must be >= 1 and copy_tolerance in [0, 1)")
        if not 0.0 <= self.trim_fraction < 0.5:
            raise ValueError("screening.trim_fraction must be in [0, 0.5) (0: off)")
        if self.young_rounds < 0 or not 0.0 <= self.young_weight_cap <= 1.0:
            raise ValueError("screening.young_rounds must be >= 0 and young_weight_cap in [0, 1]")
        if self.probation_merges < 0 or not 0.0 < self.probation_start_fraction <= 1.0:
            raise ValueError("screening.probation_merges must be >= 0 and probation_start_fraction in (0, 1]")
        if not (self.step_time_slack_factor == 0.0 or 1.0 <= self.step_time_slack_factor < math.inf):
            raise ValueError("screening.step_time_slack_factor must be 0 (off) or a finite number >= 1")
        if not (self.ban_after >= 0 and self.forgive_half_life_s > 0 and self.ban_s > 0):
            raise ValueError("screening.ban_after must be >= 0, forgive_half_life_s and ban_s > 0")
        if self.loss_batches < 1 or self.loss_batch_size < 1 or self.loss_sequence_tokens < 0:
            raise ValueError(
                "screening.loss_batches and loss_batch_size must be >= 1, loss_sequence_tokens >= 0 (0: the context)"
            )
        if not (0.0 <= self.loss_tolerance < math.inf and 0.0 <= self.loss_mad_factor < math.inf):
            raise ValueError("screening.loss_tolerance and loss_mad_factor must be finite numbers >= 0")
        if not 0.0 <= self.loss_context_read_mib < math.inf:
            raise ValueError("screening.loss_context_read_mib must be a finite number >= 0")
        if not self.loss_reverse_tolerance >= 0.0:
            raise ValueError("screening.loss_reverse_tolerance must be a number >= 0 (inf: off)")
        if not 0.0 <= self.evidence_zero_fraction < self.evidence_full_fraction < math.inf:
            raise ValueError("screening needs 0 <= evidence_zero_fraction < evidence_full_fraction (finite)")
        if min(self.evidence_zero_violation_after, self.evidence_sustained_contributions) < 0:
            raise ValueError(
                "screening.evidence_zero_violation_after and evidence_sustained_contributions must be >= 0 (0: off)"
            )
        if self.evidence_warmup_window < 0:
            raise ValueError("screening.evidence_warmup_window must be >= 0 (0: off)")

    def evidence(self) -> EvidenceConfig:
        """The evidence weighting's config (off when the screening is)."""
        return EvidenceConfig(
            enabled=self.enabled and self.evidence_weighting,
            zero_fraction=self.evidence_zero_fraction,
            full_fraction=self.evidence_full_fraction,
            scales_step=self.evidence_scales_step,
            zero_streak=self.evidence_zero_violation_after,
            sustained=self.evidence_sustained_contributions,
            cosine_needs_slope=self.evidence_public_residual,
            warmup_window=self.evidence_warmup_window,
            history=self.history,
            min_history=self.min_history,
        )


@dataclass(frozen=True, kw_only=True, slots=True)
class Verdict:
    """What the screen made of one contribution."""

    tag: str  # ACCEPTED, CLIPPED, or the rejection's tag (NON_FINITE, NORM, DIRECTION)
    reason: str  # one line for the log, e.g. "norm 3.1e+38 over bound 12.4 (10 x parameter norm)"
    params: Mapping[str, torch.Tensor] | None  # float32, clipped if CLIPPED; None when rejected
    norm: float = math.nan  # the delta's norm as it will be merged (after clipping)
    cosine: float | None = None  # with the recent merged direction, when that was checked
    blame: bool = True  # a rejection the sender answers for (ledger, bans); see LossBound.judge

    @property
    def accepted(self) -> bool:
        return self.params is not None


@dataclass(frozen=True, slots=True)
class ScreenUpdate:
    """What one merge adds to the screen's state, computed off the event loop and committed with the merge."""

    norms: tuple[float, ...]  # the merged participants' delta norms
    # the fragment's next recent merged direction (None: unchanged), or the key of its file when spilled
    direction: dict[str, torch.Tensor] | str | None
    losses: tuple[float, ...] = ()  # the merged participants' held-out loss-delta scores (those measured)
    slopes: tuple[float, ...] = ()  # the held-out slopes of those merged at full evidence weight
    # and their cosines with the recent merged direction (node.diloco.evidence)
    cosines: tuple[float, ...] = ()


def _norm(tensors: Iterable[torch.Tensor]) -> float:
    # float64: a float32 sum of squares overflows long before the values do (1e20 squared); a chunk at a time
    return norms.norm(tensors)


def _delta_norm(base: Mapping[str, torch.Tensor], params: Mapping[str, torch.Tensor]) -> float | None:
    """The norm of base - params (float64, as `_norm` of the deltas), None if a value is not finite; a chunk at a
    time."""
    terms = []
    for name in base:
        tensor = []
        for start, stop in chunked.ranges(chunked.numel(base, name)):
            delta = chunked.delta_piece(base, params, name, start, stop)
            if not bool(torch.isfinite(delta).all()):
                return None
            tensor.append(chunked.squared(delta))
        terms.append(math.fsum(tensor))
    return math.sqrt(math.fsum(terms))


def _clipped(
    base: Mapping[str, torch.Tensor], params: Mapping[str, torch.Tensor], scale: float
) -> dict[str, torch.Tensor]:
    """base - (base - params) x scale in float32, written a chunk at a time into the one new tensor per name."""
    out: dict[str, torch.Tensor] = {}
    for name in base:
        tensor = out[name] = torch.empty(chunked.shape(base, name), dtype=torch.float32)
        flat = tensor.view(-1)
        for start, stop in chunked.ranges(tensor.numel()):
            delta = chunked.delta_piece(base, params, name, start, stop)
            flat[start:stop] = chunked.piece(base, name, start, stop).to(torch.float32) - delta * scale
    return out


class ContributionScreen:
    """Per fragment, the merged norms and the recent merged direction, and the verdicts by tag (see the module
    docstring). Memory: `history` floats and one float32 copy of each fragment's tensors (one model), unless
    `spill` is given: then each fragment's direction is a file there (node.diloco.spill), read when used."""

    def __init__(self, config: ScreeningConfig | None = None, *, spill: SpillDir | None = None) -> None:
        self.config = config or ScreeningConfig()
        self.spill = spill
        self._norms: dict[int, deque[float]] = {}
        self._direction: dict[int, dict[str, torch.Tensor] | str] = {}
        self._merges: dict[int, int] = {}  # merges folded into the direction, per fragment
        self.counts: Counter[str] = Counter()  # verdicts by tag, rollbacks included
        c = self.config
        self.loss = LossBound(
            tolerance=c.loss_tolerance,
            mad_factor=c.loss_mad_factor,
            reverse_tolerance=c.loss_reverse_tolerance,
            history=c.history,
            min_history=c.min_history,
        )
        self.evidence = EvidenceWeight(c.evidence())

    def check_loss(
        self, fragment: int, score: LossScore | None, peer: str = "", *, outage: bool = False
    ) -> Verdict | None:
        """The rejection of `peer`'s contribution whose held-out loss-delta score is over the bound; None if it
        passes (or was not scored: the probe off, its data not loaded yet). Blamed only when corroborated
        (`LossBound.judge`). `outage`: work on a version this syncer took over and has not merged since (many
        steps on an old base, judged by a bound with nothing learned): over the bound, it is let through and
        counted as `LOSS_WAIVED`, not refused; the other screens still apply."""
        if score is None or not (self.config.enabled and self.config.loss_probe):
            return None
        if outage:
            if (reason := self.loss.check(fragment, score)) is not None:
                self.counts[LOSS_WAIVED] += 1
                logger.info("outage work of %s let through the loss screen: %s", peer[-8:], reason)
            return None
        reason, excuse = self.loss.judge(fragment, score, peer)
        if reason is None:
            return None
        if excuse is not None:
            reason += f" (not blamed: {excuse})"
        return replace(self._reject(LOSS, reason), blame=excuse is None)

    def check(
        self,
        fragment: int,
        params: Mapping[str, torch.Tensor],
        base: Mapping[str, torch.Tensor] | None,
        current: Mapping[str, torch.Tensor],
        loss: LossScore | None = None,
        peer: str = "",
        *,
        outage: bool = False,
    ) -> Verdict:
        """Screen `peer`'s contribution to `fragment` built on `base` (its base version's tensors; None: unknown,
        taken as `current`, the fragment's global tensors now, as the merge does); `loss`: its held-out score, if
        measured; `outage`: see `check_loss`."""
        if not self.config.enabled:
            return Verdict(tag=ACCEPTED, reason="not screened", params=_float32(params))
        base = base if base is not None else current
        norm = _delta_norm(base, params)  # a chunk at a time: no delta held (issue 17)
        if norm is None:
            return self._reject(NON_FINITE, "non-finite")
        clip_at, reject_at, basis = self.bounds(fragment, _norm(current.values()))
        if norm > reject_at:
            return self._reject(NORM, f"norm {norm:.3g} over bound {reject_at:.3g} ({basis})")
        cosine = self._cosine(fragment, chunked.Delta(base, params), norm)
        if cosine is not None and cosine < self.config.min_cosine:
            return self._reject(DIRECTION, f"direction cos {cosine:.2f} < {self.config.min_cosine:g}")
        if (rejected := self.check_loss(fragment, loss, peer, outage=outage)) is not None:
            return rejected
        if norm <= clip_at:
            self.counts[ACCEPTED] += 1
            return Verdict(tag=ACCEPTED, reason="ok", params=_float32(params), norm=norm, cosine=cosine)
        clipped = _clipped(base, params, clip_at / norm)
        self.counts[CLIPPED] += 1
        reason = f"norm {norm:.3g} clipped to {clip_at:.3g} ({basis})"
        return Verdict(tag=CLIPPED, reason=reason, params=clipped, norm=clip_at, cosine=cosine)

    def median_norm(self, fragment: int) -> float | None:
        """The lower median of `fragment`'s merged delta norms (a round's honest work); None in warm-up."""
        norms = sorted(self._norms.get(fragment, ()))
        return norms[(len(norms) - 1) // 2] if len(norms) >= self.config.min_history else None

    def bounds(self, fragment: int, param_norm: float) -> tuple[float, float, str]:
        """(clip above, reject above, what set them) for a delta to `fragment` whose parameters have that norm."""
        ceiling = self.config.max_relative_norm * max(param_norm, 1.0)
        median = self.median_norm(fragment)  # lower median: half the window cannot raise it
        if median is None:
            return ceiling, ceiling, f"warm-up: {self.config.max_relative_norm:g} x parameter norm"
        reject_at = min(ceiling, self.config.reject_factor * median)
        clip_at = min(reject_at, self.config.clip_factor * median)
        return clip_at, reject_at, f"median merged norm {median:.3g}"

    def _cosine(self, fragment: int, deltas: Mapping[str, torch.Tensor], norm: float) -> float | None:
        if (
            fragment not in self._direction
            or self._merges.get(fragment, 0) < self.config.min_history
            or norm <= 0
        ):
            return None
        direction = self.direction(fragment)
        assert direction is not None
        length = chunked.norm(direction)
        if length <= 0:
            return None
        # the delta's norm is bounded by now, so a float32 dot cannot overflow; a chunk at a time
        dot = math.fsum(
            float(torch.dot(chunked.piece(deltas, n, a, b), chunked.piece(direction, n, a, b)))
            for n in deltas
            for a, b in chunked.ranges(chunked.numel(deltas, n))
        )
        return dot / (norm * length)

    def _reject(self, tag: str, reason: str) -> Verdict:
        self.counts[tag] += 1
        return Verdict(tag=tag, reason=reason, params=None)

    def prepare_commit(
        self,
        fragment: int,
        result: MergeResult,
        losses: Mapping[str, float] | None = None,
        slopes: Mapping[str, float] | None = None,
        cosines: Mapping[str, float] | None = None,
        step_scale: float = 1.0,
    ) -> ScreenUpdate | None:
        """The state a merge adds (heavy part, off the event loop): its participants' norms and held-out scores
        (`losses`: peer -> score, those measured), the slopes of those merged at full evidence weight (`slopes`,
        `cosines`: node.diloco.evidence) and the next recent direction from the merged pseudo-gradient, which moves
        it by `step_scale` x its usual share: a round whose step was scaled down (node.diloco.evidence) moved the
        model that much less, and at full share its direction (the low-evidence contributions') would pull the
        recent direction, which the evidence's cosines are measured against, away from where the model went."""
        if not self.config.enabled:
            return None
        norms = tuple(result.delta_norms[p] for p in result.participants if p in result.delta_norms)
        scores = tuple((losses or {})[p] for p in result.participants if p in (losses or {}))
        kept = tuple((slopes or {})[p] for p in result.participants if p in (slopes or {}))
        agreed = tuple((cosines or {})[p] for p in result.participants if p in (cosines or {}))
        length = chunked.norm(result.outer_grad)  # (a spilled one read a chunk at a time: the same terms)
        if length <= 0 or not math.isfinite(length):
            return ScreenUpdate(norms, None, scores, kept, agreed)
        previous, keep = self.direction(fragment), self.config.direction_decay
        fresh = (1.0 - keep) * min(step_scale, 1.0)  # at scale 1: exactly as before
        if step_scale < 1.0:
            keep = 1.0 - fresh
        if self.spill is None:
            direction = {
                n: g.detach().to(torch.float32) * (fresh / length)
                + (previous[n] * keep if previous is not None and n in previous else 0.0)
                for n, g in result.outer_grad.items()
            }
            return ScreenUpdate(norms, direction, scores, kept, agreed)

        def chunks() -> Iterator[torch.Tensor]:  # the same values, a chunk at a time (off the event loop)
            for n in result.outer_grad:  # (names: a spilled gradient's items() would read each tensor whole)
                for a, b in chunked.ranges(chunked.numel(result.outer_grad, n)):
                    new = chunked.piece(result.outer_grad, n, a, b).to(torch.float32) * (fresh / length)
                    if previous is not None and n in previous:
                        new = new + chunked.piece(previous, n, a, b) * keep
                    yield new

        key = self.spill.new_key(f"direction-{fragment}")
        layout = [(n, chunked.shape(result.outer_grad, n)) for n in result.outer_grad]
        self.spill.write_stream(key, layout, chunks())
        return ScreenUpdate(norms, key, scores, kept, agreed)

    def public_residual(
        self, fragment: int, base: Mapping[str, torch.Tensor], params: Mapping[str, torch.Tensor]
    ) -> PublicResidual | None:
        """The contribution less its projection on the recent merged direction, whose held-out slope the evidence
        judges (node.diloco.screening_residual); None when off or before the direction is past warm-up (as for the
        cosine: then no cosine either, and the delta's own slope is judged)."""
        c = self.config
        if not (c.enabled and c.evidence_weighting and c.evidence_public_residual):
            return None
        direction = self.direction(fragment) if self._merges.get(fragment, 0) >= c.min_history else None
        return None if direction is None else public_residual(base, params, direction)

    def direction(self, fragment: int) -> Mapping[str, torch.Tensor] | None:
        """The fragment's recent merged direction (read from its file when spilled), None before its first merge."""
        direction = self._direction.get(fragment)
        if isinstance(direction, str):
            assert self.spill is not None
            return self.spill.tensors(direction)  # read a chunk at a time when used
        return direction

    def discard(self, update: ScreenUpdate | None) -> None:
        """An update that will not be committed (its merge was not published): its file goes."""
        if update is not None and isinstance(update.direction, str) and self.spill is not None:
            self.spill.delete(update.direction)

    def commit(self, fragment: int, update: ScreenUpdate | None) -> None:
        """The merge that `update` came from was published."""
        if update is None:
            return
        window = self._norms.setdefault(fragment, deque(maxlen=self.config.history))
        # a zero norm (a learner without progress) says nothing about the size of a step
        window.extend(n for n in update.norms if n > 0 and math.isfinite(n))
        self.loss.commit(fragment, list(update.losses))
        self.evidence.commit(fragment, update.slopes, update.cosines)
        if update.direction is not None:
            old = self._direction.get(fragment)
            self._direction[fragment] = update.direction
            if isinstance(old, str) and old != update.direction and self.spill is not None:
                self.spill.delete(old)
            self._merges[fragment] = self._merges.get(fragment, 0) + 1

    def rolled_back(self, fragment: int, result: MergeResult, error: Exception) -> NothingToMerge:
        """The NothingToMerge to raise for a round whose outer step was not finite: every participant rejected."""
        self.counts[ROLLBACK] += 1
        rejected = {**result.rejected, **dict.fromkeys(result.participants, ROLLBACK)}
        logger.warning("fragment %d: round rolled back: %s (%s)", fragment, ROLLBACK, error)
        return NothingToMerge(f"fragment {fragment}: {ROLLBACK}, round rolled back", rejected)

    def status(self) -> dict[str, int]:
        """Verdicts by tag and the evidence weighting's counts, for /api/status."""
        evidence = {f"evidence: {k}": v for k, v in self.evidence.status().items() if v}
        return {**self.counts, **evidence}


def _float32(params: Mapping[str, torch.Tensor]) -> Mapping[str, torch.Tensor]:
    if getattr(params, "chunk", None) is not None:
        return params  # a spill file (float32): read a chunk at a time by whoever uses it, never here
    return {n: t.detach().to(torch.float32) for n, t in params.items()}
