"""Progress counters of a Decoupled DiLoCo learner, and how the syncer weighs and caps them.

A learner counts, per fragment, the inner steps and tokens it processed since that fragment was last
overwritten by a broadcast (the digest's c^steps_{m,p} and c^tokens_{m,p}). The syncer turns them into
merge weights w = tokens**2 / steps ("quantity" times "quality": tokens per step is the effective batch).
Because the weight is quadratic in claimed tokens and volunteers are untrusted, the syncer first caps
the self-reports by what elapsed time and the manifest's batch size make possible (`cap_counters`).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class Counters:
    """Steps and tokens of one fragment since its last overwrite; mutable, owned by one learner."""

    steps: int = 0
    tokens: int = 0

    def record_step(self, tokens: int) -> None:
        if tokens < 0:
            raise ValueError(f"tokens per step must be >= 0, got {tokens}")
        self.steps += 1
        self.tokens += tokens

    def reset(self) -> None:
        """Called when the fragment is overwritten by a broadcast version."""
        self.steps = 0
        self.tokens = 0

    def weight(self) -> float:
        return token_weight(self.tokens, self.steps)


class CounterBank:
    """One `Counters` per fragment: every inner step advances all of them, an overwrite resets one."""

    def __init__(self, num_fragments: int) -> None:
        if num_fragments < 1:
            raise ValueError(f"num_fragments must be >= 1, got {num_fragments}")
        self._counters = [Counters() for _ in range(num_fragments)]

    def __len__(self) -> int:
        return len(self._counters)

    def __getitem__(self, fragment: int) -> Counters:
        return self._counters[fragment]

    def record_step(self, tokens: int) -> None:
        for counters in self._counters:
            counters.record_step(tokens)

    def reset(self, fragment: int) -> None:
        self._counters[fragment].reset()

    def snapshot(self) -> list[tuple[int, int]]:
        """(steps, tokens) per fragment, for the per-step metadata message."""
        return [(c.steps, c.tokens) for c in self._counters]


def token_weight(tokens: int | float, steps: int | float) -> float:
    """Merge weight tokens**2 / steps; 0 when no step (or no token) was made. Negative input is an error."""
    if tokens < 0 or steps < 0:
        raise ValueError(f"counters must be >= 0, got tokens={tokens} steps={steps}")
    if steps == 0 or tokens == 0:
        return 0.0
    return float(tokens) * float(tokens) / float(steps)


def cap_counters(
    reported_steps: int,
    reported_tokens: int,
    elapsed_s: float,
    *,
    max_steps_per_s: float,
    tokens_per_step: int,
) -> tuple[int, int, bool]:
    """Bound a learner's self-reported counters by what time and the batch size allow.

    `elapsed_s` is the syncer's own measure of the time since the fragment's last overwrite (e.g. since
    it published the version the learner says it built on), so a learner cannot stretch it.
    Steps are capped at floor(elapsed_s * max_steps_per_s) and tokens at steps * tokens_per_step (the
    manifest's per-step batch in tokens). Negative reports are treated as zero. Returns
    (steps, tokens, capped) where `capped` says whether any reduction was made, so the caller can count
    it against the sender. Raises ValueError only for bad configuration (non-positive limits).
    """
    if not max_steps_per_s > 0 or not math.isfinite(max_steps_per_s):
        raise ValueError(f"max_steps_per_s must be finite and > 0, got {max_steps_per_s!r}")
    if tokens_per_step < 1:
        raise ValueError(f"tokens_per_step must be >= 1, got {tokens_per_step!r}")
    capped = False
    steps, tokens = int(reported_steps), int(reported_tokens)
    if steps < 0 or tokens < 0:
        steps, tokens, capped = max(steps, 0), max(tokens, 0), True
    elapsed = max(0.0, elapsed_s) if math.isfinite(elapsed_s) else 0.0
    # The epsilon keeps an exact multiple (10 s at 2 steps/s = 20 steps) from flooring to 19.
    step_limit = math.floor(elapsed * max_steps_per_s + 1e-9)
    if steps > step_limit:
        steps, capped = step_limit, True
    token_limit = steps * tokens_per_step
    if tokens > token_limit:
        tokens, capped = token_limit, True
    if capped:
        logger.debug(
            "capped counters %s/%s to %s/%s over %.3fs",
            reported_steps,
            reported_tokens,
            steps,
            tokens,
            elapsed_s,
        )
    return steps, tokens, capped
