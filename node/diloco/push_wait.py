"""How long the syncer holds a push before it answers, announced so the learner waits for the answer (issue 17).

The syncer judges a push inside the push call: the frame's checks, the screens and the held-out loss probe, one push
at a time (`SyncerService._accept_push`), and only then answers accepted (its target version) or refused. The
learner's call timeout was the call base (10 s) plus the push's bytes at 8 MiB/s (`transfer_timeout_s`). At
llama-350m on a loaded box the probe alone took 37-48 s a push, longer than that timeout: the learner gave up, the
syncer accepted the push anyway and its answer found the stream closed, so the learner never heard it was taken
(`acked` 0 in every round, docs/scale.md "Push pacing") and re-sent it, to be judged again.

So the syncer measures how long its push route holds a push, from the frame received to the answer (`PushWaits`),
and says so in every versions answer (`push_wait_s`): the longest of its recent pushes and of those it holds now (a
push still in judgement counts from when it arrived, so the first slow push of a run is covered too, not only the
ones after it). The learner's push call waits for its answer until `push_deadline_s`: the transfer timeout plus
`push_wait_factor` times the latest announcement, capped, re-read while the call waits (the watcher's long-polls
bring a new one every `poll_wait_s` at most), so a push that the syncer is still judging keeps its caller waiting and
hears the verdict: acked, or refused for good. No check is shortened: the syncer judges as before, only the caller
waits longer. A syncer that announces nothing (an older one) leaves the timeout as it was.
"""

from __future__ import annotations

import itertools
import math
from collections import deque

# recent pushes the announcement looks back on: enough to cover a round of every fragment's pushes
RECENT_PUSHES = 16
# the learner waits this x the announced hold beyond the transfer timeout: a push judged a little slower than the
# slowest recent one (a busier moment, a queue at the probe) still hears its answer
PUSH_WAIT_FACTOR = 1.5
# the most a syncer's announcement can add to a push call (the slowest probe measured, 114 s at llama-350m on a
# loaded box, docs/scale.md, with room): a syncer cannot stall a learner's sender longer per push
MAX_PUSH_WAIT_S = 600.0


class PushWaits:
    """Seconds the push route held its recent pushes and holds the ones in progress. Pure: the caller passes the
    time (the syncer's monotonic clock)."""

    def __init__(self, recent: int = RECENT_PUSHES) -> None:
        self._recent: deque[float] = deque(maxlen=recent)
        self._open: dict[int, float] = {}  # push in progress -> when it arrived
        self._ids = itertools.count()

    def started(self, now: float) -> int:
        """A push arrived at `now`; the token to end it with."""
        token = next(self._ids)
        self._open[token] = now
        return token

    def ended(self, token: int, now: float) -> None:
        """The push of `token` was answered (accepted or refused) or failed at `now`."""
        arrived = self._open.pop(token, None)
        if arrived is not None:
            self._recent.append(max(0.0, now - arrived))

    @property
    def holding(self) -> int:
        """Pushes in progress."""
        return len(self._open)

    def announce_s(self, now: float) -> float:
        """The longest hold among recent and open pushes (0: none yet), what the versions answer says."""
        held = max(self._recent, default=0.0)
        return max(held, max((now - arrived for arrived in self._open.values()), default=0.0))


def push_deadline_s(transfer_s: float, announced_s: float, *, factor: float, cap_s: float) -> float:
    """Seconds a push call waits for its answer: the transfer timeout plus `factor` x the syncer's announced hold,
    the hold capped at `cap_s` (a syncer cannot stall the sender longer; a malformed announcement counts 0)."""
    if not (math.isfinite(announced_s) and announced_s > 0):
        return transfer_s
    return transfer_s + min(cap_s, factor * announced_s)
