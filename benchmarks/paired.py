"""Paired, interleaved timing comparisons: a randomized schedule of A/B blocks and the share B -> A adds.

Why: on a shared 2-core box, the load drifts by more than the few percent we want to resolve, and a fixed order of
paths within a turn (A always right after B) turns carry-over effects (allocator state, caches, the scheduler) into
a bias of its own. So each comparison is run as many blocks of two adjacent calls, one per arm, in an order that
is balanced (A first in exactly half the blocks of a comparison) and shuffled, with the blocks of every comparison
shuffled together; the figure is the median of the per-block ratios A/B - 1, with a bootstrap interval over
blocks. An A/A comparison (the same path in both arms, the same procedure) measures what the method reports when
there is nothing to find.
"""

from __future__ import annotations

import dataclasses
import random
import statistics
from collections.abc import Sequence


@dataclasses.dataclass(frozen=True)
class Comparison:
    """Arm `a` against arm `b` (path names); `a == b` is an A/A control."""

    name: str
    a: str
    b: str


@dataclasses.dataclass(frozen=True)
class Block:
    """Two adjacent calls: the paths in the order run, and whether arm `a` ran first."""

    comparison: Comparison
    a_first: bool

    @property
    def order(self) -> tuple[str, str]:
        c = self.comparison
        return (c.a, c.b) if self.a_first else (c.b, c.a)


def schedule(comparisons: Sequence[Comparison], blocks_each: int, rng: random.Random) -> list[Block]:
    """`blocks_each` blocks per comparison, arm `a` first in half of them (`blocks_each` rounded up to even), all
    comparisons' blocks shuffled together so that every comparison sees the same drift of the load."""
    half = (blocks_each + 1) // 2
    blocks = [Block(c, a_first) for c in comparisons for a_first in (True, False) for _ in range(half)]
    rng.shuffle(blocks)
    return blocks


@dataclasses.dataclass(frozen=True)
class PairedShare:
    """Median over blocks of a/b - 1, a 95 % percentile-bootstrap interval of it (blocks resampled), and the
    median paired difference a - b in seconds."""

    share: float
    ci95_low: float
    ci95_high: float
    median_diff_s: float
    blocks: int


def paired_share(
    a_s: Sequence[float], b_s: Sequence[float], resamples: int = 2000, seed: int = 0
) -> PairedShare:
    """The share arm b -> arm a adds, from per-block times (same index = same block)."""
    if len(a_s) != len(b_s) or not a_s:
        raise ValueError("paired samples must be non-empty and of equal length")
    ratios = [a / b - 1 for a, b in zip(a_s, b_s, strict=True)]
    rng = random.Random(seed)
    medians = sorted(statistics.median(rng.choices(ratios, k=len(ratios))) for _ in range(resamples))
    return PairedShare(
        share=statistics.median(ratios),
        ci95_low=medians[int(0.025 * resamples)],
        ci95_high=medians[int(0.975 * resamples) - 1],
        median_diff_s=statistics.median(a - b for a, b in zip(a_s, b_s, strict=True)),
        blocks=len(ratios),
    )
