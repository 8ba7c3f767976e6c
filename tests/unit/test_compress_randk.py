"""randk (issue 20): a shared random mask, no index on the wire; the decoder refuses bad input before allocating."""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

from node.diloco.compression import (
    ContributionEncoder,
    ErrorFeedback,
    decode_contribution,
    encode_contribution,
    push_mask,
)
from node.diloco.fragments import plan_fragments
from node.diloco.sync_client import contribution_meta
from node.diloco.syncer_core import wire_params
from protocol import compress
from protocol.codec import TensorLimits
from protocol.compress import (
    BAD_HEADER,
    BAD_SCALE,
    TOO_LARGE,
    WRONG_CODEC,
    WRONG_LENGTH,
    WRONG_MASK,
    CodecSpec,
    MaskKey,
    compression_ratio,
    decode,
    encode,
    mask_for,
    mask_period,
    payload_size,
    randk_kept,
    randk_positions,
)
from protocol.errors import CompressionError, ProtocolError
from protocol.manifest import RunManifest, parse_run_toml

LIMITS = TensorLimits(max_bytes=64 << 20)
RANDK = CodecSpec(codec="randk", chunk=4096, k=410, bits=2, scale_bits=16)  # 1/10 at 2 bits
SIGN = CodecSpec(codec="randk", chunk=4096, k=819, bits=1, scale_bits=16)  # 1/5 at 1 bit
SMALL = CodecSpec(codec="randk", chunk=64, k=8, bits=4)
SPECS = (RANDK, SIGN, SMALL, CodecSpec(codec="randk", chunk=256, k=16, bits=8))
MASK = MaskKey(seed=12345, stratum=3)


def _gaussian(shape: tuple[int, ...], seed: int = 0) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * 1e-3


def _ids(spec: CodecSpec) -> str:
    return f"{spec.chunk}-{spec.k}-{spec.bits}"


@pytest.mark.parametrize("spec", SPECS, ids=_ids)
@pytest.mark.parametrize("shape", [(1,), (7,), (3, 5), (1000,), (2, 3, 4097)])
def test_randk_round_trips_on_the_mask_and_zeroes_the_rest(spec: CodecSpec, shape: tuple[int, ...]) -> None:
    x = _gaussian(shape)
    encoded = encode(x, spec, mask=MASK)
    assert encoded.nbytes == payload_size(spec, x.numel())
    y = decode(encoded.header, encoded.payload_tensor(), LIMITS, expect=spec, mask=MASK)
    assert y.shape == x.shape and y.dtype == torch.float32
    positions = randk_positions(spec, x.numel(), MASK)
    assert positions.numel() == randk_kept(spec, x.numel()) == int((y != 0).sum())
    sent = torch.zeros(x.numel(), dtype=torch.bool)
    sent[positions] = True
    assert bool((y.reshape(-1)[~sent] == 0).all())
    # the values on the mask keep the delta's direction (a quantizer, not noise)
    cosine = torch.nn.functional.cosine_similarity(y.reshape(-1)[sent], x.reshape(-1)[sent], dim=0)
    assert float(cosine) > (0.75 if spec.bits == 1 else 0.9)


def test_positions_are_k_per_chunk_increasing_and_in_range() -> None:
    numel = 3 * 4096 + 1000
    positions = randk_positions(RANDK, numel, MASK)
    chunks = positions // RANDK.chunk
    assert torch.bincount(chunks).tolist() == [410, 410, 410, math.ceil(1000 * 410 / 4096)]
    assert bool((positions[1:] > positions[:-1]).all()) and int(positions.max()) < numel


def test_both_sides_derive_the_same_mask_and_it_changes_with_fragment_and_version() -> None:
    for rotate in (True, False):
        spec = CodecSpec(codec="randk", k=410, bits=2, mask_rotate=rotate)
        a = mask_for(spec, run_seed=7, fragment=1, version=4)
        assert a == mask_for(spec, run_seed=7, fragment=1, version=4)
        assert torch.equal(randk_positions(spec, 20000, a), randk_positions(spec, 20000, a))
        for other in (
            mask_for(spec, run_seed=8, fragment=1, version=4),
            mask_for(spec, run_seed=7, fragment=2, version=4),
            mask_for(spec, run_seed=7, fragment=1, version=5),
        ):
            assert other != a
            assert not torch.equal(randk_positions(spec, 20000, other), randk_positions(spec, 20000, a))


def test_a_rotating_mask_covers_every_coordinate_once_per_period() -> None:
    numel = 2 * 4096 + 1808
    counts = torch.zeros(numel, dtype=torch.int64)
    for version in range(100, 100 + mask_period(RANDK)):
        counts[randk_positions(RANDK, numel, mask_for(RANDK, run_seed=1, fragment=0, version=version))] += 1
    assert int(counts.min()) == 1 and int(counts[: 2 * 4096].max()) == 2  # 10 x 410 = 4100: 4 twice a chunk
    # control: independent draws leave coordinates unsent over as many versions
    draw = CodecSpec(codec="randk", k=410, bits=2, mask_rotate=False)
    counts.zero_()
    for version in range(mask_period(draw)):
        counts[randk_positions(draw, numel, mask_for(draw, run_seed=1, fragment=0, version=version))] += 1
    assert int((counts == 0).sum()) > numel // 5


def test_randk_at_one_tenth_two_bits_is_over_150x_with_every_scale_counted() -> None:
    assert compression_ratio(RANDK, 1 << 20) > 156 and compression_ratio(SIGN, 1 << 20) > 156
    assert payload_size(RANDK, 4096) == 2 + math.ceil(410 * 2 / 8)


def test_randk_cannot_encode_without_a_mask() -> None:
    with pytest.raises(ValueError, match="mask"):
        encode(_gaussian((100,)), RANDK)


# ---------------------------------------------------------------------------------------------------- refusals


@pytest.fixture
def no_output_allocation(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The decoder allocates its output (torch.zeros) and the mask (torch.rand) only after every check."""

    def boom(*args: Any, **kwargs: Any) -> torch.Tensor:
        raise AssertionError("the decoder allocated before refusing")

    monkeypatch.setattr(compress.torch, "zeros", boom)
    monkeypatch.setattr(compress.torch, "rand", boom)
    yield


def _refused(reason: str, header: dict[str, Any], payload: bytes, **kw: Any) -> None:
    with pytest.raises(CompressionError) as info:
        decode(header, payload, LIMITS, **kw)
    assert info.value.reason == reason
    assert isinstance(info.value, ProtocolError) and info.value.blame_sender


_ENCODED = encode(_gaussian((3 * 4096,)), RANDK, mask=MASK)  # before any fixture stubs the allocators


def _encoded() -> compress.Encoded:
    return _ENCODED


def test_control_the_untouched_push_decodes_with_its_mask() -> None:
    encoded = _encoded()
    assert decode(encoded.header, encoded.payload, LIMITS, expect=RANDK, mask=MASK).shape == (3 * 4096,)
    # no expectation: the header's mask is used (range-checked only)
    assert decode(encoded.header, encoded.payload, LIMITS).shape == (3 * 4096,)


def test_control_the_allocation_trap_bites_on_an_untouched_push(no_output_allocation: None) -> None:
    with pytest.raises(AssertionError, match="allocated"):
        decode(_encoded().header, _encoded().payload, LIMITS, expect=RANDK, mask=MASK)


def test_a_huge_declared_size_or_wrong_length_is_refused_before_allocation(
    no_output_allocation: None,
) -> None:
    encoded = _encoded()
    for shape in ([1 << 40], [LIMITS.max_bytes // 4 + 1]):
        _refused(TOO_LARGE, {**encoded.header, "numel": math.prod(shape), "shape": shape}, encoded.payload)
    for payload in (encoded.payload[:-1], encoded.payload + b"\x00", b""):
        _refused(WRONG_LENGTH, encoded.header, payload)
    # the same payload declared as a larger tensor: its length no longer matches
    _refused(WRONG_LENGTH, {**encoded.header, "numel": 4 * 4096, "shape": [4 * 4096]}, encoded.payload)


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf, -1e-3])
def test_a_bad_scale_is_refused_before_allocation(value: float, no_output_allocation: None) -> None:
    encoded = _encoded()
    scale = torch.tensor([value], dtype=torch.float16).view(torch.uint8).numpy().tobytes()
    _refused(BAD_SCALE, encoded.header, scale + encoded.payload[len(scale) :])


@pytest.mark.parametrize(
    "edit",
    [
        lambda h: h.pop("mask_seed"),
        lambda h: h.update(mask_seed=-1),
        lambda h: h.update(mask_seed=1 << 62),
        lambda h: h.update(mask_seed=1.5),
        lambda h: h.update(mask_stratum=10),  # 4096 / 410 -> strata 0..9
        lambda h: h.update(mask_stratum=-1),
        lambda h: h.update(mask_stratum=True),
        lambda h: h.update(bits=3),
        lambda h: h.update(k=0),
        lambda h: h.update(extra=1),
    ],
)
def test_a_randk_header_out_of_schema_is_refused(
    edit: Callable[[dict[str, Any]], object], no_output_allocation: None
) -> None:
    header = dict(_encoded().header)
    edit(header)
    _refused(BAD_HEADER, header, _encoded().payload)


def test_a_push_on_another_mask_or_codec_is_refused(no_output_allocation: None) -> None:
    encoded = _encoded()
    _refused(WRONG_MASK, encoded.header, encoded.payload, expect=RANDK, mask=MaskKey(seed=12345, stratum=4))
    _refused(WRONG_MASK, encoded.header, encoded.payload, expect=RANDK, mask=MaskKey(seed=1, stratum=3))
    topk = CodecSpec(codec="topk", chunk=4096, k=410, bits=2, scale_bits=16)
    _refused(WRONG_CODEC, encoded.header, encoded.payload, expect=topk)


# ---------------------------------------------------------------------------------------------------- feedback, wire


def test_error_feedback_under_randk_delivers_the_sum_of_the_deltas() -> None:
    feedback, sent, total = ErrorFeedback(RANDK), torch.zeros(5000), torch.zeros(5000)
    for version in range(25):
        delta = _gaussian((5000,), seed=version)
        mask = mask_for(RANDK, run_seed=3, fragment=0, version=version)
        encoded = feedback.encode(0, delta, mask=mask)
        sent += decode(encoded.header, encoded.payload, LIMITS, mask=mask)
        total += delta
    residual = feedback.residual(0)
    assert residual is not None
    assert torch.allclose(sent + residual, total, atol=1e-6)
    assert float(residual.norm()) < 0.5 * float(total.norm())


def test_the_syncer_refuses_a_contribution_on_another_mask() -> None:
    base = {"w": torch.zeros(64, 80), "b": torch.zeros(80)}
    params = {"w": _gaussian((64, 80)), "b": _gaussian((80,), seed=1)}
    plan = plan_fragments({"w": 64 * 80, "b": 80}, 1, set())
    encoder = ContributionEncoder(RANDK, plan)
    mask = mask_for(RANDK, run_seed=9, fragment=0, version=2)
    sent = encoder.encode(0, base, params, mask=mask)
    names = plan.fragments[0].names
    rebuilt = decode_contribution(sent.tensors, sent.meta, spec=RANDK, base=base, names=names, mask=mask)
    assert set(rebuilt) == set(names)
    stale = mask_for(RANDK, run_seed=9, fragment=0, version=1)
    with pytest.raises(CompressionError) as info:
        decode_contribution(sent.tensors, sent.meta, spec=RANDK, base=base, names=names, mask=stale)
    assert info.value.reason == WRONG_MASK


def test_the_manifest_names_randk_and_its_mask_rotation() -> None:
    manifest = parse_run_toml('[outer_codec]\ncodec = "randk"\nk = 410\nbits = 1\nmask_rotate = false\n')
    assert manifest.outer_codec == CodecSpec(codec="randk", k=410, bits=1, mask_rotate=False)
    assert RunManifest.from_canonical_bytes(manifest.to_canonical_bytes()) == manifest
    with pytest.raises(ValueError, match="mask_rotate"):
        CodecSpec(codec="randk", mask_rotate=1)  # type: ignore[arg-type]


# ---------------------------------------------------------------------------------------------------- learner, syncer


def test_learner_and_syncer_derive_the_push_mask_from_its_base_version() -> None:
    from tests.unit.test_compressed_sync import lossy_learner, push_every_fragment

    spec = CodecSpec(codec="randk", chunk=256, k=32, bits=2)

    async def scenario() -> None:
        sync, model, syncer = lossy_learner(spec)
        initial = {n: t.detach().clone() for n, t in model.named_parameters()}
        await push_every_fragment(sync, model, syncer)
        live = dict(model.named_parameters())
        assert syncer.pushed
        for pushed in syncer.pushed:
            names = sync.plan.fragments[pushed.fragment].names
            mask = push_mask(spec, pushed.fragment, pushed.base_version)
            assert mask is not None and pushed.codec_meta["z_mask_seed"] == mask.seed
            meta = {**contribution_meta(pushed)}
            base = {n: initial[n] for n in names}
            rebuilt = decode_contribution(pushed.params, meta, spec=spec, base=base, names=names, mask=mask)
            true = torch.cat([(base[n] - live[n].detach()).reshape(-1) for n in names])
            got = torch.cat([(base[n] - rebuilt[n]).reshape(-1) for n in names])
            assert int((got != 0).sum()) == randk_kept(spec, true.numel())

    asyncio.run(asyncio.wait_for(scenario(), 20))


def test_wire_params_refuses_a_push_whose_mask_is_not_its_base_versions() -> None:
    from tests.unit.test_compressed_sync import PLAN, core, trained

    c = core()
    params, names = trained(c, 0, seed=1), PLAN.fragments[0].names
    on = {version: push_mask(RANDK, 0, version) for version in (0, 1)}
    sent = encode_contribution(ErrorFeedback(RANDK), 0, c.fragment_tensors(0), params, names, mask=on[1])
    assert wire_params(c, RANDK, 0, 1, sent.tensors, sent.meta)  # control: the version its mask follows
    with pytest.raises(CompressionError) as info:
        wire_params(c, RANDK, 0, 0, sent.tensors, sent.meta)  # the same push naming another base version
    assert info.value.reason == WRONG_MASK
