"""Fuzz the compressed-tensor decoder (issue 20): whatever header and payload a peer sends, only a CompressionError
escapes, and anything accepted is a finite float32 tensor within the receiver's cap, of the declared shape."""

from __future__ import annotations

from typing import Any

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from protocol.codec import TensorLimits
from protocol.compress import CodecSpec, MaskKey, decode, encode
from protocol.errors import CompressionError

LIMITS = TensorLimits(max_bytes=64 * 1024, max_rank=4, max_dim=1 << 20)
SPECS = [
    CodecSpec(codec="fp32"),
    CodecSpec(codec="int8", block=16),
    CodecSpec(codec="int4", block=8, scale_bits=16),
    CodecSpec(codec="topk", chunk=32, k=3, bits=2),
    CodecSpec(codec="topk", chunk=100, k=7, bits=8, scale_bits=16),
    CodecSpec(codec="topk_rice", chunk=32, k=3, bits=2),
    CodecSpec(codec="topk_rice", chunk=100, k=7, bits=4, scale_bits=16),
    CodecSpec(codec="randk", chunk=32, k=4, bits=1),
    CodecSpec(codec="randk", chunk=100, k=10, bits=2, scale_bits=16),
]
scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-3, 1 << 41),
    st.floats(),
    st.text(max_size=6),
    st.sampled_from(["fp32", "int8", "int4", "topk", "topk_rice", "randk"]),
)
field_values = st.one_of(scalars, st.lists(st.one_of(st.integers(-2, 5000), scalars), max_size=4))


@st.composite
def headers_and_payloads(draw: st.DrawFn) -> tuple[dict[str, Any], bytes]:
    """A real encoding of a small tensor, then a few fields replaced and the payload flipped, cut or extended."""
    spec = draw(st.sampled_from(SPECS))
    shape = draw(st.lists(st.integers(1, 40), min_size=1, max_size=3))
    mask = MaskKey(draw(st.integers(0, 1 << 40)), draw(st.integers(0, 7))) if spec.codec == "randk" else None
    encoded = encode(torch.randn(shape), spec, mask=mask)
    header: dict[str, Any] = dict(encoded.header)
    for key in draw(st.lists(st.sampled_from([*header, "extra"]), max_size=3)):
        if draw(st.booleans()):
            header[key] = draw(field_values)
        else:
            header.pop(key, None)
    payload = bytearray(encoded.payload)
    for position, byte in draw(st.lists(st.tuples(st.integers(0, 1 << 16), st.integers(0, 255)), max_size=4)):
        if payload:
            payload[position % len(payload)] = byte
    cut = draw(st.integers(-3, 3))
    payload = payload[: len(payload) + cut] if cut < 0 else payload + bytes(cut)
    return header, bytes(payload)


@settings(max_examples=500, deadline=None)
@given(case=headers_and_payloads())
def test_decoder_only_raises_compression_errors(case: tuple[dict[str, Any], bytes]) -> None:
    header, payload = case
    try:
        out = decode(header, payload, LIMITS)
    except CompressionError:
        return
    assert out.dtype == torch.float32 and 4 * out.numel() <= LIMITS.max_bytes
    assert list(out.shape) == header["shape"] and bool(torch.isfinite(out).all())
