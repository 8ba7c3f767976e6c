"""Pure decisions of the pipeline: which replica serves a hop, when a hop is retried, which microbatch steps were
already applied, where a new node goes, and when a stage replica should move to a starved stage.

Nothing here touches sockets, asyncio or the global clock: `now` (seconds on any monotonic clock) and a seeded
`random.Random` are passed in, so every rule is tested on a fake clock (tests/unit/test_routing.py).

* `ReplicaRouter` picks the least-loaded live replica of a stage, SWARM-style: projected finish time =
  (work queued there + 1 microbatch) / throughput, where throughput is our own measurement of that replica
  when we have one and its announced figure otherwise, and "work queued" counts both its announced queue and
  the hops we already have in flight on it. Failed replicas sit out a cooldown that doubles per failure.
  A replica that got nothing of ours for `reprobe_after_s` gets the next hop of its stage, so one slow
  measurement cannot starve it for good (scores only move on answers).
  A replica that timed out is slow, not gone: its estimate is divided, the next request to it may take longer,
  and only `timeouts_before_cooldown` timeouts in a row put it in a cooldown.
* `RetryPolicy` bounds how many tries one hop may make and how long each may take.
* `IdempotencyLedger` remembers (run, microbatch, stage, direction) keys that were applied, so a retried
  request is answered from cache or refused, never applied twice. Bounded: when a key is evicted its
  microbatch id becomes its sender's floor, and anything at or below a floor is refused as stale, so eviction
  can never re-open a double application (microbatch ids grow per sender).
* `choose_stage` places a new node on the stage with the least throughput per layer, each replica counted at
  its effective throughput (`effective_throughputs`): what it announces, clamped into [m / slack, m x slack] around
  the median m of what the run's verifiers measured of it (while no verifier measured it: as announced, at most
  slack x the median measured replica of its stage, or of the run), so a replica that lies about its speed cannot
  steer where others go.
* `Rebalancer` moves a replica from a well-served stage to a starved one, with hysteresis: the imbalance must
  hold for `dwell_s` (restarted when the starved stage gains a replica), the move must leave the two stages
  `min_gain` times better balanced and the donor not starved in turn (so a move is never undone), moves of one
  replica are at least `cooldown_s` apart, and the donor's slowest replicas move one at a time, staggered by
  peer id (so replicas that all see the same view do not stampede).
"""

from __future__ import annotations

import enum
import logging
import math
import random
from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

logger = logging.getLogger(__name__)


# ---------------------------------------------------------------------------------------------------- replicas


@dataclass(frozen=True, kw_only=True, slots=True)
class ReplicaInfo:
    """What the verifier knows about one stage replica from its heartbeat."""

    peer_id: str
    stage: int
    throughput: float = 0.0  # announced tokens/s
    queue: float = 0.0  # announced microbatches waiting or held (its `load`)
    maddrs: tuple[str, ...] = ()


@dataclass(frozen=True, kw_only=True, slots=True)
class RoutingConfig:
    """How replicas are scored and how long a failed one sits out."""

    prior_throughput: float = 1000.0  # tokens/s assumed for a replica nobody has measured or that announces 0
    measurement_weight: float = 0.3  # EMA weight of each new measurement of a replica's tokens/s
    failure_cooldown_s: float = 5.0  # first pause after a failure; doubles per consecutive failure
    max_cooldown_s: float = 60.0  # ... up to this
    max_tracked_peers: int = 4096  # measurements and failures kept (least recently touched forgotten)
    # A timeout on a loaded machine is usually a slow answer, not a dead replica: a cooldown would take the only
    # live replica of a stage out (the verifier waits while every replica of a stage cools down). Only this many
    # timeouts in a row (each already given a longer timeout) count as a failure.
    timeouts_before_cooldown: int = 3
    # Scores only move on answers, so a replica that measured slow once (a cold first call on a loaded box) and
    # then lost every choice would never be measured again: one idle this long gets the next hop of its stage.
    reprobe_after_s: float = 20.0  # inf: never

    def __post_init__(self) -> None:
        if not self.reprobe_after_s > 0:
            raise ValueError(f"reprobe_after_s must be positive, got {self.reprobe_after_s}")
        if not (math.isfinite(self.prior_throughput) and self.prior_throughput > 0):
            raise ValueError(f"prior_throughput must be positive, got {self.prior_throughput}")
        if not 0 < self.measurement_weight <= 1:
            raise ValueError(f"measurement_weight must be in (0, 1], got {self.measurement_weight}")
        if not 0 < self.failure_cooldown_s <= self.max_cooldown_s:
            raise ValueError("need 0 < failure_cooldown_s <= max_cooldown_s")
        if self.max_tracked_peers < 1 or self.timeouts_before_cooldown < 1:
            raise ValueError("max_tracked_peers and timeouts_before_cooldown must be >= 1")


@dataclass(frozen=True, slots=True)
class Choice:
    """A chosen replica and why (for logs and status)."""

    peer_id: str
    projected_s: float  # projected seconds until our microbatch is done there
    reason: str


@dataclass(slots=True)
class _Failures:
    consecutive: int = 0
    blocked_until: float = -math.inf


class ReplicaRouter:
    """Replica choice for one verifier: measurements, in-flight counts and failure cooldowns per replica."""

    def __init__(self, config: RoutingConfig | None = None) -> None:
        self.config = config or RoutingConfig()
        self._measured: OrderedDict[str, float] = OrderedDict()  # peer -> EMA tokens/s (our measurement)
        self._failures: OrderedDict[str, _Failures] = OrderedDict()
        self._in_flight: dict[str, int] = {}
        self._timeouts: OrderedDict[str, int] = OrderedDict()  # peer -> timeouts in a row
        self._last_chosen: OrderedDict[str, float] = OrderedDict()  # peer -> when last chosen (or first seen)

    # ---- bookkeeping

    def started(self, peer_id: str) -> None:
        """A hop was sent to `peer_id` (pair with `finished`)."""
        self._in_flight[peer_id] = self._in_flight.get(peer_id, 0) + 1

    def finished(self, peer_id: str) -> None:
        left = self._in_flight.get(peer_id, 0) - 1
        if left > 0:
            self._in_flight[peer_id] = left
        else:
            self._in_flight.pop(peer_id, None)

    def in_flight(self, peer_id: str) -> int:
        return self._in_flight.get(peer_id, 0)

    def record_success(self, peer_id: str, *, tokens: int, seconds: float) -> None:
        """A hop of `tokens` took `seconds` end to end: update our throughput estimate, clear its failures."""
        self._failures.pop(peer_id, None)
        self._timeouts.pop(peer_id, None)
        if tokens <= 0 or not seconds > 0:
            return
        sample = tokens / seconds
        old = self._measured.pop(peer_id, None)
        w = self.config.measurement_weight
        self._measured[peer_id] = sample if old is None else (1 - w) * old + w * sample
        self._trim(self._measured)

    def record_failure(self, peer_id: str, now: float) -> float:
        """A hop to `peer_id` failed: block it for a cooldown that doubles per consecutive failure.

        Returns the cooldown in seconds."""
        state = self._failures.pop(peer_id, None) or _Failures()
        state.consecutive += 1
        cooldown = min(
            self.config.failure_cooldown_s * 2 ** (state.consecutive - 1), self.config.max_cooldown_s
        )
        state.blocked_until = now + cooldown
        self._failures[peer_id] = state
        self._trim(self._failures)
        return cooldown

    def record_timeout(self, peer_id: str, now: float, *, slowdown: float = 2.0) -> float:
        """A request to `peer_id` got no answer in time: it is at least `slowdown` times slower than we thought.

        Its throughput estimate is divided by `slowdown` (so other replicas are preferred), the next request to it
        gets a longer timeout (`hop_timeout_s`), and `timeouts_before_cooldown` in a row count as a failure.
        Returns the cooldown that started (0 when none)."""
        count = self._timeouts.pop(peer_id, 0) + 1
        self._timeouts[peer_id] = count
        self._trim(self._timeouts)
        known = self._measured.pop(peer_id, None)
        if known is not None:
            self._measured[peer_id] = known / slowdown
        if count >= self.config.timeouts_before_cooldown:
            return self.record_failure(peer_id, now)
        return 0.0

    def timeouts(self, peer_id: str) -> int:
        """Timeouts in a row of `peer_id` (cleared by its next answer)."""
        return self._timeouts.get(peer_id, 0)

    def hop_timeout_s(self, peer_id: str, policy: RetryPolicy) -> float:
        """How long the next request to `peer_id` may take: longer after each timeout in a row."""
        return policy.timeout_s(self.timeouts(peer_id))

    def is_blocked(self, peer_id: str, now: float) -> bool:
        state = self._failures.get(peer_id)
        return state is not None and now < state.blocked_until

    def measured_throughput(self, peer_id: str) -> float | None:
        return self._measured.get(peer_id)

    def _trim(self, table: OrderedDict[str, Any]) -> None:
        while len(table) > self.config.max_tracked_peers:
            table.popitem(last=False)

    # ---- the decision

    def throughput(self, replica: ReplicaInfo) -> float:
        """Tokens/s we expect of `replica`: our measurement, else its announcement, else the prior."""
        measured = self._measured.get(replica.peer_id)
        if measured is not None:
            return measured
        if math.isfinite(replica.throughput) and replica.throughput > 0:
            return replica.throughput
        return self.config.prior_throughput

    def projected_s(self, replica: ReplicaInfo, tokens: int) -> float:
        queue = max(0.0, replica.queue if math.isfinite(replica.queue) else 0.0)
        waiting = queue + self.in_flight(replica.peer_id) + 1
        return waiting * max(tokens, 1) / self.throughput(replica)

    def choose(
        self,
        replicas: Iterable[ReplicaInfo],
        *,
        stage: int,
        tokens: int,
        now: float,
        rng: random.Random,
        exclude: Iterable[str] = (),
        banned: Iterable[str] = (),
    ) -> Choice | None:
        """The replica of `stage` with the earliest projected finish, or None if none is usable.

        Replicas in `exclude` (already failed for this hop) or `banned` are skipped, and so are those in a failure
        cooldown unless every remaining replica of the stage is in one. Ties (within 1 %) are broken at random,
        so equal replicas share the load. A candidate idle for `reprobe_after_s` goes first, whatever its score.
        """
        skip = set(exclude) | set(banned)
        eligible = [r for r in replicas if r.stage == stage and r.peer_id not in skip]
        candidates = [r for r in eligible if not self.is_blocked(r.peer_id, now)]
        note = ""
        if not candidates and eligible:
            # A cooldown is a preference, not a ban: when it covers the whole stage, a transient fault on every
            # replica would otherwise stall the pipeline until the cooldowns run out.
            candidates, note = eligible, " (all in cooldown)"
        if not candidates:
            return None
        stale = self._stale(candidates, now)
        if stale is not None:
            idle_s, peer_id = stale
            best_s = self.projected_s(next(r for r in candidates if r.peer_id == peer_id), tokens)
            reason = f"re-measuring a replica idle for {idle_s:.0f} s (projected {best_s * 1000:.0f} ms)"
        else:
            scored = sorted((self.projected_s(r, tokens), r.peer_id) for r in candidates)
            best_s = scored[0][0]
            tied = [peer for s, peer in scored if s <= best_s * 1.01]
            peer_id = tied[0] if len(tied) == 1 else rng.choice(tied)
            reason = f"least projected time {best_s * 1000:.0f} ms of {len(candidates)} live replica(s){note}"
        self._last_chosen.pop(peer_id, None)
        self._last_chosen[peer_id] = now
        self._trim(self._last_chosen)
        return Choice(peer_id=peer_id, projected_s=best_s, reason=reason)

    def _stale(self, candidates: list[ReplicaInfo], now: float) -> tuple[float, str] | None:
        """The candidate idle longest, if it has had nothing of ours for `reprobe_after_s` since it was last
        chosen (or first seen here) and holds nothing of ours now; None otherwise."""
        idle: list[tuple[float, str]] = []
        for r in candidates:
            since = self._last_chosen.setdefault(r.peer_id, now)
            if self.in_flight(r.peer_id) == 0 and now - since >= self.config.reprobe_after_s:
                idle.append((now - since, r.peer_id))
        self._trim(self._last_chosen)
        return max(idle) if idle else None


# ---------------------------------------------------------------------------------------------------- retries


class HopFailure(str, enum.Enum):
    """Why one hop (one request to one replica) failed, as the retry policy sees it."""

    UNREACHABLE = "unreachable"  # could not open the stream or reach the replica
    TIMEOUT = "timeout"  # no full answer in time
    LOST = "answer lost"  # the stream ended after the request went out: the replica may have applied it
    REFUSED = "refused"  # the replica answered with an error
    NO_CONTEXT = "no context"  # a backward reached a replica that no longer holds the forward's context
    BAD_REPLY = "bad reply"  # the answer failed our checks (signature, signer, shape...)
    DROPPED = "dropped"  # the boundary check dropped the tensor (SENTINEL seam)


@dataclass(frozen=True, kw_only=True, slots=True)
class RetryPolicy:
    """Bounds on one hop: tries and the time each may take.

    A failed replica is not tried again for the same hop, except one that timed out or whose answer was lost: on a
    loaded machine those are the usual failures of a live replica (both were seen on the survivor of a killed
    replica, whose exclusion left no replica and abandoned the microbatch), and every request is idempotent. It
    is tried again after the others (its cooldown or, for a timeout, its estimate divided by
    `ReplicaRouter.record_timeout`), a timed-out one with a timeout `timeout_growth` times longer per timeout
    in a row, up to `max_hop_timeout_s`. A dead replica costs one more try: the next one finds it unreachable.

    Asking the same replica again after a lost answer (`ask_same_again`, up to `same_replica_retries` per replica
    a hop reaches) is not a new try: it is the same request, answered from cache if it was applied.
    """

    max_attempts: int = 3  # tries of one hop (another replica, or a timed-out one again), then abandoned
    hop_timeout_s: float = 30.0  # one request to one replica, sending included, when it has not timed out
    same_replica_retries: int = 1  # a timed-out backward is asked again of the same replica first (cached)
    timeout_growth: float = 2.0  # the timeout of a replica is multiplied by this per timeout in a row
    max_hop_timeout_s: float = 120.0
    # Whether a forward answer SENTINEL dropped is asked of another replica of the stage (nothing was applied
    # yet) rather than dropping its microbatch. Off: in the 3 x 3 real-process test (test_sentinel_procs) it
    # banned an honest replica in 2 runs of 3 (0 of 5 without), likely because the flagged replica's
    # microbatches went to its peers, which then drifted apart from it.
    retry_dropped_forward: bool = False

    def __post_init__(self) -> None:
        if self.max_attempts < 1 or self.same_replica_retries < 0:
            raise ValueError("max_attempts must be >= 1 and same_replica_retries >= 0")
        if not (math.isfinite(self.hop_timeout_s) and self.hop_timeout_s > 0):
            raise ValueError(f"hop_timeout_s must be positive, got {self.hop_timeout_s}")
        if not (math.isfinite(self.timeout_growth) and self.timeout_growth >= 1):
            raise ValueError(f"timeout_growth must be >= 1, got {self.timeout_growth}")
        if not (math.isfinite(self.max_hop_timeout_s) and self.max_hop_timeout_s >= self.hop_timeout_s):
            raise ValueError("max_hop_timeout_s must be >= hop_timeout_s")

    def timeout_s(self, timeouts: int) -> float:
        """The time a request may take to a replica that timed out `timeouts` times in a row."""
        return min(self.hop_timeout_s * self.timeout_growth ** max(0, timeouts), self.max_hop_timeout_s)

    def excludes(self, failure: HopFailure) -> bool:
        """Whether a replica that failed this way is left out of the hop's next tries.

        Not after a timeout or a lost answer (maybe alive, see the class docstring), nor a lost context (the
        verifier rebuilds it there)."""
        return failure not in (HopFailure.TIMEOUT, HopFailure.LOST, HopFailure.NO_CONTEXT)

    def retry_elsewhere(self, failure: HopFailure, attempt: int, *, forward: bool = False) -> bool:
        """After the `attempt`-th failed try (1-based): may another replica be tried?

        A dropped gradient is never re-sent: the replica that sent it has applied its backward, so a retry would
        apply the microbatch twice at that stage. A dropped forward answer is, with `retry_dropped_forward`
        (the flag is already recorded; the replica that sent it is left out of the hop's next tries)."""
        if failure is HopFailure.DROPPED and not (forward and self.retry_dropped_forward):
            return False
        return attempt < self.max_attempts

    def ask_same_again(self, failure: HopFailure, same_tries: int) -> bool:
        """A backward whose answer was lost may already be applied there: ask the same replica again first,
        where it is answered from cache, before re-running it elsewhere (which would apply it twice)."""
        return failure in (HopFailure.TIMEOUT, HopFailure.LOST) and same_tries < self.same_replica_retries

    def blames_replica(self, failure: HopFailure) -> bool:
        """Whether the failure should put the replica in a cooldown at once. Not a lost context (not its fault),
        nor a timeout (`ReplicaRouter.record_timeout` counts those: only several in a row start a cooldown)."""
        return failure not in (HopFailure.NO_CONTEXT, HopFailure.TIMEOUT)


# ---------------------------------------------------------------------------------------------------- idempotency


class Phase(str, enum.Enum):
    FORWARD = "forward"
    BACKWARD = "backward"


@dataclass(frozen=True, slots=True)
class IdempotencyKey:
    """One application of one microbatch at one stage in one direction. `sender` is whoever numbers the
    microbatches (the verifier), so two verifiers' ids never collide."""

    run_id: str
    sender: str
    microbatch: int
    stage: int
    phase: Phase


class Verdict(str, enum.Enum):
    NEW = "new"  # never seen: apply it
    APPLIED = "applied"  # applied before: answer from cache if possible, never apply again
    STALE = "stale"  # at or below the sender's evicted floor: refuse


@dataclass(frozen=True, kw_only=True, slots=True)
class LedgerConfig:
    capacity: int = 65536  # keys remembered; oldest evicted first (their ids become the sender's floor)
    max_cached_results: int = 256  # answers kept for retried requests (the most recent ones)

    def __post_init__(self) -> None:
        if self.capacity < 1 or self.max_cached_results < 0:
            raise ValueError("capacity must be >= 1 and max_cached_results >= 0")


class IdempotencyLedger:
    """Which microbatch steps were applied; see the module docstring for the eviction floor.

    The cached result of a key is whatever the caller stores (the reply frame, an input gradient): a
    retried request for an applied key is answered with it, never recomputed.
    """

    def __init__(self, config: LedgerConfig | None = None) -> None:
        self.config = config or LedgerConfig()
        self._applied: OrderedDict[IdempotencyKey, None] = OrderedDict()
        self._results: OrderedDict[IdempotencyKey, object] = OrderedDict()
        self._floor: dict[tuple[str, str], int] = {}  # (run, sender) -> highest evicted microbatch id
        self.duplicates = 0  # requests for keys already applied (answered from cache or refused)

    def __len__(self) -> int:
        return len(self._applied)

    def check(self, key: IdempotencyKey) -> Verdict:
        if key in self._applied:
            return Verdict.APPLIED
        floor = self._floor.get((key.run_id, key.sender))
        if floor is not None and key.microbatch <= floor:
            return Verdict.STALE
        return Verdict.NEW

    def mark_applied(self, key: IdempotencyKey, result: object = None) -> bool:
        """Record `key` as applied (with an optional cached result); False, and nothing changes, if it was."""
        if self.check(key) is not Verdict.NEW:
            self.duplicates += 1
            return False
        self._applied[key] = None
        while len(self._applied) > self.config.capacity:
            old, _ = self._applied.popitem(last=False)
            floor_key = (old.run_id, old.sender)
            self._floor[floor_key] = max(self._floor.get(floor_key, old.microbatch), old.microbatch)
            self._results.pop(old, None)
        if result is not None and self.config.max_cached_results > 0:
            self._results[key] = result
            while len(self._results) > self.config.max_cached_results:
                self._results.popitem(last=False)
        return True

    def cached(self, key: IdempotencyKey) -> object | None:
        """The stored result of an applied key, if still cached."""
        return self._results.get(key)

    def note_duplicate(self) -> None:
        self.duplicates += 1

    def recent(self, limit: int) -> list[IdempotencyKey]:
        """The last `limit` applied keys, oldest first."""
        keys = list(self._applied)
        return keys[-limit:] if limit > 0 else []


# ---------------------------------------------------------------------------------------------------- placement


@dataclass(frozen=True, kw_only=True, slots=True)
class Measurement:
    """What one authorized verifier measured of the stage replicas (a checked `measured` record)."""

    verifier: str
    sent_at: float  # DHT time it was written
    rates: Mapping[str, float]  # replica peer id -> tokens/s end to end


def effective_throughput(announced: float, measured: Sequence[float], slack: float) -> float:
    """A replica's throughput for placement: `announced` clamped into [median / slack, median x slack] of the
    verifiers' `measured` figures; as announced when none. End to end includes the network and queueing, so an
    honest replica's announced (compute only) figure sits above what is measured: `slack` leaves it room; a
    100x lie, or a deflating one, is cut to the band. `slack` = inf turns the clamp off."""
    own = max(0.0, announced) if math.isfinite(announced) else 0.0
    figures = sorted(m for m in measured if math.isfinite(m) and m >= 0)
    if not figures or math.isinf(slack):
        return own
    median = _median(figures)
    return min(max(own, median / slack), median * slack)


def _median(figures: Sequence[float]) -> float:
    """The median of sorted, non-empty `figures`."""
    mid = len(figures) // 2
    return figures[mid] if len(figures) % 2 else (figures[mid - 1] + figures[mid]) / 2


def unmeasured_ceiling(measured: Mapping[int, Sequence[float]], stage: int, slack: float) -> float:
    """The most a replica no verifier measured yet may count for placement: `slack` x the median of the measured
    replicas' figures (`measured`: stage -> each measured replica's median) of its stage, or of every stage while
    none of its own is measured; unbounded while nobody is (a run's start) or with the clamp off. Without it a
    fresh identity announcing 100x counted in full until a verifier got to it (issue 18: placement on
    verifier-measured throughput)."""
    figures = sorted(measured.get(stage) or [f for rates in measured.values() for f in rates])
    if not figures or math.isinf(slack):
        return math.inf
    return _median(figures) * slack


def effective_throughputs(
    replicas: Sequence[ReplicaInfo],
    measurements: Iterable[Measurement],
    *,
    now: float,
    slack: float,
    max_age_s: float,
) -> list[ReplicaInfo]:
    """`replicas` with each throughput replaced by its effective one (`effective_throughput`; one nobody measured
    capped at `unmeasured_ceiling`) over the fresh measurements (written at most `max_age_s` before `now`; records
    from the future count as fresh: their authors' clocks are within the validator's skew). Callers pass only records the validator checked, so
    every measurement comes from one of the manifest's authorized verifiers."""
    fresh = [m for m in measurements if now - m.sent_at <= max_age_s]
    seen = {r.peer_id: [m.rates[r.peer_id] for m in fresh if r.peer_id in m.rates] for r in replicas}
    by_stage: dict[int, list[float]] = {}
    for r in replicas:
        figures = sorted(f for f in seen[r.peer_id] if math.isfinite(f) and f >= 0)
        if figures:
            by_stage.setdefault(r.stage, []).append(_median(figures))
    out = []
    for r in replicas:
        effective = effective_throughput(r.throughput, seen[r.peer_id], slack)
        if not seen[r.peer_id]:
            effective = min(effective, unmeasured_ceiling(by_stage, r.stage, slack))
        out.append(replace(r, throughput=effective))
    return out


@dataclass(frozen=True, kw_only=True, slots=True)
class StageLoad:
    """How well one stage is served: its layer count and what its live replicas announce."""

    stage: int
    num_layers: int
    throughput: float  # sum of announced tokens/s
    replicas: int

    @property
    def per_layer(self) -> float:
        return self.throughput / max(self.num_layers, 1)


def stage_loads(
    replicas: Iterable[ReplicaInfo], spans: Sequence[tuple[int, int]], *, exclude: str | None = None
) -> list[StageLoad]:
    """Per-stage load from the live replicas (optionally leaving one peer, usually ourselves, out)."""
    throughput = [0.0] * len(spans)
    count = [0] * len(spans)
    for r in replicas:
        if r.peer_id == exclude or not 0 <= r.stage < len(spans):
            continue
        throughput[r.stage] += max(0.0, r.throughput) if math.isfinite(r.throughput) else 0.0
        count[r.stage] += 1
    return [
        StageLoad(stage=s, num_layers=b - a, throughput=throughput[s], replicas=count[s])
        for s, (a, b) in enumerate(spans)
    ]


def choose_stage(loads: Sequence[StageLoad]) -> tuple[int, str]:
    """Where a new node goes: least throughput per layer, then fewest replicas, then lowest index."""
    if not loads:
        raise ValueError("no stages to choose from")
    best = min(loads, key=lambda s: (s.per_layer, s.replicas, s.stage))
    return best.stage, (
        f"stage {best.stage} has the least throughput per layer "
        f"({best.per_layer:.0f} tokens/s/layer over {best.replicas} replica(s))"
    )


@dataclass(frozen=True, kw_only=True, slots=True)
class RebalanceConfig:
    """When a replica leaves its stage for a starved one."""

    check_period_s: float = 10.0  # how often the stage role asks
    starve_ratio: float = 0.5  # a stage is starved below this share of the donor's per-layer throughput
    dwell_s: float = (
        30.0  # the imbalance must hold this long (since it began, or since the starved stage gained
    )
    # a replica, whose throughput may not be measured yet) before anyone moves
    cooldown_s: float = 120.0  # least time between two moves of one replica (and after it joined)
    min_donor_replicas: int = 2  # never leave a stage with fewer than min_donor_replicas - 1 replicas
    # A move must make the two stages' per-layer throughputs (lesser / greater) this much better balanced. Undoing
    # a move gives back the balance before it, so a move is never undone, even where measurements are noisy.
    min_gain: float = 1.25
    # Replicas of the donor stage within `slow_margin` of its slowest are the candidates to move, ordered by peer
    # id (which every replica sees the same, unlike throughputs that change between heartbeats): the first
    # moves after `dwell_s`, the k-th only after `dwell_s + k * stagger_s`, by which time the first one's move
    # shows in its heartbeat and restarts everyone's dwell. Keep it above heartbeat period + check period.
    slow_margin: float = 1.25
    stagger_s: float = 30.0
    # A stage with no replica at all stops the whole pipeline (two nodes joining at once both pick the same
    # stage): a replica of a stage that others also serve moves there after `empty_dwell_s`, cooldown or not,
    # the k-th candidate (by peer id) only after `empty_dwell_s + k * stagger_s`.
    empty_dwell_s: float = 5.0
    # Placement (a new node's stage) and moves count each replica at its announced throughput clamped into
    # [m / slack, m x slack] around what the run's verifiers measured of it (`effective_throughputs`), with
    # measurements at most `measured_max_age_s` old; inf turns the clamp off (announcements count as they are).
    # A liar gains at most slack / r over an honest replica whose announced (compute-only) figure is r times its
    # measured (end-to-end) one; 1 places on measurements alone. Honest replicas above the band are cut to it too,
    # which keeps measured replicas comparable (all counted near what the verifiers see).
    measured_slack: float = 2.0
    measured_max_age_s: float = (
        120.0  # older verifier measurements do not count (the replica counts as announced)
    )

    def __post_init__(self) -> None:
        if not (self.measured_slack >= 1):  # inf allowed: the clamp off
            raise ValueError(f"measured_slack must be >= 1, got {self.measured_slack}")
        if not (math.isfinite(self.measured_max_age_s) and self.measured_max_age_s > 0):
            raise ValueError(f"measured_max_age_s must be positive, got {self.measured_max_age_s}")
        if not 0 < self.starve_ratio < 1:
            raise ValueError(f"starve_ratio must be in (0, 1), got {self.starve_ratio}")
        for name in ("check_period_s", "dwell_s", "cooldown_s", "stagger_s", "empty_dwell_s"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"{name} must be >= 0, got {value}")
        if self.check_period_s <= 0:
            raise ValueError("check_period_s must be positive")
        if self.min_donor_replicas < 2:
            raise ValueError("min_donor_replicas must be >= 2 (a stage is never emptied)")
        for name in ("min_gain", "slow_margin"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 1):
                raise ValueError(f"{name} must be >= 1, got {value}")


@dataclass(frozen=True, slots=True)
class Move:
    to_stage: int
    reason: str


@dataclass(slots=True)
class Rebalancer:
    """The per-replica hysteresis state behind "should I move to a starved stage?"."""

    config: RebalanceConfig
    started_at: float  # when this replica began serving its stage (counts as a move for the cooldown)
    _starved_since: dict[int, float] = field(default_factory=dict)
    _members: dict[int, frozenset[str]] = field(default_factory=dict)  # replicas per stage at the last check
    _empty_since: dict[int, float] = field(default_factory=dict)  # stages with no replica, since when
    last_reason: str = "no check yet"

    def moved(self, now: float) -> None:
        self.started_at = now
        self._starved_since.clear()
        self._empty_since.clear()

    def decide(
        self,
        *,
        now: float,
        me: str,
        my_stage: int,
        my_throughput: float,
        replicas: Sequence[ReplicaInfo],
        spans: Sequence[tuple[int, int]],
    ) -> Move | None:
        """A move for this replica, or None (`last_reason` says why not). `replicas`: the live replicas of every
        stage, those still joining a stage included (one moving counts where it goes: nobody follows it there)."""
        cfg = self.config
        loads = stage_loads(replicas, spans, exclude=me)
        mine = loads[my_stage]
        if (hole := self._track_empty(now, loads, my_stage)) is not None:
            return self._fill_empty(now, me, my_stage, hole, replicas)
        own = max(0.0, my_throughput) if math.isfinite(my_throughput) else 0.0
        here = (mine.throughput + own) / mine.num_layers  # per layer, with us
        starved = [s for s in loads if s.stage != my_stage and s.per_layer < cfg.starve_ratio * here]
        self._track(now, replicas, me, {s.stage for s in starved})
        if not starved:
            self.last_reason = "no stage is starved"
            return None
        target = min(starved, key=lambda s: (s.per_layer, s.replicas, s.stage))
        if mine.replicas + 1 < cfg.min_donor_replicas:
            self.last_reason = f"stage {my_stage} would be left with {mine.replicas} replica(s)"
            return None
        donor_after = mine.per_layer  # what our stage keeps if we leave (loads exclude us)
        target_after = (target.throughput + own) / max(target.num_layers, 1)
        if donor_after < cfg.starve_ratio * target_after:  # the same ratio both ways: no ping-pong
            self.last_reason = f"moving would starve stage {my_stage} instead"
            return None
        before, after = _balance(here, target.per_layer), _balance(donor_after, target_after)
        if after < cfg.min_gain * before:
            self.last_reason = f"moving would not balance the stages better ({before:.2f} -> {after:.2f})"
            return None
        rank = _candidate_rank(me, own, my_stage, replicas, cfg.slow_margin)
        if rank is None:
            self.last_reason = "a slower replica of this stage should move first"
            return None
        held_s = now - self._starved_since[target.stage]
        needed_s = cfg.dwell_s + rank * cfg.stagger_s
        if held_s < needed_s:
            self.last_reason = (
                f"stage {target.stage} starved for {held_s:.0f} s < {needed_s:.0f} s "
                f"(dwell, candidate {rank + 1} to move)"
            )
            return None
        if now - self.started_at < cfg.cooldown_s:
            self.last_reason = (
                f"moved or joined {now - self.started_at:.0f} s ago < cooldown {cfg.cooldown_s:.0f} s"
            )
            return None
        self.last_reason = (
            f"stage {target.stage} has {target.per_layer:.0f} tokens/s/layer against {here:.0f} here, "
            f"for {held_s:.0f} s"
        )
        return Move(to_stage=target.stage, reason=self.last_reason)

    def _track_empty(self, now: float, loads: Sequence[StageLoad], my_stage: int) -> int | None:
        """Keep the clocks of the stages nobody serves; the first of them if others also serve ours (we may go)."""
        empty = [s.stage for s in loads if s.replicas == 0 and s.stage != my_stage]
        self._empty_since = {stage: self._empty_since.get(stage, now) for stage in empty}
        return empty[0] if empty and loads[my_stage].replicas >= 1 else None

    def _fill_empty(
        self, now: float, me: str, my_stage: int, target: int, replicas: Sequence[ReplicaInfo]
    ) -> Move | None:
        """Move to the replica-less stage `target` once it has been empty `empty_dwell_s` (plus a stagger per
        candidate ahead of us: the replicas of our stage in peer id order, which every one of them sees alike)."""
        candidates = sorted({r.peer_id for r in replicas if r.stage == my_stage} | {me})
        rank = candidates.index(me)
        held_s = now - self._empty_since[target]
        needed_s = self.config.empty_dwell_s + rank * self.config.stagger_s
        if held_s < needed_s:
            self.last_reason = (
                f"stage {target} has no replica for {held_s:.0f} s < {needed_s:.0f} s "
                f"(candidate {rank + 1} of stage {my_stage} to move)"
            )
            return None
        self.last_reason = f"stage {target} had no replica for {held_s:.0f} s; stage {my_stage} keeps others"
        return Move(to_stage=target, reason=self.last_reason)

    def _track(self, now: float, replicas: Sequence[ReplicaInfo], me: str, starved: set[int]) -> None:
        """Starvation clocks: started when a stage becomes starved, restarted when it gains a replica."""
        members: dict[int, set[str]] = {}
        for r in replicas:
            if r.peer_id != me:
                members.setdefault(r.stage, set()).add(r.peer_id)
        for stage in list(self._starved_since):
            if stage not in starved:
                del self._starved_since[stage]
        for stage in starved:
            now_members = frozenset(members.get(stage, ()))
            gained = now_members - self._members.get(stage, frozenset())
            if stage not in self._starved_since or gained:
                self._starved_since[stage] = now
        self._members = {stage: frozenset(peers) for stage, peers in members.items()}


def _balance(a: float, b: float) -> float:
    """How evenly two per-layer throughputs match: lesser / greater, 1 when equal, 0 when one is empty."""
    high = max(a, b)
    return 1.0 if high <= 0 else min(a, b) / high


def _candidate_rank(
    me: str, own: float, stage: int, replicas: Sequence[ReplicaInfo], slow_margin: float
) -> int | None:
    """Our place among the donor's candidates to move (those near its slowest, by peer id); None if we are not."""
    throughputs = {
        r.peer_id: max(0.0, r.throughput) for r in replicas if r.stage == stage and r.peer_id != me
    }
    throughputs[me] = own
    slowest = min(throughputs.values())
    candidates = sorted(p for p, t in throughputs.items() if t <= slowest * slow_margin)
    return candidates.index(me) if me in candidates else None


def replicas_by_stage(replicas: Iterable[ReplicaInfo], num_stages: int) -> Mapping[int, list[ReplicaInfo]]:
    out: dict[int, list[ReplicaInfo]] = {s: [] for s in range(num_stages)}
    for r in replicas:
        if 0 <= r.stage < num_stages:
            out[r.stage].append(r)
    return out
