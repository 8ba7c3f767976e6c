"""`open_envelope(views=True)`: a received frame's tensors as views over the frame, not copies (the syncer's push
route: the frame is the push's only copy in memory, issue 17). Aligned at any header length, equal to the copies,
checked (signature, digest, finiteness) before anything is used; a refused frame is left as it was signed (the
evidence digest). Controls: the copy path allocates a second payload; a frame opened as views is moved in place."""

from __future__ import annotations

import asyncio
import tracemalloc
from typing import Any

import pytest
import torch

from node.roles.syncer_rpc import SyncerService
from protocol import envelope
from protocol.codec import TensorLimits
from protocol.envelope import Context, Direction, Kind, open_envelope, seal
from protocol.errors import DigestMismatch, TensorPolicyError
from protocol.identity import NodeIdentity
from protocol.replay import ReplayGuard
from tests.unit.test_syncer_ban_push import Host, live_learner, push_frame

pytestmark = pytest.mark.timeout(60)
NOW = 1_700_000_000.0
ALICE, BOB = NodeIdentity.generate(), NodeIdentity.generate()
LIMITS = TensorLimits(max_bytes=1 << 24, max_tensors=8)
CTX = Context(
    run_id="run-1",
    kind=Kind.FRAGMENT,
    receiver=BOB.peer_id,
    stage=envelope.NO_STAGE,
    direction=Direction.NONE,
)


def fragment(seed: int = 0, rows: int = 3) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {
        "w": torch.randn(rows, 5, generator=gen),
        "b": torch.randn(3, generator=gen).to(
            torch.bfloat16
        ),  # 6 bytes: the next tensor's offset is odd for it
        "ids": torch.arange(5),
        "v": torch.randn(7, generator=gen),
    }


def framed(tensors: dict[str, torch.Tensor], pad: int = 0) -> bytearray:
    """A signed frame whose header is `pad` bytes longer: the payload starts at every alignment."""
    meta = {"fragment": 0, "pad": "x" * pad}
    return bytearray(seal(ALICE, CTX, microbatch=0, step=1, now=NOW, tensors=tensors, meta=meta))


def opened(
    frame: bytes | bytearray, *, views: bool, limits: TensorLimits = LIMITS
) -> dict[str, torch.Tensor]:
    return open_envelope(
        frame,
        remote_peer=ALICE.peer_id,
        expect=CTX,
        limits=limits,
        replay=ReplayGuard(),
        now=NOW,
        views=views,
    ).tensors


def inside(tensor: torch.Tensor, frame: bytearray) -> bool:
    start = torch.frombuffer(frame, dtype=torch.uint8).data_ptr()
    return start <= tensor.data_ptr() < start + len(frame)


@pytest.mark.parametrize("pad", range(8))
def test_views_equal_the_copies_are_aligned_and_live_in_the_frame(pad: int) -> None:
    sent = fragment(pad)
    copies = opened(framed(sent, pad), views=False)
    frame = framed(sent, pad)
    views = opened(frame, views=True)
    assert list(views) == list(sent)
    assert all(torch.equal(views[n], t) and torch.equal(copies[n], t) for n, t in sent.items())
    assert all(t.data_ptr() % t.element_size() == 0 for t in views.values())
    assert inside(views["w"], frame) and inside(views["b"], frame)  # no copy of the payload's first tensors
    assert all(not inside(t, frame) for t in copies.values())  # control: the copy path's are private


def test_a_tampered_frame_is_refused_before_any_view() -> None:
    frame = framed(fragment())
    frame[-3] ^= 1
    with pytest.raises(DigestMismatch):
        opened(frame, views=True)


def test_a_refused_tensor_leaves_the_frame_as_signed() -> None:
    sent = fragment()
    sent["v"][2] = float("nan")
    frame = framed(sent, pad=1)
    signed = bytes(frame)
    with pytest.raises(TensorPolicyError):
        opened(frame, views=True)
    assert bytes(frame) == signed  # the evidence digest of a refused frame is the signed frame's
    honest = framed(fragment(), pad=1)
    before = bytes(honest)
    opened(honest, views=True)
    assert bytes(honest) != before  # control: opening as views moves the payload in place (pad 1: misaligned)


def peak_bytes(run: Any) -> int:
    tracemalloc.start()
    try:
        run()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_no_second_payload_is_allocated_when_opened_as_views() -> None:
    sent = fragment(rows=1 << 18)  # 5 MiB of float32
    size = sent["w"].numel() * 4
    frame = framed(sent, pad=3)
    as_views = peak_bytes(lambda: opened(frame, views=True))
    as_copies = peak_bytes(lambda: opened(framed(sent, pad=3), views=False))
    assert as_views < size // 8, as_views
    assert as_copies >= size, as_copies  # control: the copy path holds a second payload


def test_a_push_decoded_as_views_is_held_bit_identically_to_the_copy_path(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Through the syncer's push route: the contribution the core holds for its merge (what the merge reads) is the
    same, bit for bit. (This fixture's lone young learner merges at weight 0, so the merge itself is not run.)"""
    learner = NodeIdentity.generate()
    held: list[dict[str, torch.Tensor]] = []
    real_open = SyncerService._open
    for copy_path in (False, True):
        host = Host(swarm_banned=set())
        if copy_path:  # control: the push decoded as copies, as before
            monkeypatch.setattr(
                SyncerService, "_open", lambda self, *a, **k: real_open(self, *a, views=False)
            )
        live_learner(host, learner)
        torch.manual_seed(0)
        frame = push_frame(host, learner)
        assert asyncio.run(host.service._handle_push(bytearray(frame), learner.peer_id))
        entry = host.core.rounds[0].entries[learner.peer_id]
        held.append({n: t.clone() for n, t in entry.contribution.params.items()})
    views, copies = held
    assert list(views) == list(copies) and views
    assert all(torch.equal(views[n], copies[n]) for n in views)


def test_views_need_a_writable_frame() -> None:
    """bytes (read only) are copied as before: a view could not be moved into alignment."""
    frame = bytes(framed(fragment(), pad=2))
    tensors = opened(frame, views=True)
    assert all(torch.equal(tensors[n], t) for n, t in fragment().items())
