"""The signed wire protocol over real hivemind P2P daemons on loopback (127.0.0.1 only).

One module-scoped pair of peers (ALICE calls, SERVER serves) runs on a loop thread; the memory-bound test runs its
receiver in a child process (`python tests/integration/test_wire.py --receiver ...`, the `__main__` block below) so
that its resident memory can be measured without the attacker's buffers in the same process.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import pickle
import re
import struct
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import blake3
import pytest
import torch
from hivemind.p2p import P2P, PeerID

from protocol import codec, envelope
from protocol.codec import TensorLimits
from protocol.envelope import (
    SIGNATURE_DOMAIN,
    Context,
    Direction,
    Header,
    Kind,
    TensorSpec,
    encode_frame,
    max_frame_bytes,
    open_frame,
    payload_digest,
    seal,
    seal_streaming,
)
from protocol.errors import FrameTooLarge, RemoteRefused
from protocol.identity import NodeIdentity
from protocol.replay import ReplayGuard
from protocol.rpc import (
    FramedServer,
    PeerStrikes,
    Route,
    Status,
    StreamConfig,
    call_framed,
    encode_preamble,
    protocol_name,
    read_message,
    write_message,
)

pytestmark = pytest.mark.integration

RUN_ID = "wire-test"
LOOPBACK = ["/ip4/127.0.0.1/tcp/0"]
LIMITS = TensorLimits(max_bytes=64 << 20)
SERVER_CONFIG = StreamConfig(chunk_timeout_s=1.0, message_timeout_s=20.0, max_streams_per_peer=4)
RSS_BUDGET_MIB = 64
REPO_ROOT = str(Path(__file__).resolve().parents[2])


async def start_p2p(identity_path: Path, initial_peers: list[Any] | None = None) -> P2P:
    return await P2P.create(
        initial_peers=initial_peers,
        identity_path=str(identity_path),
        check_if_identity_free=False,
        host_maddrs=LOOPBACK,
    )


def tensor_digest(tensor: torch.Tensor) -> bytes:
    return blake3.blake3(codec.tensor_bytes(tensor)).digest()


@dataclass
class Wire:
    """ALICE -> SERVER over real daemons; BOB is a key that never connects (ALICE relays frames BOB signed)."""

    server_id: NodeIdentity
    alice_id: NodeIdentity
    bob_id: NodeIdentity
    server_p2p: P2P
    alice_p2p: P2P
    server: FramedServer
    strikes: PeerStrikes
    built: list[str] = field(default_factory=list)  # dtypes of every tensor the envelope built
    accepted: list[Header] = field(default_factory=list)

    def expect(self, stage: int) -> Context:
        return Context(
            run_id=RUN_ID,
            kind=Kind.ACTIVATION,
            receiver=self.server_id.peer_id,
            stage=stage,
            direction=Direction.FORWARD,
        )


@pytest.fixture(scope="module")
def wire(loop_thread: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Wire]:
    tmp = tmp_path_factory.mktemp("wire")
    ids = {name: NodeIdentity.load_or_create(tmp / f"{name}.key") for name in ("server", "alice", "bob")}
    guard, strikes = ReplayGuard(), PeerStrikes()
    state: dict[str, Wire] = {}

    def activation_route(stage: int) -> Route:
        async def handle(frame: bytearray, remote_peer: str) -> bytes:
            wire = state["wire"]
            header, tensor = open_frame(
                frame,
                remote_peer=remote_peer,
                expect=wire.expect(stage),
                limits=LIMITS,
                replay=guard,
                now=time.time(),
            )
            wire.accepted.append(header)
            return tensor_digest(tensor)

        return Route(handle, max_frame_bytes(LIMITS))

    async def big_answer(frame: bytearray, remote_peer: str) -> bytes:
        return b"x" * (2 << 20)

    async def setup() -> Wire:
        server_p2p = await start_p2p(tmp / "server.key")
        alice_p2p = await start_p2p(tmp / "alice.key", await server_p2p.get_visible_maddrs())
        routes = {
            "act.s0": activation_route(0),
            "act.s1": activation_route(1),
            "big": (big_answer, 1024),  # the tuple form of a Route
        }
        server = FramedServer(server_p2p, routes, config=SERVER_CONFIG, strikes=strikes)
        await server.start()
        return Wire(ids["server"], ids["alice"], ids["bob"], server_p2p, alice_p2p, server, strikes)

    with pytest.MonkeyPatch.context() as patch:
        real_build = codec.build_tensor

        def spy(dtype: str, *args: Any) -> torch.Tensor:
            state["wire"].built.append(dtype)
            return real_build(dtype, *args)

        patch.setattr(codec, "build_tensor", spy)
        wire = state["wire"] = loop_thread.run(setup())
        try:
            yield wire
        finally:
            loop_thread.run(_teardown(wire))


async def _teardown(wire: Wire) -> None:
    await wire.server.stop()
    await wire.alice_p2p.shutdown()
    await wire.server_p2p.shutdown()


def call(
    loop_thread: Any, wire: Wire, name: str, frame: bytes | bytearray, max_response_bytes: int = 64
) -> bytearray:
    coro = call_framed(
        wire.alice_p2p,
        wire.server_id.peer_id,
        name,
        frame,
        max_response_bytes=max_response_bytes,
        timeout_s=30,
    )
    return loop_thread.run(coro, timeout_s=40)


def refused(loop_thread: Any, wire: Wire, name: str, frame: bytes | bytearray) -> str:
    with pytest.raises(RemoteRefused) as err:
        call(loop_thread, wire, name, frame)
    return err.value.reason


def activation(wire: Wire, tensor: torch.Tensor, *, sender: NodeIdentity | None = None, **kw: Any) -> bytes:
    kw.setdefault("microbatch", 1)
    kw.setdefault("step", 1)
    kw.setdefault("now", time.time())
    ctx = kw.pop("ctx", wire.expect(0))
    return seal(sender or wire.alice_id, ctx, tensor=tensor, **kw)


def forged(wire: Wire, spec: TensorSpec, payload: bytes, **meta: Any) -> bytes:
    """Signed by ALICE (so it passes signer, signature and context checks) but declaring whatever it likes."""
    header = Header(
        version=1,
        run_id=RUN_ID,
        kind=Kind.ACTIVATION,
        sender=wire.alice_id.peer_id,
        receiver=wire.server_id.peer_id,
        stage=0,
        direction=Direction.FORWARD,
        microbatch=9,
        step=1,
        timestamp=time.time(),
        nonce=os.urandom(16),
        tensors=(spec,),
        digest=payload_digest([payload]),
        meta=meta,
    )
    return encode_frame(wire.alice_id, header, [payload])


# ------------------------------------------------------------------------------------------------ tests


@pytest.mark.parametrize("num_bytes", [4 << 10, 48 << 20])
def test_small_and_large_frames_roundtrip(
    loop_thread: Any, wire: Wire, num_bytes: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    passes: list[int] = []
    real = envelope.payload_digest
    monkeypatch.setattr(envelope, "payload_digest", lambda parts: passes.append(len(parts)) or real(parts))
    tensor = torch.randn(num_bytes // 4)
    answer = call(loop_thread, wire, "act.s0", activation(wire, tensor, microbatch=num_bytes))
    assert bytes(answer) == tensor_digest(tensor)
    assert wire.accepted[-1].sender == wire.alice_id.peer_id  # the Noise-authenticated caller
    assert passes == []  # the server digested the payload as it arrived, not in a pass of its own


def test_tampered_byte_anywhere_refused_before_build_and_struck(loop_thread: Any, wire: Wire) -> None:
    tensor = torch.randn(16)
    frame = activation(wire, tensor, microbatch=100)
    (header_len,) = struct.unpack(">I", frame[:4])
    payload_start = 4 + header_len + 64
    positions = [*range(payload_start), payload_start, len(frame) // 2 + payload_start // 2, len(frame) - 1]
    built_before, strikes_before = len(wire.built), wire.strikes.count(wire.alice_id.peer_id)
    reasons: dict[str, int] = {}
    for pos in positions:
        bad = bytearray(frame)
        bad[pos] ^= 0x01
        reason = refused(loop_thread, wire, "act.s0", bad)
        reasons[reason] = reasons.get(reason, 0) + 1
    assert len(wire.built) == built_before  # no tampered frame ever reached the tensor builder
    assert wire.strikes.count(wire.alice_id.peer_id) == strikes_before + len(positions)
    assert {"malformed", "bad signature", "digest mismatch"} <= set(reasons)
    # the untouched frame still goes through: the rejections recorded nothing in the replay guard
    assert bytes(call(loop_thread, wire, "act.s0", frame)) == tensor_digest(tensor)


def test_frame_signed_by_another_peer_is_not_counted_against_that_peer(loop_thread: Any, wire: Wire) -> None:
    before = wire.strikes.count(wire.alice_id.peer_id, "signer is not the remote peer")
    frame = activation(wire, torch.randn(8), sender=wire.bob_id, microbatch=200)
    assert refused(loop_thread, wire, "act.s0", frame) == "signer is not the remote peer"
    assert wire.strikes.count(wire.bob_id.peer_id) == 0
    assert (
        wire.strikes.count(wire.alice_id.peer_id, "signer is not the remote peer") == before + 1
    )  # the relay


def test_replayed_cross_stage_cross_run_and_far_future_refused(loop_thread: Any, wire: Wire) -> None:
    alice = wire.alice_id.peer_id
    frame = activation(wire, torch.randn(8), microbatch=300)
    call(loop_thread, wire, "act.s0", frame)
    assert refused(loop_thread, wire, "act.s0", frame) == "replay"
    assert (
        refused(loop_thread, wire, "act.s1", activation(wire, torch.randn(8), microbatch=301))
        == "wrong context"
    )
    other_run = dataclasses.replace(wire.expect(0), run_id="another-run")
    assert (
        refused(loop_thread, wire, "act.s0", activation(wire, torch.randn(8), ctx=other_run))
        == "wrong context"
    )
    backward = dataclasses.replace(wire.expect(0), direction=Direction.BACKWARD)
    assert (
        refused(loop_thread, wire, "act.s0", activation(wire, torch.randn(8), ctx=backward))
        == "wrong context"
    )

    skew_before = wire.strikes.count(alice, "clock skew")
    total_before = wire.strikes.count(alice)
    call(loop_thread, wire, "act.s0", activation(wire, torch.randn(8), microbatch=302, now=time.time() + 30))
    assert (
        refused(loop_thread, wire, "act.s0", activation(wire, torch.randn(8), now=time.time() + 300))
        == "clock skew"
    )
    assert wire.strikes.count(alice, "clock skew") == skew_before == 0
    assert wire.strikes.count(alice) == total_before  # refused, never struck


@pytest.mark.parametrize(
    ("spec", "payload", "reason"),
    [
        (TensorSpec("", "object", (1,)), b"\0" * 8, "dtype not allowed"),
        (TensorSpec("", "void", (8,)), b"\0" * 8, "dtype not allowed"),
        (TensorSpec("", "float32", (-1,)), b"\0" * 8, "bad shape"),
        (TensorSpec("", "float32", (2, -1)), b"\0" * 8, "bad shape"),
        (TensorSpec("", "float32", (2,)), struct.pack("<2f", 1.0, float("nan")), "non-finite values"),
        (TensorSpec("", "float32", (3,)), b"\0" * 8, "size mismatch"),
    ],
)
def test_tensor_policy_errors_over_the_wire(
    loop_thread: Any, wire: Wire, spec: TensorSpec, payload: bytes, reason: str
) -> None:
    before = wire.strikes.count(wire.alice_id.peer_id, reason)
    assert refused(loop_thread, wire, "act.s0", forged(wire, spec, payload)) == reason
    assert wire.strikes.count(wire.alice_id.peer_id, reason) == before + 1


def test_pickle_on_every_path_is_refused_and_never_executed(
    loop_thread: Any, wire: Wire, tmp_path: Path
) -> None:
    marker = tmp_path / "pickle-ran"

    class Exploit:
        def __reduce__(self) -> tuple[Any, tuple[str, str]]:
            return (open, (str(marker), "w"))

    blob = pickle.dumps(Exploit())
    signed_header = struct.pack(">I", len(blob)) + blob + wire.alice_id.sign(SIGNATURE_DOMAIN + blob)
    attempts = {
        "frame": blob,
        "header": signed_header,
        "object payload": forged(wire, TensorSpec("", "object", (len(blob),)), blob),
        "float payload": forged(
            wire, TensorSpec("", "float32", (len(blob) // 4,)), blob[: len(blob) // 4 * 4]
        ),
    }
    for name, frame in attempts.items():
        try:
            call(loop_thread, wire, "act.s0", frame)
        except RemoteRefused:
            continue
        assert name == "float payload"  # raw floats are just floats (or NaN, refused); never unpickled
    with pytest.raises(ValueError):  # metadata holds scalars and strings only: seal() refuses to build it
        activation(wire, torch.zeros(2), meta={"blob": blob})
    raw_meta = forged(wire, TensorSpec("", "float32", (2,)), b"\0" * 8, blob="placeholder")
    raw_meta = _swap_meta_for_bytes(wire, raw_meta, blob)
    assert refused(loop_thread, wire, "act.s0", raw_meta) == "malformed"
    # and as a raw stream that is not our framing at all
    sent, answer = loop_thread.run(raw_stream(wire.alice_p2p, wire.server_id.peer_id, "act.s0", blob, []))
    assert answer == (Status.ERROR, "malformed")
    assert not marker.exists()


def _swap_meta_for_bytes(wire: Wire, frame: bytes, blob: bytes) -> bytes:
    """Re-sign `frame` with its metadata value replaced by raw bytes (what a malicious sender can do)."""
    import msgpack

    (n,) = struct.unpack(">I", frame[:4])
    fields = msgpack.unpackb(frame[4 : 4 + n])
    fields[-1] = {"blob": blob}
    raw = msgpack.packb(fields, use_bin_type=True)
    return (
        struct.pack(">I", len(raw)) + raw + wire.alice_id.sign(SIGNATURE_DOMAIN + raw) + frame[4 + n + 64 :]
    )


def test_client_refuses_an_answer_over_its_cap(loop_thread: Any, wire: Wire) -> None:
    with pytest.raises(FrameTooLarge):
        call(loop_thread, wire, "big", b"", max_response_bytes=1 << 20)
    assert len(call(loop_thread, wire, "big", b"", max_response_bytes=4 << 20)) == 2 << 20


def test_stalled_stream_times_out_and_is_struck(loop_thread: Any, wire: Wire) -> None:
    before = wire.strikes.count(wire.alice_id.peer_id, "read timeout")
    start = time.monotonic()
    preamble = encode_preamble(Status.REQUEST, 1000, 1 << 20)  # then nothing
    _, answer = loop_thread.run(raw_stream(wire.alice_p2p, wire.server_id.peer_id, "act.s0", preamble, []))
    assert answer == (Status.ERROR, "read timeout")
    assert time.monotonic() - start < SERVER_CONFIG.chunk_timeout_s + 5
    assert wire.strikes.count(wire.alice_id.peer_id, "read timeout") == before + 1


def test_per_peer_stream_limit_answers_busy_without_a_strike(loop_thread: Any, wire: Wire) -> None:
    async def scenario() -> tuple[str, list[tuple[Status, str]]]:
        peer = PeerID.from_base58(wire.server_id.peer_id)
        held = [
            await wire.alice_p2p.call_binary_stream_handler(peer, protocol_name("act.s0")) for _ in range(4)
        ]
        for _, _, writer in held:  # each stream starts a request and holds it open
            writer.write(encode_preamble(Status.REQUEST, 10, 1 << 20))
            await writer.drain()
        await _wait_for(lambda: sum(wire.server._active.values()) == 4, timeout_s=5)
        with pytest.raises(RemoteRefused) as err:
            await call_framed(
                wire.alice_p2p, wire.server_id.peer_id, "act.s0", b"", max_response_bytes=64, timeout_s=5
            )
        answers = [await _read_answer(reader) for _, reader, _ in held]
        for _, _, writer in held:
            writer.close()
        return err.value.reason, answers

    strikes_before = wire.strikes.count(wire.alice_id.peer_id)
    reason, answers = loop_thread.run(scenario())
    assert reason == "busy"
    assert answers == [(Status.ERROR, "read timeout")] * 4  # the held streams themselves stall and time out
    assert wire.strikes.count(wire.alice_id.peer_id) == strikes_before + 4  # four stalls, nothing for "busy"


async def _wait_for(predicate: Any, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError("condition not met in time")
        await asyncio.sleep(0.01)


async def _read_answer(reader: asyncio.StreamReader) -> tuple[Status, str]:
    status, body = await read_message(
        reader,
        max_bytes=4096,
        config=StreamConfig(chunk_timeout_s=10),
        statuses=frozenset({Status.OK, Status.ERROR}),
    )
    return status, body.decode(errors="replace")


async def raw_stream(
    p2p: P2P,
    peer_id: str,
    name: str,
    preamble: bytes,
    chunks: list[bytes] | Iterator[bytes],
    *,
    stop_on_answer: bool = True,
    deadline_s: float = 15,
) -> tuple[int, tuple[Status, str] | None]:
    """Write arbitrary bytes into a framed handler's stream; return (bytes written, the server's answer).

    The answer is read concurrently, as `call_framed` does; a polite caller stops writing once it has arrived, a
    hostile one (`stop_on_answer=False`) keeps pushing until the stream breaks or `deadline_s` passes.
    """
    _, reader, writer = await p2p.call_binary_stream_handler(PeerID.from_base58(peer_id), protocol_name(name))
    answer_task = asyncio.ensure_future(_read_answer(reader))
    sent, stop_at = 0, time.monotonic() + deadline_s
    try:
        writer.write(preamble)
        for chunk in chunks:
            if time.monotonic() > stop_at or (stop_on_answer and answer_task.done()):
                break
            writer.write(chunk)
            await asyncio.wait_for(writer.drain(), 5)
            sent += len(chunk)
    except (ConnectionError, asyncio.TimeoutError):
        pass  # the receiver hung up on us: the point of the exercise
    try:
        answer: tuple[Status, str] | None = await asyncio.wait_for(answer_task, 10)
    except Exception:
        answer = None
    writer.close()
    return sent, answer


# ------------------------------------------------------------------------------------------------ signed while streaming


class FlipWriter:
    """A man in the middle on the sender's side of the stream: flips one bit of the byte at stream offset `at`."""

    def __init__(self, writer: asyncio.StreamWriter, at: int) -> None:
        self.writer, self.at, self.offset = writer, at, 0

    def write(self, data: Any) -> None:
        data = bytes(data)
        if self.offset <= self.at < self.offset + len(data):
            i = self.at - self.offset
            data = data[:i] + bytes([data[i] ^ 0x10]) + data[i + 1 :]
        self.offset += len(data)
        self.writer.write(data)

    async def drain(self) -> None:
        await self.writer.drain()


async def _send_tampered(wire: Wire, frame: Any, at: int) -> tuple[Status, bytes]:
    _, reader, writer = await wire.alice_p2p.call_binary_stream_handler(
        PeerID.from_base58(wire.server_id.peer_id), protocol_name("act.s0")
    )
    try:
        await write_message(FlipWriter(writer, at), Status.REQUEST, frame, config=StreamConfig())  # type: ignore[arg-type]
        status, body = await read_message(
            reader, max_bytes=1024, config=StreamConfig(), statuses=frozenset({Status.OK, Status.ERROR})
        )
        return status, bytes(body)
    finally:
        writer.close()


def streaming(wire: Wire, tensor: torch.Tensor) -> envelope.StreamingFrame:
    return seal_streaming(wire.alice_id, wire.expect(0), microbatch=1, step=1, now=time.time(), tensor=tensor)


def test_a_frame_signed_while_it_streams_arrives_whole(loop_thread: Any, wire: Wire) -> None:
    tensor = torch.randn(3 << 18)  # 3 MiB: three 1 MiB pieces, hashed on the hashing thread at both ends
    built = len(wire.built)
    assert call(loop_thread, wire, "act.s0", streaming(wire, tensor)) == tensor_digest(tensor)  # type: ignore[arg-type]
    assert wire.built[built:] == ["float32"]


def test_a_chunk_tampered_in_flight_is_refused_and_the_control_lets_it_through(
    loop_thread: Any, wire: Wire, monkeypatch: pytest.MonkeyPatch
) -> None:
    tensor = torch.randn(3 << 18)
    at = 20 + 4 + (1 << 20) + 4 + 12345  # inside the second payload chunk on the wire
    built = len(wire.built)
    status, body = loop_thread.run(_send_tampered(wire, streaming(wire, tensor), at), timeout_s=40)
    assert (status, body) == (Status.ERROR, b"digest mismatch")
    assert wire.built[built:] == []  # refused before any tensor was built
    # negative control: the receiver's digest check off, the same tampering delivers a tensor that is not the sent one
    monkeypatch.setattr(
        envelope,
        "_digest_of",
        lambda frame, payload: (
            envelope._decode_header(bytes(frame[4 : 4 + struct.unpack_from(">I", frame)[0]]), LIMITS).digest
        ),
    )
    status, body = loop_thread.run(_send_tampered(wire, streaming(wire, tensor), at), timeout_s=40)
    assert status == Status.OK and body != tensor_digest(tensor)
    assert wire.built[built:] == ["float32"]


# ------------------------------------------------------------------------------------------------ memory bound


def _attack_chunks(total_bytes: int, chunk_bytes: int = 1 << 20) -> Iterator[bytes]:
    body = struct.pack(">I", chunk_bytes) + b"\xa5" * chunk_bytes
    for _ in range(total_bytes // chunk_bytes):
        yield body


def test_declared_oversize_and_overlong_streams_keep_receiver_memory_bounded(
    loop_thread: Any, wire: Wire, tmp_path: Path, record_property: Any
) -> None:
    """Measured: the receiving *Python* process (child), VmHWM reset before each attack. p2pd is a separate Go
    process; its RSS is reported in the failure message for information, not asserted."""
    maddrs = loop_thread.run(wire.alice_p2p.get_visible_maddrs())
    child = subprocess.Popen(
        [sys.executable, __file__, "--receiver", str(tmp_path / "receiver.key"), *map(str, maddrs)],
        # this checkout's code, not whatever the venv's editable install points at
        env={
            **os.environ,
            "PYTHONPATH": os.pathsep.join(filter(None, [REPO_ROOT, os.environ.get("PYTHONPATH")])),
        },
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        hello = _child_reply(child)
        receiver = hello["peer_id"]
        alice = wire.alice_id.peer_id
        attacks = {
            # declares 1 GiB (cap 4 MiB), then pushes 256 MiB of chunks anyway
            "declares 1 GiB": (encode_preamble(Status.REQUEST, 1 << 30, 1 << 20), _attack_chunks(256 << 20)),
            # declares 1.5 MiB in 2 chunks, sends 1 MiB, then a second 1 MiB chunk and 254 MiB more
            "more than declared": (
                struct.pack(">4sBBHQI", b"HVNF", 1, 0, 0, 3 << 19, 2),
                _attack_chunks(256 << 20),
            ),
        }
        report = {}
        for name, (preamble, chunks) in attacks.items():
            base = _child_command(child, "reset")
            sent, answer = loop_thread.run(
                raw_stream(wire.alice_p2p, receiver, "sink", preamble, chunks, stop_on_answer=False),
                timeout_s=40,
            )
            after = _child_command(child, "stats")
            report[name] = {
                "attacker_wrote_mib": round(sent / 2**20, 1),
                "answer": answer,
                "python_hwm_growth_mib": round((after["hwm_kib"] - base["rss_kib"]) / 1024, 1),
                "p2pd_rss_mib": round(after["p2pd_rss_kib"] / 1024, 1),
            }
        honest = bytes(range(256)) * (3 << 12)  # 3 MiB under the 4 MiB cap: still served afterwards
        answer = loop_thread.run(
            call_framed(wire.alice_p2p, receiver, "sink", honest, max_response_bytes=64, timeout_s=20),
            timeout_s=30,
        )
        strikes = _child_command(child, "stats")["strikes"].get(alice, {})
    finally:
        child.stdin.close()  # type: ignore[union-attr]
        child.wait(timeout=20)
        child.stdout.close()  # type: ignore[union-attr]
    assert int(answer) == len(honest)
    detail = json.dumps(report)
    record_property("memory_report", detail)
    assert report["declares 1 GiB"]["answer"] == (Status.ERROR, "too large"), detail
    assert report["more than declared"]["answer"] == (Status.ERROR, "more than declared"), detail
    for name, figures in report.items():
        assert figures["python_hwm_growth_mib"] < RSS_BUDGET_MIB, f"{name}: {detail}"
    assert strikes == {"too large": 1, "more than declared": 1}, detail


def _child_reply(child: subprocess.Popen[str]) -> dict[str, Any]:
    line = child.stdout.readline()  # type: ignore[union-attr]
    if not line:
        raise RuntimeError(f"receiver child exited with {child.wait(timeout=5)}")
    return json.loads(line)


def _child_command(child: subprocess.Popen[str], command: str) -> dict[str, Any]:
    child.stdin.write(command + "\n")  # type: ignore[union-attr]
    child.stdin.flush()  # type: ignore[union-attr]
    return _child_reply(child)


def _status_kib(pid: int | str, field_name: str) -> int:
    text = Path(f"/proc/{pid}/status").read_text()
    match = re.search(rf"^{field_name}:\s+(\d+) kB", text, re.M)
    return int(match.group(1)) if match else 0


def _receiver_main(identity_path: str, initial_peers: list[str]) -> None:
    """The child: a FramedServer with a 4 MiB "sink" route; answers "reset"/"stats" lines on stdin with JSON."""
    from tools.proctree import descendants

    async def main() -> None:
        NodeIdentity.load_or_create(Path(identity_path))
        p2p = await start_p2p(Path(identity_path), initial_peers)

        async def sink(frame: bytearray, remote_peer: str) -> bytes:
            return str(len(frame)).encode()

        server = FramedServer(p2p, {"sink": Route(sink, 4 << 20)}, config=SERVER_CONFIG)
        await server.start()
        loop = asyncio.get_running_loop()

        def stats() -> dict[str, Any]:
            p2pd = sum(_status_kib(pid, "VmRSS") for pid in descendants(os.getpid()))
            return {
                "peer_id": p2p.peer_id.to_base58(),
                "rss_kib": _status_kib("self", "VmRSS"),
                "hwm_kib": _status_kib("self", "VmHWM"),
                "p2pd_rss_kib": p2pd,
                "strikes": server.strikes.snapshot(),
            }

        print(json.dumps(stats()), flush=True)
        while line := (await loop.run_in_executor(None, sys.stdin.readline)).strip():
            if line == "reset":
                Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current RSS
            print(json.dumps(stats()), flush=True)
        await server.stop()
        await p2p.shutdown()

    asyncio.run(main())


if __name__ == "__main__":
    if sys.argv[1:2] == ["--receiver"]:
        _receiver_main(sys.argv[2], sys.argv[3:])
