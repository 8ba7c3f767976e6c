"""Codec: allowed dtypes round-trip bit-exactly; every bad (dtype, shape, bytes) is a typed error before allocation."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from protocol import codec
from protocol.codec import WIRE_DTYPES, TensorLimits, check_spec, decode_tensor, encode_tensor
from protocol.errors import ProtocolError, SizeMismatch, TensorPolicyError

ALL = TensorLimits(max_bytes=1 << 20, allowed_dtypes=frozenset(WIRE_DTYPES))


def _random_tensor(dtype: torch.dtype, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    if dtype.is_floating_point:
        return torch.randn(shape, generator=gen).to(dtype)
    high = {torch.uint8: 256, torch.uint16: 1 << 16}.get(dtype, 1 << 31)
    return torch.randint(0, high, shape, generator=gen, dtype=dtype)


@settings(max_examples=150, deadline=None)
@given(
    dtype=st.sampled_from(sorted(WIRE_DTYPES)),
    shape=st.lists(st.integers(1, 6), min_size=0, max_size=4).map(tuple),
    seed=st.integers(0, 2**31),
)
def test_roundtrip_is_bit_exact(dtype: str, shape: tuple[int, ...], seed: int) -> None:
    tensor = _random_tensor(WIRE_DTYPES[dtype], shape, seed)
    name, wire_shape, data = encode_tensor(tensor)
    assert (name, wire_shape) == (dtype, shape)
    back = decode_tensor(name, list(wire_shape), data, ALL)
    assert back.dtype == tensor.dtype and back.shape == tensor.shape
    assert encode_tensor(back)[2] == data  # bit-exact, NaN payloads and signed zeros included


def test_noncontiguous_and_bfloat16_views_are_encoded_in_logical_order() -> None:
    base = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    for tensor in (base.t(), base.to(torch.bfloat16).t()):
        dtype, shape, data = encode_tensor(tensor)
        assert torch.equal(decode_tensor(dtype, shape, data, ALL), tensor)


def test_decoded_tensor_owns_a_writable_copy() -> None:
    data = bytearray(encode_tensor(torch.ones(4))[2])
    tensor = decode_tensor("float32", [4], data, ALL)
    data[:4] = b"\0\0\0\0"
    tensor.add_(1)  # writable, and not aliasing the caller's buffer
    assert tensor.tolist() == [2.0, 2.0, 2.0, 2.0]


@pytest.mark.parametrize(
    "dtype", ["object", "O", "void", "V8", "|V4", "float64", "bool", "complex64", "", None, 7, b"f"]
)
def test_unknown_or_disallowed_dtypes_refused(dtype: object) -> None:
    with pytest.raises(TensorPolicyError) as err:
        check_spec(dtype, [2], ALL)
    assert err.value.reason == "dtype not allowed"


def test_dtype_outside_the_manifest_allow_list_refused() -> None:
    tokens_only = TensorLimits(max_bytes=1024, allowed_dtypes=frozenset({"int64"}))
    assert check_spec("int64", [4], tokens_only) == 32
    with pytest.raises(TensorPolicyError):
        check_spec("float32", [4], tokens_only)


@pytest.mark.parametrize(
    "shape", [[-1], [0], [2, -1], [2, 0, 3], [True], [1.0], ["2"], [None], "12", 5, None, {"a": 1}]
)
def test_bad_shapes_refused(shape: object) -> None:
    with pytest.raises(TensorPolicyError) as err:
        check_spec("float32", shape, ALL)
    assert err.value.reason == "bad shape"


def test_rank_dim_and_size_caps_checked_before_allocation() -> None:
    limits = TensorLimits(max_bytes=1 << 20, max_rank=3, max_dim=1000)
    with pytest.raises(TensorPolicyError, match="rank"):
        check_spec("float32", [1] * 4, limits)
    with pytest.raises(TensorPolicyError, match="dimension"):
        check_spec("float32", [1001], limits)
    # 2**62 elements would need exabytes: refused from arithmetic alone, and fast.
    huge = TensorLimits(max_bytes=1 << 20, max_rank=8, max_dim=1 << 62)
    with pytest.raises(TensorPolicyError) as err:
        check_spec("float32", [1 << 62, 1 << 62], huge)
    assert err.value.reason == "tensor too large"


def test_byte_count_must_equal_dtype_times_shape() -> None:
    for data in (b"\0" * 15, b"\0" * 17, b""):
        with pytest.raises(SizeMismatch):
            decode_tensor("float32", [4], data, ALL)


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_nonfinite_refused_by_default_allowed_by_policy(value: float, dtype: str) -> None:
    tensor = torch.tensor([1.0, value, 2.0]).to(WIRE_DTYPES[dtype])
    name, shape, data = encode_tensor(tensor)
    with pytest.raises(TensorPolicyError) as err:
        decode_tensor(name, shape, data, ALL)
    assert err.value.reason == "non-finite values"
    permissive = TensorLimits(max_bytes=1024, allowed_dtypes=frozenset(WIRE_DTYPES), nonfinite="allow")
    assert decode_tensor(name, shape, data, permissive).isfinite().sum() == 2


def test_sender_refuses_dtypes_and_empty_dims_that_never_travel() -> None:
    for tensor in (torch.zeros(2, dtype=torch.float64), torch.zeros(2, dtype=torch.bool), torch.zeros(0, 3)):
        with pytest.raises(TensorPolicyError):
            encode_tensor(tensor)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"max_bytes": 0},
        {"max_bytes": 8, "max_rank": -1},
        {"max_bytes": 8, "max_tensors": 0},
        {"max_bytes": 8, "allowed_dtypes": frozenset({"object"})},
        {"max_bytes": 8, "nonfinite": "warn"},
    ],
)
def test_limits_validate(kwargs: dict[str, object]) -> None:
    with pytest.raises(ValueError):
        TensorLimits(**kwargs)  # type: ignore[arg-type]


@settings(max_examples=300, deadline=None)
@given(
    dtype=st.one_of(st.sampled_from([*WIRE_DTYPES, "object", "void", "float64"]), st.text(max_size=8)),
    shape=st.lists(st.integers(-(2**40), 2**40), max_size=10),
    data=st.binary(max_size=256),
)
def test_random_input_only_ever_raises_protocol_errors(dtype: str, shape: list[int], data: bytes) -> None:
    try:
        tensor = decode_tensor(dtype, shape, data, ALL)
    except ProtocolError:
        return
    assert tensor.numel() * tensor.element_size() == len(data)
    assert codec.DTYPE_NAMES[tensor.dtype] == dtype


def test_finite_check_is_exact_when_a_finite_sum_overflows() -> None:
    big = torch.full((8,), 3e38)  # every element finite, the float32 sum is inf
    assert not bool(torch.isfinite(big.sum()))
    assert codec.all_finite(big)
    assert not codec.all_finite(torch.cat([big, torch.tensor([float("nan")])]))
    half = torch.full((4,), 60000.0, dtype=torch.float16)
    assert codec.all_finite(half)
