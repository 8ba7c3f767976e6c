"""When the learner's sender may push again after the syncer throttled it. Pure: the caller passes the time.

A push the syncer's limiter refuses (`protocol.rpc.PeerThrottled`: its bytes in flight per peer or in total, the
push route's rate, its stream slots) is a refusal of this learner as a whole, not of one fragment: the next fragment
of the batch would meet the same cap. A refusal for bytes in flight carries `retry_after_s` 0 (the syncer cannot know
when a probe that holds a push ends, docs/scale.md), so the sender's own schedule is the only pacing. With the old
fixed `deferred_retry_s` (0.5 s) after every batch of refused pushes, a learner beside a slow syncer (a 10-28 s
probe a push) made 308 push attempts in 31 steps and was logged as flooding.

The limiter's flood rule (`protocol.limits.PeerLimiter._note_own_fault`): a peer is flooding when, at one of its
own-fault throttles at syncer time t, more than `flood_threshold` (20) of them lie in [t - `flood_window_s`, t]
(10 s). One request is throttled at most once (the stream slot, the declared size, or one chunk: each refusal ends
the request), so throttles are bounded by throttled attempts.

`PushPacer` keeps the sender under that rule two ways:

* backoff: after the k-th throttle in a row, no push for
  max(retry_after_s, min(cap, base * 2^(k-1)) * (1 - jitter * u)), base `deferred_retry_s`, cap
  `throttle_backoff_max_s`, u uniform in [0, 1) from the injected RNG (learners throttled together drift apart);
  an answer from the syncer's handler (acked, or refused for good) resets k. With the defaults (0.5 s, 8 s, 0.25)
  the gaps are at least 0.375, 0.75, 1.5, 3, 6, 6, ... s: at most 5 throttles of one run in any 10 s.
* budget: no push starts while `flood_budget` throttles were received in the last `flood_window_s` (+ a margin).
  This holds whatever resets the backoff. The bound: pushes are sequential, and a throttle reaches us after the
  syncer counted it (r_i >= t_i), while the syncer counts the next one after we sent it (t_{i+1} >= s_{i+1}).
  Were budget + 1 throttles t_j..t_{j+b} in one syncer window, the push behind t_{j+b} was sent at
  s <= t_{j+b} <= t_j + W <= r_j + W, after r_j..r_{j+b-1} all arrived: b throttles received in [s - W, s], which
  the budget forbids. So at most `flood_budget` (10, half the threshold: room for the watcher's own calls)
  of the sender's throttles fall in any window of the syncer's; 10 <= 20: never flooding.

A refusal that can never pass (`retry_after_s` inf: a push over the syncer's caps alone) is final, never retried:
the transport raises it as `ContributionRefused` (`sync_client.is_retryable`), and `refused` rejects it.
Unthrottled pushes never wait: with no throttle in the window and none in a row, `wait_s` is 0.
"""

from __future__ import annotations

import math
import random
from collections import deque

from node.diloco.sync_types import SyncClientConfig

# added to the budget's window: the syncer's clock may run a little fast against ours over a window
BUDGET_MARGIN_S = 0.25
# doublings past this many throttles in a row change nothing (any cap is reached) and would overflow
MAX_DOUBLINGS = 30


class PushPacer:
    """The throttle backoff and flood budget of one sender (one learner, one syncer at a time)."""

    def __init__(self, config: SyncClientConfig, rng: random.Random | None = None) -> None:
        self.config = config
        self.rng = rng or random.Random()
        self.in_a_row = 0  # throttles since the syncer's handler last answered a push
        self.not_before = -math.inf  # the backoff's end (our clock)
        self._received: deque[float] = deque()  # when the throttles inside the budget's window reached us

    def wait_s(self, now: float) -> float:
        """Seconds before the next push may start (0: now)."""
        window_s = self.config.flood_window_s + BUDGET_MARGIN_S
        received = self._received
        while received and received[0] < now - window_s:
            received.popleft()
        wait = self.not_before - now
        if len(received) >= self.config.flood_budget:
            # the oldest leaves the window once it lies more than window_s back
            oldest = received[len(received) - self.config.flood_budget]
            wait = max(wait, oldest + window_s - now + 1e-3)
        return max(0.0, wait)

    def throttled(self, now: float, retry_after_s: float) -> float:
        """A push was throttled, the refusal received at `now`: the backoff in seconds (also held in `wait_s`)."""
        if not (math.isfinite(retry_after_s) and retry_after_s >= 0):
            raise ValueError(f"a refusal with retry_after_s {retry_after_s} is final, not retried")
        self.in_a_row += 1
        config = self.config
        nominal = min(
            config.throttle_backoff_max_s,
            config.deferred_retry_s * 2.0 ** min(self.in_a_row - 1, MAX_DOUBLINGS),
        )
        delay = max(retry_after_s, nominal * (1.0 - config.throttle_jitter * self.rng.random()))
        self.not_before = now + delay
        self._received.append(now)
        return delay

    def answered(self) -> None:
        """The syncer's handler answered a push (acked or refused for good): the backoff starts over. The budget's
        window keeps its throttles: they still count on the syncer's side."""
        self.in_a_row = 0
        self.not_before = -math.inf
