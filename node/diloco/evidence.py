"""Evidence of work (issue 18): a contribution's merge weight scaled by how far it points down the held-out loss.

The screens before it refuse what is harmful (non-finite, oversized, an ascent step, a copy). Noise at an honest
norm is none of these: it neither raises the held-out loss beyond the floor nor points anywhere, and weighed by
its honest claims it held 0.11 of the merge weight in the live benchmark (benchmarks/poisoning.py, `noise`).
What it lacks is evidence of useful work, and the held-out loss probe measures that already: with the delta
applied and reversed (node.diloco.loss_probe), `LossScore.slope` = (loss reversed - loss applied) / (2 x the
delta's norm) is the held-out loss's descent along the delta per unit of norm (nats), the first-order term of
both (the overshoot cancels). An honest pseudo-gradient points down the held-out gradient; a random direction in
a fragment of n parameters has about 1/sqrt(n) of its slope, and either sign.

Per fragment, the reference is the lower median, over recent merges, of the lower median of the slopes of each
merge's contributions merged at full weight (only those: one this scaled down never moves its own standard, and
a Sybil majority of noise merged in warm-up is outvoted once honest slopes fill the window; one value per merge,
see `EvidenceWeight.commit`). A contribution's factor is 0 at or below
`zero_fraction` x the reference, 1 at or above `full_fraction` x it, linear between. A small private batch sees
an honest delta's descent noisily (in the live benchmark a quarter of honest slopes were under half the median,
a tenth negative), so the same ramp on the delta's cosine with the recent merged direction (the screen's EMA of
unit merged updates; its reference the lower median of full-weight contributions' cosines) can raise the factor,
never lower it: an honest delta agrees with where the swarm went, noise agrees with nothing (its cosine is about
1/sqrt(n) either way), and a disagreeing cosine alone judges nothing (honest stage replicas' deltas were seen at
-0.54; they are not scored anyway).

The recent merged direction is public, though (every learner fetches the merged versions): noise plus 0.2 x that
direction looked honest to both rules (the `noise_aligned` arms of benchmarks/poisoning.py; docs/security.md,
"Cosine gaming"). So with `cosine_needs_slope` (`[syncer] screening.evidence_public_residual`) the slope judged is
the residual's, the contribution less its projection on the recent merged direction (node.diloco.screening_residual,
measured by the probe in the same score), and the cosine raises only a factor that slope earned above 0: agreeing
with where the swarm went is free, so it adds to evidence and is none alone. The token weight is multiplied by the
factor before the seniority cap (node.diloco.seniority). It is a down-weight, never a refusal: an honest contribution that shows little evidence
loses that round's weight, not its learner's standing (no ledger violation, no demotion). Until `min_history`
merges recorded a full-weight slope (warm-up, after a restart) and for a contribution without a slope (not scored: the probe
off or not loaded yet, a stage replica, a loss that is not finite) the factor is 1.

Weights are normalised per round, so a factor alone only moves weight between the contributions of one round: a
lone contribution (quorum K = 1, or the only one in its round) kept the whole merge at any factor above 0, and a
round whose contributions all earned little kept its whole step. So the round's outer gradient is scaled by
`step_scale`, the largest factor among the contributions it merges (`scales_step`; the same way the seniority cap
scales a young-only merge, the two scales multiplied): a lone contribution moves the model by its factor x what it
would have, and a round with one contribution at factor 1 is unchanged (bit for bit). The largest factor, not the
weight-weighted mean: the mean is the tighter bound when everything is low (each contribution's effective share at
most its factor x its token share), but it would also shrink every round in which one contribution was zeroed,
making noise at full claims a lever that slows the honest learners by its token share at K > 1 (and honest
contributions are zeroed now and then by their small held-out batch), where normalisation among full-evidence
contributions already bounds it. With the largest factor, a contribution's effective share (weight x step scale)
is at most its factor x its weight / the best-evidenced contribution's weight.

A contribution's factor is at most the lower median of its peer's recent judged factors (`SustainedEvidence`): a
lone lucky score of noise earns nothing, and so no longer ends its run of zeros below either.

A peer whose last `zero_streak` scored contributions (any fragment) all earned factor 0 showed no evidence of work
in any of them: `ZeroStreaks` reports it once per such run, with the slopes and cosines, and the syncer records one
learner ledger violation (node.diloco.learner_ledger; forgiven with its half-life like the others, so repeated it
bans). One zeroed contribution is no violation: a small held-out batch zeroes honest work now and then (up to half
of it in some four-learner benchmark arms at K = 1), and runs of 5 gave honest learners violations in 4 of 5 such
arms; runs of 10 gave none, while noise attackers (about 85 % zeroed) still got theirs, but a fragment stalled
by a first-round reference (see `EvidenceWeight.commit`) still gave honest learners 2 (docs/diloco.md).

Pure: no sockets, no clock (nothing here ages with time; the window is a count).
"""

from __future__ import annotations

import dataclasses
import math
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

NO_EVIDENCE = "evidence: none"  # the learner ledger's tag of a `ZeroStreak`


@dataclass(frozen=True, kw_only=True, slots=True)
class EvidenceConfig:
    enabled: bool = True
    zero_fraction: float = 0.1  # a slope at or below this x the reference earns no weight
    full_fraction: float = 0.3  # a slope at or above this x the reference keeps its whole weight
    history: int = 32  # merges whose full-weight slopes are kept per fragment (a count; one value per merge)
    min_history: int = 4  # such merges before the factor applies
    scales_step: bool = True  # a round's outer gradient x the largest factor it merges (see `step_scale`)
    # consecutive scored contributions at factor 0 that make a ledger violation (0: off)
    zero_streak: int = 10
    # a peer's factor is at most the lower median of its last this many judged factors (`SustainedEvidence`; 0: off)
    sustained: int = 16
    # the cosine raises only a factor the slope earned above 0 (the public-direction rule, `_judged`; false: any)
    cosine_needs_slope: bool = True
    # warm-up (no reference yet): a slope at or below zero_fraction x the largest of the fragment's last this many
    # scored slopes earns 0, as the ramp does after it (`_probation`; 0: off, every warm-up factor 1)
    warmup_window: int = 0
    # ... against this x the ramp's fractions of that largest slope (honest slopes fall 10-30x within the first merges,
    # noise's are about 1/1000 of an honest one; replayed: 0.1 lowered no honest warm-up score, 1.0 zeroed a third)
    warmup_scale: float = 0.1

    def __post_init__(self) -> None:
        if not 0.0 <= self.zero_fraction < self.full_fraction < math.inf:
            raise ValueError("evidence needs 0 <= zero_fraction < full_fraction (finite)")
        if not 1 <= self.min_history <= self.history:
            raise ValueError("evidence needs 1 <= min_history <= history")
        if not 0.0 < self.warmup_scale <= 1.0:
            raise ValueError("evidence needs 0 < warmup_scale <= 1")
        if self.zero_streak < 0 or self.sustained < 0 or self.warmup_window < 0:
            raise ValueError("evidence needs zero_streak, sustained and warmup_window >= 0 (0: off)")


@dataclass(frozen=True, kw_only=True, slots=True)
class ZeroStreak:
    """`zero_streak` consecutive scored contributions of `peer` at factor 0: a ledger violation's evidence."""

    peer: str
    slopes: tuple[float, ...]
    cosines: tuple[float | None, ...]
    digest: str = ""  # the last one's (node.diloco.learner_ledger.contribution_digest), set by the caller

    def scores(self) -> dict[str, float]:
        """The ledger's numbers: each slope and measured cosine, oldest first."""
        out = {f"slope_{i}": round(v, 6) for i, v in enumerate(self.slopes)}
        out.update({f"cosine_{i}": round(v, 4) for i, v in enumerate(self.cosines) if v is not None})
        return out


class ZeroStreaks:
    """Per peer, its current run of scored contributions at factor 0 (bounded: `max_peers`, the least recently
    scored first out)."""

    def __init__(self, length: int, max_peers: int = 4096) -> None:
        self.length, self.max_peers = length, max_peers
        self._runs: OrderedDict[str, list[tuple[float, float | None]]] = OrderedDict()

    def observe(self, peer: str, factor: float, slope: float, cosine: float | None) -> ZeroStreak | None:
        """A scored contribution of `peer`; the streak it completes, if it does (the run then starts over)."""
        run = self._runs.pop(peer, [])
        if self.length <= 0 or factor > 0.0:
            return None  # a contribution with any evidence ends the run (and off, nothing is kept)
        run.append((slope, cosine))
        if len(run) >= self.length:
            return ZeroStreak(peer=peer, slopes=tuple(s for s, _ in run), cosines=tuple(c for _, c in run))
        self._runs[peer] = run
        while len(self._runs) > self.max_peers:
            self._runs.popitem(last=False)
        return None


class SustainedEvidence:
    """Per peer, its last `length` judged factors (any fragment, each before this gate), and the gate they set: their
    lower median, this contribution's own included. A contribution's factor is at most its peer's gate, so weight
    needs evidence in most of a peer's recent work, not in one lucky score. Noise at an honest norm earns factor 0 in
    most scores and more than 0 in a minority that the held-out batch or a low reference lets through (in the live
    `noise_k1` arm 21 of 67, most in the embedding's fragment, whose reference noise merged in warm-up had pulled
    down: docs/security.md); its gate stays 0. Honest work earns 1 in most scores, so its gate stays 1 and only a
    contribution's own factor scales it. A young identity's window is short and as strict (of two scores, the
    lower): it earns weight by showing evidence from its first scores on. Warm-up scores (no reference) enter no
    window. Bounded: `max_peers`, the least recently scored first out."""

    def __init__(self, length: int, max_peers: int = 4096) -> None:
        self.length, self.max_peers = length, max_peers
        self._factors: OrderedDict[str, deque[float]] = OrderedDict()

    def observe(self, peer: str, factor: float) -> float:
        """`peer`'s judged `factor` into its window; the gate, in [0, 1] (1 when off)."""
        if self.length <= 0:
            return 1.0
        window = self._factors.pop(peer, None) or deque(maxlen=self.length)
        window.append(factor)
        self._factors[peer] = window  # most recently scored last
        while len(self._factors) > self.max_peers:
            self._factors.popitem(last=False)
        ordered = sorted(window)
        return ordered[(len(ordered) - 1) // 2]


class EvidenceWeight:
    """Per fragment, the recent full-weight slopes and cosines, and the factor a contribution earns (see the
    module docstring)."""

    def __init__(self, config: EvidenceConfig | None = None) -> None:
        self.config = config or EvidenceConfig()
        self._slopes: dict[int, deque[float]] = {}
        self._cosines: dict[int, deque[float]] = {}
        self._recent: dict[int, deque[float]] = {}  # per fragment, the last `warmup_window` scored slopes
        self.scaled = 0  # contributions given a factor below 1
        self.zeroed = 0  # of those, ones given 0
        self.scaled_steps = 0  # rounds whose outer gradient `step_scale` scaled below 1 (and above 0)
        self.streaks = ZeroStreaks(self.config.zero_streak if self.config.enabled else 0)
        self.sustained = SustainedEvidence(self.config.sustained)
        self.gated = 0  # contributions whose factor their peer's sustained evidence lowered
        self.zero_streaks = 0  # `ZeroStreak`s reported
        self._completed: list[ZeroStreak] = []  # since the last `take_streaks`

    def reference(self, fragment: int, *, cosine: bool = False) -> float | None:
        """The lower median of the fragment's recorded slopes (or cosines); None in warm-up."""
        values = sorted((self._cosines if cosine else self._slopes).get(fragment, ()))
        if len(values) < self.config.min_history:
            return None
        return values[(len(values) - 1) // 2]

    def _ramp(self, value: float | None, reference: float | None) -> float | None:
        """0 at or below zero_fraction x reference, 1 at or above full_fraction x it, linear between; None when
        either is unknown."""
        if value is None or not math.isfinite(value) or reference is None:
            return None
        low, high = self.config.zero_fraction * reference, self.config.full_fraction * reference
        return 1.0 if value >= high else 0.0 if value <= low else (value - low) / (high - low)

    def factor(self, fragment: int, slope: float | None, cosine: float | None = None) -> float:
        """The weight factor in [0, 1] of a contribution with held-out `slope` and `cosine` with the recent
        merged direction (None: not measured), on its own (`factors` also applies its peer's gate). The slope
        judges; the cosine can only raise the factor (an honest delta that a small held-out batch happens to see
        little descent along still agrees with the merged direction, noise does neither) and never lowers it
        (honest stage replicas' deltas were seen at -0.54)."""
        judged = self._judged(fragment, slope, cosine)
        return 1.0 if judged is None else judged

    def _judged(self, fragment: int, slope: float | None, cosine: float | None) -> float | None:
        """`factor`, None when nothing judges it (off, warm-up, not scored)."""
        if not self.config.enabled:
            return None
        by_slope = self._ramp(slope, self.reference(fragment))
        if by_slope is None:
            return None
        if by_slope <= 0.0 and self.config.cosine_needs_slope:
            return by_slope  # agreeing with the public direction is free: it adds to evidence, is none alone
        by_cosine = self._ramp(cosine, self.reference(fragment, cosine=True))
        return max(by_slope, by_cosine or 0.0)

    def factors(
        self, fragment: int, slopes: Mapping[str, float | None], cosines: Mapping[str, float | None]
    ) -> dict[str, float]:
        """Per peer of `slopes`, its contribution's `factor`, at most its peer's `SustainedEvidence` gate (a
        judged one only: warm-up and unscored contributions keep 1 and enter no window); counted in `scaled` /
        `zeroed`, and in `gated` where the gate lowered it."""
        out: dict[str, float] = {}
        if self.config.enabled and self.config.warmup_window > 0:
            recent = self._recent.setdefault(fragment, deque(maxlen=self.config.warmup_window))
            recent.extend(s for s in slopes.values() if s is not None and math.isfinite(s))
        for peer, slope in slopes.items():
            judged = self._judged(fragment, slope, cosines.get(peer))
            if judged is None:
                out[peer] = self._probation(fragment, slope)
                continue
            out[peer] = min(judged, self.sustained.observe(peer, judged))
            self.gated += out[peer] < judged
        self.scaled += sum(1 for f in out.values() if f < 1.0)
        self.zeroed += sum(1 for f in out.values() if f <= 0.0)
        return out

    def _probation(self, fragment: int, slope: float | None) -> float:
        """A warm-up factor (no reference yet; 1 when off or not scored): the ramp against the largest of the
        fragment's recent scored slopes, this round's included. Honest slopes from a fresh model are all large
        (0.23-0.42 in the poisoning benchmark) and fall a few fold over the warm-up, so a recent one stays within
        the ramp's full fraction of the largest; noise's are about 1/sqrt(n) of them (0.0002-0.0006), which the
        lone first merges took whole at K = 1 (docs/security.md). Recent, not the first: slopes fall 10-30x
        within the first merges, and a stale largest one would hold honest work under the full fraction, out of
        the reference (which only full-weight slopes build), and the warm-up would never end. Not in the
        sustained window (a provisional reference)."""
        if slope is None or not math.isfinite(slope) or not self.config.warmup_window:
            return 1.0
        # this slope is in it: a largest <= 0 means this one is too
        largest = max(self._recent.get(fragment, ()), default=0.0)
        judged = self._ramp(slope, self.config.warmup_scale * largest) if largest > 0 else 0.0
        return 1.0 if judged is None else judged

    def observe_streaks(
        self,
        factors: Mapping[str, float],
        slopes: Mapping[str, float],
        cosines: Mapping[str, float | None],
        digest: Callable[[str], str],
    ) -> None:
        """Each scored contribution's factor (of `factors()`) into `ZeroStreaks`; a run it completes is kept for
        `take_streaks`, named by `digest(peer)` (its last contribution's)."""
        for peer, f in factors.items():
            if peer in slopes and (streak := self.streaks.observe(peer, f, slopes[peer], cosines.get(peer))):
                self._completed.append(dataclasses.replace(streak, digest=digest(peer)))
                self.zero_streaks += 1

    def take_streaks(self) -> list[ZeroStreak]:
        """The `ZeroStreak`s completed since the last call."""
        taken, self._completed = self._completed, []
        return taken

    def step_scale(self, factors: Mapping[str, float], weights: Mapping[str, float]) -> float:
        """What a round's outer gradient is scaled by: the largest factor (those not scored: 1) among the peers
        of `weights` (peer -> its weight before the factor) with positive weight; 1 when off or nobody has weight
        (nothing merges then). Counted in `scaled_steps` when between 0 and 1."""
        if not (self.config.enabled and self.config.scales_step):
            return 1.0
        scale = max((factors.get(p, 1.0) for p, w in weights.items() if w > 0), default=1.0)
        self.scaled_steps += 0.0 < scale < 1.0
        return scale

    def commit(self, fragment: int, slopes: Iterable[float], cosines: Iterable[float] = ()) -> None:
        """The slopes and cosines of a published merge's contributions that kept their whole weight (factor
        1); only positive ones (descent, agreement) set the standard, one value per merge: their lower median.
        Per merge, not per contribution: the held-out descent per unit norm falls 10-30x within the first few
        merges of a run (0.23-0.42 -> 0.01-0.04 in the poisoning benchmark's `clean` arm), and a first round of
        `min_history` learners from the untrained model made the whole reference; every honest contribution after
        it then earned factor 0, and since only full-weight slopes move the reference, it stayed there (rounds
        that merged nothing, a fragment frozen for 6 rounds; docs/diloco.md). Counted per merge, the warm-up
        lasts `min_history` merges and the first round is one value of the lower median, not all of it."""
        for into, values in ((self._slopes, slopes), (self._cosines, cosines)):
            kept = sorted(v for v in values if math.isfinite(v) and v > 0)
            if kept:
                into.setdefault(fragment, deque(maxlen=self.config.history)).append(
                    kept[(len(kept) - 1) // 2]
                )

    def status(self) -> dict[str, int]:
        return {
            "scaled": self.scaled,
            "zeroed": self.zeroed,
            "scaled_steps": self.scaled_steps,
            "zero_streaks": self.zero_streaks,
            "gated": self.gated,
        }
