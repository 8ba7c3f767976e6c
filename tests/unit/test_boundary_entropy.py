"""Entropy-coded boundary codecs (the ``...z`` codecs, `protocol.boundary_entropy`): round trips at fewer bytes than
the packed grids, a relay that re-encodes to the same stream, and streams refused before they inflate past their
declared size (each refusal with a negative control that shows what it stops)."""

from __future__ import annotations

import math
import zlib
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from protocol import boundary_codec
from protocol import boundary_entropy as entropy
from protocol import boundary_lowbit as lowbit
from protocol.boundary_codec import META_PREFIX, BoundaryCodecSpec, encode
from protocol.compress import BAD_SCALE, TOO_LARGE, WRONG_LENGTH
from protocol.errors import CompressionError
from tests.unit.test_boundary_codec import (
    CTX,
    ERROR_BOUND,
    GRAD_CTX,
    offsets,
    refused,
    relative_error,
    round_trip,
    rounding,
    through_frame,
)

ENTROPY_CODECS = sorted(lowbit.ENTROPY_CODED)
SHAPE = (4, 32, 64)


def gaussian_codes(count: int, levels: int, seed: int = 0) -> torch.Tensor:
    """Codes of Gaussian values on a grid spanning +-3 sigma: the middle levels common, the ends rare."""
    x = torch.randn(count, generator=torch.Generator().manual_seed(seed))
    return ((x / 6 + 0.5) * (levels - 1)).round().clamp(0, levels - 1).to(torch.int64)


@pytest.mark.parametrize("levels", [4, 5, 6, 8, 25, 32])
@pytest.mark.parametrize("count", [1, 2, 105, 16384])  # odd counts pad the last pair
def test_codes_round_trip_and_gaussian_codes_take_fewer_bits_than_packed(levels: int, count: int) -> None:
    codes = gaussian_codes(count, levels)
    stream = entropy.encode_codes(codes, levels)
    assert stream.numel() <= entropy.stream_bound(count, levels)
    assert torch.equal(entropy.decode_codes(stream, count, levels), codes)
    if count == 16384:
        # below the fixed-width packing of the same grid (the point of coding them)
        assert stream.numel() < 0.95 * lowbit.codes_size(count, levels)


@pytest.mark.parametrize("codec", ENTROPY_CODECS)
@pytest.mark.parametrize("gradient", [False, True])
def test_entropy_coded_round_trip_sizes_and_errors(codec: Any, gradient: bool) -> None:
    x, spec = offsets(), BoundaryCodecSpec(codec=codec)
    payload, meta = encode(x, spec, gradient=gradient, rounding=rounding())
    assert meta[META_PREFIX + "codec"] == codec
    scheme, levels = lowbit.scheme_of(codec, gradient)
    bound = boundary_codec.payload_size(codec, SHAPE, gradient)
    packed = lowbit.payload_size(scheme, levels, SHAPE)  # the same grid, packed at fixed width
    assert lowbit.scales_size(scheme, SHAPE) < payload.numel() <= bound
    assert payload.numel() < packed
    back = round_trip(x, spec, gradient)
    # the grid's error: the codes are the same as packed ones, only their bytes differ
    plain = lowbit.decode_rows(
        lowbit.encode_rows(x.reshape(-1, 64), scheme, levels, rounding=None), SHAPE, scheme, levels
    )
    if not gradient:
        assert torch.equal(back, plain)
    # as test_boundary_codec's bounds for the packed grids (stochastic rounding: up to about sqrt(2)x)
    bound = {**ERROR_BOUND, 32: 0.06}[levels] * (1.5 if gradient else 1.0)
    assert back.shape == x.shape and relative_error(back, x) < bound


@pytest.mark.parametrize("codec", ENTROPY_CODECS)
@pytest.mark.parametrize("gradient", [False, True])
def test_a_relayed_tensor_encodes_to_the_same_stream(codec: Any, gradient: bool) -> None:
    spec = BoundaryCodecSpec(codec=codec)
    context = GRAD_CTX if gradient else CTX
    payload, meta = encode(offsets(), spec, gradient=gradient, rounding=rounding())
    decoded = through_frame(payload, meta, spec, context=context).tensors[""]
    again, _ = encode(decoded, spec, gradient=gradient, rounding=rounding(1))  # other noise
    assert again.numel() == payload.numel() and float((again == payload).float().mean()) > 0.99


def bomb(symbols: int) -> bytes:
    """A raw deflate stream of `symbols` zero bytes: ~1000x smaller than what it inflates to."""
    compressor = zlib.compressobj(9, zlib.DEFLATED, -15)
    return compressor.compress(bytes(symbols)) + compressor.flush()


def test_a_decode_bomb_inflates_no_further_than_the_declared_count() -> None:
    declared = 16384
    stream = bomb(64 << 20)  # 64 MiB of symbols in ~64 KiB
    assert len(stream) < 100_000
    with pytest.raises(CompressionError) as e:
        entropy.decode_codes(torch.frombuffer(bytearray(stream), dtype=torch.uint8), declared, 25)
    assert e.value.reason == entropy.BAD_STREAM
    # negative control: inflated without the bound, the same stream allocates all 64 MiB
    assert len(zlib.decompress(stream, -15)) == 64 << 20


@pytest.mark.parametrize("codec", ENTROPY_CODECS)
def test_a_bomb_in_a_frame_is_refused_by_its_length_or_its_stream(codec: Any) -> None:
    spec = BoundaryCodecSpec(codec=codec)
    payload, meta = encode(offsets(), spec, rounding=rounding())
    scales = lowbit.scales_size(lowbit.scheme_of(codec, False)[0], SHAPE)
    assert through_frame(payload, meta, spec).tensors[""].shape == SHAPE  # control: the honest frame
    for symbols in (math.prod(SHAPE) + 1, 4 << 20):  # one symbol too many; a bomb within the length bound
        forged = torch.cat([payload[:scales], torch.frombuffer(bytearray(bomb(symbols)), dtype=torch.uint8)])
        assert refused(forged, meta, spec) == entropy.BAD_STREAM
    # a declared shape past the cap is refused before any stream is read, as for every codec
    assert refused(payload, {**meta, META_PREFIX + "shape": [8, 32, 64 << 20]}, spec) == TOO_LARGE


@pytest.mark.parametrize("codec", ENTROPY_CODECS)
def test_short_truncated_trailing_and_garbage_streams_are_refused(codec: Any) -> None:
    spec = BoundaryCodecSpec(codec=codec)
    payload, meta = encode(offsets(), spec, rounding=rounding())
    scales = lowbit.scales_size(lowbit.scheme_of(codec, False)[0], SHAPE)
    levels = lowbit.scheme_of(codec, False)[1]
    count = math.prod(SHAPE)
    short = entropy.encode_codes(torch.zeros(count - 2, dtype=torch.int64), levels)  # inflates short
    assert refused(torch.cat([payload[:scales], short]), meta, spec) == entropy.BAD_STREAM
    assert refused(payload[:-3], meta, spec) == entropy.BAD_STREAM  # truncated: ends before its last block
    assert (
        refused(torch.cat([payload, payload[-2:]]), meta, spec) == entropy.BAD_STREAM
    )  # bytes after the end
    garbage = payload.clone()
    garbage[scales:] = 0xFF  # not a deflate stream
    assert refused(garbage, meta, spec) == entropy.BAD_STREAM
    # nothing but the scales, or past the bound: refused by length before inflating
    assert refused(payload[:scales], meta, spec) == WRONG_LENGTH
    over = boundary_codec.payload_size(codec, SHAPE, False) + 1
    assert refused(torch.zeros(over, dtype=torch.uint8), meta, spec) == WRONG_LENGTH


@pytest.mark.parametrize("levels", [5, 25])  # two codes a symbol; one
def test_a_symbol_off_the_grid_is_refused(levels: int, monkeypatch: pytest.MonkeyPatch) -> None:
    count = 105
    per = entropy.codes_per_symbol(levels)
    symbols = torch.zeros(entropy.symbol_count(count, levels), dtype=torch.int64)
    symbols[0] = levels**per  # one past the grid: would alias another code
    compressor = zlib.compressobj(9, zlib.DEFLATED, -15, 9, zlib.Z_HUFFMAN_ONLY)
    stream = compressor.compress(symbols.to(torch.uint8).numpy().tobytes()) + compressor.flush()
    data = torch.frombuffer(bytearray(stream), dtype=torch.uint8)
    with pytest.raises(CompressionError) as e:
        entropy.decode_codes(data, count, levels)
    assert e.value.reason == entropy.BAD_CODE
    if per == 2:  # the pad code of an odd count must be 0 (one payload per tensor)
        symbols[0] = 0
        symbols[-1] = levels  # pad digit 1
        compressor = zlib.compressobj(9, zlib.DEFLATED, -15, 9, zlib.Z_HUFFMAN_ONLY)
        padded = compressor.compress(symbols.to(torch.uint8).numpy().tobytes()) + compressor.flush()
        with pytest.raises(CompressionError):
            entropy.decode_codes(torch.frombuffer(bytearray(padded), dtype=torch.uint8), count, levels)
    # negative control: without the grid check the forged symbol decodes to a code past the last level
    monkeypatch.setattr(torch.Tensor, "all", lambda self: torch.tensor(True))
    assert int(entropy.decode_codes(data, count, levels).max()) >= levels


@settings(max_examples=300, deadline=None)
@given(
    stream=st.binary(max_size=3000),
    count=st.integers(1, 5000),
    levels=st.sampled_from([4, 5, 6, 8, 25, 32]),
)
def test_any_bytes_decode_to_exactly_the_declared_codes_or_are_refused(
    stream: bytes, count: int, levels: int
) -> None:
    data = (
        torch.frombuffer(bytearray(stream), dtype=torch.uint8)
        if stream
        else torch.zeros(0, dtype=torch.uint8)
    )
    try:
        codes = entropy.decode_codes(data, count, levels)
    except CompressionError as e:
        assert e.reason in (entropy.BAD_STREAM, entropy.BAD_CODE)
        return
    assert codes.numel() == count and int(codes.min()) >= 0 and int(codes.max()) < levels


@pytest.mark.parametrize("codec", ENTROPY_CODECS)
@pytest.mark.parametrize("gradient", [False, True])
def test_entropy_coded_scales_are_checked_like_the_packed_ones(codec: Any, gradient: bool) -> None:
    spec, context = BoundaryCodecSpec(codec=codec), GRAD_CTX if gradient else CTX
    payload, meta = encode(offsets(), spec, gradient=gradient, rounding=rounding())
    scale_at = 0 if gradient else 4 * 64  # the tensor's S, or the first channel's step
    for bad in (float("nan"), float("inf"), -1.0):
        poisoned = payload.clone()
        poisoned[scale_at : scale_at + 4].view(torch.float32)[0] = bad
        assert refused(poisoned, meta, spec, context=context) == BAD_SCALE
    assert through_frame(payload, meta, spec, context=context).tensors[""].isfinite().all()  # control


def test_no_declared_symbols_is_refused_not_read_as_no_bound() -> None:
    stream = torch.frombuffer(bytearray(bomb(1 << 20)), dtype=torch.uint8)
    with pytest.raises(CompressionError) as e:
        entropy.decode_codes(stream, 0, 25)
    assert e.value.reason == entropy.BAD_STREAM
    # negative control: zlib's max_length 0 is unbounded, the whole megabyte comes out
    assert len(zlib.decompressobj(-15).decompress(stream.numpy().tobytes(), 0)) == 1 << 20
