"""The low-bit boundary quantizers' own logic (`protocol.boundary_lowbit`): grids of any number of levels packed
several codes per word, and their refusal of a word off the grid (with its negative control). The codecs built on
them go through `test_boundary_codec`'s frame tests too."""

from __future__ import annotations

import pytest
import torch

from protocol import boundary_lowbit as lowbit
from protocol.bitpack import pack_bits
from protocol.errors import CompressionError


def gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def gradients(seed: int = 0) -> torch.Tensor:
    """Gaussian rows whose sizes differ by position (as boundary gradients do: row norms vary 4x)."""
    g = gen(seed)
    return torch.randn(256, 64, generator=g) * torch.linspace(0.25, 1.0, 256).unsqueeze(1)


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


@pytest.mark.parametrize(
    ("levels", "expected"),
    [(16, (1, 4)), (4, (1, 2)), (256, (1, 8)), (22, (2, 9)), (25, (3, 14)), (5, (3, 7))],
)
def test_packing_takes_the_fewest_bits_per_value(levels: int, expected: tuple[int, int]) -> None:
    assert lowbit.packing(levels) == expected
    per_word, word_bits = expected
    assert levels**per_word <= 2**word_bits < 2 * levels**per_word  # the word holds n digits, no bit to spare


@pytest.mark.parametrize("levels", [4, 5, 16, 22, 25])
@pytest.mark.parametrize("count", [1, 2, 3, 104, 105])  # ends on, and off, a word boundary
def test_codes_round_trip_at_their_size(levels: int, count: int) -> None:
    codes = torch.randint(0, levels, (count,), generator=gen(count))
    packed = lowbit._pack_codes(codes, levels)
    assert packed.numel() == lowbit.codes_size(count, levels)
    assert torch.equal(lowbit._unpack_codes(packed, count, levels), codes)


def test_a_word_off_the_grid_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    levels, count = 22, 10
    per_word, word_bits = lowbit.packing(levels)
    words = count // per_word
    top = 2**word_bits - 1  # 511: past 22^2 - 1 = 483
    honest = pack_bits(
        torch.full((words,), top - levels**per_word), word_bits
    )  # 27, the word 511 would alias
    forged = pack_bits(torch.full((words,), top), word_bits)
    assert not torch.equal(honest, forged)
    with pytest.raises(CompressionError) as refused:
        lowbit._unpack_codes(forged, count, levels)
    assert refused.value.reason == lowbit.BAD_CODE
    # negative control: without the check the forged payload decodes exactly as the honest one (two encodings of
    # one tensor: a payload is no longer the one canonical form of what it carries)
    monkeypatch.setattr(lowbit, "_on_grid", lambda words, bound: True)
    assert torch.equal(
        lowbit._unpack_codes(forged, count, levels), lowbit._unpack_codes(honest, count, levels)
    )


def test_fractional_bit_grids_lose_less_than_the_power_of_two_below() -> None:
    x = torch.randn(256, 64, generator=gen(1)) + 2.0 * torch.randn(64, generator=gen(2))
    errors = {}
    for levels in (16, 22, 25, 32):
        payload = lowbit.encode_rows(x, "channel", levels, rounding=None)
        assert payload is not None
        errors[levels] = relative_error(lowbit.decode_rows(payload, (256, 64), "channel", levels), x)
        assert payload.numel() == lowbit.payload_size("channel", levels, (256, 64))
    assert errors[16] > errors[22] > errors[25] > errors[32]  # the step shrinks as (levels - 1)
    assert errors[22] < 0.8 * errors[16]
