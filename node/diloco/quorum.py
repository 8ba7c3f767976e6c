"""When the syncer merges a round: minimum quorum K plus the adaptive grace window.

A round is one merge of one fragment. It opens, contributions arrive, and `QuorumPolicy.decide` says
"wait" or "merge":

* until `required` contributions are in, wait (no deadline: only an arrival can change that);
* once the quorum is reached, merge at once if every expected learner has arrived; otherwise wait for
  latecomers until quorum_reached_at + grace, with
  ``grace = gamma * max(0, tau * xi_step - xi_quorum - xi_sync)``, capped at `max_grace_steps` step
  times and at `max_grace_s`. tau * xi_step is how long a learner keeps computing after it sent the
  fragment before it needs the merged version back, so waiting no longer than the slack left after the
  quorum wait and the merge itself cannot stall anyone; gamma < 1 is the safety margin.

The xi are exponential moving averages fed by the caller through `observe_*` (the first observation
sets the value). Until a step time has been observed the grace window is zero: without an estimate we
cannot know that waiting is free.

The same policy expresses the baselines the benchmarks compare against:

* `QuorumConfig.decoupled(K)`: the paper's default, K = 1 with the grace window.
* `QuorumConfig.synchronous(M)`: synchronous (Streaming) DiLoCo. Every one of the M registered learners
  must contribute, dead ones included, and there is no grace window; `num_expected` is ignored.
* `QuorumConfig.elastic_synchronous()`: wait for every learner the membership says is alive, i.e.
  `required = num_expected`. The caller keeps a crashed learner in `num_expected` until its failure
  detector times out, which is what a crash costs this baseline.

Who counts as expected (`counted_holders`): a live heartbeat alone costs an identity nothing, so a round
waits only for holders that proved themselves (a contribution of theirs merged within `proven_s`), and in a
run where nobody has yet, for everyone during the round's first `unproven_wait_s`. Before, one fake
heartbeat stalled every elastic round for as long as it was kept up (`required = num_expected`, and it
never sends).

Q6 of the digest (whose xi_step?) is left to the caller: feed the step times of the learners that make
the quorum, or of all learners; the policy keeps one EMA.

Eligibility (the digest's Q5), `drop_stale`: in the decoupled mode only contributions built on the
fragment's current version are eligible; one on an older version missed the round that merged its base
(its learner was further behind the one that triggered the round than the grace window) and gets weight 0,
as the paper's late learners: the caller refuses it. It must not open a round of its own (one more version
per straggler overwrites every other learner's unsent progress), and folding it into the next round
counted its learner's progress twice (its next stretch starts from a version without it and re-learns
much of it) and destabilised the outer Nesterov step in our runs (docs/diloco.md). The synchronous
baselines take every contribution (`drop_stale=False`): a lock-step round must never wait for a learner
that is itself waiting for that round.
"""

from __future__ import annotations

import logging
import math
from collections import OrderedDict
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, TypedDict

if TYPE_CHECKING:  # Unpack is in typing only from 3.11
    from typing_extensions import Unpack

logger = logging.getLogger(__name__)

Action = Literal["wait", "merge"]


class GraceOverrides(TypedDict, total=False):
    """The grace-window knobs `QuorumConfig.decoupled` lets a caller override."""

    grace_gamma: float
    grace_tau: float
    max_grace_steps: float
    max_grace_s: float
    ema_alpha: float


@dataclass(frozen=True, kw_only=True, slots=True)
class QuorumConfig:
    """Knobs of the merge trigger; see the module docstring for the baselines' constructors."""

    min_quorum: int = 1  # K: contributions that start a merge
    grace_gamma: float = 0.8  # gamma in [0, 1): share of the slack spent waiting; 0 disables the window
    grace_tau: float = 2.0  # tau in steps: how long a learner computes before it needs the merge back
    max_grace_steps: float = 1.0  # cap on the grace window, in EMA step times
    max_grace_s: float = math.inf  # absolute cap on the grace window, seconds
    ema_alpha: float = 0.2  # weight of a new observation in the xi EMAs, (0, 1]
    wait_for_all_expected: bool = False  # elastic synchronous: required = num_expected, K is ignored
    ignore_expected: bool = False  # synchronous: never merge early on num_expected (dead ones count)
    drop_stale: bool = True  # Q5: a contribution on an older base than the current version gets weight 0

    def __post_init__(self) -> None:
        if not isinstance(self.min_quorum, int) or isinstance(self.min_quorum, bool) or self.min_quorum < 1:
            raise ValueError(f"min_quorum must be a positive int, got {self.min_quorum!r}")
        if not 0.0 <= self.grace_gamma < 1.0:
            raise ValueError(f"grace_gamma must be in [0, 1), got {self.grace_gamma!r}")
        if not (math.isfinite(self.grace_tau) and self.grace_tau >= 0):
            raise ValueError(f"grace_tau must be finite and >= 0, got {self.grace_tau!r}")
        if not (math.isfinite(self.max_grace_steps) and self.max_grace_steps >= 0):
            raise ValueError(f"max_grace_steps must be finite and >= 0, got {self.max_grace_steps!r}")
        if not self.max_grace_s >= 0:
            raise ValueError(f"max_grace_s must be >= 0, got {self.max_grace_s!r}")
        if not 0.0 < self.ema_alpha <= 1.0:
            raise ValueError(f"ema_alpha must be in (0, 1], got {self.ema_alpha!r}")
        if self.wait_for_all_expected and self.ignore_expected:
            raise ValueError("wait_for_all_expected and ignore_expected exclude each other")

    @classmethod
    def decoupled(cls, min_quorum: int = 1, **overrides: Unpack[GraceOverrides]) -> QuorumConfig:
        """Decoupled DiLoCo: merge at K contributions, then the adaptive grace window."""
        return cls(min_quorum=min_quorum, **overrides)

    @classmethod
    def synchronous(cls, num_learners: int) -> QuorumConfig:
        """Synchronous DiLoCo: all M registered learners, alive or dead, and no grace window."""
        return cls(min_quorum=num_learners, grace_gamma=0.0, ignore_expected=True, drop_stale=False)

    @classmethod
    def elastic_synchronous(cls) -> QuorumConfig:
        """Wait for every learner the membership believes alive (required = num_expected), no grace."""
        return cls(min_quorum=1, grace_gamma=0.0, wait_for_all_expected=True, drop_stale=False)


@dataclass(frozen=True, kw_only=True, slots=True)
class Decision:
    action: Action
    deadline: float | None  # when waiting on a timer: decide again at this time; None: wait for arrivals
    reason: str


def step_time_floor(elapsed_s: float, steps: int, slack_factor: float) -> float | None:
    """The least inner-step time a learner may report for work the syncer timed: `elapsed_s` from its base's
    publication (or its previous merged push on that base) to this push, over the `steps` credited to it, divided by
    `slack_factor` (an honest learner's steps fill most of that time: it computes, sends and receives in it). None
    when nothing was timed (no steps, a base we did not publish) or the bound is off (factor 0)."""
    if slack_factor <= 0 or steps <= 0 or not (math.isfinite(elapsed_s) and elapsed_s > 0):
        return None
    return elapsed_s / steps / slack_factor


class PeerStepTimes:
    """The step time the grace window is sized from: each learner's latest self-reported inner-step time, and the
    upper median over the learners reporting within `max_age_s`. Fed one report at a time into the EMA, one peer
    reporting 1 us at every push dragged the estimate, and with it the grace window, to nothing, so that rounds
    merged before slower honest learners arrived (issue 18). The upper median moves only when at least half of the
    learners report it (with two, the slower one sets it).

    A majority of identities still moves a median, so each report is first raised to the floor the syncer measured
    for that learner's work (`step_time_floor`: its pushes' timing over the steps it was credited with; a report
    without a timed push keeps the peer's latest floor): a learner reporting 1 us must also claim the steps 1 us
    steps allow, and claims are capped at `max_steps_per_s` of elapsed time and at the swarm's measured rate
    (node.diloco.claims), so no report on timed work falls below 1 / (max_steps_per_s x slack), however many
    identities lie. Untimed: a peer's first pushes on a version the syncer did not publish (the seed, a restored
    one: a run's or a takeover's first round of each fragment)."""

    def __init__(self, *, max_peers: int = 4096, max_age_s: float = 600.0) -> None:
        self.max_peers, self.max_age_s = max_peers, max_age_s
        # peer -> (step time, when, its latest measured floor or 0)
        self._times: OrderedDict[str, tuple[float, float, float]] = OrderedDict()
        self.clamped = 0  # reports raised to their floor

    def report(self, peer: str, step_time_s: float, now: float, *, floor_s: float | None = None) -> float:
        """Record `peer`'s step time at `now`, raised to `floor_s` (or the peer's latest floor); the upper median
        over recent reporters (itself included)."""
        earlier = self._times.pop(peer, None)
        floor = floor_s if floor_s is not None else (earlier[2] if earlier is not None else 0.0)
        if step_time_s < floor:
            step_time_s = floor
            self.clamped += 1
        self._times[peer] = (step_time_s, now, floor)
        while len(self._times) > self.max_peers:
            self._times.popitem(last=False)
        times = sorted(t for t, at, _ in self._times.values() if now - at <= self.max_age_s)
        return times[len(times) // 2]


class QuorumPolicy:
    """Pure merge trigger: EMA estimates in, wait/merge decisions out; the clock is passed in."""

    def __init__(self, config: QuorumConfig) -> None:
        self._config = config
        self._xi_step: float | None = None
        self._xi_quorum: float | None = None
        self._xi_sync: float | None = None
        # learners' latest reported step times, their median fed to xi_step; None (every report fed as it is) only
        # for the negative control of the test that shows why
        self.step_times: PeerStepTimes | None = PeerStepTimes()

    @property
    def config(self) -> QuorumConfig:
        return self._config

    @property
    def xi_step(self) -> float | None:
        return self._xi_step

    @property
    def xi_quorum(self) -> float | None:
        return self._xi_quorum

    @property
    def xi_sync(self) -> float | None:
        return self._xi_sync

    def observe_step(self, duration_s: float) -> None:
        """A learner's inner step took `duration_s`."""
        self._xi_step = self._ema(self._xi_step, duration_s)

    def observe_peer_step(
        self, peer: str, duration_s: float, now: float, *, floor_s: float | None = None
    ) -> None:
        """`peer` reports that its inner step took `duration_s` (at least `floor_s`, what the syncer timed:
        `step_time_floor`): xi_step follows the peers' median (PeerStepTimes)."""
        times = self.step_times
        median = times.report(peer, duration_s, now, floor_s=floor_s) if times is not None else duration_s
        self.observe_step(median)

    def observe_quorum(self, duration_s: float) -> None:
        """A round took `duration_s` from opening to its K-th contribution."""
        self._xi_quorum = self._ema(self._xi_quorum, duration_s)

    def observe_sync(self, duration_s: float) -> None:
        """The syncer's merge, outer step and broadcast of a round took `duration_s`."""
        self._xi_sync = self._ema(self._xi_sync, duration_s)

    def required(self, num_expected: int) -> int:
        """Contributions needed before a merge may start."""
        if self._config.wait_for_all_expected:
            return max(num_expected, 1)
        return self._config.min_quorum

    def grace_s(self) -> float:
        """Current grace window in seconds (0 until a step time has been observed)."""
        cfg = self._config
        if cfg.grace_gamma == 0.0 or self._xi_step is None:
            return 0.0
        slack = cfg.grace_tau * self._xi_step - (self._xi_quorum or 0.0) - (self._xi_sync or 0.0)
        grace = cfg.grace_gamma * max(0.0, slack)
        return min(grace, cfg.max_grace_steps * self._xi_step, cfg.max_grace_s)

    def decide(
        self,
        now: float,
        round_opened_at: float,
        num_received: int,
        num_expected: int,
        quorum_reached_at: float | None,
    ) -> Decision:
        """Wait or merge the round that opened at `round_opened_at`.

        `num_received` counts usable contributions so far, `num_expected` the learners that could still
        contribute (e.g. alive per membership, including those already in). `quorum_reached_at` is when
        the required-th contribution arrived; it must be given once num_received >= required. The
        returned deadline is recomputed from the current EMAs on every call.
        """
        if num_received < 0 or num_expected < 0:
            raise ValueError("counts must be >= 0")
        if now < round_opened_at:
            raise ValueError(f"now ({now}) is before the round opened ({round_opened_at})")
        required = self.required(num_expected)
        if num_received < required:
            return Decision(
                action="wait",
                deadline=None,
                reason=f"quorum {num_received}/{required} after {now - round_opened_at:.3f}s",
            )
        if quorum_reached_at is None:
            raise ValueError("quorum_reached_at is required once the quorum is reached")
        if not self._config.ignore_expected and num_received >= num_expected:
            return Decision(action="merge", deadline=None, reason=f"all {num_expected} expected arrived")
        grace = self.grace_s()
        deadline = quorum_reached_at + grace
        if now >= deadline:
            return Decision(
                action="merge",
                deadline=None,
                reason=f"{num_received}/{num_expected} in, grace {grace:.3f}s over",
            )
        return Decision(
            action="wait",
            deadline=deadline,
            reason=f"{num_received}/{num_expected} in, grace until +{grace:.3f}s",
        )

    def _ema(self, current: float | None, value: float) -> float:
        if not math.isfinite(value) or value < 0:
            raise ValueError(f"durations must be finite and >= 0, got {value!r}")
        if current is None:
            return float(value)
        alpha = self._config.ema_alpha
        return (1.0 - alpha) * current + alpha * value


def counted_holders(
    live: Collection[str],
    last_merged: Callable[[str], float | None],
    *,
    round_opened_at: float | None,
    now: float,
    proven_s: float,
    unproven_wait_s: float,
) -> set[str]:
    """The live holders a round counts as expected: those with a contribution merged within `proven_s`; when
    none has one (a fresh run), all of them during the round's first `unproven_wait_s`, then none.

    A newcomer is not waited for once others are proven: its contribution, late for the round, goes into the
    next one (the synchronous modes take it; decoupled refuses it as a missed round, as any late one), and
    one fake heartbeat costs a fresh run `unproven_wait_s` once. `last_merged(peer)`: when a contribution of
    `peer` was last merged (None: never, or forgotten after a refusal). A peer already in the round counts
    anyway (`_num_expected` adds the round's entries)."""
    proven = set()
    for peer in live:
        merged_at = last_merged(peer)
        if merged_at is not None and now - merged_at <= proven_s:
            proven.add(peer)
    if proven:
        return proven
    if round_opened_at is None or now - round_opened_at < unproven_wait_s:
        return set(live)
    return set()
