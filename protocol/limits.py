"""Per-peer resource limits: request rates, concurrent streams, bytes in flight, and DHT store quotas.

This module owns the *decisions* only. hivemind's p2pd builds its libp2p resource manager with
`rcmgr.InfiniteLimits`, and its DHT has no per-peer store quota and no cap on a writer's expiration time
(papers/reliability.md §2.5), so every cap has to live in our layer. The networked servers ask these cores
before doing work and act on the returned `Admission`.

Pure: the clock is passed in as `now` (seconds, any monotonic origin for `PeerLimiter`, DHT time for
`StoreQuota`), nothing here reads global time or touches sockets, and memory is bounded whatever peers send:
the number of tracked peers is capped and new peer entries are only created for admitted work, so a flood of
fresh (Sybil) peer ids cannot grow the tables; it can only evict idle entries as fast as the global caps admit
newcomers (never a peer with open streams or reserved bytes, and, with the `QuotaConfig` invariant, never a
peer's store quota inside its window).
"""

from __future__ import annotations

import logging
import math
from collections import Counter, OrderedDict, deque
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from types import MappingProxyType

from protocol.errors import FrameTooLarge, ProtocolError

logger = logging.getLogger(__name__)

# Rejection reasons: short, stable strings, used as log fields and metric labels.
RATE = "rate"
GLOBAL_RATE = "global rate"
STREAMS = "streams"
GLOBAL_STREAMS = "global streams"
BYTES_IN_FLIGHT = "bytes in flight"
GLOBAL_BYTES_IN_FLIGHT = "global bytes in flight"
PEER_TABLE_FULL = "peer table full"
VALUE_TOO_LARGE = "value too large"
EXPIRATION_TOO_FAR = "expiration too far"
ALREADY_EXPIRED = "already expired"
STORE_RECORDS = "store records"
STORE_BYTES = "store bytes"
GLOBAL_STORE_RECORDS = "global store records"
# The guests' pool is full: what is left of the global record quota is reserved for known peers.
GUEST_STORE_RECORDS = "guest store records"
SUBKEYS = "subkeys per key"
INVALID_RECORD = "invalid record"  # refused by the record validator before it could count toward a quota

# Only these are the peer's own doing; global caps and a full table can be hit by honest peers when someone
# else floods, so they never count towards a flooding report.
_PEER_ATTRIBUTABLE = frozenset({RATE, STREAMS, BYTES_IN_FLIGHT})

OTHER_RPCS = "*"  # bucket key shared by every RPC name without its own entry in `LimitsConfig.rpc_rates`

MiB = 1 << 20
KiB = 1 << 10


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(message)


def _is_positive(x: float) -> bool:
    return math.isfinite(x) and x > 0


class TokenBucket:
    """A token bucket: `burst` tokens at most, refilled at `rate_per_s`; it starts full.

    The bucket's clock starts at the first `now` it is given. A clock that steps backwards refills nothing
    (rather than minting tokens later), so over any interval [t0, t] the bucket hands out at most
    `burst + rate_per_s * (t - t0)` tokens.
    """

    __slots__ = ("rate_per_s", "burst", "_tokens", "_last")

    def __init__(self, rate_per_s: float, burst: float) -> None:
        _require(_is_positive(rate_per_s), f"rate_per_s must be positive and finite, got {rate_per_s}")
        _require(_is_positive(burst), f"burst must be positive and finite, got {burst}")
        self.rate_per_s = float(rate_per_s)
        self.burst = float(burst)
        self._tokens = self.burst
        self._last: float | None = None

    def _refill(self, now: float) -> None:
        if self._last is None:
            self._last = now
        elif now > self._last:
            self._tokens = min(self.burst, self._tokens + (now - self._last) * self.rate_per_s)
            self._last = now

    def tokens(self, now: float) -> float:
        """Tokens available at `now`."""
        self._refill(now)
        return self._tokens

    def try_take(self, now: float, cost: float = 1.0) -> bool:
        """Take `cost` tokens if there are enough; return whether they were taken."""
        _require(cost >= 0, f"cost must be >= 0, got {cost}")
        self._refill(now)
        if cost <= self._tokens:
            self._tokens -= cost
            return True
        return False

    def time_until(self, now: float, cost: float = 1.0) -> float:
        """Seconds from `now` until `cost` tokens are available (0 if they are; inf if cost > burst)."""
        _require(cost >= 0, f"cost must be >= 0, got {cost}")
        if cost > self.burst:
            return math.inf
        self._refill(now)
        return max(0.0, (cost - self._tokens) / self.rate_per_s)


@dataclass(frozen=True, kw_only=True, slots=True)
class FloodReport:
    """A peer was throttled for its own behaviour more than `flood_threshold` times within `window_s`.

    A decision for the node to log and count (and to feed reputation); not a ban by itself.
    """

    peer: str
    num_throttled: int  # throttles inside the window that triggered this report
    window_s: float
    reasons: Mapping[str, int]  # the peer's throttles by reason, since it was first tracked
    reason: str  # human-readable summary, for the log line


@dataclass(frozen=True, kw_only=True, slots=True)
class Admission:
    """The answer to "may this peer do this now?"; truthy when admitted."""

    ok: bool
    reason: str = ""  # one of the module's reason constants when refused; "" when admitted
    retry_after_s: float = 0.0  # for rate refusals: when a retry could pass (inf: never); else 0
    flood: FloodReport | None = None  # set on the refusal that made the peer count as flooding

    def __bool__(self) -> bool:
        return self.ok


ADMITTED = Admission(ok=True)


class Throttled(ProtocolError):
    """Raised by the context-manager helpers when a stream or byte reservation is refused."""

    reason = "throttled"
    blame_sender = False  # being over a limit is load, not proof of misbehaviour; flooding is judged apart

    def __init__(self, admission: Admission) -> None:
        super().__init__(f"throttled: {admission.reason}")
        self.admission = admission


@dataclass(frozen=True, kw_only=True, slots=True)
class RateLimit:
    rate_per_s: float  # sustained requests per second
    burst: float  # requests that may arrive back to back after a quiet period

    def __post_init__(self) -> None:
        _require(_is_positive(self.rate_per_s), f"rate_per_s must be positive, got {self.rate_per_s}")
        _require(_is_positive(self.burst) and self.burst >= 1, f"burst must be >= 1, got {self.burst}")


@dataclass(frozen=True, kw_only=True, slots=True)
class LimitsConfig:
    """Caps for `PeerLimiter`. Defaults are sized for a 2-core volunteer node; reasons inline."""

    # Per-peer rate for any RPC without its own entry. Honest peers make a few DHT, heartbeat and status calls
    # a second (DHT get/store take ~ms on loopback, peers.md §2.2); 20/s sustained with a 40-call burst is
    # an order of magnitude above that and still bounds what one identity can make us do.
    default_rate: RateLimit = RateLimit(rate_per_s=20.0, burst=40.0)
    # Per-RPC overrides (e.g. forward/backward at the pipeline's microbatch rate). Names not listed here share
    # one per-peer bucket (`OTHER_RPCS`), so a peer cannot grow our tables by inventing RPC names.
    rpc_rates: Mapping[str, RateLimit] = field(default_factory=dict)
    # All peers together: a 2-core node cannot serve more than a few hundred handler calls a second anyway,
    # and shedding before the work starts is cheaper than timing it out. None disables it.
    global_rate: RateLimit | None = RateLimit(rate_per_s=400.0, burst=800.0)
    # A verifier keeps a few microbatches in flight per stage (forward and backward overlap); 8 covers that.
    max_streams_per_peer: int = 8
    # Each stream holds a handler task and a reassembly buffer; 64 keeps the worst case inside memory.
    max_streams_total: int = 64
    # When the server names its preferred peers (`PeerLimiter.prefer`: a stage's authorized verifiers), the
    # others ("guests") share what is left after `reserved_streams`, at most `max_streams_per_guest` each: eight
    # fresh identities with eight streams each (long-polls included) can no longer take every slot. At most half
    # of `max_streams_total` is reserved, whatever this says.
    reserved_streams: int = 16
    max_streams_per_guest: int = 4
    # One activation of the demo model is ~1 MiB (16 x 128 x 128 fp32); 64 MiB per peer leaves room for
    # larger models while keeping one peer to a bounded share of the node's memory. Counted chunk by chunk as
    # request bytes arrive (`FrameReservation`), which is what the receive buffers hold.
    max_bytes_in_flight_per_peer: int = 64 * MiB
    max_bytes_in_flight_total: int = 512 * MiB
    # Peer entries are a few hundred bytes each (buckets per RPC name plus counters); 4096 is ~1-2 MiB.
    max_tracked_peers: int = 4096
    # An honest peer that honours `retry_after_s` is throttled a few times at most; 20 own-fault throttles in
    # 10 s means it ignores the hints.
    flood_threshold: int = 20
    flood_window_s: float = 10.0

    def __post_init__(self) -> None:
        object.__setattr__(self, "rpc_rates", MappingProxyType(dict(self.rpc_rates)))
        _require(OTHER_RPCS not in self.rpc_rates, f"{OTHER_RPCS!r} is reserved for unlisted RPCs")
        for name in ("max_streams_per_peer", "max_streams_total", "max_tracked_peers", "flood_threshold"):
            _require(getattr(self, name) >= 1, f"{name} must be >= 1")
        _require(self.max_bytes_in_flight_per_peer >= 1, "max_bytes_in_flight_per_peer must be >= 1")
        _require(
            self.max_bytes_in_flight_total >= self.max_bytes_in_flight_per_peer,
            "max_bytes_in_flight_total must be >= max_bytes_in_flight_per_peer",
        )
        _require(
            self.max_streams_total >= self.max_streams_per_peer, "max_streams_total < max_streams_per_peer"
        )
        _require(self.reserved_streams >= 0, "reserved_streams must be >= 0")
        _require(self.max_streams_per_guest >= 1, "max_streams_per_guest must be >= 1")
        _require(_is_positive(self.flood_window_s), "flood_window_s must be positive")

    def rate_for(self, rpc: str) -> tuple[str, RateLimit]:
        """The bucket key and rate that govern `rpc`."""
        limit = self.rpc_rates.get(rpc)
        return (rpc, limit) if limit is not None else (OTHER_RPCS, self.default_rate)


@dataclass(frozen=True, kw_only=True, slots=True)
class PeerStats:
    num_throttled: int
    throttled_by_reason: Mapping[str, int]
    num_open_streams: int
    bytes_in_flight: int
    peak_bytes_in_flight: int  # the most this peer held at once since it was (last) tracked
    num_flood_reports: int


@dataclass(frozen=True, kw_only=True, slots=True)
class LimiterStats:
    peers: Mapping[str, PeerStats]  # currently tracked peers only
    throttled_by_reason: Mapping[str, int]  # all refusals ever, including evicted and never-tracked peers
    num_admitted: int
    num_flood_reports: int
    num_tracked_peers: int
    num_evicted_peers: int
    num_open_streams: int
    bytes_in_flight: int
    peak_bytes_in_flight: int  # the most all peers held at once, ever


@dataclass(slots=True)
class _PeerState:
    buckets: dict[str, TokenBucket] = field(default_factory=dict)
    streams: Counter[str] = field(default_factory=Counter)
    num_streams: int = 0
    guest_streams: int = 0  # of num_streams, those opened while the peer was not preferred
    bytes_in_flight: int = 0
    peak_bytes_in_flight: int = 0
    throttled: Counter[str] = field(default_factory=Counter)
    recent_throttles: deque[float] = field(default_factory=deque)  # own-fault throttle times, bounded
    num_flood_reports: int = 0

    def is_idle(self) -> bool:
        return self.num_streams == 0 and self.bytes_in_flight == 0


class PeerLimiter:
    """Per-peer (and global) request rates, concurrent streams and bytes in flight.

    Unary requests ask `admit`; streaming calls ask `open_stream` (a rate token plus a stream slot) and must
    `close_stream` (or use the `stream` context manager); payloads reserve their bytes before allocating them,
    chunk by chunk as they arrive (`frame`, `FrameReservation`). Refusals are counted per peer and reason; a peer refused for its own behaviour more than
    `flood_threshold` times within `flood_window_s` gets a `FloodReport` on the refusal that crossed the line
    (once per crossing).

    Peers with open streams or reserved bytes are never evicted; idle ones are evicted least recently used
    first when the table is full, and losing an idle peer's state only hands it a fresh bucket, which any new
    identity gets anyway (the global caps bound that).
    """

    def __init__(self, config: LimitsConfig) -> None:
        self.config = config
        self._peers: OrderedDict[str, _PeerState] = OrderedDict()
        self._global_bucket = (
            TokenBucket(config.global_rate.rate_per_s, config.global_rate.burst)
            if config.global_rate
            else None
        )
        self._throttled: Counter[str] = Counter()
        self._num_admitted = 0
        self._num_flood_reports = 0
        self._num_evicted = 0
        self._num_streams = 0
        self._num_guest_streams = 0
        self._bytes_in_flight = 0
        self._peak_bytes_in_flight = 0
        self._preferred: Callable[[str], bool] | None = None  # None: every peer is preferred

    # ---- public API -----------------------------------------------------------------------------------

    def prefer(self, preferred: Callable[[str], bool] | None) -> None:
        """Name the peers that may use the reserved stream slots (None: everyone, no reservation)."""
        self._preferred = preferred

    def admit(self, peer: str, rpc: str, now: float, cost: float = 1.0) -> Admission:
        """May `peer` make one unary `rpc` call (weighing `cost` tokens) at `now`?"""
        state = self._peers.get(peer)
        refusal = self._check_rate(state, rpc, now, cost)
        if refusal is not None:
            return self._refuse(peer, state, refusal, now)
        state = self._state_for_admitted(peer)
        if state is None:
            return self._refuse(peer, None, Admission(ok=False, reason=PEER_TABLE_FULL), now)
        self._take_rate(state, rpc, now, cost)
        self._num_admitted += 1
        return ADMITTED

    def open_stream(self, peer: str, rpc: str, now: float) -> Admission:
        """May `peer` open one streaming `rpc` call now? Takes a rate token and a stream slot if so."""
        state = self._peers.get(peer)
        guest = self._preferred is not None and not self._preferred(peer)
        refusal = self._check_streams(state, guest)
        if refusal is None:  # a stream refused for slots must not also spend a rate token
            refusal = self._check_rate(state, rpc, now, 1.0)
        if refusal is not None:
            return self._refuse(peer, state, refusal, now)
        state = self._state_for_admitted(peer)
        if state is None:
            return self._refuse(peer, None, Admission(ok=False, reason=PEER_TABLE_FULL), now)
        self._take_rate(state, rpc, now, 1.0)
        state.streams[rpc] += 1
        state.num_streams += 1
        self._num_streams += 1
        if guest:
            state.guest_streams += 1
            self._num_guest_streams += 1
        self._num_admitted += 1
        return ADMITTED

    def close_stream(self, peer: str, rpc: str) -> None:
        """Release the slot taken by an admitted `open_stream(peer, rpc, ...)`."""
        state = self._peers.get(peer)
        if state is None or state.streams[rpc] <= 0:
            raise ValueError(f"close_stream({peer!r}, {rpc!r}) without a matching open_stream")
        state.streams[rpc] -= 1
        if state.streams[rpc] == 0:
            del state.streams[rpc]
        state.num_streams -= 1
        if state.guest_streams > state.num_streams:  # a guest stream closed (which one does not matter)
            state.guest_streams -= 1
            self._num_guest_streams -= 1
        self._num_streams -= 1

    @contextmanager
    def stream(self, peer: str, rpc: str, now: float) -> Iterator[Admission]:
        """`with limiter.stream(peer, rpc, now):` holds a stream slot for the block; raises `Throttled`."""
        admission = self.open_stream(peer, rpc, now)
        if not admission:
            raise Throttled(admission)
        try:
            yield admission
        finally:
            self.close_stream(peer, rpc)

    def reserve_bytes(self, peer: str, num_bytes: int, now: float) -> Admission:
        """Reserve `num_bytes` of buffer for `peer` before allocating it (a chunk's length, from its header)."""
        _require(num_bytes >= 0, f"num_bytes must be >= 0, got {num_bytes}")
        state = self._peers.get(peer)
        refusal = self._check_bytes(state, num_bytes)
        if refusal is not None:
            return self._refuse(peer, state, refusal, now)
        state = self._state_for_admitted(peer)
        if state is None:
            return self._refuse(peer, None, Admission(ok=False, reason=PEER_TABLE_FULL), now)
        state.bytes_in_flight += num_bytes
        self._bytes_in_flight += num_bytes
        state.peak_bytes_in_flight = max(state.peak_bytes_in_flight, state.bytes_in_flight)
        self._peak_bytes_in_flight = max(self._peak_bytes_in_flight, self._bytes_in_flight)
        return ADMITTED

    def admit_bytes(self, peer: str, num_bytes: int, now: float) -> Admission:
        """May `peer` start sending a `num_bytes` message now? Reserves nothing (`FrameReservation` reserves its
        chunks as they arrive). Refused for good (`retry_after_s` inf) when it could never fit, being over the
        per-peer or the total cap alone; refused for now when it does not fit beside what the peer and the node
        hold at this moment, so that a transfer the caps would cut midway is not started."""
        _require(num_bytes >= 0, f"num_bytes must be >= 0, got {num_bytes}")
        state = self._peers.get(peer)
        never = self._check_bytes(None, num_bytes, held_total=0)
        if never is not None:
            return self._refuse(
                peer, state, Admission(ok=False, reason=never.reason, retry_after_s=math.inf), now
            )
        for_now = self._check_bytes(state, num_bytes)
        return ADMITTED if for_now is None else self._refuse(peer, state, for_now, now)

    @contextmanager
    def frame(self, peer: str, declared_bytes: int, now: float) -> Iterator[FrameReservation]:
        """`with limiter.frame(peer, declared, now) as held:` admits the message (`admit_bytes`; raises `Throttled`)
        and gives back every byte its chunks reserved (`held.take`) when the block ends: consumed or refused."""
        admission = self.admit_bytes(peer, declared_bytes, now)
        if not admission:
            raise Throttled(admission)
        held = FrameReservation(self, peer, declared_bytes)
        try:
            yield held
        finally:
            held.release()

    def release_bytes(self, peer: str, num_bytes: int) -> None:
        """Give back bytes taken by an admitted `reserve_bytes`."""
        state = self._peers.get(peer)
        if state is None or not 0 <= num_bytes <= state.bytes_in_flight:
            raise ValueError(f"release_bytes({peer!r}, {num_bytes}) exceeds what was reserved")
        state.bytes_in_flight -= num_bytes
        self._bytes_in_flight -= num_bytes

    @contextmanager
    def reserved_bytes(self, peer: str, num_bytes: int, now: float) -> Iterator[Admission]:
        """`with limiter.reserved_bytes(peer, n, now):` holds the reservation for the block; raises `Throttled`."""
        admission = self.reserve_bytes(peer, num_bytes, now)
        if not admission:
            raise Throttled(admission)
        try:
            yield admission
        finally:
            self.release_bytes(peer, num_bytes)

    @property
    def bytes_in_flight(self) -> int:
        """Bytes reserved now, all peers together."""
        return self._bytes_in_flight

    def stats(self) -> LimiterStats:
        peers = {
            peer: PeerStats(
                num_throttled=sum(state.throttled.values()),
                throttled_by_reason=dict(state.throttled),
                num_open_streams=state.num_streams,
                bytes_in_flight=state.bytes_in_flight,
                peak_bytes_in_flight=state.peak_bytes_in_flight,
                num_flood_reports=state.num_flood_reports,
            )
            for peer, state in self._peers.items()
        }
        return LimiterStats(
            peers=peers,
            throttled_by_reason=dict(self._throttled),
            num_admitted=self._num_admitted,
            num_flood_reports=self._num_flood_reports,
            num_tracked_peers=len(self._peers),
            num_evicted_peers=self._num_evicted,
            num_open_streams=self._num_streams,
            bytes_in_flight=self._bytes_in_flight,
            peak_bytes_in_flight=self._peak_bytes_in_flight,
        )

    # ---- internals ------------------------------------------------------------------------------------

    def _bucket(self, state: _PeerState | None, rpc: str) -> TokenBucket:
        key, limit = self.config.rate_for(rpc)
        if state is None:
            return TokenBucket(limit.rate_per_s, limit.burst)  # what a new peer would get: a full bucket
        bucket = state.buckets.get(key)
        if bucket is None:
            bucket = state.buckets[key] = TokenBucket(limit.rate_per_s, limit.burst)
        return bucket

    def _check_rate(self, state: _PeerState | None, rpc: str, now: float, cost: float) -> Admission | None:
        wait_s = self._bucket(state, rpc).time_until(now, cost)
        if wait_s > 0:
            return Admission(ok=False, reason=RATE, retry_after_s=wait_s)
        if self._global_bucket is not None:
            wait_s = self._global_bucket.time_until(now, cost)
            if wait_s > 0:
                return Admission(ok=False, reason=GLOBAL_RATE, retry_after_s=wait_s)
        return None

    def _take_rate(self, state: _PeerState, rpc: str, now: float, cost: float) -> None:
        taken = self._bucket(state, rpc).try_take(now, cost)
        if self._global_bucket is not None:
            taken = self._global_bucket.try_take(now, cost) and taken
        assert taken, "tokens vanished between check and take"

    def _check_streams(self, state: _PeerState | None, guest: bool) -> Admission | None:
        config = self.config
        per_peer = (
            min(config.max_streams_per_peer, config.max_streams_per_guest)
            if guest
            else config.max_streams_per_peer
        )
        if state is not None and state.num_streams >= per_peer:
            return Admission(ok=False, reason=STREAMS)
        if self._num_streams >= config.max_streams_total:
            return Admission(ok=False, reason=GLOBAL_STREAMS)
        reserved = min(config.reserved_streams, config.max_streams_total // 2)  # guests keep half at least
        if guest and self._num_guest_streams >= config.max_streams_total - reserved:
            return Admission(ok=False, reason=GLOBAL_STREAMS)
        return None

    def _check_bytes(
        self, state: _PeerState | None, num_bytes: int, *, held_total: int | None = None
    ) -> Admission | None:
        held = state.bytes_in_flight if state is not None else 0
        if held + num_bytes > self.config.max_bytes_in_flight_per_peer:
            return Admission(ok=False, reason=BYTES_IN_FLIGHT)
        total = self._bytes_in_flight if held_total is None else held_total
        if total + num_bytes > self.config.max_bytes_in_flight_total:
            return Admission(ok=False, reason=GLOBAL_BYTES_IN_FLIGHT)
        return None

    def _state_for_admitted(self, peer: str) -> _PeerState | None:
        """The peer's entry, created (evicting an idle peer if needed) for work that passed every check."""
        state = self._peers.get(peer)
        if state is not None:
            self._peers.move_to_end(peer)
            return state
        if len(self._peers) >= self.config.max_tracked_peers and not self._evict_one_idle():
            return None
        state = self._peers[peer] = _PeerState()
        return state

    def _evict_one_idle(self) -> bool:
        for peer, state in self._peers.items():  # least recently used first
            if state.is_idle():
                del self._peers[peer]
                self._num_evicted += 1
                logger.debug("evicted idle peer %s from the limiter table", peer)
                return True
        return False

    def _refuse(self, peer: str, state: _PeerState | None, refusal: Admission, now: float) -> Admission:
        self._throttled[refusal.reason] += 1
        if state is None:
            return refusal  # untracked peers stay untracked: refusals must not grow the table
        self._peers.move_to_end(peer)
        state.throttled[refusal.reason] += 1
        if refusal.reason not in _PEER_ATTRIBUTABLE:
            return refusal
        flood = self._note_own_fault(peer, state, now)
        return (
            refusal
            if flood is None
            else Admission(ok=False, reason=refusal.reason, retry_after_s=refusal.retry_after_s, flood=flood)
        )

    def _note_own_fault(self, peer: str, state: _PeerState, now: float) -> FloodReport | None:
        threshold, window_s = self.config.flood_threshold, self.config.flood_window_s
        recent = state.recent_throttles
        recent.append(now)
        while recent and recent[0] < now - window_s:
            recent.popleft()
        if len(recent) <= threshold:
            return None
        num_throttled = len(recent)
        recent.clear()  # report once per crossing; the next report needs another threshold + 1 throttles
        state.num_flood_reports += 1
        self._num_flood_reports += 1
        summary = ", ".join(f"{reason}: {count}" for reason, count in state.throttled.most_common())
        return FloodReport(
            peer=peer,
            num_throttled=num_throttled,
            window_s=window_s,
            reasons=dict(state.throttled),
            reason=f"throttled {num_throttled} times within {window_s:g} s ({summary})",
        )


class FrameReservation:
    """The bytes one incoming message holds against a `PeerLimiter`: reserved chunk by chunk as the chunks arrive
    (`take`, before each is read), all given back at once (`release`) when the message was consumed or refused.

    Counting chunks rather than the declared size means a peer holds the budget of what it has actually sent: a
    peer that declares a fragment-sized frame and stalls holds nothing, and the node's bytes in flight are the bytes
    its receive buffers hold (the stream layer grows them as chunks land). A chunk past a cap is refused, and so is
    one that would carry the message past its declared size: that is the sender's fault (`FrameTooLarge`).
    """

    __slots__ = ("limiter", "peer", "declared_bytes", "held_bytes", "num_chunks")

    def __init__(self, limiter: PeerLimiter, peer: str, declared_bytes: int) -> None:
        _require(declared_bytes >= 0, f"declared_bytes must be >= 0, got {declared_bytes}")
        self.limiter = limiter
        self.peer = peer
        self.declared_bytes = declared_bytes
        self.held_bytes = 0
        self.num_chunks = 0  # chunks reserved so far

    def take(self, num_bytes: int, now: float) -> Admission:
        """Reserve one `num_bytes` chunk; a refusal reserves nothing (the caller refuses the whole message)."""
        if self.held_bytes + num_bytes > self.declared_bytes:
            raise FrameTooLarge(
                f"chunk {self.num_chunks + 1} brings the message to {self.held_bytes + num_bytes} bytes, more than"
                f" the {self.declared_bytes} declared",
                reason="more than declared",
            )
        admission = self.limiter.reserve_bytes(self.peer, num_bytes, now)
        if admission:
            self.held_bytes += num_bytes
            self.num_chunks += 1
        return admission

    def release(self) -> None:
        """Give back everything taken (idempotent)."""
        if self.held_bytes:
            self.limiter.release_bytes(self.peer, self.held_bytes)
            self.held_bytes = 0


# ---- DHT store quotas ----------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True, slots=True)
class QuotaConfig:
    """Caps for `StoreQuota`. Times are DHT times (seconds since the epoch, as expiration times are)."""

    window_s: float = 60.0  # sliding window for the per-peer and global store counts
    # A node re-stores its heartbeat about every 30 s, plus the odd ban or syncer lease: ~2-4 stores a minute.
    # 60 a minute is ~15x that, so bursts at join or after a partition pass, while one identity cannot fill
    # the table.
    max_records_per_peer: int = 60
    # Our records (heartbeat, lease, ban with evidence digests) are a few KiB; 256 KiB a minute is generous.
    max_bytes_per_peer: int = 256 * KiB
    # Tensors never travel through the DHT; a single value above 64 KiB is a mistake or an attack.
    max_value_bytes: int = 64 * KiB
    # All peers together, per window. A fresh identity costs ~1 ms, so per-peer caps alone do not bound a
    # Sybil flood; this does. 2048/min serves ~500-1000 honest peers at their normal re-store rate.
    max_records_total: int = 2048
    # Of `max_records_total`, the records per window that only known peers (`StoreQuota`'s `known`) may use:
    # every other identity ("guest") shares the rest, each within its own per-peer quota, so a flood of fresh
    # identities fills the guests' pool and never the known peers' share. 0: one pool for everyone.
    reserved_records_total: int = 0
    # Of `reserved_records_total`, the records per window that guests may use with a store that shows they paid
    # the run's admission cost (their own heartbeat carrying a valid proof: `admit_store(admitted=True)`); known
    # peers keep the rest whatever admitted identities store. A full share sends admitted stores to the guests'
    # pool. 0: admitted stores are guests'.
    admitted_records_total: int = 0
    # reliability.md §4.5: expiration at most "now + 2 x refresh period". Owners re-publish the slowest of our
    # records (manifest, bans) every 300 s, so 600 s; anything longer must be refreshed by its owner.
    max_expiration_horizon_s: float = 600.0
    # hivemind assumes peers' clocks agree within ~3 s (peers.md §3, item 12); allow a little more.
    clock_skew_s: float = 10.0
    # One key holding one subkey per peer (e.g. the peer directory) stays below this in any swarm we target.
    max_subkeys_per_key: int = 1024
    # Bounded tables. `max_tracked_peers >= max_records_total` makes an eviction unable to reset the quota of
    # a peer that stored within the window: new entries are only made for admitted stores, and at most
    # `max_records_total` are admitted per window.
    max_tracked_peers: int = 4096
    max_tracked_keys: int = 4096
    # Live (key, subkey) pairs remembered for the subkey cap, all keys together (~100 B each). Past it the least
    # recently stored keys are forgotten, which resets their count: the cap is best effort under a flood.
    max_tracked_subkeys: int = 65536

    def __post_init__(self) -> None:
        _require(_is_positive(self.window_s), "window_s must be positive")
        _require(_is_positive(self.max_expiration_horizon_s), "max_expiration_horizon_s must be positive")
        _require(math.isfinite(self.clock_skew_s) and self.clock_skew_s >= 0, "clock_skew_s must be >= 0")
        for name in (
            "max_records_per_peer",
            "max_bytes_per_peer",
            "max_value_bytes",
            "max_records_total",
            "max_subkeys_per_key",
            "max_tracked_peers",
            "max_tracked_keys",
            "max_tracked_subkeys",
        ):
            _require(getattr(self, name) >= 1, f"{name} must be >= 1")
        _require(self.max_value_bytes <= self.max_bytes_per_peer, "max_value_bytes > max_bytes_per_peer")
        _require(
            0 <= self.reserved_records_total < self.max_records_total,
            "reserved_records_total must be >= 0 and leave the guests at least one record of max_records_total",
        )
        _require(
            0 <= self.admitted_records_total <= self.reserved_records_total,
            "admitted_records_total must be >= 0 and at most reserved_records_total",
        )
        _require(
            self.max_tracked_peers >= self.max_records_total,
            "max_tracked_peers must be >= max_records_total, or evictions could reset live quotas",
        )


@dataclass(frozen=True, kw_only=True, slots=True)
class QuotaStats:
    rejected_by_reason: Mapping[str, int]
    rejected_by_peer: Mapping[str, Mapping[str, int]]  # tracked peers only
    num_admitted: int
    num_admitted_guests: int  # of num_admitted, records from peers that are not known
    num_admitted_by_proof: int = 0  # of num_admitted, records of the admitted stores' share (not guests')
    num_tracked_peers: int
    num_tracked_keys: int
    num_evicted_peers: int


@dataclass(slots=True)
class _PeerWindow:
    stores: deque[tuple[float, int]] = field(default_factory=deque)  # (time, value bytes), within the window
    num_bytes: int = 0
    rejected: Counter[str] = field(default_factory=Counter)

    def prune(self, horizon: float) -> None:
        while self.stores and self.stores[0][0] <= horizon:
            _, size = self.stores.popleft()
            self.num_bytes -= size


def _nobody(_peer: str) -> bool:
    return False


class StoreQuota:
    """Admission for DHT stores: per-peer record and byte quotas per window, a global record quota, a cap on
    value size and on how far in the future a record may expire, and a cap on distinct live subkeys per key.

    `known(peer)` names the peers that may use the `reserved_records_total` records of the global quota (None:
    nobody); the others, guests, share what is left. Known-ness is asked on every store, so it may change. A
    guest's store that shows its sender admitted (`admit_store(admitted=True)`) draws on the
    `admitted_records_total` share of the reserve while it has room.

    Call `admit_store` from the store handler, where the sender is known, before the record reaches storage;
    a refused record is dropped. Signatures cover the expiration time, so a too-distant one is refused, never
    clamped.
    """

    def __init__(self, config: QuotaConfig, known: Callable[[str], bool] | None = None) -> None:
        self.config = config
        self._known = known or _nobody
        self._peers: OrderedDict[str, _PeerWindow] = OrderedDict()
        self._global: deque[float] = deque()
        self._guests: deque[float] = deque()  # the guests' stores within the window, a subset of `_global`
        self._admitted: deque[float] = deque()  # the admitted stores' share's, within the window, ditto
        # key -> {subkey: expiration time}, least recently stored key first
        self._subkeys: OrderedDict[bytes | str, dict[bytes | str, float]] = OrderedDict()
        self._num_subkeys = 0
        self._rejected: Counter[str] = Counter()
        self._num_admitted = 0
        self._num_admitted_guests = 0
        self._num_admitted_by_proof = 0
        self._num_evicted = 0

    def admit_store(
        self,
        peer: str,
        key: bytes | str,
        value_size: int,
        expiration_time: float,
        now: float,
        *,
        subkey: bytes | str | None = None,
        admitted: bool = False,
    ) -> Admission:
        """May `peer` store a `value_size`-byte value under `key` (and `subkey`) expiring at `expiration_time`?
        `admitted`: the record itself shows `peer` paid the run's admission cost (its own heartbeat carrying a valid
        proof, `HivenodeRecordValidator.admits_store`): this store may use the known peers' reserve too."""
        _require(value_size >= 0, f"value_size must be >= 0, got {value_size}")
        window = self._peers.get(peer)
        pool = self._pool(peer, admitted, now)
        reason = self._check(window, key, subkey, value_size, expiration_time, now, pool=pool)
        if reason is not None:
            self._rejected[reason] += 1
            if window is not None:
                window.rejected[reason] += 1
                self._peers.move_to_end(peer)
            return Admission(ok=False, reason=reason)
        self._commit(peer, key, subkey, value_size, expiration_time, now)
        if pool is not None:
            pool.append(now)
        if pool is self._guests:
            self._num_admitted_guests += 1
        elif pool is self._admitted:
            self._num_admitted_by_proof += 1
        return ADMITTED

    def _pool(self, peer: str, admitted: bool, now: float) -> deque[float] | None:
        """The share of the global budget a store draws on: None for a known peer's (or where nothing is
        reserved), the admitted stores' share while it has room, else the guests' pool."""
        config = self.config
        if config.reserved_records_total == 0 or self._known(peer):
            return None
        if admitted and config.admitted_records_total > 0:
            horizon = now - config.window_s
            while self._admitted and self._admitted[0] <= horizon:
                self._admitted.popleft()
            if len(self._admitted) < config.admitted_records_total:
                return self._admitted
        return self._guests

    def refuse_invalid(self, peer: str) -> Admission:
        """Count a record the validator refused before admission (it never touches a quota or a subkey count)."""
        self._rejected[INVALID_RECORD] += 1
        window = self._peers.get(peer)
        if window is not None:
            window.rejected[INVALID_RECORD] += 1
        return Admission(ok=False, reason=INVALID_RECORD)

    def stats(self) -> QuotaStats:
        return QuotaStats(
            rejected_by_reason=dict(self._rejected),
            rejected_by_peer={peer: dict(w.rejected) for peer, w in self._peers.items() if w.rejected},
            num_admitted=self._num_admitted,
            num_admitted_guests=self._num_admitted_guests,
            num_admitted_by_proof=self._num_admitted_by_proof,
            num_tracked_peers=len(self._peers),
            num_tracked_keys=len(self._subkeys),
            num_evicted_peers=self._num_evicted,
        )

    def _check(
        self,
        window: _PeerWindow | None,
        key: bytes | str,
        subkey: bytes | str | None,
        value_size: int,
        expiration_time: float,
        now: float,
        *,
        pool: deque[float] | None,
    ) -> str | None:
        config = self.config
        if value_size > config.max_value_bytes:
            return VALUE_TOO_LARGE
        if (
            not math.isfinite(expiration_time)
            or expiration_time > now + config.max_expiration_horizon_s + config.clock_skew_s
        ):
            return EXPIRATION_TOO_FAR
        if expiration_time <= now - config.clock_skew_s:
            return ALREADY_EXPIRED
        horizon = now - config.window_s
        for times in (self._global, self._guests):
            while times and times[0] <= horizon:
                times.popleft()
        if window is not None:
            window.prune(horizon)
            if len(window.stores) >= config.max_records_per_peer:
                return STORE_RECORDS
            if window.num_bytes + value_size > config.max_bytes_per_peer:
                return STORE_BYTES
        if len(self._global) >= config.max_records_total:
            return GLOBAL_STORE_RECORDS
        if (
            pool is self._guests
            and len(self._guests) >= config.max_records_total - config.reserved_records_total
        ):
            return GUEST_STORE_RECORDS
        if subkey is not None and self._is_new_subkey_over_cap(key, subkey, now):
            return SUBKEYS
        return None

    def _is_new_subkey_over_cap(self, key: bytes | str, subkey: bytes | str, now: float) -> bool:
        live = self._subkeys.get(key)
        if live is None:
            return False
        self._drop_expired_subkeys(live, now)
        return subkey not in live and len(live) >= self.config.max_subkeys_per_key

    def _drop_expired_subkeys(self, live: dict[bytes | str, float], now: float) -> None:
        for expired in [s for s, expiration in live.items() if expiration <= now]:
            del live[expired]
            self._num_subkeys -= 1

    def _commit(
        self,
        peer: str,
        key: bytes | str,
        subkey: bytes | str | None,
        value_size: int,
        expiration: float,
        now: float,
    ) -> None:
        window = self._peers.get(peer)
        if window is None:
            if len(self._peers) >= self.config.max_tracked_peers:
                self._peers.popitem(last=False)  # least recently used; see QuotaConfig.max_tracked_peers
                self._num_evicted += 1
            window = self._peers[peer] = _PeerWindow()
        else:
            self._peers.move_to_end(peer)
        window.stores.append((now, value_size))
        window.num_bytes += value_size
        self._global.append(now)
        self._num_admitted += 1
        if subkey is not None:
            self._note_subkey(key, subkey, expiration)

    def _note_subkey(self, key: bytes | str, subkey: bytes | str, expiration: float) -> None:
        live = self._subkeys.get(key)
        if live is None:
            live = self._subkeys[key] = {}
        self._subkeys.move_to_end(key)
        if subkey not in live:
            self._num_subkeys += 1
        live[subkey] = max(expiration, live.get(subkey, expiration))
        self._forget_old_keys()

    def _forget_old_keys(self) -> None:
        """Keep the subkey tables within their caps by forgetting the least recently stored keys (O(1) each)."""
        config = self.config
        while len(self._subkeys) > config.max_tracked_keys or self._num_subkeys > config.max_tracked_subkeys:
            _, live = self._subkeys.popitem(last=False)
            self._num_subkeys -= len(live)
