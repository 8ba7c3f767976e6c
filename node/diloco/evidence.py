"""Evidence of work (issue 18): a contribution's merge weight scaled by how far it points down the held-out loss.

The screens before it refuse what is harmful (non-finite, oversized, an ascent step, a copy). Noise at an honest
norm is none of these: it neither raises the held-out loss beyond the floor nor points anywhere, and weighed by
its honest claims it held 0.11 of the merge weight in the live benchmark (benchmarks/poisoning.py, `noise`).
What it lacks is evidence of useful work, and the held-out loss probe measures that already: with the delta
applied and reversed (node.diloco.loss_probe), `LossScore.slope` = (loss reversed - loss applied) / (2 x the
delta's norm) is the held-out loss's descent along the delta per unit of norm (nats), the first-order term of
both (the overshoot cancels). An honest pseudo-gradient points down the held-out gradient; a random direction in
a fragment of n parameters has about 1/sqrt(n) of its slope, and either sign.

Per fragment, the reference is the lower median of the slopes of recent contributions merged at full weight
(only those: one this scaled down never moves its own standard, and a Sybil majority of noise merged in warm-up
is outvoted once honest slopes fill the window). A contribution's factor is 0 at or below
`zero_fraction` x the reference, 1 at or above `full_fraction` x it, linear between. A small private batch sees
an honest delta's descent noisily (in the live benchmark a quarter of honest slopes were under half the median,
a tenth negative), so the same ramp on the delta's cosine with the recent merged direction (the screen's EMA of
unit merged updates; its reference the lower median of full-weight contributions' cosines) can raise the factor,
never lower it: an honest delta agrees with where the swarm went, noise agrees with nothing (its cosine is about
1/sqrt(n) either way), and a disagreeing cosine alone judges nothing (honest stage replicas' deltas were seen at
-0.54; they are not scored anyway). The token weight is multiplied by the factor before the seniority cap
(node.diloco.seniority). It is a down-weight, never a refusal: an honest contribution that shows little evidence
loses that round's weight, not its learner's standing (no ledger violation, no demotion). Until `min_history`
slopes were recorded (warm-up, after a restart) and for a contribution without a slope (not scored: the probe
off or not loaded yet, a stage replica, a loss that is not finite) the factor is 1.

Pure: no sockets, no clock (nothing here ages with time; the window is a count).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True, slots=True)
class EvidenceConfig:
    enabled: bool = True
    zero_fraction: float = 0.1  # a slope at or below this x the reference earns no weight
    full_fraction: float = 0.3  # a slope at or above this x the reference keeps its whole weight
    history: int = 32  # slopes kept per fragment (a count)
    min_history: int = 4  # slopes recorded before the factor applies

    def __post_init__(self) -> None:
        if not 0.0 <= self.zero_fraction < self.full_fraction < math.inf:
            raise ValueError("evidence needs 0 <= zero_fraction < full_fraction (finite)")
        if not 1 <= self.min_history <= self.history:
            raise ValueError("evidence needs 1 <= min_history <= history")


class EvidenceWeight:
    """Per fragment, the recent full-weight slopes and cosines, and the factor a contribution earns (see the
    module docstring)."""

    def __init__(self, config: EvidenceConfig | None = None) -> None:
        self.config = config or EvidenceConfig()
        self._slopes: dict[int, deque[float]] = {}
        self._cosines: dict[int, deque[float]] = {}
        self.scaled = 0  # contributions given a factor below 1
        self.zeroed = 0  # of those, ones given 0

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
        merged direction (None: not measured). The slope judges; the cosine can only raise the factor (an honest
        delta that a small held-out batch happens to see little descent along still agrees with the merged
        direction, noise does neither) and never lowers it (honest stage replicas' deltas were seen at -0.54)."""
        if not self.config.enabled:
            return 1.0
        by_slope = self._ramp(slope, self.reference(fragment))
        if by_slope is None:
            return 1.0
        by_cosine = self._ramp(cosine, self.reference(fragment, cosine=True))
        return max(by_slope, by_cosine or 0.0)

    def factors(
        self, fragment: int, slopes: Mapping[str, float | None], cosines: Mapping[str, float | None]
    ) -> dict[str, float]:
        """`factor` per peer of `slopes`; counted in `scaled` / `zeroed`."""
        out = {peer: self.factor(fragment, slope, cosines.get(peer)) for peer, slope in slopes.items()}
        self.scaled += sum(1 for f in out.values() if f < 1.0)
        self.zeroed += sum(1 for f in out.values() if f <= 0.0)
        return out

    def commit(self, fragment: int, slopes: Iterable[float], cosines: Iterable[float] = ()) -> None:
        """The slopes and cosines of a published merge's contributions that kept their whole weight (factor
        1); only positive ones (descent, agreement) set the standard."""
        for into, values in ((self._slopes, slopes), (self._cosines, cosines)):
            window = into.setdefault(fragment, deque(maxlen=self.config.history))
            window.extend(v for v in values if math.isfinite(v) and v > 0)

    def status(self) -> dict[str, int]:
        return {"scaled": self.scaled, "zeroed": self.zeroed}
