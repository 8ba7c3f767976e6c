"""Fuzz the frame decoder and verify pipeline (reliability.md §7, F1/F2/F6).

Properties: only a ProtocolError ever escapes `open_envelope`; a frame is admitted iff it is byte-for-byte a frame
that was sealed for this receiver (any mutation of a valid frame is refused); signed headers with arbitrary msgpack
content are refused with a typed error, never a crash.
"""

from __future__ import annotations

from typing import Any

import msgpack
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from protocol.codec import TensorLimits
from protocol.envelope import SIGNATURE_DOMAIN, Context, Direction, Kind, open_envelope, seal
from protocol.errors import ProtocolError
from protocol.identity import NodeIdentity
from protocol.replay import ReplayGuard

NOW = 1_700_000_000.0
ALICE, BOB = NodeIdentity.generate(), NodeIdentity.generate()
LIMITS = TensorLimits(max_bytes=1 << 12, max_tensors=3)
CTX = Context(run_id="fuzz", kind=Kind.GRADIENT, receiver=BOB.peer_id, stage=1, direction=Direction.BACKWARD)
SETTINGS = settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _valid_frames() -> list[bytes]:
    gen = torch.Generator().manual_seed(0)
    return [
        seal(
            ALICE,
            CTX,
            microbatch=1,
            step=2,
            now=NOW,
            tensor=torch.randn(3, 4, generator=gen),
            nonce=b"a" * 16,
        ),
        seal(ALICE, CTX, microbatch=2, step=2, now=NOW, tensor=torch.arange(5), nonce=b"b" * 16),
        seal(
            ALICE,
            CTX,
            microbatch=3,
            step=2,
            now=NOW,
            tensors={"w": torch.randn(2, 2, generator=gen), "b": torch.zeros(2, dtype=torch.bfloat16)},
            meta={"loss": 1.5, "ids": [1, 2, 3], "tag": "x"},
            nonce=b"c" * 16,
        ),
        seal(ALICE, CTX, microbatch=4, step=2, now=NOW, meta={"only": "metadata"}, nonce=b"d" * 16),
    ]


VALID = _valid_frames()


def admit(frame: bytes | bytearray) -> bool:
    try:
        open_envelope(
            frame, remote_peer=ALICE.peer_id, expect=CTX, limits=LIMITS, replay=ReplayGuard(), now=NOW
        )
    except ProtocolError:
        return False
    return True


def test_every_seed_frame_is_admitted() -> None:
    assert all(admit(frame) for frame in VALID)


@SETTINGS
@given(data=st.binary(max_size=2048))
def test_random_bytes_only_raise_protocol_errors(data: bytes) -> None:
    assert not admit(data)


@SETTINGS
@given(
    index=st.integers(0, len(VALID) - 1),
    edits=st.lists(
        st.tuples(
            st.sampled_from(["flip", "set", "insert", "delete"]), st.integers(0, 1 << 16), st.integers(0, 255)
        ),
        min_size=1,
        max_size=4,
    ),
    cut=st.one_of(st.none(), st.integers(0, 1 << 16)),
)
def test_any_mutation_of_a_valid_frame_is_refused(
    index: int, edits: list[tuple[str, int, int]], cut: int | None
) -> None:
    original = VALID[index]
    frame = bytearray(original)
    for op, pos, value in edits:
        pos %= len(frame) + (op == "insert")
        if op == "flip":
            frame[pos] ^= 1 << (value % 8)
        elif op == "set":
            frame[pos] = value
        elif op == "insert":
            frame.insert(pos, value)
        elif len(frame) > 1:
            del frame[pos]
    if cut is not None:
        frame = frame[: cut % (len(frame) + 1)]
    assume(bytes(frame) != original)
    assert not admit(frame)


header_values = st.recursive(
    st.one_of(
        st.none(),
        st.booleans(),
        st.integers(-(1 << 63), (1 << 64) - 1),
        st.floats(),
        st.text(max_size=20),
        st.binary(max_size=40),
    ),
    lambda inner: st.one_of(
        st.lists(inner, max_size=5), st.dictionaries(st.text(max_size=5), inner, max_size=3)
    ),
    max_leaves=20,
)


def _header_fields(frame: bytes) -> list[Any]:
    n = int.from_bytes(frame[:4], "big")
    return msgpack.unpackb(frame[4 : 4 + n])


@SETTINGS
@given(
    fields=st.lists(header_values, max_size=16),
    replace=st.lists(st.tuples(st.integers(0, 13), header_values), max_size=3),
)
def test_signed_garbage_headers_are_typed_errors(fields: list[Any], replace: list[tuple[int, Any]]) -> None:
    """Headers that pass the signature (ALICE signs them) but hold anything msgpack can say: either random arrays,
    or a valid header with a few fields replaced by random values."""
    if replace:
        fields = _header_fields(VALID[2])
        for i, value in replace:
            fields[i] = value
    raw = msgpack.packb(fields, use_bin_type=True)
    frame = len(raw).to_bytes(4, "big") + raw + ALICE.sign(SIGNATURE_DOMAIN + raw) + b"\0" * 16
    admit(frame)  # must not raise anything but ProtocolError
