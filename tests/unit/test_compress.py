"""Compressed outer gradients (issue 20): error bounds per codec, ratios from real encoded sizes, decode bombs refused
with a typed error before the output is allocated (each beside a well-formed control), and error feedback."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

from node.diloco.compression import ErrorFeedback, relative_error
from protocol import compress
from protocol.bitpack import pack_bits
from protocol.codec import TensorLimits
from protocol.compress import (
    BAD_HEADER,
    BAD_INDEX,
    BAD_SCALE,
    NON_FINITE,
    TOO_LARGE,
    WRONG_CODEC,
    WRONG_LENGTH,
    CodecSpec,
    compression_ratio,
    decode,
    encode,
    index_bits,
    payload_size,
    topk_kept,
)
from protocol.errors import CompressionError, ProtocolError

LIMITS = TensorLimits(max_bytes=64 << 20)
FP32 = CodecSpec(codec="fp32")
INT8 = CodecSpec(codec="int8", block=64)
INT4 = CodecSpec(codec="int4", block=64, scale_bits=16)
TOPK = CodecSpec(codec="topk", chunk=256, k=8, bits=4)
SPARSELOCO = CodecSpec(codec="topk", chunk=4096, k=32, bits=2, scale_bits=16)
ALL_SPECS = (FP32, INT8, INT4, TOPK, SPARSELOCO)


def _gaussian(shape: tuple[int, ...], seed: int = 0, scale: float = 1e-3) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * scale


def _roundtrip(x: torch.Tensor, spec: CodecSpec) -> torch.Tensor:
    encoded = encode(x, spec)
    assert encoded.nbytes == payload_size(spec, x.numel())
    return decode(encoded.header, encoded.payload_tensor(), LIMITS, expect=spec)


# ---------------------------------------------------------------------------------------------------- round trips


@pytest.mark.parametrize("spec", ALL_SPECS, ids=lambda s: f"{s.codec}-{s.k}-{s.bits}")
@pytest.mark.parametrize("shape", [(1,), (7,), (3, 5), (1000,), (2, 3, 4097), (64, 64)])
def test_every_codec_round_trips_shape_and_dtype(spec: CodecSpec, shape: tuple[int, ...]) -> None:
    x = _gaussian(shape)
    y = _roundtrip(x, spec)
    assert y.shape == x.shape and y.dtype == torch.float32 and bool(torch.isfinite(y).all())


def test_fp32_is_exact() -> None:
    x = _gaussian((3, 333))
    assert torch.equal(_roundtrip(x, FP32), x)


@pytest.mark.parametrize(("spec", "qmax"), [(INT8, 127), (INT4, 7)])
def test_block_quantizers_err_at_most_half_a_step_per_element(spec: CodecSpec, qmax: int) -> None:
    x = _gaussian((10_000,), seed=1)
    y = _roundtrip(x, spec)
    blocks = torch.nn.functional.pad(x, (0, (-x.numel()) % spec.block)).view(-1, spec.block)
    step = (blocks.abs().amax(dim=1) / qmax).repeat_interleave(spec.block)[: x.numel()]
    # half a step, plus the float16 rounding of the scale (2**-11 relative) on the largest element
    assert bool(((y - x).abs() <= step * (0.5 + qmax * 2**-10)).all())


def test_int8_relative_error_is_small_and_int4_bounded() -> None:
    x = _gaussian((1 << 16,), seed=2)
    assert relative_error(_roundtrip(x, INT8), x) < 0.01
    assert relative_error(_roundtrip(x, INT4), x) < 0.15


def test_topk_keeps_exactly_the_k_largest_of_every_chunk() -> None:
    x = _gaussian((10 * 256 + 5,), seed=3)  # a short last chunk, with fewer elements than k... plus five
    y = _roundtrip(x, TOPK)
    for start in range(0, x.numel(), TOPK.chunk):
        chunk, out = x[start : start + TOPK.chunk], y[start : start + TOPK.chunk]
        k = min(TOPK.k, chunk.numel())
        assert set(out.nonzero().flatten().tolist()) == set(chunk.abs().topk(k).indices.tolist())
        kept = chunk.abs().topk(k).indices
        half_step = chunk[kept].abs().max() / (1 << (TOPK.bits - 1)) / 2
        assert bool(((out[kept] - chunk[kept]).abs() <= half_step * 1.001).all())
        assert bool((torch.sign(out[kept]) == torch.sign(chunk[kept])).all())


def test_topk_last_chunk_shorter_than_k_keeps_everything() -> None:
    x = _gaussian((256 + 3,), seed=4)
    y = _roundtrip(x, TOPK)
    assert bool((y[256:] != 0).all())
    assert topk_kept(TOPK, x.numel()) == TOPK.k + 3


def test_zero_tensor_decodes_to_zero_in_every_codec() -> None:
    for spec in ALL_SPECS:
        assert not bool(_roundtrip(torch.zeros(300), spec).any())


def test_encoder_refuses_what_it_cannot_represent() -> None:
    with pytest.raises(ValueError, match="NaN"):
        encode(torch.tensor([1.0, math.nan]), INT8)
    with pytest.raises(ValueError, match="scale above"):
        encode(torch.tensor([1e12]), INT8)
    with pytest.raises(ValueError, match="empty dimension"):
        encode(torch.zeros(0), INT8)
    with pytest.raises(ValueError, match="bad codec spec"):
        CodecSpec(codec="topk", chunk=64, k=65)


# ---------------------------------------------------------------------------------------------------- ratios

RATIO_NUMEL = 1 << 20  # a 4 MiB float32 fragment


def _measured_ratio(spec: CodecSpec) -> float:
    x = _gaussian((RATIO_NUMEL,), seed=6)
    return 4 * x.numel() / encode(x, spec).nbytes


@pytest.mark.parametrize(
    ("spec", "at_least"),
    [
        (CodecSpec(codec="int8", block=128), 3.5),
        (CodecSpec(codec="int4", block=128), 7.0),
        (CodecSpec(codec="int4", block=128, scale_bits=16), 7.5),
        (CodecSpec(codec="topk", chunk=4096, k=64, bits=4), 50.0),  # density 1/64, int4 values: 124x
        (CodecSpec(codec="topk", chunk=4096, k=64, bits=2, scale_bits=16), 140.0),  # SparseLoCo's own: 143.7x
        (SPARSELOCO, 150.0),  # k=32, 2-bit values, 12-bit indices, fp16 scales: 282x, index cost included
    ],
    ids=lambda v: str(v) if isinstance(v, float) else f"{v.codec}-{v.k}-{v.bits}-{v.scale_bits}",
)
def test_compression_ratio_from_encoded_bytes(spec: CodecSpec, at_least: float) -> None:
    ratio = _measured_ratio(spec)
    assert ratio >= at_least
    assert ratio == pytest.approx(compression_ratio(spec, RATIO_NUMEL))


def test_sparseloco_index_cost_is_counted() -> None:
    assert index_bits(4096) == 12 and index_bits(3000) == 12 and index_bits(2) == 1
    # per 4096-element chunk: 32 x (12 + 2) bits = 56 bytes, plus a 2-byte scale
    assert payload_size(SPARSELOCO, 4096) == 58


# ---------------------------------------------------------------------------------------------------- decode bombs


@pytest.fixture
def no_output_allocation(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The decoder allocates its output with torch.zeros only: make that fail, so a refusal proves it came first."""

    def boom(*args: Any, **kwargs: Any) -> torch.Tensor:
        raise AssertionError("the decoder allocated its output before refusing")

    monkeypatch.setattr(compress.torch, "zeros", boom)
    yield


def _refused(reason: str, header: dict[str, Any], payload: bytes | torch.Tensor, **kw: Any) -> None:
    with pytest.raises(CompressionError) as info:
        decode(header, payload, LIMITS, **kw)
    assert info.value.reason == reason
    assert isinstance(info.value, ProtocolError) and info.value.blame_sender


@pytest.mark.parametrize("spec", ALL_SPECS, ids=lambda s: f"{s.codec}-{s.k}")
def test_a_huge_declared_numel_is_refused_before_allocation(
    spec: CodecSpec, no_output_allocation: None
) -> None:
    encoded = encode(_gaussian((4096,)), spec)
    for shape in ([1 << 40], [1 << 20, 1 << 20], [LIMITS.max_bytes // 4 + 1]):
        header = {**encoded.header, "numel": math.prod(shape), "shape": shape}
        _refused(TOO_LARGE, header, encoded.payload)


def test_control_a_well_formed_payload_of_the_same_shape_decodes() -> None:
    for spec in ALL_SPECS:
        encoded = encode(_gaussian((4096,)), spec)
        assert decode(encoded.header, encoded.payload, LIMITS).shape == (4096,)
    at_cap = torch.zeros(LIMITS.max_bytes // 4)
    assert decode(encode(at_cap, SPARSELOCO).header, encode(at_cap, SPARSELOCO).payload, LIMITS).numel() == (
        LIMITS.max_bytes // 4
    )


@pytest.mark.parametrize(
    "edit",
    [
        lambda h: h.pop("scale_bits", h.pop("shape")),
        lambda h: h.update(extra=1),
        lambda h: h.update(codec="zstd"),
        lambda h: h.update(codec=["topk"]),
        lambda h: h.update(numel=h["numel"] + 1),
        lambda h: h.update(numel=True),
        lambda h: h.update(shape=[0]),
        lambda h: h.update(shape=[-4096]),
        lambda h: h.update(shape="4096"),
        lambda h: h.update(scale_bits=8),
        lambda h: h.update(scale_bits=16.0),
    ],
)
@pytest.mark.parametrize("spec", [INT4, SPARSELOCO], ids=["int4", "topk"])
def test_a_header_out_of_schema_is_refused(
    spec: CodecSpec, edit: Callable[[dict[str, Any]], object], no_output_allocation: None
) -> None:
    encoded = encode(_gaussian((4096,)), spec)
    header = dict(encoded.header)
    edit(header)
    _refused(BAD_HEADER, header, encoded.payload)


@pytest.mark.parametrize(
    "edit",
    [
        lambda h: h.update(k=4097),
        lambda h: h.update(k=0),
        lambda h: h.update(chunk=1 << 20),
        lambda h: h.update(bits=3),
        lambda h: h.update(bits=True),
    ],
)
def test_topk_parameters_out_of_range_are_refused(
    edit: Callable[[dict[str, Any]], object], no_output_allocation: None
) -> None:
    encoded = encode(_gaussian((4096,)), SPARSELOCO)
    header = dict(encoded.header)
    edit(header)
    _refused(BAD_HEADER, header, encoded.payload)


def test_a_codec_other_than_the_expected_one_is_refused(no_output_allocation: None) -> None:
    encoded = encode(_gaussian((4096,)), SPARSELOCO)
    _refused(WRONG_CODEC, encoded.header, encoded.payload, expect=INT8)
    other_k = CodecSpec(codec="topk", chunk=4096, k=64, bits=2, scale_bits=16)
    _refused(WRONG_CODEC, encoded.header, encoded.payload, expect=other_k)


@pytest.mark.parametrize("spec", ALL_SPECS, ids=lambda s: f"{s.codec}-{s.k}")
def test_a_payload_of_the_wrong_length_is_refused(spec: CodecSpec, no_output_allocation: None) -> None:
    encoded = encode(_gaussian((4096,)), spec)
    for payload in (encoded.payload[:-1], encoded.payload + b"\x00", b""):
        _refused(WRONG_LENGTH, encoded.header, payload)
    _refused(BAD_HEADER, encoded.header, torch.ones(encoded.nbytes // 4, dtype=torch.int32))


def _with_scale(encoded: compress.Encoded, spec: CodecSpec, value: float) -> bytes:
    dtype = compress.SCALE_DTYPES[spec.scale_bits]
    scale = torch.tensor([value], dtype=dtype).view(torch.uint8).numpy().tobytes()
    return scale + encoded.payload[len(scale) :]


@pytest.mark.parametrize("spec", [INT8, INT4, TOPK, SPARSELOCO], ids=lambda s: f"{s.codec}-{s.k}")
@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf, -1e-3, 1e6])
def test_a_bad_scale_is_refused(spec: CodecSpec, value: float, no_output_allocation: None) -> None:
    encoded = encode(_gaussian((4096,)), spec)
    if value == 1e6 and spec.scale_bits == 16:
        value = math.inf  # float16 has no 1e6: the largest float16 is MAX_SCALE itself
    _refused(BAD_SCALE, encoded.header, _with_scale(encoded, spec, value))


def test_control_a_zero_or_largest_scale_decodes() -> None:
    encoded = encode(_gaussian((4096,)), INT8)
    for value in (0.0, compress.MAX_SCALE):
        assert decode(encoded.header, _with_scale(encoded, INT8, value), LIMITS).shape == (4096,)


def test_fp32_payload_with_nan_is_refused() -> None:
    x = _gaussian((64,))
    encoded = encode(x, FP32)
    bad = x.clone()
    bad[5] = math.nan
    _refused(NON_FINITE, encoded.header, bad.numpy().tobytes())


def _topk_payload(spec: CodecSpec, numel: int, local: list[int]) -> bytes:
    """A topk payload with chosen local indices (scales 1, values all at level 1), for index bombs."""
    num_chunks = -(-numel // spec.chunk)
    scales = torch.ones(num_chunks, dtype=compress.SCALE_DTYPES[spec.scale_bits]).view(torch.uint8)
    values = torch.ones(len(local), dtype=torch.int64)  # level 1 of 2 bits: (1 - 2 + 0.5) x scale, non-zero
    indices = pack_bits(torch.tensor(local), index_bits(spec.chunk))
    return torch.cat([scales, indices, pack_bits(values, spec.bits)]).numpy().tobytes()


def _header(spec: CodecSpec, numel: int) -> dict[str, Any]:
    return {**spec.header_fields(), "numel": numel, "shape": [numel]}


SMALL_TOPK = CodecSpec(codec="topk", chunk=3000, k=3, bits=2)  # not a power of two: 12-bit indices reach 4095


@pytest.mark.parametrize(
    ("numel", "local"),
    [
        (6000, [0, 1, 4000, 0, 1, 2]),  # past a full chunk (the index width allows it)
        (3010, [0, 1, 2, 5, 7, 10]),  # past the end of a short last chunk
        (6000, [0, 2, 2, 0, 1, 2]),  # a repeated index
        (6000, [0, 2, 1, 0, 1, 2]),  # decreasing
        (6000, [0, 1, 2, 5, 4, 9]),  # decreasing in the second chunk
    ],
)
def test_bad_topk_indices_are_refused(numel: int, local: list[int], no_output_allocation: None) -> None:
    _refused(BAD_INDEX, _header(SMALL_TOPK, numel), _topk_payload(SMALL_TOPK, numel, local))


@pytest.mark.parametrize(
    ("numel", "local"),
    [(6000, [0, 1, 2999, 0, 1, 2]), (3010, [0, 1, 2, 5, 7, 9]), (6000, [0, 1, 2, 0, 1, 2])],
)
def test_control_good_topk_indices_decode(numel: int, local: list[int]) -> None:
    # a new chunk may restart at a lower index; only within a chunk must indices rise
    out = decode(_header(SMALL_TOPK, numel), _topk_payload(SMALL_TOPK, numel, local), LIMITS)
    assert int((out != 0).sum()) == 6


# ---------------------------------------------------------------------------------------------------- error feedback


def _structured_delta(step: int, chunks: int = 16, chunk: int = 64) -> torch.Tensor:
    """Per chunk 8 large coordinates (|x| ~ 1) and 56 small ones (0.05, fixed signs): k=4 top-k never picks a small
    one on its own, so without feedback the small ones are lost for good."""
    gen = torch.Generator().manual_seed(1000 + step)
    x = torch.full((chunks, chunk), 0.05) * torch.where(torch.arange(chunk) % 2 == 0, 1.0, -1.0)
    x[:, :8] = 1.0 + 0.1 * torch.randn(chunks, 8, generator=gen)
    return x.reshape(-1)


EF_TOPK = CodecSpec(codec="topk", chunk=64, k=4, bits=4)


def _run_feedback(feedback: ErrorFeedback, steps: int) -> tuple[torch.Tensor, torch.Tensor, list[float]]:
    true_sum = torch.zeros(16 * 64)
    decoded_sum = torch.zeros(16 * 64)
    residual_norms = []
    for step in range(steps):
        delta = _structured_delta(step)
        encoded = feedback.encode(0, delta)
        true_sum += delta
        decoded_sum += decode(encoded.header, encoded.payload, LIMITS, expect=EF_TOPK)
        residual_norms.append(feedback.residual_norm(0))
    return true_sum, decoded_sum, residual_norms


def test_error_feedback_sums_track_the_true_deltas_and_the_residual_stays_bounded() -> None:
    feedback = ErrorFeedback(EF_TOPK)
    true_sum, decoded_sum, residual_norms = _run_feedback(feedback, 200)
    residual = feedback.residual(0)
    assert residual is not None
    # by construction: what was sent plus what is kept is exactly what was trained
    assert torch.allclose(decoded_sum + residual, true_sum, atol=1e-3)
    assert relative_error(decoded_sum, true_sum) < 0.05
    # bounded: it plateaus (at ~42 here, ~4 deltas: per chunk 4 kept entries carry 8 + 2.8 units of work a step)
    assert max(residual_norms[100:]) <= 1.1 * max(residual_norms[:100])
    assert max(residual_norms) < 6 * float(_structured_delta(0).norm())
    small = torch.arange(16 * 64) % 64 >= 8
    assert relative_error(decoded_sum[small], true_sum[small]) < 0.2  # the small coordinates arrive too


def test_without_feedback_top_k_loses_the_small_coordinates() -> None:
    feedback = ErrorFeedback(EF_TOPK, enabled=False)
    true_sum, decoded_sum, _ = _run_feedback(feedback, 200)
    small = torch.arange(16 * 64) % 64 >= 8
    assert not bool(decoded_sum[small].any())
    assert relative_error(decoded_sum, true_sum) > 0.3  # half the large ones' work is lost too
    assert feedback.residual(0) is None


def test_feedback_decay_scales_the_residual_once_committed_and_never_travels() -> None:
    decayed = CodecSpec(codec="topk", chunk=64, k=4, bits=4, feedback_decay=0.5)
    full, half = ErrorFeedback(EF_TOPK), ErrorFeedback(decayed)
    a, b = full.encode(0, _structured_delta(0)), half.encode(0, _structured_delta(0))
    # a learner-side setting: the same bytes and header
    assert a.header == b.header and a.payload == b.payload
    assert torch.allclose(half.residual(0), 0.5 * full.residual(0))  # type: ignore[operator]
    # the receiver decodes it with either spec as `expect` (the header has no decay to disagree on)
    decode(b.header, b.payload, LIMITS, expect=EF_TOPK)
    # the sums no longer track the true deltas exactly (a fading residual), but stay bounded and close
    true_sum, decoded_sum, norms = _run_feedback(ErrorFeedback(decayed), 200)
    assert max(norms[100:]) <= max(norms[:100]) * 1.1
    assert relative_error(decoded_sum, true_sum) < 0.5


@pytest.mark.parametrize("decay", [0.0, -0.5, 1.5, math.nan, math.inf, True, "0.9"])
def test_a_feedback_decay_outside_0_1_is_refused(decay: object) -> None:
    with pytest.raises(ValueError, match="feedback_decay"):
        CodecSpec(codec="topk", feedback_decay=decay)  # type: ignore[arg-type]


def test_quantizer_feedback_keeps_the_residual_within_one_step() -> None:
    feedback = ErrorFeedback(INT4)
    for step in range(50):
        delta = _gaussian((4096,), seed=step)
        feedback.encode(3, delta)
        residual = feedback.residual(3)
        assert residual is not None
        assert float(residual.abs().max()) <= float(delta.abs().max()) / 7  # under one int4 step of the block


def test_feedback_starts_afresh_on_a_new_shape_and_after_forget() -> None:
    feedback = ErrorFeedback(EF_TOPK)
    feedback.encode(1, _structured_delta(0))
    assert feedback.total_bytes() == 4 * 16 * 64
    feedback.encode(1, torch.ones(128))  # another plan: the old residual does not apply
    assert feedback.residual(1) is not None and feedback.residual(1).shape == (128,)  # type: ignore[union-attr]
    feedback.forget(1)
    assert feedback.residual(1) is None and feedback.total_bytes() == 0
    assert ErrorFeedback(FP32).encode(0, torch.ones(8)).nbytes == 32
    assert ErrorFeedback(FP32).enabled is False


# ---------------------------------------------------------------------------------------------------- on the wire


def test_an_encoded_delta_travels_in_a_signed_envelope() -> None:
    """Header fields in the meta (ints and the codec name), the payload as one uint8 tensor: the envelope's own
    caps then bound the compressed bytes, and `decode` bounds the decoded size with the manifest's limits."""
    from protocol.envelope import Context, Kind, open_envelope, seal
    from protocol.identity import NodeIdentity
    from protocol.replay import ReplayGuard

    alice, bob = NodeIdentity.generate(), NodeIdentity.generate()
    context = Context(run_id="run-1", kind=Kind.FRAGMENT, receiver=bob.peer_id)
    x = _gaussian((3, 4096), seed=7)
    encoded = encode(x, SPARSELOCO)
    frame = seal(
        alice,
        context,
        microbatch=0,
        step=0,
        now=1e9,
        tensors={"delta": encoded.payload_tensor()},
        meta=encoded.header,
    )
    wire_limits = TensorLimits(max_bytes=encoded.nbytes, allowed_dtypes=frozenset({"uint8"}))
    opened = open_envelope(
        frame, remote_peer=alice.peer_id, expect=context, limits=wire_limits, replay=ReplayGuard(), now=1e9
    )
    decoded = decode(opened.meta, opened.tensors["delta"], LIMITS, expect=SPARSELOCO)
    assert torch.equal(decoded, _roundtrip(x, SPARSELOCO))


def test_a_fragment_travels_as_one_vector_and_the_syncer_recovers_the_params() -> None:
    from node.diloco.compression import fragment_delta, params_from_delta, unflatten_fragment
    from protocol.compress import header_from_meta, header_to_meta

    names = ["b.weight", "a.bias"]  # plan order, not sorted order
    base = {"a.bias": _gaussian((5,), seed=8, scale=1.0), "b.weight": _gaussian((3, 7), seed=9, scale=1.0)}
    params = {name: t - _gaussian(t.shape, seed=10 + i) for i, (name, t) in enumerate(base.items())}
    delta = fragment_delta(base, params, names)
    assert delta.shape == (26,)
    encoded = encode(delta, FP32)
    meta = {"fragment": 3, **header_to_meta(encoded.header)}  # beside the contribution's own fields
    decoded = decode(header_from_meta(meta), encoded.payload, LIMITS, expect=FP32)
    recovered = params_from_delta(base, decoded, names)
    assert set(recovered) == set(names)
    for name in names:
        assert torch.allclose(recovered[name], params[name], atol=1e-6)
    with pytest.raises(ValueError, match="elements"):
        unflatten_fragment(torch.zeros(25), {"a.bias": (5,), "b.weight": (3, 7)}, names)
