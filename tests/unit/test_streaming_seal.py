"""Signing while streaming: a `StreamingFrame` goes payload first (hashed piece by piece as it is written) and its
signed head last; the receiver rebuilds the usual frame, and `open_envelope` refuses a tampered piece before any
tensor is built. No sockets: the writer is a buffer and the reader an `asyncio.StreamReader` fed from it."""

from __future__ import annotations

import asyncio
import struct
from typing import Any

import pytest
import torch

from protocol import codec, envelope
from protocol.codec import TensorLimits
from protocol.envelope import Context, Direction, Kind, ReceivedFrame, open_envelope, seal_streaming
from protocol.errors import BadSignature, DigestMismatch, FrameTooLarge, MalformedFrame
from protocol.identity import NodeIdentity
from protocol.replay import ReplayGuard
from protocol.rpc import (
    Preamble,
    Reassembler,
    Status,
    StreamConfig,
    encode_preamble,
    parse_preamble,
    read_message,
    write_message,
)

NOW = 1_700_000_000.0
ALICE, BOB = NodeIdentity.generate(), NodeIdentity.generate()
LIMITS = TensorLimits(max_bytes=1 << 20, max_tensors=4)
CTX = Context(
    run_id="run-1", kind=Kind.ACTIVATION, receiver=BOB.peer_id, stage=1, direction=Direction.FORWARD
)
CHUNK = 1000  # small chunks: many pieces, a tensor boundary inside the payload, and a head of several chunks


class BufferWriter:
    """What `write_message` needs of a StreamWriter; keeps every write."""

    def __init__(self) -> None:
        self.data = bytearray()

    def write(self, data: Any) -> None:
        self.data += bytes(data)

    async def drain(self) -> None:
        pass


def wire_bytes(body: Any, status: Status = Status.REQUEST) -> bytearray:
    writer = BufferWriter()
    asyncio.run(write_message(writer, status, body, config=StreamConfig(max_chunk_bytes=CHUNK)))  # type: ignore[arg-type]
    return writer.data


def read_wire(data: bytes | bytearray) -> ReceivedFrame:
    async def read() -> ReceivedFrame:
        reader = asyncio.StreamReader()
        reader.feed_data(bytes(data))
        reader.feed_eof()
        _, body = await read_message(
            reader,
            max_bytes=1 << 21,
            config=StreamConfig(max_chunk_bytes=CHUNK),
            statuses=frozenset({Status.REQUEST}),
            digest=True,
        )
        return body

    return asyncio.run(read())


def streaming(**tensors: torch.Tensor) -> envelope.StreamingFrame:
    named = tensors or {"": torch.randn(30, 40)}
    return seal_streaming(ALICE, CTX, microbatch=3, step=2, now=NOW, tensors=named, nonce=b"n" * 16)


def receive(frame: bytes | bytearray) -> envelope.Opened:
    return open_envelope(
        frame, remote_peer=ALICE.peer_id, expect=CTX, limits=LIMITS, replay=ReplayGuard(), now=NOW
    )


@pytest.fixture
def passes(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Sizes of every separate digest pass `open_envelope` makes (a streamed frame needs none)."""
    sizes: list[int] = []
    real = envelope.payload_digest
    monkeypatch.setattr(envelope, "payload_digest", lambda parts: sizes.append(len(parts[0])) or real(parts))
    return sizes


def test_the_receiver_rebuilds_the_frame_seal_would_have_made(passes: list[int]) -> None:
    tensors = {"a": torch.randn(30, 40), "b": torch.arange(777, dtype=torch.int64)}
    frame = streaming(**tensors)
    data = wire_bytes(frame)
    (head_bytes,) = struct.unpack_from(">H", data, 6)
    assert head_bytes == frame.head_bytes
    assert bytes(data[24 : 24 + CHUNK]) == bytes(codec.tensor_bytes(tensors["a"])[:CHUNK])  # payload first
    received = read_wire(data)
    assert bytes(received) == bytes(frame.to_bytes())  # Ed25519 is deterministic: the very same frame
    opened = receive(received)
    assert passes == []  # the payload was hashed on the way in, not again
    assert all(torch.equal(opened.tensors[name], t) for name, t in tensors.items())


def test_each_transmission_is_hashed_afresh() -> None:
    frame = streaming()
    assert wire_bytes(frame) == wire_bytes(frame)  # a retry re-sends the same signed frame


def _tamper_payload(data: bytearray) -> bytearray:
    tampered = bytearray(data)
    tampered[20 + 4 + 2 * CHUNK // 3] ^= 0x40  # inside the first chunk of the payload, on the wire
    return tampered


def test_a_tampered_piece_is_refused_before_any_tensor_is_built(monkeypatch: pytest.MonkeyPatch) -> None:
    built: list[str] = []
    real = codec.build_tensor
    monkeypatch.setattr(codec, "build_tensor", lambda dtype, *a: built.append(dtype) or real(dtype, *a))
    data = wire_bytes(streaming())
    with pytest.raises(DigestMismatch):
        receive(read_wire(_tamper_payload(data)))
    assert built == []


def test_negative_control_with_the_digest_check_off_the_tampered_tensor_gets_through(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    tensor = torch.randn(30, 40)
    data = wire_bytes(streaming(t=tensor))
    monkeypatch.setattr(
        envelope,
        "_digest_of",
        lambda frame, payload: (
            envelope._decode_header(bytes(frame[4 : 4 + struct.unpack_from(">I", frame)[0]]), LIMITS).digest
        ),
    )
    opened = receive(read_wire(_tamper_payload(data)))
    assert not torch.equal(opened.tensors["t"], tensor)  # the attack wins without the check


def test_a_tampered_head_fails_the_signature() -> None:
    frame = streaming()
    data = wire_bytes(frame)
    data[-frame.head_bytes + 20] ^= 0x01  # inside the header, which now comes last
    with pytest.raises((BadSignature, MalformedFrame)):
        receive(read_wire(data))


def test_a_head_that_lies_about_its_length_gets_a_digest_of_its_own(passes: list[int]) -> None:
    """A preamble whose head size disagrees with the header length: the streamed digest is not used."""
    frame = streaming()
    data = wire_bytes(frame)
    struct.pack_into(">H", data, 6, frame.head_bytes - 1)
    with pytest.raises((BadSignature, MalformedFrame, DigestMismatch)):
        receive(read_wire(data))


def test_preamble_head_bounds() -> None:
    ok = encode_preamble(Status.REQUEST, 5000, CHUNK, head_bytes=300, num_chunks=6)
    assert (
        parse_preamble(ok, max_bytes=5000, max_chunk_bytes=CHUNK, statuses=frozenset(Status)).head_bytes
        == 300
    )
    too_big = encode_preamble(Status.REQUEST, 200, CHUNK, head_bytes=300)
    with pytest.raises(MalformedFrame):
        parse_preamble(too_big, max_bytes=5000, max_chunk_bytes=CHUNK, statuses=frozenset(Status))
    error_with_head = encode_preamble(Status.ERROR, 20, CHUNK, head_bytes=10)
    with pytest.raises(MalformedFrame):
        parse_preamble(error_with_head, max_bytes=5000, max_chunk_bytes=CHUNK, statuses=frozenset(Status))
    over_cap = encode_preamble(Status.REQUEST, 1 << 30, CHUNK, head_bytes=300)
    with pytest.raises(FrameTooLarge):  # the cap holds before anything is allocated, head or not
        parse_preamble(over_cap, max_bytes=5000, max_chunk_bytes=CHUNK, statuses=frozenset(Status))


@pytest.mark.parametrize("chunk", [1, 7, 333, 4096])
def test_any_chunking_across_the_payload_and_head_boundary_reassembles(chunk: int) -> None:
    """The sender picks the chunking: chunks that straddle the payload/head boundary still land in place."""
    frame = streaming()
    layout = bytes(frame.to_bytes())
    head, payload = layout[: frame.head_bytes], layout[frame.head_bytes :]
    order = payload + head
    num_chunks = -(-len(order) // chunk)
    preamble = Preamble(Status.REQUEST, len(order), num_chunks, head_bytes=len(head))
    parts = Reassembler(preamble, max_chunk_bytes=chunk, digest=True)
    for start in range(0, len(order), chunk):
        piece = order[start : start + chunk]
        parts.add(piece[: parts.next_chunk_length(struct.pack(">I", len(piece)))])
    received = parts.finish()
    assert bytes(received) == layout
    assert (
        received.digester is not None and received.digester.digest(frame.head_bytes, len(layout)) is not None
    )
    receive(received)


def test_a_metadata_only_frame_is_sent_in_order() -> None:
    frame = seal_streaming(ALICE, CTX, microbatch=1, step=1, now=NOW, meta={"loss": 1.5}, nonce=b"m" * 16)
    data = wire_bytes(frame)
    assert struct.unpack_from(">H", data, 6) == (0,)
    assert receive(read_wire(data)).meta["loss"] == 1.5


def test_big_pieces_are_hashed_on_the_hashing_thread_in_order(monkeypatch: pytest.MonkeyPatch) -> None:
    """Pieces from BACKGROUND_HASH_BYTES go to the hashing thread on both ends; the digests still match, and a
    tampered piece is still refused."""
    submitted: list[int] = []
    real = envelope._hashing_thread()
    real_submit = real.submit
    monkeypatch.setattr(
        real, "submit", lambda fn, piece: submitted.append(len(piece)) or real_submit(fn, piece)
    )
    tensor = torch.randn(3 << 18)  # 3 MiB
    frame = seal_streaming(ALICE, CTX, microbatch=3, step=2, now=NOW, tensor=tensor, nonce=b"b" * 16)
    writer = BufferWriter()
    asyncio.run(write_message(writer, Status.REQUEST, frame, config=StreamConfig()))  # type: ignore[arg-type]

    async def read(data: bytes) -> ReceivedFrame:
        reader = asyncio.StreamReader()
        reader.feed_data(data)
        reader.feed_eof()
        return (
            await read_message(
                reader,
                max_bytes=4 << 20,
                config=StreamConfig(),
                statuses=frozenset({Status.REQUEST}),
                digest=True,
            )
        )[1]

    limits = TensorLimits(max_bytes=4 << 20)
    received = asyncio.run(read(bytes(writer.data)))
    opened = open_envelope(
        received, remote_peer=ALICE.peer_id, expect=CTX, limits=limits, replay=ReplayGuard(), now=NOW
    )
    assert torch.equal(opened.tensors[""], tensor)
    assert submitted.count(1 << 20) == 6  # three pieces sent, three received
    tampered = bytearray(writer.data)
    tampered[20 + 4 + (2 << 20)] ^= 0x01  # in the second piece
    with pytest.raises(DigestMismatch):
        open_envelope(
            asyncio.run(read(bytes(tampered))),
            remote_peer=ALICE.peer_id,
            expect=CTX,
            limits=limits,
            replay=ReplayGuard(),
            now=NOW,
        )
