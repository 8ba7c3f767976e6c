"""Envelope: seal/open round trips, and every rejection in the documented order, before any tensor is built."""

from __future__ import annotations

import dataclasses
import pickle
import re
import struct
from pathlib import Path
from typing import Any

import msgpack
import pytest
import torch

from protocol import codec, envelope
from protocol.codec import TensorLimits
from protocol.envelope import (
    SIGNATURE_DOMAIN,
    Context,
    Direction,
    Header,
    Kind,
    ReceivedFrame,
    TensorSpec,
    encode_frame,
    max_frame_bytes,
    open_envelope,
    open_frame,
    payload_digest,
    seal,
)
from protocol.errors import (
    BadSignature,
    ClockSkew,
    DigestMismatch,
    FrameTooLarge,
    MalformedFrame,
    ProtocolError,
    ReplayedFrame,
    SignerMismatch,
    SizeMismatch,
    StaleFrame,
    TensorPolicyError,
    WrongContext,
)
from protocol.identity import NodeIdentity
from protocol.replay import ReplayConfig, ReplayGuard
from protocol.rpc import Preamble, Reassembler, Status

NOW = 1_700_000_000.0
ALICE, BOB, MALLORY = NodeIdentity.generate(), NodeIdentity.generate(), NodeIdentity.generate()
LIMITS = TensorLimits(max_bytes=1 << 16, max_tensors=4)
CTX = Context(
    run_id="run-1", kind=Kind.ACTIVATION, receiver=BOB.peer_id, stage=2, direction=Direction.FORWARD
)


@pytest.fixture
def built(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Names of the dtypes of every tensor the envelope builds (to prove rejections happen before building)."""
    calls: list[str] = []
    real = codec.build_tensor

    def spy(dtype: str, *args: Any) -> torch.Tensor:
        calls.append(dtype)
        return real(dtype, *args)

    monkeypatch.setattr(codec, "build_tensor", spy)
    return calls


def sealed(
    tensor: torch.Tensor | None = None, *, sender: NodeIdentity = ALICE, ctx: Context = CTX, **kw: Any
) -> bytes:
    kw.setdefault("microbatch", 7)
    kw.setdefault("step", 3)
    kw.setdefault("now", NOW)
    return seal(sender, ctx, tensor=torch.arange(6.0).reshape(2, 3) if tensor is None else tensor, **kw)


def receive(
    frame: bytes | bytearray, *, remote: str = ALICE.peer_id, guard: ReplayGuard | None = None, **kw: Any
):
    kw.setdefault("now", NOW)
    kw.setdefault("expect", CTX)
    kw.setdefault("limits", LIMITS)
    return open_frame(frame, remote_peer=remote, replay=guard if guard is not None else ReplayGuard(), **kw)


def forge(signer: NodeIdentity = ALICE, payload: bytes = b"\0" * 8, **fields: Any) -> bytes:
    """A correctly signed frame whose header says whatever `fields` say (what a malicious sender can send)."""
    header = Header(
        version=1,
        run_id=CTX.run_id,
        kind=CTX.kind,
        sender=signer.peer_id,
        receiver=CTX.receiver,
        stage=CTX.stage,
        direction=CTX.direction,
        microbatch=7,
        step=3,
        timestamp=NOW,
        nonce=b"n" * 16,
        tensors=(TensorSpec("", "float32", (2,)),),
        digest=payload_digest([payload]),
        meta={},
    )
    return encode_frame(signer, dataclasses.replace(header, **fields), [payload])


def forge_raw_header(fields: list[Any], payload: bytes = b"", signer: NodeIdentity = ALICE) -> bytes:
    raw = msgpack.packb(fields, use_bin_type=True)
    return struct.pack(">I", len(raw)) + raw + signer.sign(SIGNATURE_DOMAIN + raw) + payload


# ------------------------------------------------------------------------------------------------ happy paths


def test_roundtrip_binds_every_field(built: list[str]) -> None:
    tensor = torch.randn(4, 8)
    header, back = receive(sealed(tensor, meta={"loss": 2.5, "tokens": [1, 2], "note": "x"}))
    assert torch.equal(back, tensor)
    assert (header.sender, header.receiver, header.run_id, header.kind, header.stage, header.direction) == (
        ALICE.peer_id,
        BOB.peer_id,
        "run-1",
        Kind.ACTIVATION,
        2,
        Direction.FORWARD,
    )
    assert (header.microbatch, header.step, header.timestamp) == (7, 3, NOW)
    assert header.meta == {"loss": 2.5, "tokens": [1, 2], "note": "x"}
    assert built == ["float32"]


def test_fragment_of_named_tensors_and_one_digest() -> None:
    frag = {
        "layers.0.w": torch.randn(3, 3),
        "layers.0.b": torch.zeros(3, dtype=torch.bfloat16),
        "ids": torch.arange(5),
    }
    ctx = dataclasses.replace(CTX, kind=Kind.FRAGMENT, stage=envelope.NO_STAGE, direction=Direction.NONE)
    frame = seal(
        ALICE, ctx, microbatch=0, step=12, now=NOW, tensors=frag, meta={"fragment": 3, "base_version": 11}
    )
    opened = open_envelope(
        frame, remote_peer=ALICE.peer_id, expect=ctx, limits=LIMITS, replay=ReplayGuard(), now=NOW
    )
    assert list(opened.tensors) == list(frag)
    assert all(torch.equal(opened.tensors[k], v) for k, v in frag.items())
    assert [(t.name, t.dtype, t.shape) for t in opened.header.tensors][1] == ("layers.0.b", "bfloat16", (3,))
    assert opened.meta["base_version"] == 11
    with pytest.raises(WrongContext):  # open_frame is for exactly one tensor
        open_frame(frame, remote_peer=ALICE.peer_id, expect=ctx, limits=LIMITS, replay=ReplayGuard(), now=NOW)


def test_metadata_only_frame() -> None:
    ctx = dataclasses.replace(CTX, kind=Kind.LOSS)
    frame = seal(ALICE, ctx, microbatch=1, step=1, now=NOW, meta={"loss": 1.25})
    opened = open_envelope(
        frame, remote_peer=ALICE.peer_id, expect=ctx, limits=LIMITS, replay=ReplayGuard(), now=NOW
    )
    assert opened.tensors == {} and opened.meta == {"loss": 1.25}


def test_max_frame_bytes_is_the_stream_cap() -> None:
    big = TensorLimits(max_bytes=4 * 4096)
    frame = sealed(torch.zeros(4096))
    assert len(frame) <= max_frame_bytes(big)
    receive(frame, limits=big)


# ------------------------------------------------------------------------------------------------ each check


def test_oversized_frame_refused_first() -> None:
    with pytest.raises(FrameTooLarge):
        receive(b"\xff" * (max_frame_bytes(LIMITS) + 1))


@pytest.mark.parametrize(
    "frame",
    [
        b"",
        b"\0\0\0",
        struct.pack(">I", 10) + b"x" * 20,  # header + signature run past the end
        struct.pack(">I", 1 << 30) + b"x" * 100,  # header length over its cap
        struct.pack(">I", 1) + b"\xc1" + b"s" * 64,  # 0xc1 is never valid msgpack
        struct.pack(">I", 1) + b"\x90" + b"s" * 64,  # an empty array
    ],
)
def test_garbage_is_malformed(frame: bytes) -> None:
    with pytest.raises((MalformedFrame, FrameTooLarge)):
        receive(frame)


def _legit_fields() -> list[Any]:
    raw = sealed()
    (n,) = struct.unpack(">I", raw[:4])
    return msgpack.unpackb(raw[4 : 4 + n])


@pytest.mark.parametrize(
    ("index", "value"),
    [
        (0, 2),  # protocol version
        (0, True),
        (2, "telepathy"),  # kind
        (5, 1 << 20),  # stage
        (5, 2.0),
        (6, "sideways"),
        (7, -1),  # microbatch
        (8, 1 << 63),  # step: msgpack carries a u64, we refuse it
        (9, float("nan")),
        (9, 5),  # int timestamp
        (10, b"short"),
        (11, [["", "float32"]]),
        (11, {"a": 1}),
        (12, b"\0" * 31),
        (13, {"blob": b"\x80\x04"}),  # bytes in metadata
        (13, {"nested": {"a": 1}}),
        (13, {"x": float("inf")}),
        (13, {1: 2}),
        (3, ""),
    ],
)
def test_each_malformed_header_field(index: int, value: Any) -> None:
    fields = _legit_fields()
    fields[index] = value
    with pytest.raises(MalformedFrame):
        receive(forge_raw_header(fields))


def test_msgpack_extension_types_refused() -> None:
    for ext in (msgpack.ExtType(5, b"\x80\x04payload"), msgpack.Timestamp(1, 0)):  # the second is ext type -1
        fields = _legit_fields()
        fields[13] = {"x": ext}
        with pytest.raises(MalformedFrame):
            receive(forge_raw_header(fields))


def test_signer_must_be_the_authenticated_remote_peer() -> None:
    frame = sealed(sender=MALLORY)  # MALLORY's valid signature, delivered by ALICE's connection
    with pytest.raises(SignerMismatch) as err:
        receive(frame, remote=ALICE.peer_id)
    assert err.value.blame_sender is False


def test_signature_over_the_domain_separated_header() -> None:
    frame = bytearray(sealed())
    frame[-1] ^= 1  # payload tamper is caught by the digest, after the signature
    with pytest.raises(DigestMismatch):
        receive(frame)
    (n,) = struct.unpack(">I", frame[:4])
    undomained = bytearray(sealed())
    undomained[4 + n : 4 + n + 64] = ALICE.sign(bytes(undomained[4 : 4 + n]))
    with pytest.raises(BadSignature):
        receive(undomained)


@pytest.mark.parametrize(
    "field",
    [
        {"run_id": "run-2"},
        {"kind": Kind.GRADIENT},
        {"stage": 3},
        {"direction": Direction.BACKWARD},
        {"receiver": MALLORY.peer_id},
    ],
)
def test_cross_context_frames_refused(field: dict[str, Any]) -> None:
    with pytest.raises(WrongContext):
        receive(sealed(ctx=dataclasses.replace(CTX, **field)))


def test_replay_and_clock_skew() -> None:
    guard = ReplayGuard()
    frame = sealed()
    receive(frame, guard=guard)
    with pytest.raises(ReplayedFrame):
        receive(frame, guard=guard)
    receive(sealed(now=NOW + 30), guard=guard)
    with pytest.raises(ClockSkew) as err:
        receive(sealed(now=NOW + 300), guard=guard)
    assert err.value.reason == "clock skew" and not err.value.blame_sender
    with pytest.raises(StaleFrame):
        receive(sealed(step=500), guard=guard, current_step=10)


@pytest.mark.parametrize(
    ("spec", "error", "reason"),
    [
        (TensorSpec("", "object", (1,)), TensorPolicyError, "dtype not allowed"),
        (TensorSpec("", "void", (8,)), TensorPolicyError, "dtype not allowed"),
        (TensorSpec("", "float32", (-1,)), TensorPolicyError, "bad shape"),
        (TensorSpec("", "float32", (2, 0)), TensorPolicyError, "bad shape"),
        (TensorSpec("", "float32", (1 << 20, 1 << 20)), TensorPolicyError, "tensor too large"),
        (TensorSpec("", "float32", (3,)), SizeMismatch, "size mismatch"),
        (TensorSpec("", "float16", (2,)), SizeMismatch, "size mismatch"),
    ],
)
def test_declared_tensor_checked_after_signature_before_digest(
    spec: TensorSpec, error: type[ProtocolError], reason: str, built: list[str]
) -> None:
    with pytest.raises(error) as err:
        receive(forge(tensors=(spec,), digest=b"\0" * 32))  # a wrong digest too: the size check comes first
    assert err.value.reason == reason
    assert built == []


def test_nan_payload_refused_after_digest_and_not_recorded(built: list[str]) -> None:
    guard = ReplayGuard()
    frame = sealed(torch.tensor([1.0, float("nan")]))
    with pytest.raises(TensorPolicyError) as err:
        receive(frame, guard=guard)
    assert err.value.reason == "non-finite values" and guard.num_seen == 0


def test_too_many_tensors_refused_while_decoding() -> None:
    specs = tuple(TensorSpec(str(i), "float32", (1,)) for i in range(5))
    with pytest.raises(TensorPolicyError):
        receive(forge(tensors=specs, payload=b"\0" * 20))


# ------------------------------------------------------------------------------------------------ order


def test_check_order_each_failure_masks_the_later_ones(built: list[str]) -> None:
    """A frame broken in two ways reports the earlier check; the chain follows DESIGN.md exactly."""
    guard = ReplayGuard(ReplayConfig())
    accepted = sealed()
    receive(accepted, guard=guard)
    wrong_ctx = dataclasses.replace(CTX, stage=5)
    cases: list[tuple[bytes, str, type[ProtocolError]]] = [
        (b"\xc1" * (max_frame_bytes(LIMITS) + 1), ALICE.peer_id, FrameTooLarge),  # too large and garbage
        (
            struct.pack(">I", 1) + b"\xc1" + b"\0" * 64,
            MALLORY.peer_id,
            MalformedFrame,
        ),  # garbage from a stranger
        (sealed(sender=MALLORY, ctx=wrong_ctx), ALICE.peer_id, SignerMismatch),  # + wrong context
        (_break_signature(sealed(ctx=wrong_ctx)), ALICE.peer_id, BadSignature),  # + wrong context
        (sealed(ctx=wrong_ctx, now=NOW + 999), ALICE.peer_id, WrongContext),  # + clock skew
        (accepted[:-4], ALICE.peer_id, ReplayedFrame),  # + size mismatch
        (forge(tensors=(TensorSpec("", "float32", (3,)),), digest=b"\0" * 32), ALICE.peer_id, SizeMismatch),
        (
            _break_payload(sealed(torch.tensor([float("nan"), 1.0]), nonce=b"z" * 16)),
            ALICE.peer_id,
            DigestMismatch,
        ),
    ]
    for frame, remote, error in cases:
        with pytest.raises(error):
            receive(frame, remote=remote, guard=guard)
    assert built == ["float32"]  # only the one accepted frame was ever built


def _break_signature(frame: bytes) -> bytes:
    (n,) = struct.unpack(">I", frame[:4])
    out = bytearray(frame)
    out[4 + n] ^= 0x80
    return bytes(out)


def _break_payload(frame: bytes) -> bytes:
    out = bytearray(frame)
    out[-1] ^= 0x01
    return bytes(out)


# ------------------------------------------------------------------------------------------------ sender side


@pytest.mark.parametrize(
    "kwargs",
    [
        {"meta": {"blob": b"bytes"}},
        {"meta": {"deep": [[1]]}},
        {"meta": {"x": float("nan")}},
        {"meta": {"": 1}},
        {"microbatch": -1},
        {"step": 1 << 63},
        {"now": float("inf")},
        {"nonce": b"short"},
    ],
)
def test_seal_validates_its_arguments(kwargs: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        sealed(**kwargs)


def test_pickle_in_any_field_is_never_unpickled(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"

    class Exploit:
        def __reduce__(self) -> tuple[Any, tuple[str, str]]:
            return (open, (str(marker), "w"))

    blob = pickle.dumps(Exploit())
    attempts = [
        blob,  # as the whole frame
        struct.pack(">I", len(blob)) + blob + ALICE.sign(SIGNATURE_DOMAIN + blob),  # as a signed header
        forge(tensors=(TensorSpec("", "object", (1,)),), payload=blob),  # as an "object" payload
        forge_raw_header([*_legit_fields()[:13], {"meta": blob}]),  # as metadata
    ]
    for frame in attempts:
        with pytest.raises(ProtocolError):
            receive(frame)
    # As a plain uint8 payload it is only ever bytes.
    raw = TensorLimits(max_bytes=1 << 16, allowed_dtypes=frozenset({"uint8"}))
    _, tensor = receive(forge(tensors=(TensorSpec("", "uint8", (len(blob),)),), payload=blob), limits=raw)
    assert bytes(tensor.numpy()) == blob
    assert not marker.exists()


def test_protocol_package_never_unpickles() -> None:
    """Ratchet: nothing under protocol/ imports pickle or calls torch.load."""
    root = Path(envelope.__file__).parent
    for path in root.glob("*.py"):
        text = path.read_text()
        assert not re.search(r"^\s*(import|from)\s+(c?pickle|dill|cloudpickle)\b", text, re.M), path
        assert "torch.load(" not in text, path


# ------------------------------------------------------------------------------------------------ streamed digest


def arrive(frame: bytes | bytearray, chunk: int) -> ReceivedFrame:
    """`frame` as the framed stream hands it to a handler: reassembled from `chunk`-byte chunks and digested on the
    way (the sender picks the chunking, down to one byte, so the header length itself may arrive in pieces)."""
    num_chunks = -(-len(frame) // chunk)
    parts = Reassembler(Preamble(Status.REQUEST, len(frame), num_chunks), max_chunk_bytes=chunk, digest=True)
    for start in range(0, len(frame), chunk):
        piece = frame[start : start + chunk]
        parts.add(bytes(piece[: parts.next_chunk_length(struct.pack(">I", len(piece)))]))
    return parts.finish()


@pytest.fixture
def passes(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Sizes of every separate digest pass `open_envelope` makes (a streamed frame should need none)."""
    sizes: list[int] = []
    real = envelope.payload_digest

    def spy(parts: list[Any]) -> bytes:
        sizes.append(sum(len(p) for p in parts))
        return real(parts)

    monkeypatch.setattr(envelope, "payload_digest", spy)
    return sizes


@pytest.mark.parametrize("chunk", [1, 3, 4, 5, 77, 4096, 1 << 20])
def test_a_streamed_frame_is_digested_on_arrival_not_again(chunk: int, passes: list[int]) -> None:
    tensor = torch.randn(40, 50)
    frame = arrive(sealed(tensor), chunk)
    header, back = receive(frame, limits=TensorLimits(max_bytes=1 << 20))
    assert torch.equal(back, tensor) and passes == []
    receive(bytes(frame), limits=TensorLimits(max_bytes=1 << 20))  # control: the same bytes, not streamed
    assert passes == [tensor.numel() * 4]


def test_a_streamed_frame_meets_every_check_in_order(built: list[str], passes: list[int]) -> None:
    payload_flip = arrive(_break_payload(sealed(nonce=b"p" * 16)), 64)
    with pytest.raises(DigestMismatch):
        receive(payload_flip)
    header_flip = bytearray(sealed(nonce=b"h" * 16))
    header_flip[8] ^= 0x01  # inside the header: the signature fails first, whatever the streamed digest says
    with pytest.raises((BadSignature, MalformedFrame)):
        receive(arrive(header_flip, 64))
    with pytest.raises(BadSignature):
        receive(arrive(_break_signature(sealed(nonce=b"s" * 16)), 64))
    with pytest.raises(FrameTooLarge):  # a header length over the cap: the digester stands aside
        receive(arrive(struct.pack(">I", envelope.MAX_HEADER_BYTES + 1) + b"\0" * 100, 7))
    with pytest.raises(MalformedFrame):  # one that runs past the frame
        receive(arrive(struct.pack(">I", 1000) + b"\0" * 100, 7))
    edited = arrive(sealed(nonce=b"e" * 16), 64)
    edited[-1] ^= 0x01  # edited in place after it arrived: its streamed digest is dropped, the edit is caught
    with pytest.raises(DigestMismatch):
        receive(edited)
    assert built == [] and passes == [24]  # nothing built; only the edited frame was digested again


def test_seal_copies_and_hashes_in_pieces_across_tensors(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(envelope, "SEAL_PIECE_BYTES", 5)  # pieces that straddle every tensor boundary
    frag = {"a": torch.randn(3), "b": torch.arange(7), "c": torch.ones(2, 2, dtype=torch.bfloat16)}
    ctx = dataclasses.replace(CTX, kind=Kind.FRAGMENT)
    frame = seal(ALICE, ctx, microbatch=0, step=1, now=NOW, tensors=frag)
    payload = b"".join(bytes(codec.tensor_bytes(t)) for t in frag.values())
    assert frame.endswith(payload)
    opened = open_envelope(
        frame, remote_peer=ALICE.peer_id, expect=ctx, limits=LIMITS, replay=ReplayGuard(), now=NOW
    )
    assert opened.header.digest == payload_digest([payload])
    assert all(torch.equal(opened.tensors[k], v) for k, v in frag.items())
