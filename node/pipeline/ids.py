"""Microbatch ids: one counter per verifier, for its training microbatches, its held-out evaluations and its
disguised spot checks alike (`MicrobatchIds`).

A disguised spot check (node/pipeline/checks.py) must not be told from a training microbatch by its id: it takes
the next id of the very counter the training microbatches take theirs from, so a checker sees one increasing
sequence with gaps (ids that went to other replicas of the stage, or to evaluations), the same as it sees without
checks.
"""

from __future__ import annotations

import time
from collections.abc import Callable


class MicrobatchIds:
    """Fresh microbatch ids, in increasing order, never reused by this counter."""

    def __init__(self, first: int) -> None:
        if first < 0:
            raise ValueError(f"microbatch ids are non-negative, got {first}")
        self._next = first

    @classmethod
    def from_clock(cls, wall_clock: Callable[[], float] = time.time) -> MicrobatchIds:
        """Starting from the wall clock in ms x 2^16: ids grow across restarts, so stage ledgers never see a
        reuse (a restarted verifier would otherwise be refused `already applied`)."""
        return cls(int(wall_clock() * 1000) << 16)

    @property
    def next(self) -> int:
        """The id the next `take` returns."""
        return self._next

    def take(self, count: int = 1) -> int:
        """The first of `count` consecutive fresh ids."""
        if count < 1:
            raise ValueError(f"count must be >= 1, got {count}")
        first = self._next
        self._next += count
        return first
