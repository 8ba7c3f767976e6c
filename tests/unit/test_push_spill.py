"""The syncer's push received into a spill file as it arrives (protocol.rpc.SpillRoute, protocol.frame_file,
node.roles.syncer_push; issue 17): the contribution it gives is the in-memory route's, bit for bit; a tampered frame is
refused before any tensor of it is used, a truncated or oversize one is a typed error, and none leaves a file; the
file lives until the contribution is merged or dropped; receiving N MiB holds a chunk, not N MiB (control: in memory
it holds >= N MiB). Everything runs the real stream server over in-memory streams (no daemon, no sleeps)."""

from __future__ import annotations

import asyncio
import gc
import time
import tracemalloc
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

import node.roles.syncer_rpc as syncer_rpc
import protocol.frame_file as frame_file
from node.diloco.quorum import QuorumConfig
from node.diloco.spill import SpilledTensors
from node.diloco.sync_client import PUSH_ROUTE
from node.diloco.syncer_core import SyncerCore
from node.ml.model import ModelConfig, embedding_param_names
from node.roles.syncer_rpc import SyncerService
from protocol.envelope import Context, Kind, seal, seal_streaming
from protocol.errors import FrameTooLarge, StreamClosed
from protocol.identity import NodeIdentity
from protocol.rpc import (
    FramedServer,
    Route,
    SpillRoute,
    Status,
    StreamConfig,
    encode_preamble,
    protocol_name,
    write_message,
)
from tests.unit.test_syncer_ban_push import MODEL, RUN_ID, Host, live_learner, push_frame

pytestmark = [pytest.mark.timeout(60), pytest.mark.usefixtures("params_mode")]

CHUNK = 1 << 16


class Collector:
    """A stream writer that keeps what is written (the wire bytes of a message)."""

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


class WireReader:
    """A stream reader over given wire bytes (held by the test, not by the receiver), ending where they end."""

    def __init__(self, wire: bytes | bytearray) -> None:
        self.view, self.at = memoryview(wire), 0

    async def readexactly(self, n: int) -> bytes:
        if self.at + n > len(self.view):
            rest = bytes(self.view[self.at :])
            self.at = len(self.view)
            raise asyncio.IncompleteReadError(rest, n)
        out = bytes(self.view[self.at : self.at + n])
        self.at += n
        return out

    async def read(self, n: int) -> bytes:
        out = bytes(self.view[self.at : self.at + n])
        self.at += len(out)
        return out


def wire(body: Any, chunk: int = CHUNK) -> bytearray:
    """A request as the caller's stream layer sends it (a `StreamingFrame` goes head last)."""
    out = Collector()
    asyncio.run(write_message(out, Status.REQUEST, body, config=StreamConfig(max_chunk_bytes=chunk)))  # type: ignore[arg-type]
    return out.data


def frame_files(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if p.name.startswith(frame_file.FILE_PREFIX))


# ------------------------------------------------------------------------------------------------ the stream layer


def receiver(
    spill_dir: Path, handled: list[Any], *, max_bytes: int = 1 << 30, min_bytes: int = 0
) -> tuple[FramedServer, Route]:
    async def on_file(frame: frame_file.FrameFile, remote: str) -> bytes:
        handled.append((frame.read(0, frame.size), frame.path))
        return b"ok"

    async def in_memory(frame: bytearray, remote: str) -> bytes:
        handled.append((bytes(frame), None))
        return b"ok"

    route = Route(in_memory, max_bytes, spill=SpillRoute(lambda: spill_dir, on_file, min_bytes))
    server = FramedServer(None, {"push": route}, config=StreamConfig(max_chunk_bytes=CHUNK))  # type: ignore[arg-type]
    return server, route


def serve(server: FramedServer, route: Route, data: bytes | bytearray) -> Any:
    return asyncio.run(server._handle("push", route, "peer", WireReader(data)))  # type: ignore[arg-type]


@pytest.mark.parametrize("streaming", [False, True])
def test_a_frame_arrives_in_a_file_byte_for_byte_and_the_file_goes_after(
    tmp_path: Path, streaming: bool
) -> None:
    sender, receiver_id = NodeIdentity.generate(), NodeIdentity.generate()
    tensors = {"a": torch.randn(70_000), "b": torch.randn(3, 5)}
    context = Context(run_id=RUN_ID, kind=Kind.FRAGMENT, receiver=receiver_id.peer_id)
    sealed = seal_streaming(sender, context, microbatch=0, step=0, now=time.time(), tensors=tensors)
    handled: list[Any] = []
    server, route = receiver(tmp_path, handled)
    assert serve(server, route, wire(sealed if streaming else sealed.to_bytes())) == b"ok"
    ((got, path),) = handled
    assert path is not None and path.parent == tmp_path  # in a file, not in memory
    # (the head of a head-last frame is put in front: the file is the frame in its usual layout)
    assert got == bytes(sealed.to_bytes())
    assert frame_files(tmp_path) == []  # removed once the handler returned


def test_small_frames_stay_in_memory(tmp_path: Path) -> None:
    handled: list[Any] = []
    server, route = receiver(tmp_path, handled, min_bytes=1 << 20)
    serve(server, route, wire(bytes(1000)))
    assert handled == [(bytes(1000), None)] and frame_files(tmp_path) == []


def test_truncated_and_oversize_frames_are_typed_errors_and_leave_no_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    data = wire(bytes(range(256)) * 1024)  # 256 KiB: 4 chunks
    handled: list[Any] = []
    server, route = receiver(tmp_path, handled)
    with pytest.raises(StreamClosed):
        serve(server, route, data[: len(data) - 1000])  # the stream ends inside the last chunk
    assert frame_files(tmp_path) == []
    # a chunk header that runs past the declared total: the preamble says 3 chunks for 200 KiB
    over = bytearray(encode_preamble(Status.REQUEST, 200 << 10, CHUNK)) + data[20:]
    with pytest.raises(FrameTooLarge):
        serve(server, route, over)
    assert frame_files(tmp_path) == []
    with pytest.raises(FrameTooLarge):  # declared over the route's cap: refused before any file exists
        serve(*receiver(tmp_path, handled, max_bytes=1000), data)
    assert handled == [] and frame_files(tmp_path) == []
    # control: without the cleanup, the truncated transfer's file stays behind
    monkeypatch.setattr(frame_file.FileSink, "discard", lambda self: self._close())
    with pytest.raises(StreamClosed):
        serve(server, route, data[: len(data) - 1000])
    assert len(frame_files(tmp_path)) == 1


def received_peak(tmp_path: Path, data: bytearray, *, to_disk: bool) -> int:
    handled: list[Any] = []
    server, route = receiver(tmp_path, handled, min_bytes=0 if to_disk else 1 << 40)
    tracemalloc.start()
    try:
        serve(server, route, data)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert len(handled) == 1
    return peak


def test_receiving_a_frame_to_disk_holds_a_chunk_not_the_frame(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    size = 24 << 20
    data = wire(bytes(size))
    # the handlers themselves read the whole body to compare it: measured without that here
    monkeypatch.setattr(frame_file.FrameFile, "read", lambda self, offset, length: b"")
    on_disk = received_peak(tmp_path, data, to_disk=True)
    in_memory = received_peak(tmp_path, data, to_disk=False)  # control: the buffer grows to the frame
    assert in_memory >= size
    assert on_disk < 1 << 20, on_disk  # a few chunks of 64 KiB, whatever the frame's size


# ------------------------------------------------------------------------------------------------ the push route


class FakeP2P:
    """Records the stream handlers a server registers (the daemon is not needed to drive them)."""

    def __init__(self) -> None:
        self.handlers: dict[str, Any] = {}

    async def add_binary_stream_handler(self, name: str, handler: Any) -> None:
        self.handlers[name] = handler


def spilled_host(spill_dir: Path) -> Host:
    host = Host(swarm_banned=set())
    core = host.core
    host.core = SyncerCore(
        host.plan,
        {n: t.clone() for n, t in core.params.items()},
        quorum=QuorumConfig.decoupled(1, grace_gamma=0.0),
        embedding_names=embedding_param_names(ModelConfig.from_dict(MODEL)),
        outer_lr=0.7,
        outer_momentum=0.0,
        clip_factor=None,
        max_staleness=2,
        max_steps_per_s=10.0,
        tokens_per_step=64,
        now=time.monotonic(),
        screening=host.config.screening,
        spill_dir=spill_dir,
    )
    return host


def push_through_route(host: Host, learner: NodeIdentity, frame: bytes | bytearray) -> Status:
    """`frame` sent to the host's push route through its real stream server; the answer's status."""

    data = wire(frame)

    async def run() -> Status:
        p2p = FakeP2P()
        await host.service.start(p2p, on_throttle=lambda *a: None)
        info = SimpleNamespace(peer_id=SimpleNamespace(to_base58=lambda: learner.peer_id))
        answer = Collector()
        await p2p.handlers[protocol_name(PUSH_ROUTE)](info, WireReader(data), answer)
        return Status(answer.data[5])

    return asyncio.run(run())


@pytest.fixture
def on_disk(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(syncer_rpc, "PUSH_SPILL_MIN_BYTES", 0)  # this model's pushes are a few KiB


def held_params(host: Host, learner: NodeIdentity) -> Any:
    return host.core.rounds[0].entries[learner.peer_id].contribution.params


@pytest.mark.usefixtures("on_disk")
def test_a_push_received_to_disk_gives_the_same_contribution_held_in_its_own_file(tmp_path: Path) -> None:
    learner = NodeIdentity.generate()
    held = []
    for to_disk in (True, False):
        host = spilled_host(tmp_path / str(to_disk))
        live_learner(host, learner)
        torch.manual_seed(0)
        frame = push_frame(host, learner)
        if to_disk:
            assert push_through_route(host, learner, frame) == Status.OK
        else:  # control: the same push opened in memory, as views over its frame
            assert asyncio.run(host.service._handle_push(bytearray(frame), learner.peer_id))
        params = held_params(host, learner)
        held.append({n: params[n].clone() for n in params})
        if to_disk:  # the core holds the received file itself: no copy into a contribution file
            assert isinstance(params, SpilledTensors) and params.key.startswith(frame_file.FILE_PREFIX)
            assert frame_files(host.core.history.spill.directory) == [params.key]
    assert list(held[0]) == list(held[1]) and held[0]
    assert all(torch.equal(held[0][n], held[1][n]) for n in held[0])


@pytest.mark.usefixtures("on_disk")
def test_the_file_goes_when_the_contribution_is_merged(tmp_path: Path) -> None:
    learner = NodeIdentity.generate()
    host = spilled_host(tmp_path)
    live_learner(host, learner)
    assert push_through_route(host, learner, push_frame(host, learner)) == Status.OK
    assert len(frame_files(tmp_path)) == 1
    host.core.merge_now(0, 1, time.monotonic() + 60.0)
    gc.collect()
    assert frame_files(tmp_path) == [] and 0 not in host.core.rounds


@pytest.mark.usefixtures("on_disk")
def test_the_file_goes_when_a_newer_push_replaces_it_or_the_push_is_refused_after_its_open(
    tmp_path: Path,
) -> None:
    learner = NodeIdentity.generate()
    host = spilled_host(tmp_path)
    live_learner(host, learner)
    assert push_through_route(host, learner, push_frame(host, learner)) == Status.OK
    first = held_params(host, learner).key
    assert push_through_route(host, learner, push_frame(host, learner)) == Status.OK
    gc.collect()
    assert frame_files(tmp_path) == [held_params(host, learner).key] != [first]
    host.active = False  # standby: refused after the frame was opened and its tensors taken
    assert push_through_route(host, learner, push_frame(host, learner)) == Status.ERROR
    gc.collect()
    assert frame_files(tmp_path) == [held_params(host, learner).key]


@pytest.mark.usefixtures("on_disk")
def test_a_tampered_push_is_refused_before_any_tensor_is_used_and_leaves_no_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    learner = NodeIdentity.generate()
    used: list[int] = []
    real = syncer_rpc.open_push_file.__globals__["file_tensors"]

    def watched(*args: Any, **kwargs: Any) -> Any:
        used.append(1)
        return real(*args, **kwargs)

    monkeypatch.setitem(syncer_rpc.open_push_file.__globals__, "file_tensors", watched)
    host = spilled_host(tmp_path)
    live_learner(host, learner)
    tampered = bytearray(push_frame(host, learner))
    tampered[-5] ^= 1  # a payload byte: the signed digest no longer matches
    assert push_through_route(host, learner, tampered) == Status.ERROR
    assert used == [] and 0 not in host.core.rounds and frame_files(tmp_path) == []
    assert host.strikes.count(learner.peer_id, "digest mismatch") == 1
    # control: with the digest check off, the same tampered bytes are taken as a contribution
    signed_digest: list[bytes] = []
    real_check = frame_file.check_head

    def keep(*args: Any, **kwargs: Any) -> Any:
        out = real_check(*args, **kwargs)
        signed_digest.append(out[0].digest)
        return out

    monkeypatch.setattr(frame_file, "check_head", keep)
    monkeypatch.setattr(frame_file, "_file_digest", lambda frame, start: signed_digest[-1])
    tampered = bytearray(push_frame(host, learner))
    tampered[-5] ^= 1
    assert push_through_route(host, learner, tampered) == Status.OK
    assert used == [1] and learner.peer_id in host.core.rounds[0].entries


@pytest.mark.usefixtures("on_disk")
def test_a_non_finite_push_on_disk_is_refused_with_its_frame_digest_and_leaves_no_file(
    tmp_path: Path,
) -> None:
    learner = NodeIdentity.generate()
    host = spilled_host(tmp_path)
    live_learner(host, learner)
    params = {n: t.clone() for n, t in host.core.fragment_tensors(0).items()}
    next(iter(params.values())).view(-1)[3] = float("nan")
    from node.diloco.sync_client import contribution_meta
    from node.diloco.sync_types import OutgoingContribution

    meta = contribution_meta(
        OutgoingContribution(
            fragment=0, params=params, base_version=0, steps=2, tokens=64, sent_step=2, sched_step=2,
            step_time_s=0.1,
        )
    )  # fmt: skip
    context = Context(run_id=RUN_ID, kind=Kind.FRAGMENT, receiver=host.identity.peer_id)
    frame = seal(learner, context, microbatch=0, step=0, now=time.time(), tensors=params, meta=meta)
    assert push_through_route(host, learner, frame) == Status.ERROR
    assert frame_files(tmp_path) == [] and 0 not in host.core.rounds
    assert host.service.refusals.get("non-finite values") == 1


def test_the_route_registers_the_spill_only_for_the_push() -> None:
    host = Host(swarm_banned=set())
    p2p = FakeP2P()
    service: SyncerService = host.service
    asyncio.run(service.start(p2p, on_throttle=lambda *a: None))
    routes = service._server.routes
    assert routes[PUSH_ROUTE].spill is not None
    assert all(route.spill is None for name, route in routes.items() if name != PUSH_ROUTE)
