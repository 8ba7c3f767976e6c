"""Replay protection for signed frames: clock-skew limit, step window and a bounded seen-set. Pure: `now` is passed in.

Three checks, in this order:

1. **Clock skew.** A frame whose timestamp is more than `max_skew_s` away from our clock is refused with
   `ClockSkew` (never blamed on the sender: either clock may be wrong). This also bounds how long the seen-set must
   remember a frame: once `now - timestamp > max_skew_s`, a replay of it fails this check anyway.
2. **Step window.** If the receiver knows the current step or version (a syncer knows its version), a frame's step
   must lie in `[current - window_steps, current + max_ahead_steps]`. Otherwise the window slides per channel
   (sender, kind, stage, direction) on the highest step accepted so far, RFC 6479-style: any step above it is
   accepted and moves the window, steps below `highest - window_steps` are stale.
3. **Seen-set.** The exact frame id (kind, stage, direction, microbatch, step, nonce) of each sender is remembered
   until its timestamp leaves the skew window. Each sender's set is capped; when it is full, the oldest entry is
   dropped and its timestamp becomes that sender's floor (anything at or below it is refused as stale), so eviction
   can never re-open a replay.

The sender table is bounded too. Identities cost nothing, so a Sybil flood (one signed frame from each of many
fresh identities) must not lock new honest senders out: when the table is full of live senders, the least
recently active *newcomer* (fewer than `established_frames` accepted frames) is evicted, an established sender
only when no newcomer is left. An evicted sender's newest timestamp raises a table-wide floor: a frame from a sender
the table does not hold is refused as stale at or below it, so an eviction never re-opens a replay either (an
honest newcomer whose frame predates the floor is refused once, as stale, and its next frame passes).

`check` does not change state and `record` commits, so a receiver records a frame only after every later check
(byte count, digest, tensor policy) has passed. Not thread-safe: use it from one thread (the node's event loop).
"""

from __future__ import annotations

import heapq
import logging
import math
from dataclasses import dataclass, field

from protocol.errors import ClockSkew, ProtocolError, ReplayedFrame, StaleFrame

logger = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True, slots=True)
class ReplayConfig:
    window_steps: int = 64  # how far behind the current/highest step a frame may be
    max_ahead_steps: int = 1  # how far past a receiver-supplied current step a frame may be
    max_skew_s: float = 60.0  # |frame timestamp - our clock| allowed
    max_seen_per_sender: int = 4096  # remembered frame ids per sender
    max_senders: int = 4096  # senders tracked at once
    max_channels_per_sender: int = 64  # (kind, stage, direction) step windows per sender
    # a full sender table evicts a newcomer (else refuses new senders: the behaviour a Sybil flood defeats)
    evict_when_full: bool = True
    established_frames: int = 8  # accepted frames after which a sender is evicted only after every newcomer

    def __post_init__(self) -> None:
        if self.window_steps < 0 or self.max_ahead_steps < 0:
            raise ValueError("window_steps and max_ahead_steps must be >= 0")
        if not (math.isfinite(self.max_skew_s) and self.max_skew_s > 0):
            raise ValueError(f"max_skew_s must be a positive number, got {self.max_skew_s}")
        if min(self.max_seen_per_sender, self.max_senders, self.max_channels_per_sender) <= 0:
            raise ValueError("max_seen_per_sender, max_senders and max_channels_per_sender must be positive")
        if self.established_frames < 1:
            raise ValueError("established_frames must be >= 1")


@dataclass(frozen=True, slots=True)
class FrameId:
    """What identifies one signed frame for replay purposes (all of it is covered by the signature)."""

    sender: str
    kind: str
    stage: int
    direction: str
    microbatch: int
    step: int
    nonce: bytes
    timestamp: float

    @property
    def channel(self) -> tuple[str, int, str]:
        return (self.kind, self.stage, self.direction)

    @property
    def key(self) -> tuple[str, int, str, int, int, bytes]:
        return (self.kind, self.stage, self.direction, self.microbatch, self.step, self.nonce)


@dataclass(slots=True)
class _SenderState:
    seen: dict[tuple[str, int, str, int, int, bytes], float] = field(default_factory=dict)
    by_time: list[tuple[float, tuple[str, int, str, int, int, bytes]]] = field(default_factory=list)
    floor_ts: float = -math.inf  # entries at or below were evicted before they expired
    highest_step: dict[tuple[str, int, str], int] = field(default_factory=dict)
    newest_ts: float = -math.inf  # the newest timestamp accepted from it
    last_active: float = -math.inf  # our clock when it last had a frame accepted
    accepted: int = 0

    def expire(self, now: float, max_skew_s: float) -> None:
        while self.by_time and now - self.by_time[0][0] > max_skew_s:
            _, key = heapq.heappop(self.by_time)
            del self.seen[key]

    def evict_oldest(self) -> None:
        ts, key = heapq.heappop(self.by_time)
        del self.seen[key]
        self.floor_ts = max(self.floor_ts, ts)

    def is_idle(self, now: float, max_skew_s: float) -> bool:
        """Nothing left to remember: every frame it sent is too old to pass the skew check again."""
        self.expire(now, max_skew_s)
        return not self.seen and now - self.floor_ts > max_skew_s


class ReplayGuard:
    """Per-sender replay state; see the module docstring for the rules."""

    def __init__(self, config: ReplayConfig | None = None) -> None:
        self.config = config or ReplayConfig()
        self._senders: dict[str, _SenderState] = {}
        self._latest_now = -math.inf
        self._evicted_floor = -math.inf  # newest timestamp of any evicted sender
        self.num_evicted = 0

    @property
    def num_seen(self) -> int:
        """Frame ids currently remembered (all senders)."""
        return sum(len(state.seen) for state in self._senders.values())

    @property
    def num_senders(self) -> int:
        return len(self._senders)

    def _clock(self, now: float) -> float:
        # A wall clock stepped backwards must not revive frames whose seen-set entries have already expired.
        self._latest_now = max(self._latest_now, now)
        return self._latest_now

    def check(self, frame: FrameId, *, now: float, current_step: int | None = None) -> None:
        """Raise the ProtocolError that refuses `frame`, or return if it is fresh. Changes no state.

        Raises:
            ClockSkew: the timestamp is too far from `now` (blame_sender False).
            StaleFrame: the step is outside the window, or the frame predates an evicted entry.
            ReplayedFrame: this exact frame id was accepted before.
        """
        now = self._clock(now)
        cfg = self.config
        if not abs(frame.timestamp - now) <= cfg.max_skew_s:  # also refuses NaN
            raise ClockSkew(
                f"frame timestamp is {frame.timestamp - now:+.1f} s from our clock (limit {cfg.max_skew_s} s)"
            )
        state = self._senders.get(frame.sender)
        self._check_step(frame, state, current_step)
        if state is None:
            if frame.timestamp <= self._evicted_floor:
                raise StaleFrame(  # the floor is others' doing: never strike the sender for it
                    "frame is older than the replay history of evicted senders", blame_sender=False
                )
            return
        state.expire(now, cfg.max_skew_s)
        if frame.key in state.seen:
            raise ReplayedFrame(
                f"frame {frame.kind} step {frame.step} mb {frame.microbatch} was already accepted"
            )
        if frame.timestamp <= state.floor_ts:
            raise StaleFrame("frame is older than this sender's evicted replay history")

    def _check_step(self, frame: FrameId, state: _SenderState | None, current_step: int | None) -> None:
        cfg = self.config
        if current_step is not None:
            low, high = current_step - cfg.window_steps, current_step + cfg.max_ahead_steps
            if not low <= frame.step <= high:
                raise StaleFrame(f"step {frame.step} outside [{low}, {high}]")
            return
        highest = None if state is None else state.highest_step.get(frame.channel)
        if highest is not None and frame.step < highest - cfg.window_steps:
            raise StaleFrame(f"step {frame.step} is more than {cfg.window_steps} behind {highest}")

    def record(self, frame: FrameId, *, now: float) -> None:
        """Remember an accepted frame (call after `check` and every later check passed).

        Raises:
            ProtocolError: the sender table is full of live senders (reason "replay table full", not blamed).
        """
        now = self._clock(now)
        cfg = self.config
        state = self._senders.get(frame.sender)
        if state is None:
            state = self._admit_sender(frame.sender, now)
        state.expire(now, cfg.max_skew_s)
        while len(state.seen) >= cfg.max_seen_per_sender:
            state.evict_oldest()
        state.seen[frame.key] = frame.timestamp
        heapq.heappush(state.by_time, (frame.timestamp, frame.key))
        state.newest_ts = max(state.newest_ts, frame.timestamp)
        state.last_active = now
        state.accepted += 1
        channel = frame.channel
        if channel in state.highest_step or len(state.highest_step) < cfg.max_channels_per_sender:
            state.highest_step[channel] = max(frame.step, state.highest_step.get(channel, frame.step))

    def admit(self, frame: FrameId, *, now: float, current_step: int | None = None) -> None:
        """`check` then `record`."""
        self.check(frame, now=now, current_step=current_step)
        self.record(frame, now=now)

    def _admit_sender(self, sender: str, now: float) -> _SenderState:
        if len(self._senders) >= self.config.max_senders:
            self.forget_idle(now)
        if len(self._senders) >= self.config.max_senders and self.config.evict_when_full:
            self._evict_one(now)
        if len(self._senders) >= self.config.max_senders:
            raise ProtocolError(
                f"replay table holds {len(self._senders)} live senders",
                reason="replay table full",
                blame_sender=False,
            )
        state = self._senders[sender] = _SenderState()
        return state

    def _evict_one(self, now: float) -> None:
        """Drop the least recently active newcomer (else sender); its newest timestamp, capped at our clock,
        raises the floor (uncapped, one future-dated Sybil frame would refuse every newcomer for max_skew_s; the
        cost is that a replay of an evicted sender's frames dated past our clock, by its clock's lead, passes)."""
        established = self.config.established_frames
        victim = min(
            self._senders,
            key=lambda s: (self._senders[s].accepted >= established, self._senders[s].last_active),
        )
        state = self._senders.pop(victim)
        self._evicted_floor = max(self._evicted_floor, min(max(state.newest_ts, state.floor_ts), now))
        self.num_evicted += 1
        logger.debug("replay table full: evicted sender %s (%d frames)", victim[:16], state.accepted)

    def forget_idle(self, now: float) -> int:
        """Drop senders with nothing left to remember; return how many were dropped."""
        now = self._clock(now)
        idle = [s for s, state in self._senders.items() if state.is_idle(now, self.config.max_skew_s)]
        for sender in idle:
            del self._senders[sender]
        return len(idle)
