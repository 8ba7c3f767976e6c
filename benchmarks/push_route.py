"""Synthetic pushes sent through the syncer's real push route, in one process (benchmarks.scale `--push-route`, the
1B part's default): the route's stream server (`SyncerService`'s `FramedServer` handler, as the daemon would call it)
reads the request from a stream, writes it to a file of the core's spill directory as it arrives
(`protocol.rpc.SpillRoute`), opens the file (signature, replay, digest, finite values) and hands the push to the
core's `accept`, as a learner's push over the network is taken (node.roles.syncer_push).

The learner's side must not hold the push either, or the process would count a fragment the syncer does not hold:
the frame is generated a piece at a time as the stream is read (`PushStream`), twice over the same random stream
(once for the signed digest, once for the bytes), so neither side holds more than a chunk of it."""

from __future__ import annotations

import asyncio
import itertools
import secrets
import time
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import blake3
import torch

from node.diloco import chunked
from node.diloco.sync_client import PUSH_ROUTE, contribution_meta
from node.diloco.sync_types import OutgoingContribution
from protocol.envelope import (
    DIGEST_SIZE,
    PROTOCOL_VERSION,
    Context,
    Header,
    Kind,
    TensorSpec,
    encode_frame,
)
from protocol.identity import NodeIdentity
from protocol.rpc import Status, StreamConfig, encode_preamble, protocol_name

CHUNK_BYTES = StreamConfig().max_chunk_bytes  # the stream layer's chunk, as a learner sends it


def _values(current: dict[str, torch.Tensor], seed: int) -> Iterator[memoryview]:
    """The synthetic push's payload (each tensor's values plus noise, as `benchmarks.scale.synthetic_on_disk`
    builds them), a chunk at a time, the same bytes every time for one seed."""
    gen = torch.Generator().manual_seed(seed)
    for tensor in current.values():
        flat = tensor.view(-1)
        for start, stop in chunked.ranges(tensor.numel()):
            values = torch.randn(stop - start, generator=gen).mul_(1e-3).add_(flat[start:stop])
            yield values.numpy().data.cast("B")


def _framed(pieces: Iterator[memoryview]) -> Iterator[bytes]:
    """Chunk headers and chunks of `CHUNK_BYTES` (the last shorter) over the frame's bytes. A function, not a method:
    the route stops reading after the last chunk, so the generator stays suspended, and a method's generator would
    hold its stream in a reference cycle (the last 4 MiB piece kept until the cycle collector ran: measured, 4 MiB
    more resident per push)."""
    buffer = bytearray()
    for piece in pieces:
        buffer += piece
        while len(buffer) >= CHUNK_BYTES:
            yield CHUNK_BYTES.to_bytes(4, "big") + bytes(buffer[:CHUNK_BYTES])
            del buffer[:CHUNK_BYTES]
    if buffer:
        yield len(buffer).to_bytes(4, "big") + bytes(buffer)


class PushStream:
    """The wire bytes of one signed synthetic push (preamble, then chunks of `CHUNK_BYTES`), made as they are read:
    a stream reader for the route's server (`readexactly`), holding a chunk at a time."""

    def __init__(
        self,
        learner: NodeIdentity,
        receiver: str,
        run_id: str,
        current: dict[str, torch.Tensor],
        fragment: int,
    ) -> None:
        self.seed = secrets.randbits(31)
        hasher = blake3.blake3()
        for piece in _values(current, self.seed):
            hasher.update(piece)
        contribution = OutgoingContribution(
            fragment=fragment, params={}, base_version=0, steps=4, tokens=256, sent_step=4, sched_step=4,
            step_time_s=1.0,
        )  # fmt: skip
        context = Context(run_id=run_id, kind=Kind.FRAGMENT, receiver=receiver)
        header = Header(
            version=PROTOCOL_VERSION, run_id=run_id, kind=Kind.FRAGMENT, sender=learner.peer_id,
            receiver=receiver, stage=context.stage, direction=context.direction, microbatch=fragment, step=0,
            timestamp=time.time(), nonce=secrets.token_bytes(16),
            tensors=tuple(TensorSpec(n, "float32", tuple(t.shape)) for n, t in current.items()),
            digest=bytes(hasher.digest(DIGEST_SIZE)), meta=contribution_meta(contribution),
        )  # fmt: skip
        head = encode_frame(learner, header, [])
        total = len(head) + sum(4 * t.numel() for t in current.values())
        self._pending = bytearray(encode_preamble(Status.REQUEST, total, CHUNK_BYTES))
        self._chunks = _framed(itertools.chain([memoryview(head)], _values(current, self.seed)))

    async def readexactly(self, n: int) -> bytes:
        while len(self._pending) < n:
            piece = next(self._chunks, None)
            if piece is None:
                raise asyncio.IncompleteReadError(bytes(self._pending), n)
            self._pending += piece
        out = bytes(self._pending[:n])
        del self._pending[:n]
        return out


class Answer:
    """A stream writer that keeps the route's answer."""

    def __init__(self) -> None:
        self.data = bytearray()

    def write(self, data: Any) -> None:
        self.data += data

    async def drain(self) -> None:
        return None

    def close(self) -> None:
        return None

    async def wait_closed(self) -> None:
        return None

    def refusal(self) -> str | None:
        """None for an OK answer, else the reason the route gave (after the preamble and a chunk header)."""
        if self.data[5] == Status.OK:
            return None
        return bytes(self.data[24:]).decode(errors="replace") or "no answer"


class _FakeP2P:
    def __init__(self) -> None:
        self.handlers: dict[str, Any] = {}

    async def add_binary_stream_handler(self, name: str, handler: Any) -> None:
        self.handlers[name] = handler


async def push_route(service: Any) -> Any:
    """The service's push route as the P2P daemon calls it: handler(stream info, reader, writer)."""
    p2p = _FakeP2P()
    await service.start(p2p, on_throttle=lambda *a: None)
    return p2p.handlers[protocol_name(PUSH_ROUTE)]


async def send_push(handler: Any, learner: NodeIdentity, stream: PushStream) -> str | None:
    """One push through the route; the refusal's reason, if refused."""
    info = SimpleNamespace(peer_id=SimpleNamespace(to_base58=lambda: learner.peer_id))
    answer = Answer()
    await handler(info, stream, answer)
    return answer.refusal()
