"""Bytes in flight counted chunk by chunk (`protocol.limits.FrameReservation`, `PeerLimiter.admit_bytes`), on a fake
clock, and the receive buffer that grows with the chunks (`protocol.rpc.Reassembler`): what a peer holds is what it
sent, never what it declared; a chunk past a cap or past the declared size is refused and reserves nothing."""

from __future__ import annotations

import math
import struct

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from node.diloco.fragments import plan_fragments
from node.diloco.sync_client import fragment_limits, offer_limits
from node.roles.syncer import SyncerConfig
from node.roles.syncer_rpc import fragment_server_limits
from protocol import limits
from protocol.envelope import max_frame_bytes
from protocol.errors import FrameTooLarge, SizeMismatch
from protocol.limits import FrameReservation, LimitsConfig, PeerLimiter, RateLimit, Throttled
from protocol.rpc import Preamble, Reassembler, Route, Status

MiB = 1 << 20
FAST = RateLimit(rate_per_s=1e6, burst=1e6)


def _limiter(per_peer: int = 100, total: int = 150) -> PeerLimiter:
    return PeerLimiter(
        LimitsConfig(
            default_rate=FAST,
            global_rate=None,
            max_bytes_in_flight_per_peer=per_peer,
            max_bytes_in_flight_total=total,
        )
    )


def test_a_frame_holds_the_bytes_of_the_chunks_that_arrived_and_gives_all_back() -> None:
    limiter = _limiter()
    with limiter.frame("a", 90, now=0.0) as held:
        assert limiter.stats().bytes_in_flight == 0  # admitted, nothing reserved yet
        for i in range(3):
            assert held.take(30, now=float(i))
            assert limiter.stats().peers["a"].bytes_in_flight == held.held_bytes == 30 * (i + 1)
        assert held.num_chunks == 3
    assert limiter.stats().bytes_in_flight == 0
    assert limiter.stats().peak_bytes_in_flight == 90  # the peak stays after the release
    assert limiter.stats().peers["a"].peak_bytes_in_flight == 90
    held.release()  # idempotent
    assert limiter.stats().bytes_in_flight == 0


def test_a_frame_is_released_when_its_handler_fails() -> None:
    limiter = _limiter()
    with pytest.raises(RuntimeError), limiter.frame("a", 50, now=0.0) as held:
        assert held.take(50, now=0.0)
        raise RuntimeError("handler failed")
    assert limiter.stats().bytes_in_flight == 0


def test_a_chunk_past_the_per_peer_cap_is_refused_and_reserves_nothing() -> None:
    limiter = _limiter(per_peer=100, total=1000)
    first = FrameReservation(limiter, "a", 80)
    second = FrameReservation(limiter, "a", 80)
    assert first.take(60, now=0.0)
    assert second.take(30, now=0.0)
    refused = second.take(30, now=0.0)  # 60 + 30 + 30 > 100
    assert not refused and refused.reason == limits.BYTES_IN_FLIGHT
    assert second.held_bytes == 30 and limiter.stats().peers["a"].bytes_in_flight == 90
    assert limiter.stats().peers["a"].throttled_by_reason == {limits.BYTES_IN_FLIGHT: 1}


def test_a_chunk_past_the_total_cap_is_refused_whoever_holds_the_rest() -> None:
    limiter = _limiter(per_peer=100, total=150)
    a, b = FrameReservation(limiter, "a", 100), FrameReservation(limiter, "b", 100)
    assert a.take(100, now=0.0)
    assert b.take(50, now=0.0)
    refused = b.take(1, now=0.0)
    assert not refused and refused.reason == limits.GLOBAL_BYTES_IN_FLIGHT
    assert limiter.stats().bytes_in_flight == 150
    a.release()
    assert b.take(50, now=1.0), "room again once the other frame was consumed"


def test_a_chunk_past_the_declared_size_is_the_senders_fault_and_reserves_nothing() -> None:
    limiter = _limiter()
    held = FrameReservation(limiter, "a", 50)
    assert held.take(40, now=0.0)
    with pytest.raises(FrameTooLarge) as caught:
        held.take(11, now=0.0)
    assert caught.value.reason == "more than declared" and caught.value.blame_sender
    assert held.held_bytes == 40 and limiter.stats().bytes_in_flight == 40


def test_admission_refuses_for_good_a_frame_over_a_cap_alone_and_for_now_one_that_does_not_fit() -> None:
    limiter = _limiter(per_peer=100, total=150)
    never = limiter.admit_bytes("a", 101, now=0.0)
    assert not never and never.reason == limits.BYTES_IN_FLIGHT and never.retry_after_s == math.inf
    assert limiter.admit_bytes("a", 100, now=0.0)
    held = FrameReservation(limiter, "b", 100)
    assert held.take(100, now=0.0)
    later = limiter.admit_bytes("a", 60, now=0.0)  # 100 + 60 > 150: would be cut midway, so not started
    assert not later and later.reason == limits.GLOBAL_BYTES_IN_FLIGHT and later.retry_after_s == 0
    assert limiter.admit_bytes("a", 50, now=0.0)
    with pytest.raises(Throttled) as caught, limiter.frame("a", 60, now=0.0):
        pass
    assert caught.value.admission.reason == limits.GLOBAL_BYTES_IN_FLIGHT
    assert limiter.stats().bytes_in_flight == 100, "admission reserves nothing"


def test_peers_that_declare_big_frames_and_stall_hold_nothing_but_did_when_the_declared_size_was_reserved() -> (
    None
):
    """The stall attack: Sybils declare the largest frame and send nothing. Counted per chunk they hold no budget
    and an honest frame passes; the negative control reserves the declared size up front (the old accounting) and
    the same two Sybils lock the honest peer out."""
    cap = 100
    chunked = _limiter(per_peer=cap, total=2 * cap)
    stalled = [FrameReservation(chunked, f"sybil{i}", cap) for i in range(2)]
    assert all(chunked.admit_bytes(r.peer, cap, now=0.0) for r in stalled)
    honest = FrameReservation(chunked, "honest", cap)
    assert all(honest.take(10, now=0.0) for _ in range(10))
    assert chunked.stats().bytes_in_flight == cap

    whole = _limiter(per_peer=cap, total=2 * cap)  # control: reserve what each one declared
    assert all(whole.reserve_bytes(f"sybil{i}", cap, now=0.0) for i in range(2))
    locked_out = whole.reserve_bytes("honest", cap, now=0.0)
    assert not locked_out and locked_out.reason == limits.GLOBAL_BYTES_IN_FLIGHT


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.tuples(st.integers(0, 3), st.integers(1, 40), st.booleans()),  # (frame, chunk, consume it after)
        min_size=1,
        max_size=80,
    )
)
def test_whatever_the_interleaving_held_bytes_never_pass_the_caps(steps: list[tuple[int, int, bool]]) -> None:
    per_peer, total = 100, 150
    limiter = _limiter(per_peer=per_peer, total=total)
    frames = {
        i: FrameReservation(limiter, f"peer{i % 3}", 120) for i in range(4)
    }  # peer0 sends frames 0 and 3
    for frame, chunk, consume in steps:
        held = frames[frame]
        before = held.held_bytes
        try:
            ok = bool(held.take(chunk, now=0.0))
        except FrameTooLarge:
            ok = False
            assert before + chunk > held.declared_bytes
        assert held.held_bytes == before + (chunk if ok else 0)
        stats = limiter.stats()
        assert stats.bytes_in_flight == sum(f.held_bytes for f in frames.values()) <= total
        assert all(p.bytes_in_flight <= per_peer for p in stats.peers.values())
        if consume or not ok:  # a refused frame is dropped whole, a consumed one gives its bytes back
            held.release()
            frames[frame] = FrameReservation(limiter, held.peer, 120)
    for held in frames.values():
        held.release()
    assert limiter.stats().bytes_in_flight == 0
    assert limiter.stats().peak_bytes_in_flight <= total


# ------------------------------------------------------------------------------------------------ receive buffer


def _feed(parts: Reassembler, data: bytes, chunk: int) -> list[int]:
    """Feed `data` in `chunk`-byte chunks; the buffer's size after each."""
    sizes = []
    for start in range(0, len(data), chunk):
        piece = data[start : start + chunk]
        parts.add(piece[: parts.next_chunk_length(struct.pack(">I", len(piece)))])
        sizes.append(parts.buffered_bytes)
    return sizes


def test_the_receive_buffer_grows_with_the_chunks_not_with_the_declared_size() -> None:
    data = bytes(range(256)) * 64  # 16 KiB in 1 KiB chunks
    parts = Reassembler(Preamble(Status.REQUEST, len(data), 16), max_chunk_bytes=1024)
    assert parts.buffered_bytes == 0
    assert _feed(parts, data, 1024) == [1024 * (i + 1) for i in range(16)]
    assert bytes(parts.finish()) == data


def test_a_head_sent_last_gets_its_place_up_front_and_the_payload_grows_behind_it() -> None:
    head, payload = b"H" * 100, bytes(range(256)) * 4
    parts = Reassembler(
        Preamble(Status.REQUEST, len(head) + len(payload), 12, head_bytes=len(head)), max_chunk_bytes=100
    )
    assert parts.buffered_bytes == len(head)
    sizes = _feed(parts, payload + head, 100)
    assert sizes[0] == len(head) + 100 and sizes[-1] == len(head) + len(payload)
    assert bytes(parts.finish()) == head + payload


def test_a_truncated_body_is_refused_at_finish() -> None:
    parts = Reassembler(Preamble(Status.REQUEST, 3000, 3), max_chunk_bytes=1024)
    _feed(parts, b"x" * 2048, 1024)
    with pytest.raises(SizeMismatch):
        parts.finish()


# ------------------------------------------------------------------------------------------------ the syncer's caps


async def _noop(frame: bytearray, remote: str) -> None:
    return None


@pytest.mark.parametrize("fragments", [1, 2, 3])
def test_the_syncer_holds_at_most_the_configured_number_of_largest_requests(fragments: int) -> None:
    big = 256 * MiB  # the largest fragment frame of llama-1b at P = 16
    caps = fragment_server_limits(
        {"push": Route(_noop, big), "ctl": Route(_noop, 4096)},
        fragment_frame_bytes=big,
        max_fragments_in_flight=fragments,
    )
    assert caps.max_bytes_in_flight_per_peer == big
    assert caps.max_bytes_in_flight_total == fragments * big


def test_an_offer_carries_one_version_so_it_never_lifts_the_cap_past_two_fragments() -> None:
    """17 fragments of 64 MiB (llama-1b-like at P = 16): an offer is one version per request, about one fragment's
    frame, so the total cap stays ~2 fragments (an offer of every version at once had set it at ~17)."""
    sizes = {f"layer{i}.weight": 16 * MiB for i in range(16)} | {"embed.weight": 16 * MiB}
    plan = plan_fragments(sizes, 16, ["embed.weight"])
    assert plan.num_fragments == 17
    frame = max_frame_bytes(fragment_limits(plan))
    offer = max_frame_bytes(offer_limits(plan))
    assert offer_limits(plan).max_tensors == 1 and frame < offer < frame + MiB
    caps = fragment_server_limits(
        {"push": Route(_noop, frame), "offer": Route(_noop, offer)}, fragment_frame_bytes=frame
    )
    assert caps.max_bytes_in_flight_per_peer == offer
    assert caps.max_bytes_in_flight_total == 2 * frame < 3 * 64 * MiB


def test_small_fragments_keep_the_default_room() -> None:
    caps = fragment_server_limits(
        {"push": Route(_noop, MiB)}, fragment_frame_bytes=MiB, max_fragments_in_flight=2
    )
    default = LimitsConfig()
    assert caps.max_bytes_in_flight_per_peer == default.max_bytes_in_flight_per_peer == 64 * MiB
    assert caps.max_bytes_in_flight_total == 64 * MiB


def test_max_fragments_in_flight_must_be_at_least_one() -> None:
    with pytest.raises(ValueError):
        fragment_server_limits(
            {"push": Route(_noop, MiB)}, fragment_frame_bytes=MiB, max_fragments_in_flight=0
        )
    with pytest.raises(ValueError, match="max_fragments_in_flight"):
        SyncerConfig(max_fragments_in_flight=0)
    assert SyncerConfig().max_fragments_in_flight == 2


# ------------------------------------------------------------------------------------------------ the learner's side


def test_a_push_refused_for_load_is_retried_unless_it_can_never_pass() -> None:
    """A chunk that arrived while other peers' requests held the syncer's bytes is refused midway; the learner keeps
    the contribution and sends it again (before, any `throttled: ...` dropped it). A request over the caps alone
    (`retry_after_s` inf) is final, as are refusals about the contribution itself."""
    from node.diloco.sync_client import is_retryable
    from protocol.errors import RemoteRefused
    from protocol.rpc import PeerThrottled

    def throttled(limit: str, retry_after_s: float) -> PeerThrottled:
        return PeerThrottled("x", reason=f"throttled: {limit}", limit=limit, retry_after_s=retry_after_s)

    assert is_retryable(throttled(limits.GLOBAL_BYTES_IN_FLIGHT, 0.0))
    assert is_retryable(throttled(limits.RATE, 0.5))
    assert not is_retryable(throttled(limits.BYTES_IN_FLIGHT, math.inf))
    assert is_retryable(RemoteRefused("x", reason="busy"))
    assert not is_retryable(RemoteRefused("x", reason="stale base"))
