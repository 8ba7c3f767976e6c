"""What a contribution may claim and whether it is its own work (issue 18, part 2). Pure: the caller passes `now`.

* `ClaimBound`: a learner's step claim is already capped at (time since the base it built on was published) x
  `max_steps_per_s` (node.diloco.counters.cap_counters), but that rate is a loose ceiling (50 steps/s) and the
  merge weight tokens^2 / steps grows with every step claimed. The bound here is measured: each admitted claim on
  a version the syncer published gives its peer a rate sample (the steps claimed over the syncer-measured time
  since that publication; not the capped steps, which let a median that started low rise only by `factor` a
  round), and a claim is capped at
  `claim_rate_factor` x the median of the peers' latest samples times that time. The median is over peers, so a
  minority that inflates its own samples does not move it; until `min_peers` peers gave a sample, the ceiling is
  the only cap. Limits: a lone learner (K = 1) or a Sybil majority sets the median (admission costs answer that).
  The cap alone leaves an inflating peer `factor` x an honest weight (the poisoning benchmark's `inflate:20` held
  0.31 of every merge), so `judge` also names a claim above `violation_factor` x the median rate times the measured
  time: the syncer counts it as a violation in the learner ledger (node.diloco.learner_ledger) with the numbers as
  evidence, and it is credited at the median rate (not `factor` x it). It is
  still merged: an honestly faster peer loses little on one observation, and only repeated claims that far out,
  within the ledger's forgiveness, ban (set the factor above the spread of the run's hardware, or 0 for off).
* `copy_of`: a contribution whose delta is within `tolerance` x its norm of another peer's delta in the same round
  (a copycat), or whose parameters are within that of a version the syncer published (a free-rider: it returns a
  published version, or its own base, as its work) is no work of its own and earns nothing: it is refused.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Iterable, Mapping

import torch

from node.diloco import chunked

COPYCAT, FREE_RIDER = "copycat", "free-rider"
CLAIM = "claim: rate"  # the learner ledger's tag of a claim `ClaimBound.judge` found implausible


class ClaimBound:
    """The measured step rate of the swarm (median over peers of their latest claimed rate) and the cap it sets."""

    def __init__(
        self,
        *,
        factor: float,
        min_peers: int,
        violation_factor: float = 0.0,
        max_peers: int = 4096,
        max_age_s: float = 600.0,
    ) -> None:
        if not (factor >= 1.0 and math.isfinite(factor)) or min_peers < 1:
            raise ValueError("claim_rate_factor must be a finite number >= 1 and min_peers >= 1")
        if not (violation_factor == 0.0 or 1.0 <= violation_factor < math.inf):
            raise ValueError("claim_violation_factor must be 0 (off) or a finite number >= 1")
        self.factor, self.min_peers, self.violation_factor = factor, min_peers, violation_factor
        self.max_peers, self.max_age_s = max_peers, max_age_s
        self._rates: OrderedDict[str, tuple[float, float]] = OrderedDict()  # peer -> (steps/s, when)

    def median(self, now: float) -> float | None:
        """The median of the recent rate samples of distinct peers; None until `min_peers` gave one."""
        rates = sorted(r for r, at in self._rates.values() if now - at <= self.max_age_s)
        if len(rates) < self.min_peers:
            return None
        return rates[len(rates) // 2]  # upper median: with two peers, the faster one sets it

    def rate(self, now: float) -> float | None:
        """`factor` x the median rate (the cap's rate); None until `min_peers` gave a sample."""
        median = self.median(now)
        return None if median is None else self.factor * median

    def judge(self, steps: int, elapsed_s: float, now: float) -> tuple[str, dict[str, float]] | None:
        """(reason, evidence numbers) when a claim of `steps` over `elapsed_s` measured seconds is more than
        `violation_factor` x what the median rate does in that time (at least one step); None when plausible, when
        there is no median yet, or with the check off."""
        median = self.median(now)
        if self.violation_factor <= 0 or median is None or steps <= 0:
            return None
        plausible = max(1.0, median * max(0.0, elapsed_s))
        if steps <= self.violation_factor * plausible:
            return None
        reason = (
            f"claimed {steps} steps in {elapsed_s:.3g} s: {steps / plausible:.3g} x the peers' median rate"
            f" ({median:.3g} steps/s), bound {self.violation_factor:g} x"
        )
        return reason, {"claimed_steps": float(steps), "plausible_steps": round(plausible, 3)}

    def cap(
        self, steps: int, tokens: int, elapsed_s: float, now: float, *, implausible: bool = False
    ) -> tuple[int, int, bool]:
        """(steps, tokens, capped): the claim bounded by the measured rate over `elapsed_s`; tokens keep their
        tokens per step. `implausible` (`judge` named it): bounded by the median rate itself, not `factor` x it (a
        peer caught lying about its speed is not given the benefit of the doubt a faster peer gets)."""
        median = self.median(now)
        if median is None or steps <= 0:
            return steps, tokens, False
        rate = median if implausible else self.factor * median
        limit = max(1, math.floor(rate * max(0.0, elapsed_s) + 1e-9))
        if steps <= limit:
            return steps, tokens, False
        return limit, tokens * limit // steps, True

    def observe(self, peer: str, steps: int, elapsed_s: float, now: float) -> None:
        """An admitted claim of `steps` over `elapsed_s` (syncer-measured) seconds."""
        if steps <= 0 or not (elapsed_s > 0 and math.isfinite(elapsed_s)):
            return
        self._rates.pop(peer, None)
        self._rates[peer] = (steps / elapsed_s, now)
        while len(self._rates) > self.max_peers:
            self._rates.popitem(last=False)


def copy_of(
    params: Mapping[str, torch.Tensor],
    base: Mapping[str, torch.Tensor],
    published: Iterable[tuple[int, Mapping[str, torch.Tensor]]],
    others: Iterable[tuple[str, Mapping[str, torch.Tensor]]],
    tolerance: float,
    *,
    work_norm: float | None = None,
) -> tuple[str, str] | None:
    """(tag, reason) if the contribution `params` built on `base` is a free-rider (within `tolerance` x its delta
    norm, or x `work_norm` where that is larger, of a `published` (version, tensors)) or a copycat (its delta
    within `tolerance` x its norm of another peer's delta in `others`: (peer, delta)); None if it is its own work.

    `work_norm` is the norm of a round's honest work on this fragment (the screen's median merged norm; None in
    warm-up). Without it a free-rider that returns its own current base plus noise passes: its delta is the noise,
    so its gap to the base equals its norm. The copycat test keeps its own norm: two small honest deltas (a few
    steps each) are close in absolute terms without being copies."""
    delta = chunked.Delta(base, params)  # a chunk at a time: no fragment-sized temporary (issue 17)
    norm = chunked.norm(delta)
    bound = tolerance * norm
    ride_bound = tolerance * max(norm, work_norm or 0.0)
    for version, tensors in published:
        if (gap := chunked.distance(params, tensors)) <= ride_bound:
            reason = f"within {gap:.3g} of published version {version} (delta norm {norm:.3g}"
            reason += f", a round's work {work_norm:.3g})" if work_norm else ")"
            return FREE_RIDER, reason
    for peer, theirs in others:
        if (gap := chunked.distance(delta, theirs)) <= bound:
            return COPYCAT, f"delta within {gap:.3g} of {peer[-8:]}'s in this round (norm {norm:.3g})"
    return None
