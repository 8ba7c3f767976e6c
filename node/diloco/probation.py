"""Probation: a new identity's merge weight ramps up with its accepted contributions (issue 18, Sybil resistance).

Each identity's weight in a merge is multiplied by

    ramp(n) = start_fraction + (1 - start_fraction) * min(1, n / merges)

where n is the number of accepted merges it took part in (node.diloco.seniority counts them: any fragment, each
merge by the fraction of its weight the young cap left it, back to 0 after a refused contribution or `forget_s`
idle). A fresh identity carries `start_fraction` (0.25) of its token weight, an identity in `merges` (8) accepted
merges or more its whole weight.

Merge weights are normalised (node.diloco.merge), so a ramp that scales every weight of a round alike changes
nothing relative: among identities equally new, each keeps its share. What it changes:

* *relative*: against established identities a burst of fresh ones counts `start_fraction` each, before the young
  group cap (node.diloco.seniority), which then holds the young group's total to its cap only when the ramped
  share is still above it. Unlike the group cap it applies while nobody is senior yet: learners of the run's first
  `merges` merges outweigh identities that arrive after them.
* *absolute*: the round's outer gradient is scaled by the largest multiplier among its positive weights (as the
  evidence factor's step scale: "as if an established identity with no progress held the rest"), so a merge of
  fresh identities only, a run's first merge included, moves the model by `start_fraction` of a full step, never
  by the whole of it. An honest start is slowed, not stalled: the first merges step at 0.25, 0.34, 0.44, ...,
  and every participant of a merge gains a round, so K = 1 learners reach full steps after `merges` merges each
  (at 4 learners and 3 fragments, a few rounds of each fragment).

What it cannot do: identities that start with the run ramp up with it, so a Sybil burst present from the first
merge is weighed as the honest learners are (the screens, the evidence of work and admission's cost answer it).

Pure: the caller passes each peer's count of merges (taken at its `now`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True, slots=True)
class ProbationConfig:
    merges: int = 8  # accepted merges over which an identity's weight ramps to whole (0: off)
    start_fraction: float = (
        0.25  # of its weight a fresh identity carries, and of a full step its lone merge takes
    )

    def __post_init__(self) -> None:
        if not isinstance(self.merges, int) or isinstance(self.merges, bool) or self.merges < 0:
            raise ValueError(f"probation merges must be an int >= 0 (0: off), got {self.merges!r}")
        if not 0.0 < self.start_fraction <= 1.0:
            raise ValueError(f"probation start_fraction must be in (0, 1], got {self.start_fraction!r}")

    @property
    def enabled(self) -> bool:
        return self.merges > 0 and self.start_fraction < 1.0


def ramp(config: ProbationConfig, merges: float) -> float:
    """The weight multiplier of an identity accepted in `merges` merges, in [start_fraction, 1]."""
    if not config.enabled:
        return 1.0
    done = min(1.0, max(0.0, merges) / config.merges)
    return config.start_fraction + (1.0 - config.start_fraction) * done


@dataclass(frozen=True, kw_only=True, slots=True)
class Ramped:
    weights: dict[str, float]  # the raw weights, each times its identity's multiplier
    multipliers: dict[str, float]  # per peer with positive weight and a multiplier below 1
    step_scale: float  # the largest multiplier among the positive weights (1: a full step; 1 when none)


def ramp_weights(
    weights: Mapping[str, float], merges_of: Callable[[str], float], config: ProbationConfig
) -> Ramped:
    """`weights` (raw, peer -> weight) each times its identity's `ramp`, and the round's step scale."""
    if not config.enabled:
        return Ramped(weights=dict(weights), multipliers={}, step_scale=1.0)
    factors = {p: ramp(config, merges_of(p)) for p, w in weights.items() if w > 0}
    out = {p: w * factors.get(p, 1.0) for p, w in weights.items()}
    below = {p: f for p, f in factors.items() if f < 1.0}
    return Ramped(weights=out, multipliers=below, step_scale=max(factors.values(), default=1.0))
