"""Compressed boundary activations and gradients: the codec's accuracy and size, its negotiation in the manifest,
decode bombs refused before allocation (each with a negative control), and the pipeline driven with the codec on."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import pytest
import torch

from protocol import boundary_codec
from protocol import boundary_lowbit as lowbit
from protocol.boundary_codec import META_PREFIX, BoundaryCodecSpec, compression_ratio, decode_opened, encode
from protocol.codec import TensorLimits
from protocol.compress import BAD_HEADER, BAD_SCALE, TOO_LARGE, WRONG_CODEC, WRONG_LENGTH
from protocol.envelope import Context, Direction, Kind, Opened, open_envelope, seal
from protocol.errors import CompressionError
from protocol.identity import NodeIdentity
from protocol.manifest import RunManifest, WireSpec
from protocol.pipeline import BoundaryShape
from protocol.replay import ReplayGuard
from tests.unit import test_pipeline_local as local

NOW = 1_700_000_000.0
ALICE, BOB = NodeIdentity.generate(), NodeIdentity.generate()
CTX = Context(run_id="r", kind=Kind.ACTIVATION, receiver=BOB.peer_id, stage=1, direction=Direction.FORWARD)
INT8, INT4 = BoundaryCodecSpec(codec="int8"), BoundaryCodecSpec(codec="int4")
SHAPE = BoundaryShape(max_batch=8, context_len=32, width=64, vocab_size=256, codec=INT8)


def rounding(seed: int = 0) -> torch.Generator:
    """A fresh generator of stochastic rounding's noise: every test owns its stream (the encoder's contract)."""
    return torch.Generator().manual_seed(seed)


def activation(seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(4, 32, 64, generator=g)
    return x * torch.linspace(
        0.1, 8.0, 64
    )  # channels of very different ranges: what per-channel scales are for


def through_frame(
    payload: torch.Tensor,
    meta: dict[str, Any],
    spec: BoundaryCodecSpec = INT8,
    limits: TensorLimits | None = None,
    context: Context = CTX,
) -> Opened:
    limits = limits or dataclasses.replace(SHAPE, codec=spec).limits
    frame = seal(ALICE, context, microbatch=1, step=1, now=NOW, tensor=payload, meta=meta)
    opened = open_envelope(
        frame, remote_peer=ALICE.peer_id, expect=context, limits=limits, replay=ReplayGuard(), now=NOW
    )
    return decode_opened(opened, spec, limits)


@pytest.mark.parametrize(("spec", "min_ratio", "qmax"), [(INT8, 3.85, 127), (INT4, 7.5, 7)])
def test_round_trip_within_half_a_step_per_channel(
    spec: BoundaryCodecSpec, min_ratio: float, qmax: int
) -> None:
    x = activation()
    payload, meta = encode(x, spec, rounding=rounding())
    assert payload.dtype == torch.uint8 and payload.numel() == boundary_codec.payload_size(
        spec.codec, (4, 32, 64)
    )
    assert compression_ratio(spec.codec, (4, 32, 64)) > min_ratio
    back = through_frame(payload, meta, spec).tensors[""]
    step = x.abs().amax(dim=(0, 1)) / qmax  # one scale per channel
    assert back.shape == x.shape and bool(((back - x).abs() <= step / 2 + 1e-6).all())


def test_fp32_is_the_default_and_changes_nothing() -> None:
    x = activation()
    assert RunManifest().activation_codec == BoundaryCodecSpec()
    same, meta = encode(x, BoundaryCodecSpec(), rounding=rounding())
    assert same is x and meta == {}
    # no codec payloads: uint8 only where it is the vocabulary's token dtype (`protocol.token_wire`)
    shape = BoundaryShape.from_manifest(RunManifest())
    assert "uint8" not in dataclasses.replace(shape, vocab_size=1000).limits.allowed_dtypes


def test_a_tensor_the_codec_cannot_carry_travels_as_fp32() -> None:
    x = activation()
    x[0, 0, 0] = float("nan")  # a faulty stage's output: the receiver's finite policy must still see it
    same, meta = encode(x, INT8, rounding=rounding())
    assert same is x and meta == {}


def test_the_manifest_negotiates_the_codec() -> None:
    run = RunManifest.from_dict({"activation_codec": {"codec": "int4"}, "wire": {"max_batch": 8}})
    assert run.activation_codec == INT4 and BoundaryShape.from_manifest(run).codec == INT4
    assert RunManifest.from_canonical_bytes(run.to_canonical_bytes()) == run
    low = RunManifest.from_dict({"activation_codec": {"codec": "a4g2"}})
    assert BoundaryShape.from_manifest(low).codec == BoundaryCodecSpec(codec="a4g2")
    with pytest.raises(ValueError, match="activation codec"):
        RunManifest.from_dict({"activation_codec": {"codec": "int2"}})
    with pytest.raises(ValueError, match="unknown"):
        RunManifest.from_dict({"activation_codec": {"codec": "int8", "block": 3}})


# ---------------------------------------------------------------------------------------------------- decode bombs


def refused(payload: torch.Tensor, meta: dict[str, Any], spec: BoundaryCodecSpec = INT8, **kw: Any) -> str:
    with pytest.raises(CompressionError) as e:
        through_frame(payload, meta, spec, **kw)
    return e.value.reason


def test_a_declared_shape_over_the_cap_is_refused_before_allocation(monkeypatch: pytest.MonkeyPatch) -> None:
    big = torch.randn(8, 32, 1024)  # an honest encoding of a tensor 16x the run's width: 1 MiB decoded
    payload, meta = encode(big, INT8, rounding=rounding())
    loose = dataclasses.replace(SHAPE.limits, max_bytes=4 << 20)
    frame = seal(ALICE, CTX, microbatch=1, step=1, now=NOW, tensor=payload, meta=meta)
    opened = open_envelope(
        frame, remote_peer=ALICE.peer_id, expect=CTX, limits=loose, replay=ReplayGuard(), now=NOW
    )
    allocated: list[int] = []
    real_to = torch.Tensor.to
    monkeypatch.setattr(
        torch.Tensor, "to", lambda t, *a, **k: allocated.append(t.numel()) or real_to(t, *a, **k)
    )
    tight = dataclasses.replace(SHAPE.limits, max_bytes=1 << 19)  # our cap: 512 KiB (the payload: 256 KiB)
    with pytest.raises(CompressionError) as e:
        decode_opened(opened, INT8, tight)
    assert e.value.reason == TOO_LARGE and allocated == []
    # control: the same frame under a cap that does not hold it back decodes into the big float32 tensor
    assert decode_opened(opened, INT8, loose).tensors[""].numel() == big.numel()
    assert allocated == [big.numel()]


def test_a_payload_shorter_or_longer_than_declared_is_refused() -> None:
    payload, meta = encode(activation(), INT8, rounding=rounding())
    assert refused(payload[:-1], meta) == WRONG_LENGTH
    assert refused(torch.cat([payload, payload[:1]]), meta) == WRONG_LENGTH
    huge_shape = {**meta, META_PREFIX + "shape": [8, 32, 64 * 1024 * 1024]}  # a decode bomb's header
    assert refused(payload, huge_shape) == TOO_LARGE
    assert through_frame(payload, meta).tensors[""].shape == (4, 32, 64)  # control: the honest frame decodes


def test_nan_and_negative_scales_are_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    payload, meta = encode(activation(), INT8, rounding=rounding())
    for bad in (float("nan"), float("inf"), -1.0):
        poisoned = payload.clone()
        poisoned[:4].view(torch.float32)[0] = bad  # channel 0's scale
        assert refused(poisoned, meta) == BAD_SCALE
    # negative control: with the scale check off, the NaN scale reaches the decoded tensor
    poisoned = payload.clone()
    poisoned[:4].view(torch.float32)[0] = float("nan")
    monkeypatch.setattr(
        boundary_codec, "_read_scales", lambda data, n, bits: data[: n * 4].view(torch.float32)
    )
    assert bool(through_frame(poisoned, meta).tensors[""][..., 0].isnan().all())


def test_headers_out_of_schema_or_codec_are_refused() -> None:
    payload, meta = encode(activation(), INT8, rounding=rounding())
    assert refused(payload, meta, INT4) == WRONG_CODEC  # the manifest says int4
    assert refused(payload, {**meta, META_PREFIX + "codec": "int2"}) == BAD_HEADER
    assert refused(payload, {**meta, META_PREFIX + "extra": 1}) == BAD_HEADER
    assert refused(payload, {**meta, META_PREFIX + "shape": [4, 0, 64]}) == BAD_HEADER
    assert refused(payload, {**meta, META_PREFIX + "shape": "4x32x64"}) == BAD_HEADER
    assert refused(torch.zeros(4, 32, 64), meta) == BAD_HEADER  # the header on a float32 tensor
    fp32_run = dataclasses.replace(SHAPE, codec=BoundaryCodecSpec())
    with pytest.raises(CompressionError) as e:  # an fp32 run refuses an encoded tensor
        frame_limits = dataclasses.replace(fp32_run.limits, allowed_dtypes=frozenset({"float32", "uint8"}))
        through_frame(payload, meta, BoundaryCodecSpec(), limits=frame_limits)
    assert e.value.reason == WRONG_CODEC


# ---------------------------------------------------------------------------------------------------- pipeline


class CountingTransport:
    """DirectTransport that counts the bytes of the boundary tensors each way (requests and answers)."""

    def __init__(self, inner: Any) -> None:
        self.inner, self.bytes = inner, 0

    async def call(self, peer_id: str, rpc: str, frame: Any, **kw: Any) -> Any:
        self.bytes += len(frame)
        answer = await self.inner.call(peer_id, rpc, frame, **kw)
        self.bytes += len(answer)
        return answer


@pytest.mark.parametrize("codec", ["int8", "int4", "a4g2", "a5g2.3z", "a4.7g2.7z"])
def test_the_pipeline_trains_with_the_codec_on_and_sends_fewer_bytes(codec: str) -> None:
    losses, sent = {}, {}
    for name in ("fp32", codec):
        run = dataclasses.replace(
            local.manifest(), activation_codec=BoundaryCodecSpec(codec=name), wire=WireSpec(max_batch=8)
        )
        pipe = local.build_pipeline(run)
        counter = CountingTransport(pipe.driver.transport)
        pipe.driver.hops.transport = counter
        outcomes = local.drive_all(pipe, range(1, 5))
        assert all(o.completed for o in outcomes)
        losses[name] = sum(o.loss for o in outcomes) / len(outcomes)
        sent[name] = counter.bytes
    # tokens and headers shrink less than the boundary tensors
    assert sent[codec] < sent["fp32"] / {"int8": 2.5, "int4": 4.0}.get(codec, 4.5)
    assert abs(losses[codec] - losses["fp32"]) / losses["fp32"] < 0.01  # the same first steps, within noise


# ------------------------------------------------------------------------------------------------ low-bit codecs

GRAD_CTX = dataclasses.replace(CTX, kind=Kind.GRADIENT, direction=Direction.BACKWARD)
A4G2 = BoundaryCodecSpec(codec="a4g2")
LOWBIT_CODECS = list(lowbit.LOWBIT)  # every low-bit codec, those added later too
# those of a fixed payload size (the entropy-coded ones: tests/unit/test_boundary_entropy.py)
PACKED_CODECS = [codec for codec in LOWBIT_CODECS if codec not in lowbit.ENTROPY_CODED]


# relative error bounds of a round trip of `offsets()` by number of levels (2^b, and the fractional-bit grids)
ERROR_BOUND = {16: 0.12, 8: 0.25, 4: 0.75, 20: 0.1, 22: 0.09, 25: 0.08, 5: 0.6, 6: 0.45}
MID_BYTE_BOUND = {
    16: 0.2,
    8: 0.4,
    4: 1.0,
    20: 0.17,
    22: 0.15,
    25: 0.14,
    5: 0.8,
    6: 0.6,
}  # 105 values: noisier


def outliers(seed: int = 0) -> torch.Tensor:
    """Activations with two outlier channels 30x the rest: what the rotation is for."""
    x = torch.randn(4, 32, 64, generator=torch.Generator().manual_seed(seed))
    x[..., 5] *= 30
    x[..., 40] *= 30
    return x


def offsets(seed: int = 0) -> torch.Tensor:
    """Activations whose channels sit around offsets of their own (the harness model's, |mean| / std ~ 0.7)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(4, 32, 64, generator=g) + 2.0 * torch.randn(64, generator=g)


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def round_trip(
    x: torch.Tensor, spec: BoundaryCodecSpec, gradient: bool = False, noise: torch.Generator | None = None
) -> torch.Tensor:
    payload, meta = encode(x, spec, gradient=gradient, rounding=noise or rounding())
    return through_frame(payload, meta, spec, context=GRAD_CTX if gradient else CTX).tensors[""]


@pytest.mark.parametrize("width", [64, 48, 7])  # a power of two, blocks of 16, no Hadamard block (signs only)
def test_the_rotation_is_orthogonal_and_its_own_inverse(width: int) -> None:
    rows = torch.randn(10, width)
    turned = lowbit.rotate(rows)
    assert torch.allclose(turned.norm(dim=1), rows.norm(dim=1), rtol=1e-5)
    assert torch.allclose(lowbit.unrotate(turned), rows, atol=1e-5)
    assert not torch.allclose(turned, rows)


@pytest.mark.parametrize("codec", PACKED_CODECS)
@pytest.mark.parametrize("gradient", [False, True])
def test_low_bit_round_trip_sizes_and_errors(codec: Any, gradient: bool) -> None:
    x = offsets()
    spec = BoundaryCodecSpec(codec=codec)
    payload, _ = encode(x, spec, gradient=gradient, rounding=rounding())
    levels = lowbit.scheme_of(codec, gradient)[1]
    assert payload.numel() == boundary_codec.payload_size(codec, (4, 32, 64), gradient)
    assert (
        payload.numel() < x.numel() * lowbit.bits_per_value(levels) / 8 + 520
    )  # scales: 2 x 64 float32, or a byte per 16 values + 4
    back = round_trip(x, spec, gradient)
    # Gaussian-like values on that many levels; stochastic rounding (gradients) adds up to about sqrt(2)x that
    bound = ERROR_BOUND[levels] * (1.5 if gradient else 1.0)
    assert back.shape == x.shape and relative_error(back, x) < bound
    # fewer than 3.6 bits per value over one activation and one gradient
    assert compression_ratio(codec, (8, 32, 64)) > 9.0


def test_per_channel_offsets_beat_symmetric_int4_and_rotation_on_offset_channels() -> None:
    x = offsets()
    ours = relative_error(round_trip(x, A4G2), x)
    # negative controls on the same 4-bit activations: symmetric per channel, and rotated per position
    assert ours < 0.8 * relative_error(round_trip(x, INT4), x)
    assert ours < 0.8 * relative_error(round_trip(x, BoundaryCodecSpec(codec="rot4g2")), x)


def test_the_rotation_helps_on_outlier_channels() -> None:
    x = (
        outliers()[..., 0:1].expand(4, 32, 64).clone()
    )  # every channel the same: per position, one outlier-free row
    x[..., 5] *= 30  # one outlier channel: unrotated per-position scales would spend the grid on it
    rot = relative_error(round_trip(x, BoundaryCodecSpec(codec="rot4g2"), gradient=True), x)
    plain = relative_error(
        round_trip(x, A4G2, gradient=True), x
    )  # negative control: the same bits, no rotation
    assert rot < 0.75 * plain


def test_stochastic_rounding_of_gradients_is_unbiased() -> None:
    x = offsets(1)
    noise = rounding()  # one stream for all 64: each encoding draws new noise
    mean = torch.stack([round_trip(x, A4G2, True, noise) for _ in range(64)]).mean(dim=0)
    one = round_trip(x, A4G2, True, noise)
    assert relative_error(mean, x) < 2.0 * relative_error(one, x) / 64**0.5  # the noise averages out
    # negative control: nearest rounding to the same 2-bit grid is biased: its average is its one error
    payload = lowbit.encode_rows(x.reshape(-1, 64), "row", 2, rounding=None)
    assert payload is not None
    nearest = lowbit.decode_rows(payload, (4, 32, 64), "row", 2)
    assert relative_error(nearest, x) > 4.0 * relative_error(mean, x)


def test_block_scales_lose_less_than_row_scales_on_gradients() -> None:
    x = offsets() * torch.linspace(0.05, 3.0, 64)  # values whose size changes along the row
    block = relative_error(round_trip(x, BoundaryCodecSpec(codec="a4g2b"), gradient=True), x)
    row = relative_error(round_trip(x, A4G2, gradient=True), x)  # negative control: one scale per row
    assert block < 0.8 * row


@pytest.mark.parametrize("codec", LOWBIT_CODECS)
@pytest.mark.parametrize("gradient", [False, True])
def test_a_relayed_tensor_encodes_to_the_same_codes(codec: Any, gradient: bool) -> None:
    """The driver decodes a stage's answer and encodes it again for the next stage: nothing more is lost."""
    spec = BoundaryCodecSpec(codec=codec)
    payload, meta = encode(offsets(), spec, gradient=gradient, rounding=rounding())
    decoded = through_frame(payload, meta, spec, context=GRAD_CTX if gradient else CTX).tensors[""]
    again, _ = encode(decoded, spec, gradient=gradient, rounding=rounding(1))  # other noise
    assert float((again == payload).float().mean()) > 0.995


@pytest.mark.parametrize("codec", PACKED_CODECS)
def test_low_bit_decode_bombs_are_refused(codec: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    spec = BoundaryCodecSpec(codec=codec)
    payload, meta = encode(offsets(), spec, rounding=rounding())
    assert through_frame(payload, meta, spec).tensors[""].shape == (4, 32, 64)  # control: the honest frame
    # an activation's payload declared as a gradient: the length no longer matches (a3g3 aside: 3 bits both)
    if boundary_codec.payload_size(codec, (4, 32, 64), False) != boundary_codec.payload_size(
        codec, (4, 32, 64), True
    ):
        assert refused(payload, meta, spec, context=GRAD_CTX) == WRONG_LENGTH
    assert refused(payload[:-1], meta, spec) == WRONG_LENGTH
    assert refused(payload, {**meta, META_PREFIX + "shape": [8, 32, 64 * 1024 * 1024]}, spec) == TOO_LARGE
    assert refused(payload, meta, INT4) == WRONG_CODEC
    scale_at = 4 * 64 if codec.startswith("a") else 0  # the first channel's step, or the tensor's S
    for bad in (float("nan"), float("inf"), -1.0, 1e6):
        poisoned = payload.clone()
        poisoned[scale_at : scale_at + 4].view(torch.float32)[0] = bad
        assert refused(poisoned, meta, spec) == BAD_SCALE
    if codec.startswith("a"):  # a channel offset: NaN or beyond MAX_LO
        for bad in (float("nan"), float("-inf"), 1e30):
            poisoned = payload.clone()
            poisoned[:4].view(torch.float32)[0] = bad
            assert refused(poisoned, meta, spec) == BAD_SCALE
    # negative control: with the scale check off, a NaN scale reaches the decoded tensor
    poisoned = payload.clone()
    poisoned[scale_at : scale_at + 4].view(torch.float32)[0] = float("nan")
    monkeypatch.setattr(lowbit, "_read_scales", lambda data, n, bits: data[: n * 4].view(torch.float32))
    assert bool(through_frame(poisoned, meta, spec).tensors[""].isnan().any())


def test_any_row_exponent_decodes_to_finite_values() -> None:
    payload, meta = encode(offsets(), A4G2, gradient=True, rounding=rounding())
    extreme = payload.clone()
    extreme[4:132] = 255  # every row's exponent: it only shrinks S
    assert bool(through_frame(extreme, meta, A4G2, context=GRAD_CTX).tensors[""].isfinite().all())


@pytest.mark.parametrize("gradient", [False, True])
def test_a_tensor_the_low_bit_codec_cannot_carry_travels_as_fp32(gradient: bool) -> None:
    for bad in (float("nan"), 1e9):  # non-finite; a range past what the scales may hold
        x = offsets()
        x[0, 0, 0] = bad
        same, meta = encode(x, A4G2, gradient=gradient, rounding=rounding())
        assert same is x and meta == {}
    zeros, meta = encode(
        torch.zeros(4, 32, 64), A4G2, gradient=gradient, rounding=rounding()
    )  # step 0: decodes to zeros
    assert bool(
        (through_frame(zeros, meta, A4G2, context=GRAD_CTX if gradient else CTX).tensors[""] == 0).all()
    )


@pytest.mark.parametrize("codec", LOWBIT_CODECS)
def test_the_rounding_noise_is_the_callers_own_and_never_the_global_rng(codec: Any) -> None:
    spec, x = BoundaryCodecSpec(codec=codec), offsets()
    torch.manual_seed(1234)
    before = torch.get_rng_state()
    first, _ = encode(x, spec, gradient=True, rounding=rounding(7))
    encode(x, spec, rounding=rounding(7))
    assert torch.equal(torch.get_rng_state(), before)  # training's RNG (init, data order) never moves
    # the noise is the generator's alone: the same seed gives the same payload whatever ran in between ...
    torch.rand(100)
    assert torch.equal(encode(x, spec, gradient=True, rounding=rounding(7))[0], first)
    # ... and, control, another seed other codes: the generator really is the source of the noise
    assert not torch.equal(encode(x, spec, gradient=True, rounding=rounding(8))[0], first)


@pytest.mark.parametrize("codec", PACKED_CODECS)
@pytest.mark.parametrize("gradient", [False, True])
def test_low_bit_codes_whose_bits_end_mid_byte_round_trip(codec: Any, gradient: bool) -> None:
    """3 x 5 x 7 = 105 values: their codes end mid-byte, and the payload pads only that byte."""
    spec, shape = BoundaryCodecSpec(codec=codec), (3, 5, 7)
    x = offsets()[:3, :5, :7].contiguous()
    payload, meta = encode(x, spec, gradient=gradient, rounding=rounding())
    scheme, levels = lowbit.scheme_of(codec, gradient)
    scales = (
        2 * 4 * 7 if scheme == "channel" else 4 + 15
    )  # offsets and steps per channel, or S and 15 rows' e
    per_word, word_bits = lowbit.packing(levels)
    assert (
        payload.numel()
        == boundary_codec.payload_size(codec, shape, gradient)
        == scales + math.ceil(math.ceil(105 / per_word) * word_bits / 8)
    )
    context = GRAD_CTX if gradient else CTX
    back = through_frame(payload, meta, spec, context=context).tensors[""]
    assert back.shape == shape and relative_error(back, x) < MID_BYTE_BOUND[levels]
    # a decoder still holds the payload to its exact length (control: the honest one above decodes)
    assert refused(payload[:-1], meta, spec, context=context) == WRONG_LENGTH
    assert refused(torch.cat([payload, payload[:1]]), meta, spec, context=context) == WRONG_LENGTH


FRACTIONAL = [
    (codec, gradient)
    for codec in PACKED_CODECS
    for gradient in (False, True)
    if lowbit.packing(lowbit.scheme_of(codec, gradient)[1])[0] > 1
]


@pytest.mark.parametrize(("codec", "gradient"), FRACTIONAL)
def test_a_code_word_off_a_fractional_grid_is_refused(
    codec: Any, gradient: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Levels that are no power of two pack several codes into a word: a word past levels^n is refused."""
    spec, shape = BoundaryCodecSpec(codec=codec), (4, 32, 64)
    context = GRAD_CTX if gradient else CTX
    payload, meta = encode(offsets(), spec, gradient=gradient, rounding=rounding())
    scheme, levels = lowbit.scheme_of(codec, gradient)
    codes_at = payload.numel() - lowbit.codes_size(math.prod(shape), levels)
    assert through_frame(payload, meta, spec, context=context).tensors[""].shape == shape  # control: honest
    forged = payload.clone()
    forged[codes_at : codes_at + 8] = 0xFF  # the first words all ones: past levels^n
    assert refused(forged, meta, spec, context=context) == lowbit.BAD_CODE
    # negative control: with the check off the forged frame decodes, as another encoding of some tensor
    monkeypatch.setattr(lowbit, "_on_grid", lambda words, bound: True)
    assert through_frame(forged, meta, spec, context=context).tensors[""].shape == shape
