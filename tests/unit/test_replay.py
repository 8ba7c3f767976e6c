"""Replay guard: clock skew, step windows, seen-set expiry and eviction, checked with a fake clock."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from protocol.errors import ClockSkew, ProtocolError, ReplayedFrame, StaleFrame
from protocol.replay import FrameId, ReplayConfig, ReplayGuard

T0 = 1_700_000_000.0


def frame(
    sender: str = "alice", *, step: int = 10, microbatch: int = 0, nonce: int = 0, ts: float = T0
) -> FrameId:
    return FrameId(
        sender=sender,
        kind="activation",
        stage=1,
        direction="forward",
        microbatch=microbatch,
        step=step,
        nonce=nonce.to_bytes(16, "big"),
        timestamp=ts,
    )


def test_exact_replay_refused_other_nonce_accepted() -> None:
    guard = ReplayGuard()
    guard.admit(frame(), now=T0)
    with pytest.raises(ReplayedFrame):
        guard.admit(frame(), now=T0 + 1)
    guard.admit(frame(nonce=1), now=T0 + 1)
    guard.admit(frame("bob"), now=T0 + 1)  # another sender's identical ids are its own


def test_check_does_not_record() -> None:
    guard = ReplayGuard()
    guard.check(frame(), now=T0)
    guard.check(frame(), now=T0)
    assert guard.num_seen == 0
    guard.record(frame(), now=T0)
    assert guard.num_seen == 1


@pytest.mark.parametrize("offset_s", [30.0, -30.0, 60.0, -60.0])
def test_offsets_within_skew_accepted(offset_s: float) -> None:
    ReplayGuard().admit(frame(ts=T0 + offset_s), now=T0)


@pytest.mark.parametrize("offset_s", [300.0, -300.0, 60.001, float("nan"), float("inf")])
def test_offsets_beyond_skew_refused_as_clock_skew_and_not_blamed(offset_s: float) -> None:
    with pytest.raises(ClockSkew) as err:
        ReplayGuard().admit(frame(ts=T0 + offset_s), now=T0)
    assert err.value.reason == "clock skew" and err.value.blame_sender is False


def test_replay_after_its_seen_entry_expired_fails_the_skew_check() -> None:
    guard = ReplayGuard(ReplayConfig(max_skew_s=60))
    guard.admit(frame(), now=T0)
    guard.admit(frame(nonce=1, ts=T0 + 61), now=T0 + 61)  # expires the first entry
    assert guard.num_seen == 1
    with pytest.raises(ClockSkew):
        guard.admit(frame(), now=T0 + 61)


def test_a_clock_stepped_backwards_does_not_revive_expired_frames() -> None:
    guard = ReplayGuard(ReplayConfig(max_skew_s=60))
    guard.admit(frame(), now=T0)
    guard.forget_idle(T0 + 100)
    assert guard.num_senders == 0
    with pytest.raises(ClockSkew):
        guard.admit(frame(), now=T0 + 30)  # treated as T0 + 100


def test_sliding_window_per_channel() -> None:
    guard = ReplayGuard(ReplayConfig(window_steps=4))
    guard.admit(frame(step=100), now=T0)
    guard.admit(frame(step=96, nonce=1), now=T0)  # at the edge of the window
    with pytest.raises(StaleFrame):
        guard.admit(frame(step=95, nonce=2), now=T0)
    guard.admit(frame(step=1000, nonce=3), now=T0)  # forward jumps move the window (RFC 6479 style)
    with pytest.raises(StaleFrame):
        guard.admit(frame(step=990, nonce=4), now=T0)
    other_stage = dataclasses.replace(frame(step=5, nonce=5), stage=2)
    guard.admit(other_stage, now=T0)  # each (kind, stage, direction) slides on its own


def test_receiver_supplied_current_step_bounds_both_sides() -> None:
    guard = ReplayGuard(ReplayConfig(window_steps=2, max_ahead_steps=1))
    for step in (8, 10, 11):
        guard.admit(frame(step=step, nonce=step), now=T0, current_step=10)
    for step in (7, 12):
        with pytest.raises(StaleFrame):
            guard.admit(frame(step=step, nonce=step), now=T0, current_step=10)


def test_full_seen_set_evicts_oldest_and_raises_the_floor() -> None:
    guard = ReplayGuard(ReplayConfig(max_seen_per_sender=3))
    for i in range(3):
        guard.admit(frame(nonce=i, ts=T0 + i), now=T0 + 3)
    guard.admit(frame(nonce=3, ts=T0 + 3), now=T0 + 3)  # evicts nonce 0 (ts T0)
    assert guard.num_seen == 3
    with pytest.raises(StaleFrame):  # its replay is refused by the floor, not let through
        guard.admit(frame(nonce=0, ts=T0), now=T0 + 3)
    with pytest.raises(ReplayedFrame):
        guard.admit(frame(nonce=1, ts=T0 + 1), now=T0 + 3)


def test_without_eviction_a_full_table_refuses_new_senders_until_old_ones_go_idle() -> None:
    guard = ReplayGuard(ReplayConfig(max_senders=2, max_skew_s=60, evict_when_full=False))
    guard.admit(frame("a"), now=T0)
    guard.admit(frame("b"), now=T0)
    with pytest.raises(ProtocolError) as err:
        guard.admit(frame("c"), now=T0)
    assert err.value.reason == "replay table full" and err.value.blame_sender is False
    guard.admit(frame("c", ts=T0 + 61), now=T0 + 61)  # a and b have nothing left to remember
    assert guard.num_senders == 1


@pytest.mark.parametrize(
    "kwargs", [{"window_steps": -1}, {"max_skew_s": 0}, {"max_skew_s": float("nan")}, {"max_senders": 0}]
)
def test_config_validates(kwargs: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        ReplayConfig(**kwargs)  # type: ignore[arg-type]


class ReplayMachine(RuleBasedStateMachine):
    """Invariants: no frame id is ever admitted twice; an honest sender (fresh nonce, its own clock within the skew,
    steps that never go back more than the window) is never refused while the tables have room."""

    @initialize()
    def setup(self) -> None:
        self.config = ReplayConfig(window_steps=8, max_skew_s=60, max_seen_per_sender=64)
        self.guard = ReplayGuard(self.config)
        self.now = T0
        self.admitted: list[FrameId] = []
        self.next_nonce = 0
        self.highest: dict[str, int] = {}

    @rule(
        sender=st.sampled_from(["a", "b", "c"]),
        ahead=st.integers(0, 3),
        back=st.integers(0, 8),
        clock_offset=st.floats(-59, 59),
    )
    def honest_send(self, sender: str, ahead: int, back: int, clock_offset: float) -> None:
        step = max(0, self.highest.get(sender, 0) + ahead - back)
        self.next_nonce += 1
        fid = frame(sender, step=step, nonce=self.next_nonce, ts=self.now + clock_offset)
        self.guard.admit(fid, now=self.now)  # must not raise
        self.highest[sender] = max(self.highest.get(sender, 0), step)
        self.admitted.append(fid)

    @precondition(lambda self: self.admitted)
    @rule(index=st.integers(0, 10_000))
    def replay(self, index: int) -> None:
        # An exact copy: every field is under the signature, so a replayer cannot refresh the timestamp.
        with pytest.raises(ProtocolError):
            self.guard.admit(self.admitted[index % len(self.admitted)], now=self.now)

    @rule(dt=st.floats(0, 90))
    def advance_clock(self, dt: float) -> None:
        self.now += dt

    @invariant()
    def bounded(self) -> None:
        assert self.guard.num_senders <= self.config.max_senders
        assert self.guard.num_seen <= self.config.max_seen_per_sender * 3


ReplayMachine.TestCase.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)
test_replay_state_machine = ReplayMachine.TestCase


def test_a_sybil_flood_cannot_lock_new_senders_out_of_a_full_table() -> None:
    cfg = ReplayConfig(max_senders=4, max_skew_s=60, established_frames=3)
    flood = [frame(f"sybil{i}", ts=T0 + 0.1 * i, nonce=i) for i in range(40)]
    # negative control: without eviction, one frame from each of a few fresh identities refuses everyone new
    closed = ReplayGuard(dataclasses.replace(cfg, evict_when_full=False))
    for f in flood[:4]:
        closed.admit(f, now=T0 + 5)
    with pytest.raises(ProtocolError, match="live senders"):
        closed.admit(frame("honest", ts=T0 + 5), now=T0 + 5)

    guard = ReplayGuard(cfg)
    for i in range(3):  # an established peer
        guard.admit(frame("known", nonce=100 + i, ts=T0 + i), now=T0 + i)
    for f in flood:
        guard.admit(f, now=T0 + 5)
    guard.admit(frame("honest", ts=T0 + 6, nonce=7), now=T0 + 6)  # a newcomer after the flood gets in
    assert guard.num_senders == 4 and guard.num_evicted == 38
    with pytest.raises(ReplayedFrame):  # the established peer was never evicted: its history holds
        guard.admit(frame("known", nonce=101, ts=T0 + 1), now=T0 + 6)
    for f in flood[:36]:  # an evicted sender's frames stay refused: the floor replaces their history
        with pytest.raises(StaleFrame) as err:
            guard.admit(f, now=T0 + 6)
        assert err.value.blame_sender is False


def test_a_future_dated_flood_raises_the_floor_only_to_our_clock() -> None:
    guard = ReplayGuard(ReplayConfig(max_senders=2, max_skew_s=60))
    for i in range(6):
        guard.admit(frame(f"sybil{i}", ts=T0 + 59, nonce=i), now=T0)  # dated a minute ahead
    guard.admit(frame("honest", ts=T0 + 0.5), now=T0 + 0.5)  # not locked out for a minute
