"""Fuzz the tensor builder (reliability.md §7, F3): whatever a peer declares, only a ProtocolError escapes, and
anything accepted has an allowed dtype, positive dims within the caps, and exactly numel x itemsize bytes."""

from __future__ import annotations

from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from protocol.codec import DTYPE_NAMES, WIRE_DTYPES, TensorLimits, decode_tensor
from protocol.errors import ProtocolError

LIMITS = TensorLimits(
    max_bytes=4096, max_rank=4, max_dim=512, allowed_dtypes=frozenset({"float32", "bfloat16", "int64"})
)

anything = st.recursive(
    st.one_of(
        st.none(), st.booleans(), st.integers(), st.floats(), st.text(max_size=6), st.binary(max_size=6)
    ),
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.tuples(inner, inner)),
    max_leaves=8,
)
dims = st.one_of(st.integers(-3, 40), st.sampled_from([0, -1, 1 << 31, 1 << 62, True]), anything)


@settings(max_examples=600, deadline=None)
@given(
    dtype=st.one_of(st.sampled_from([*WIRE_DTYPES, "object", "void", "O", "V4", "<f4", "float64"]), anything),
    shape=st.one_of(st.lists(dims, max_size=6), anything),
    data=st.one_of(st.binary(max_size=600), st.integers(0, 300).map(lambda n: b"\x00" * n)),
)
def test_tensor_builder_only_raises_protocol_errors(dtype: Any, shape: Any, data: bytes) -> None:
    try:
        tensor = decode_tensor(dtype, shape, data, LIMITS)
    except ProtocolError:
        return
    assert DTYPE_NAMES[tensor.dtype] in LIMITS.allowed_dtypes
    assert len(tensor.shape) <= LIMITS.max_rank and all(0 < d <= LIMITS.max_dim for d in tensor.shape)
    assert tensor.numel() * tensor.element_size() == len(data) <= LIMITS.max_bytes
    assert not tensor.dtype.is_floating_point or bool(tensor.isfinite().all())
