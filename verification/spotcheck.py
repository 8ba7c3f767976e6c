"""Spot-check recomputation policy: which microbatches another replica recomputes, and what a
difference means.

Statistics at a boundary cannot see an attacker that sends what an honest replica would plausibly send
(slow drift, an EMA-mimicking free-rider, noise at the scale of honest variation, a quiet gradient sign
flip). Recomputing the same input on another replica of the same stage can: the data variation that hides
those attacks from the monitor cancels, and what remains is the replicas' weight divergence and floating
point noise. This module owns the sampling rate (small base rate, more for new, flagged and quarantined
peers; the RNG is the verifier's and the draw happens after the sender signed its output, so the sender
cannot know in advance) and the comparison and adjudication rules. Running the recomputation is the
verifier's job.

Adjudication: a mismatch between the original and the checker is not yet proof (either may be the liar).
A third replica recomputes; if the original is the odd one out (far from both others, which are close to
each other) that is ban-grade evidence against it; if the checker is the odd one out, the checker is the
suspect (a marginal conviction: see `adjudicate`); otherwise nothing is concluded. Replicas are DiLoCo
learners whose weights differ between syncs, so "close" is calibrated on the honest divergence this stage
actually shows, and convictions carry no ban weight while the stage's replicas are seen not to agree at
all (`SpotCheckConfig.turbulence_checks`).
"""

from __future__ import annotations

import logging
import math
import random
import statistics
from collections import deque
from dataclasses import dataclass
from typing import Literal

import torch

logger = logging.getLogger(__name__)

Outcome = Literal["match", "need_third", "original_faulty", "checker_faulty", "inconclusive"]


@dataclass(frozen=True, kw_only=True, slots=True)
class SpotCheckConfig:
    """Sampling rates and tolerances; docs/sentinel.md has the measurements behind the defaults."""

    base_rate: float = 0.02  # share of an established, unflagged replica's microbatches recomputed
    new_peer_rate: float = 0.25  # rate while the replica has sent fewer than new_peer_microbatches
    new_peer_microbatches: int = 50
    flagged_rate: float = 0.5  # rate while the replica has monitor flags in its ledger window
    # rate for the very tensor the monitor just flagged: the recomputation is its trial. A match clears
    # the flag (early training and lr changes make honest flags common); a mismatch is evidence.
    flagged_tensor_rate: float = 1.0
    quarantined_rate: float = 1.0  # rate while quarantined: every microbatch
    # Floor of the relative tolerance: ample for CPU fp32 nondeterminism with identical weights
    # (measured ~1e-7). Replicas of a stage are DiLoCo learners whose weights drift apart between
    # syncs (measured: median 7 % forward, 16 % backward at lr 1e-3), hence the adaptive tolerance.
    rtol: float = 1e-4  # relative L2 difference ||a - b|| / ||b|| that always counts as a match
    atol: float = 1e-6  # max |a - b| that counts as a match whatever rtol says (all-zero tensors)
    adaptive_tolerance: bool = True  # tolerance = factor * median rel_diff of honest-looking pairs
    tolerance_factor: float = 5.0  # measured from scratch: honest max / median rel_diff 3.4-4.5
    tolerance_samples: int = 16  # honest pairs needed before the tolerance adapts (until then: max)
    tolerance_window: int = 128  # honest rel_diffs remembered
    tolerance_max: float = 0.5  # never tolerate more than this, whatever honest pairs show
    # A match clears a monitor flag only when it is a typical honest pair: rel_diff at most this many
    # times the median honest rel_diff (the tolerance is lax enough to let a x1.5 scaling pass; honest
    # replicas one or two optimizer steps ahead of their peers measured 1.5-2.5x the median).
    clear_factor: float = 3.0
    odd_one_out_ratio: float = 4.0  # the odd replica differs from BOTH others this many times more
    # than they differ from each other (measured honest max: 3.9, p99: 2.3-3.0)
    # A conviction counts in full only when the odd one is this many tolerances from both others; nearer,
    # it is marginal (LedgerConfig.marginal_convictions_to_ban: it takes more of them to ban). Measured
    # in tests/integration/test_sentinel.py: an honest replica a few steps ahead of two others was the odd
    # one out at 1.2 x the tolerance (0.18 vs 0.15) twice and was banned, about 1 run in 7. The attacks
    # of the table differ from honest replicas by 0.45 (noise at strength 0.5) to 2 (scaling by -1).
    ban_margin: float = 1.5
    # Two replicas agreeing is evidence only while honest replicas of the stage agree at all. After a
    # three-way check in which no two of the three were within the tolerance (honest spread has outgrown
    # the calibrated tolerance: an lr change, a merge that moved far), this many further checks of the
    # same stage and direction convict without ban weight (tensor dropped, replica quarantined). Measured
    # in test_sentinel's lr x8 window: honest pairs at up to 5.5 tolerances, and an honest replica ahead
    # of two peers by 4.2x their distance (4 tolerances) convicted three times and banned.
    turbulence_checks: int = 8
    # Recomputations go first to replicas the verifier does not suspect (no flag in their ledger window, not
    # quarantined); a suspect is drawn only when no other peer is left. A checker cannot tell a disguised check
    # from training, so an attacker lies on the checks it is asked to make as on its own traffic, and
    # attackers whose lies do not depend on the input (mimic, constant) or are the same function of it
    # (scaling) agree with each other: in `sentinel_table --quick` (disguised), mimic attackers vouched for
    # each other's flagged tensors 14 times and, as two against one, convicted honest replicas 19 times.
    unsuspected_checkers_first: bool = True

    def __post_init__(self) -> None:
        for name in ("base_rate", "new_peer_rate", "flagged_rate", "flagged_tensor_rate", "quarantined_rate"):
            value = getattr(self, name)
            if not 0.0 <= value <= 1.0:
                raise ValueError(f"{name} must be in [0, 1], got {value}")
        if self.new_peer_microbatches < 0:
            raise ValueError("new_peer_microbatches must be >= 0")
        if self.rtol < 0 or self.atol < 0 or self.tolerance_max < self.rtol:
            raise ValueError("need rtol >= 0, atol >= 0 and tolerance_max >= rtol")
        if self.tolerance_factor < 1.0 or self.odd_one_out_ratio < 1.0 or self.clear_factor <= 0:
            raise ValueError("need tolerance_factor >= 1, odd_one_out_ratio >= 1 and clear_factor > 0")
        if not (math.isfinite(self.ban_margin) and self.ban_margin >= 1.0):
            raise ValueError(f"ban_margin must be >= 1, got {self.ban_margin}")
        if not 1 <= self.tolerance_samples <= self.tolerance_window:
            raise ValueError("need 1 <= tolerance_samples <= tolerance_window")
        if self.turbulence_checks < 0:
            raise ValueError(f"turbulence_checks must be >= 0, got {self.turbulence_checks}")


@dataclass(frozen=True, slots=True)
class SpotCheckDecision:
    check: bool
    rate: float
    reason: str


@dataclass(frozen=True, slots=True)
class SpotCheckResult:
    match: bool
    max_abs_diff: float
    rel_diff: float  # ||a - b||_2 / max(||a||_2, ||b||_2)


@dataclass(frozen=True, slots=True)
class SpotCheckVerdict:
    outcome: Outcome
    reason: str
    original_vs_checker: SpotCheckResult
    third_vs_checker: SpotCheckResult | None = None
    third_vs_original: SpotCheckResult | None = None
    # False when the agreement of the two others is no evidence: they are identical copies of one version
    # while replicas normally drift (SpotCheckPolicy._one_opinion), or the stage is turbulent (`turbulent`).
    # The culprit's tensor is still distrusted (dropped, and the replica quarantined) but the conviction
    # does not count towards a ban.
    corroborated: bool = True
    # True when the culprit is within `ban_margin` tolerances of the two others: a conviction, but one of
    # several that a ban takes (LedgerConfig.marginal_convictions_to_ban).
    marginal: bool = False
    # True when a recent three-way check of this stage and direction found no two replicas within the
    # tolerance (SpotCheckConfig.turbulence_checks); such a conviction is not corroborated.
    turbulent: bool = False

    @property
    def culprit(self) -> Literal["original", "checker"] | None:
        """Who two replicas agree against (the odd one out); pass `corroborated` on to
        `ViolationLedger.record_evidence`: only corroborated convictions count towards a ban."""
        if self.outcome == "original_faulty":
            return "original"
        if self.outcome == "checker_faulty":
            return "checker"
        return None

    @property
    def ban_grade(self) -> bool:
        """True when the check convicts someone (the original or the checker) in full: two distinct
        opinions against one, and not marginally (a marginal conviction is a fraction of one)."""
        return self.culprit is not None and self.corroborated and not self.marginal


def compare_outputs(a: torch.Tensor, b: torch.Tensor, rtol: float, atol: float) -> SpotCheckResult:
    """Compare two recomputations of the same microbatch.

    rel_diff is ||a - b|| / max(||a||, ||b||): symmetric (neither side is presumed honest) and bounded
    by 2. Norm-wise rather than torch.allclose's element-wise test, because CPU fp32 reduction order
    (thread count, batch composition) moves single elements by far more than the tensor as a whole."""
    if a.shape != b.shape:
        return SpotCheckResult(False, math.inf, math.inf)
    with torch.no_grad():
        a32, b32 = a.detach().float(), b.detach().float()
        norm_a, norm_b = float(a32.norm()), float(b32.norm())
        if not (math.isfinite(norm_a) and math.isfinite(norm_b)):
            return SpotCheckResult(False, math.inf, math.inf)
        diff = a32 - b32
        max_abs = float(diff.abs().max()) if diff.numel() else 0.0
        diff_norm = float(diff.norm())
    ref = max(norm_a, norm_b)
    rel = diff_norm / ref if ref > 0 else 0.0
    return SpotCheckResult(rel <= rtol or max_abs <= atol, max_abs, rel)


class SpotCheckPolicy:
    """Sampling and adjudication of spot-check recomputations for one stage (or one verifier)."""

    def __init__(self, config: SpotCheckConfig | None = None) -> None:
        self.config = config or SpotCheckConfig()
        self._honest_rel: deque[float] = deque(maxlen=self.config.tolerance_window)
        # Checks concluded since the last three-way check in which no two replicas agreed (None: never).
        self._since_spread: int | None = None

    def rate(
        self, *, microbatches_seen: int, recent_flags: int, quarantined: bool, flagged_now: bool = False
    ) -> tuple[float, str]:
        cfg = self.config
        candidates = [(cfg.base_rate, "base rate")]
        if flagged_now:
            candidates.append((cfg.flagged_tensor_rate, "this tensor was flagged"))
        if microbatches_seen < cfg.new_peer_microbatches:
            candidates.append((cfg.new_peer_rate, f"new peer ({microbatches_seen} microbatches seen)"))
        if recent_flags > 0:
            candidates.append((cfg.flagged_rate, f"{recent_flags} recent flags"))
        if quarantined:
            candidates.append((cfg.quarantined_rate, "quarantined"))
        return max(candidates, key=lambda c: c[0])

    def should_check(
        self,
        rng: random.Random,
        *,
        microbatches_seen: int,
        recent_flags: int,
        quarantined: bool,
        flagged_now: bool = False,
    ) -> SpotCheckDecision:
        """Draw whether to recompute this microbatch; call only after the sender's output is signed."""
        rate, why = self.rate(
            microbatches_seen=microbatches_seen,
            recent_flags=recent_flags,
            quarantined=quarantined,
            flagged_now=flagged_now,
        )
        return SpotCheckDecision(rng.random() < rate, rate, why)

    @property
    def tolerance(self) -> float:
        """Current relative tolerance: rtol with fixed tolerances; with adaptive ones, the maximum until
        enough honest pairs were seen, then factor * their median (a median, so the minority of
        attacker checks that pass cannot ratchet it up), clamped to [rtol, tolerance_max]."""
        cfg = self.config
        if not cfg.adaptive_tolerance:
            return cfg.rtol
        if len(self._honest_rel) < cfg.tolerance_samples:
            return cfg.tolerance_max
        return min(cfg.tolerance_max, max(cfg.rtol, cfg.tolerance_factor * self._honest_median()))

    def _honest_median(self) -> float:
        """Median honest rel_diff, leaving out identical pairs when there are enough others: right after a
        merge, replicas that have not stepped since are identical (0), and those zeros say nothing about how
        far apart honest replicas get (measured from scratch: half the pairs were 0, and 3 x the median
        convicted an honest replica one step ahead of the other two). A deployment whose replicas are
        always identical keeps the zeros, and with them the tight tolerance it deserves."""
        apart = [r for r in self._honest_rel if r > self.config.rtol]
        sample = apart if len(apart) >= self.config.tolerance_samples // 2 else self._honest_rel
        return statistics.median(sample)

    def _one_opinion(self, agreeing: float) -> bool:
        """Whether the two replicas that agree against a third are one opinion rather than two: replicas
        are known to drift apart (the calibrated honest median is above rtol) and these two are identical,
        i.e. copies of one merged version that neither has stepped away from yet. Against such a pair any
        replica that has stepped since is "the odd one out", honest or not. Measured on the live pipeline
        right after a learning-rate change (lr x10): an honest replica one step ahead of two identical
        peers was the odd one out at 0.19-0.73 relative, and, recomputed on every microbatch once
        quarantined, twice in a row (a ban; see docs/sentinel.md)."""
        cfg = self.config
        return agreeing <= cfg.rtol and cfg.adaptive_tolerance and self._honest_median() > cfg.rtol

    @property
    def calibrated(self) -> bool:
        """Whether the tolerance rests on honest pairs (always, with a fixed tolerance)."""
        cfg = self.config
        return not cfg.adaptive_tolerance or len(self._honest_rel) >= cfg.tolerance_samples

    def clears(self, verdict: SpotCheckVerdict) -> bool:
        """Whether a verdict clears the original of a monitor flag: it matched (or the checker was the odd
        one out) by no more than `clear_factor` times the median honest rel_diff. Never before the
        tolerance has adapted: until then "match" only means "within the maximum tolerance"."""
        cfg = self.config
        if verdict.outcome == "match":
            rel = verdict.original_vs_checker.rel_diff
        elif verdict.outcome == "checker_faulty" and verdict.third_vs_original is not None:
            rel = verdict.third_vs_original.rel_diff
        else:
            return False
        if rel <= cfg.rtol:
            return True
        if not cfg.adaptive_tolerance or not self.calibrated:
            return False
        return rel <= cfg.clear_factor * self._honest_median()

    def compare(self, a: torch.Tensor, b: torch.Tensor) -> SpotCheckResult:
        return compare_outputs(a, b, self.tolerance, self.config.atol)

    def adjudicate(
        self,
        original: torch.Tensor,
        checker: torch.Tensor,
        third: torch.Tensor | None = None,
        *,
        turbulent_elsewhere: bool = False,
    ) -> SpotCheckVerdict:
        """Judge a spot check; pass `third` (a third replica's recomputation) after a `need_third`, and
        `turbulent_elsewhere` when the policy of the stage's other direction is `turbulent` (the same
        replicas' weights have spread: their activations and their gradients are judged apart).

        With three opinions, a replica is the odd one out when it differs from both others by more
        than the tolerance AND by more than `odd_one_out_ratio` times their difference to each other."""
        tol = self.tolerance
        first = self.compare(original, checker)
        if first.match:
            self._count_check()
            self._honest_rel.append(first.rel_diff)
            return SpotCheckVerdict("match", f"rel_diff {first.rel_diff:.2e} within {tol:.2e}", first)
        if third is None:
            return SpotCheckVerdict(
                "need_third", f"rel_diff {first.rel_diff:.2e} > {tol:.2e}: ask a third replica", first
            )
        vs_checker = self.compare(third, checker)
        vs_original = self.compare(third, original)
        turbulent = self.turbulent or turbulent_elsewhere
        self._count_check()
        if not self.calibrated:
            return self._uncalibrated(first, vs_checker, vs_original)
        outcome, reason, corroborated, marginal = self._odd_one_out(first, vs_checker, vs_original, tol)
        turbulent = turbulent and outcome != "inconclusive"
        reason, corroborated, marginal = self._weigh(outcome, reason, corroborated, marginal, turbulent)
        logger.info("spot check %s: %s", outcome, reason)
        return SpotCheckVerdict(
            outcome, reason, first, vs_checker, vs_original, corroborated, marginal, turbulent
        )

    def _uncalibrated(
        self, first: SpotCheckResult, vs_checker: SpotCheckResult, vs_original: SpotCheckResult
    ) -> SpotCheckVerdict:
        """Until the tolerance has adapted, "far" only means "beyond the maximum tolerance", and early in
        training honest replicas are that far apart: measured from scratch, one replica's first optimizer
        step moved its output by 0.82 (relative) while two replicas that had not stepped yet were identical,
        an odd one out by the rule of `_odd_one_out`. Collect samples, convict nobody."""
        reason = f"tolerance not calibrated yet ({_distances(first, vs_checker, vs_original)})"
        for pair in (vs_checker, vs_original):
            if pair.match:
                self._honest_rel.append(pair.rel_diff)
        return SpotCheckVerdict("inconclusive", reason, first, vs_checker, vs_original)

    def _odd_one_out(
        self, first: SpotCheckResult, vs_checker: SpotCheckResult, vs_original: SpotCheckResult, tol: float
    ) -> tuple[Outcome, str, bool, bool]:
        """The three-way rule: (outcome, reason, corroborated, marginal) before turbulence is weighed in.
        Feeds the agreeing pair's distance to the honest sample, and notes when no two replicas agree."""
        ratio = self.config.odd_one_out_ratio
        original_odd = min(first.rel_diff, vs_original.rel_diff) > max(tol, ratio * vs_checker.rel_diff)
        checker_odd = min(first.rel_diff, vs_checker.rel_diff) > max(tol, ratio * vs_original.rel_diff)
        distances = _distances(first, vs_checker, vs_original)
        if original_odd:
            self._honest_rel.append(vs_checker.rel_diff)
            reason = f"original is the odd one out ({distances}; tolerance {tol:.2e})"
            corroborated = not self._one_opinion(vs_checker.rel_diff)
            marginal = min(first.rel_diff, vs_original.rel_diff) < self.config.ban_margin * tol
            return "original_faulty", reason, corroborated, marginal
        if checker_odd:
            # Always marginal: the checker answered a recomputation on its current weights, the original on
            # the weights stashed at its forward, earlier, so an honest checker that stepped since is the
            # odd one out against an original and a third that did not (measured, lr x8 runs: 15 of 20
            # honest convictions were of checkers, none of 52 attacker convictions). And a lying checker
            # drops nothing by itself (the third sides with the original); it costs a recomputation.
            self._honest_rel.append(vs_original.rel_diff)
            reason = f"checker is the odd one out ({distances}; tolerance {tol:.2e})"
            return "checker_faulty", reason, not self._one_opinion(vs_original.rel_diff), True
        if min(first.rel_diff, vs_original.rel_diff, vs_checker.rel_diff) > tol:
            self._since_spread = 0  # no two replicas agree: honest spread beyond the tolerance
        return "inconclusive", f"no odd one out ({distances}; tolerance {tol:.2e})", True, False

    def _weigh(
        self, outcome: Outcome, reason: str, corroborated: bool, marginal: bool, turbulent: bool
    ) -> tuple[str, bool, bool]:
        """How much a conviction counts: nothing while turbulent or against one opinion, else full or
        marginal; returns the reason with the why appended, corroborated and marginal."""
        if turbulent:
            reason += (
                "; no two replicas agreed in a recent three-way check of this stage: honest spread beyond"
                " the tolerance, not ban-grade"
            )
            return reason, False, False
        if not corroborated:
            return reason + "; the two others are identical: one opinion, not ban-grade", False, False
        if marginal and outcome == "checker_faulty":
            reason += "; a checker's recomputation: marginal"
        elif marginal:
            reason += f"; within {self.config.ban_margin:g} x the tolerance of the others: marginal"
        return reason, corroborated, marginal

    @property
    def turbulent(self) -> bool:
        """Whether a three-way check found no two replicas within the tolerance in the last
        `turbulence_checks` concluded checks: convictions are then not ban-grade."""
        since = self._since_spread
        return since is not None and since < self.config.turbulence_checks

    def _count_check(self) -> None:
        if self._since_spread is not None:
            self._since_spread += 1


def _distances(first: SpotCheckResult, vs_checker: SpotCheckResult, vs_original: SpotCheckResult) -> str:
    return f"o-c {first.rel_diff:.2e}, t-o {vs_original.rel_diff:.2e}, t-c {vs_checker.rel_diff:.2e}"
