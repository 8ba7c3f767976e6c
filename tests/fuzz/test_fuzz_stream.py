"""Fuzz the stream reassembler (reliability.md §7, F4): whatever bytes a peer streams, `read_message` returns the
exact message that was framed or raises a ProtocolError; it never holds more than the cap, and never reads a chunk
that would pass the declared total. Also the pure bookkeeping of the stream layer (strikes, blame)."""

from __future__ import annotations

import asyncio
import struct

from hypothesis import given, settings
from hypothesis import strategies as st

from protocol.errors import ClockSkew, MalformedFrame, ProtocolError, SignerMismatch, StreamClosed
from protocol.rpc import (
    PeerStrikes,
    Preamble,
    Reassembler,
    Status,
    StreamConfig,
    blames_remote,
    encode_preamble,
    parse_preamble,
    read_message,
)

CAP = 4096
CONFIG = StreamConfig(max_chunk_bytes=512, chunk_timeout_s=1.0)
REQUEST = frozenset({Status.REQUEST})


async def _read(stream: bytes) -> tuple[Status, bytearray]:
    reader = asyncio.StreamReader()
    reader.feed_data(stream)
    reader.feed_eof()  # a truncated stream ends instead of stalling for the timeout
    return await read_message(reader, max_bytes=CAP, config=CONFIG, statuses=REQUEST)


def frame_message(body: bytes, chunk_bytes: int) -> bytes:
    out = bytearray(encode_preamble(Status.REQUEST, len(body), chunk_bytes))
    for offset in range(0, len(body), chunk_bytes):
        part = body[offset : offset + chunk_bytes]
        out += struct.pack(">I", len(part)) + part
    return bytes(out)


@settings(max_examples=300, deadline=None)
@given(body=st.binary(max_size=CAP), chunk_bytes=st.integers(1, CONFIG.max_chunk_bytes))
def test_framed_messages_roundtrip(body: bytes, chunk_bytes: int) -> None:
    status, got = asyncio.run(_read(frame_message(body, chunk_bytes)))
    assert status == Status.REQUEST and bytes(got) == body


@settings(max_examples=400, deadline=None)
@given(
    total=st.integers(0, CAP + 8),
    num_chunks=st.integers(0, 16),
    status=st.integers(0, 3),
    tail=st.binary(max_size=3000),
    framed=st.booleans(),
)
def test_random_streams_only_raise_protocol_errors(
    total: int, num_chunks: int, status: int, tail: bytes, framed: bool
) -> None:
    """Random bytes, half of the time behind a plausible preamble so that the chunk loop is reached."""
    head = struct.pack(">4sBBHQI", b"HVNF", 1, status, 0, total, num_chunks) if framed else b""
    try:
        _, got = asyncio.run(_read(head + tail))
    except ProtocolError:
        return
    assert framed and len(got) == total <= CAP


@settings(max_examples=400, deadline=None)
@given(
    body=st.binary(min_size=1, max_size=2000),
    chunk_bytes=st.integers(1, 512),
    pos=st.integers(0, 1 << 16),
    value=st.integers(0, 255),
    cut=st.one_of(st.none(), st.integers(0, 1 << 16)),
)
def test_mutated_streams_give_the_message_or_a_protocol_error(
    body: bytes, chunk_bytes: int, pos: int, value: int, cut: int | None
) -> None:
    stream = bytearray(frame_message(body, chunk_bytes))
    stream[pos % len(stream)] = value
    if cut is not None:
        stream = stream[: cut % (len(stream) + 1)]
    try:
        _, got = asyncio.run(_read(bytes(stream)))
    except ProtocolError:
        return
    # A mutation inside a chunk body changes the body, one in the framing must be caught: the output is always
    # exactly as long as declared and never longer than the cap.
    assert len(got) <= CAP
    declared = struct.unpack(">Q", bytes(stream[8:16]))[0]
    assert len(got) == declared


@settings(max_examples=400, deadline=None)
@given(
    total=st.integers(0, 1 << 40),
    num_chunks=st.integers(0, (1 << 32) - 1),
    lengths=st.lists(st.integers(0, 1 << 20), max_size=20),
)
def test_reassembler_never_passes_what_was_declared(total: int, num_chunks: int, lengths: list[int]) -> None:
    raw = struct.pack(">4sBBHQI", b"HVNF", 1, Status.REQUEST, 0, min(total, (1 << 64) - 1), num_chunks)
    try:
        preamble: Preamble = parse_preamble(raw, max_bytes=CAP, max_chunk_bytes=512, statuses=REQUEST)
    except ProtocolError:
        return
    assert preamble.total_bytes <= CAP and preamble.num_chunks <= max(preamble.total_bytes, 0)
    parts = Reassembler(preamble, max_chunk_bytes=512)
    for length in lengths:
        try:
            n = parts.next_chunk_length(struct.pack(">I", length))
        except ProtocolError:
            break
        parts.add(b"\0" * n)
        assert parts.received_bytes <= preamble.total_bytes
        assert parts.received_chunks <= preamble.num_chunks


@settings(max_examples=200, deadline=None)
@given(
    events=st.lists(
        st.tuples(st.sampled_from("abcdef"), st.sampled_from(["malformed", "replay"])), max_size=60
    )
)
def test_peer_strikes_count_exactly_and_stay_bounded(events: list[tuple[str, str]]) -> None:
    strikes = PeerStrikes(max_peers=4)
    for peer, reason in events:
        strikes.record(peer, reason)
    snapshot = strikes.snapshot()
    assert len(snapshot) <= 4
    for peer, counts in snapshot.items():  # a remembered peer keeps every strike since it was last forgotten
        assert strikes.count(peer) == sum(counts.values())
        assert strikes.count(peer, "replay") == counts.get("replay", 0)
    last = [peer for peer, _ in reversed(events)]
    recent = list(dict.fromkeys(last))[:4]  # the four most recently struck peers are the ones kept
    assert set(snapshot) == set(recent)


def test_blame_rules() -> None:
    assert blames_remote(MalformedFrame("x")) and blames_remote(SignerMismatch("relayed"))
    assert not blames_remote(ClockSkew("x")) and not blames_remote(StreamClosed("x"))
