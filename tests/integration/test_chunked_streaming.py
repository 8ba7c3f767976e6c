"""Chunked streaming with per-chunk limits, over real daemons on loopback (issue 17).

A `FramedServer` sized as the syncer sizes its own (`fragment_server_limits`) receives requests of 72 MiB, more than
the stream layer's 64 MiB default per-peer cap. Request bytes are reserved chunk by chunk as they arrive and given
back once the handler ran (or the request was refused); the receiver's accounted bytes in flight are sampled while
three peers push at once and never pass the cap of `max_fragments_in_flight` requests. Controls: with the default
caps (the cap too small) the request is refused at once, typed, and nothing is merged; a chunk that arrives past the
cap refuses its request midway (typed, logged) and nothing of it is merged while the other request completes; an
oversize, overlong, truncated or miscounted stream is refused typed, nothing merged, every byte given back.
"""

from __future__ import annotations

import asyncio
import logging
import math
import re
import struct
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import blake3
import pytest
from hivemind.p2p import P2P, PeerID

from node.roles.syncer_rpc import fragment_server_limits
from protocol import limits
from protocol.errors import ProtocolError
from protocol.identity import NodeIdentity
from protocol.rpc import (
    FramedServer,
    PeerThrottled,
    Route,
    Status,
    StreamConfig,
    call_framed,
    encode_preamble,
    protocol_name,
    read_message,
    route_limits,
)

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

MiB = 1 << 20
FRAME = 72 * MiB  # over the stream layer's default (and the syncer's former) 64 MiB per-peer cap
CHUNK = MiB
LOOPBACK = ["/ip4/127.0.0.1/tcp/0"]
CONFIG = StreamConfig(chunk_timeout_s=20.0, message_timeout_s=120.0)


class Swarm:
    """One receiving daemon, three sending ones; a server per scenario whose handler "merges" what it receives."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.server_p2p: Any = None
        self.clients: list[Any] = []
        self.merged: list[tuple[str, bytes]] = []  # (sender, digest of the body)
        self.rejected: list[tuple[str, ProtocolError]] = []

    async def start(self) -> None:
        self.server_p2p = await _p2p(self.tmp / "server.key")
        maddrs = await self.server_p2p.get_visible_maddrs()
        self.clients = [await _p2p(self.tmp / f"client{i}.key", maddrs) for i in range(3)]
        self.server_id = self.server_p2p.peer_id.to_base58()

    async def close(self) -> None:
        for p2p in (*self.clients, self.server_p2p):
            if p2p is not None:
                await p2p.shutdown()

    async def merge(self, frame: bytearray, remote: str) -> bytes:
        self.merged.append((remote, blake3.blake3(frame).digest()))
        return b"merged"

    def server(self, route: str, limits_config: limits.LimitsConfig) -> FramedServer:
        self.merged.clear()
        self.rejected.clear()
        return FramedServer(
            self.server_p2p,
            {route: Route(self.merge, FRAME, digest_payload=False)},
            config=CONFIG,
            limiter=AdmissionSpy(limits_config),
            on_reject=lambda peer, _name, error: self.rejected.append((peer, error)),
        )


class AdmissionSpy(limits.PeerLimiter):
    """Records each request's admission (its preamble read and checked), so a test can order streams."""

    def __init__(self, config: limits.LimitsConfig) -> None:
        super().__init__(config)
        self.admissions: list[limits.Admission] = []

    def admit_bytes(self, peer: str, num_bytes: int, now: float) -> limits.Admission:
        admission = super().admit_bytes(peer, num_bytes, now)
        self.admissions.append(admission)
        return admission


async def _p2p(path: Path, initial_peers: list[Any] | None = None) -> P2P:
    NodeIdentity.load_or_create(path)
    return await P2P.create(
        initial_peers=initial_peers,
        identity_path=str(path),
        check_if_identity_free=False,
        host_maddrs=LOOPBACK,
    )


async def _in_swarm(tmp: Path, scenario: Callable[[Swarm], Awaitable[Any]]) -> Any:
    swarm = Swarm(tmp)
    try:
        await swarm.start()
        return await scenario(swarm)
    finally:
        await swarm.close()


async def _until(condition: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.01)


def _body(i: int) -> bytes:
    return bytes([i + 1]) * FRAME


# ------------------------------------------------------------------------------------------------ three at once


async def _push_until_merged(
    p2p: P2P, server_id: str, route: str, body: bytes, throttles: list[str]
) -> bytes:
    """Push like a learner: a refusal for load that could pass later is retried, one that never can is final."""
    for _ in range(200):
        try:
            return bytes(
                await call_framed(
                    p2p, server_id, route, body, max_response_bytes=64, timeout_s=120, config=CONFIG
                )
            )
        except PeerThrottled as e:
            throttles.append(e.limit)
            if not math.isfinite(e.retry_after_s):
                raise
            await asyncio.sleep(0.2)
    raise AssertionError("never merged")


async def _three_at_once(swarm: Swarm) -> dict[str, Any]:
    caps = fragment_server_limits(
        {"push3": Route(swarm.merge, FRAME)}, fragment_frame_bytes=FRAME, max_fragments_in_flight=2
    )
    server = swarm.server("push3", caps)
    await server.start()
    samples: list[int] = []
    throttles: list[str] = []

    async def sample() -> None:
        while True:
            samples.append(server.limiter.bytes_in_flight)
            await asyncio.sleep(0.002)

    sampler = asyncio.ensure_future(sample())
    try:
        answers = await asyncio.gather(
            *(
                _push_until_merged(p2p, swarm.server_id, "push3", _body(i), throttles)
                for i, p2p in enumerate(swarm.clients)
            )
        )
    finally:
        sampler.cancel()
        await server.stop()
    stats = server.limiter.stats()
    return {
        "answers": answers,
        "merged": sorted(digest for _, digest in swarm.merged),
        "cap": caps.max_bytes_in_flight_total,
        "per_peer_cap": caps.max_bytes_in_flight_per_peer,
        "peak": stats.peak_bytes_in_flight,
        "peer_peaks": [p.peak_bytes_in_flight for p in stats.peers.values()],
        "after": stats.bytes_in_flight,
        "samples": samples,
        "throttles": throttles,
    }


def test_frames_over_the_old_per_peer_cap_sync_while_bytes_in_flight_stay_under_the_cap(
    loop_thread: Any, tmp_path: Path, record_property: Any
) -> None:
    out = loop_thread.run(_in_swarm(tmp_path, _three_at_once), timeout_s=280)
    assert out["answers"] == [b"merged"] * 3
    assert out["merged"] == sorted(blake3.blake3(_body(i)).digest() for i in range(3)), "each body intact"
    assert out["cap"] == 2 * FRAME and out["per_peer_cap"] == FRAME
    assert FRAME <= out["peak"] <= out["cap"], "a whole 72 MiB request was held, never more than the cap"
    assert max(out["samples"]) <= out["cap"]
    assert all(peak <= out["per_peer_cap"] for peak in out["peer_peaks"])
    partial = [s for s in out["samples"] if s % FRAME > 0]
    assert partial, "the held bytes grew chunk by chunk, not a whole declared request at once"
    assert out["after"] == 0
    assert set(out["throttles"]) <= {limits.GLOBAL_BYTES_IN_FLIGHT}, out["throttles"]
    record_property(
        "chunked_three_at_once",
        {"peak_mib": out["peak"] / MiB, "cap_mib": out["cap"] / MiB, "throttles": len(out["throttles"])},
    )


# ------------------------------------------------------------------------------------------------ controls


async def _caps_too_small(swarm: Swarm) -> dict[str, Any]:
    server = swarm.server("small", route_limits({"small": Route(swarm.merge, FRAME)}, CONFIG))
    await server.start()
    try:
        await call_framed(
            swarm.clients[0], swarm.server_id, "small", _body(0), max_response_bytes=64, timeout_s=60
        )
        refusal: Any = None
    except PeerThrottled as e:
        refusal = (e.limit, e.retry_after_s)
    finally:
        await server.stop()
    return {"refusal": refusal, "merged": list(swarm.merged), "after": server.limiter.bytes_in_flight}


def test_control_caps_too_small_refuse_the_request_typed_and_nothing_is_merged(
    loop_thread: Any, tmp_path: Path
) -> None:
    out = loop_thread.run(_in_swarm(tmp_path, _caps_too_small), timeout_s=120)
    assert out["refusal"] == (limits.BYTES_IN_FLIGHT, math.inf), "refused for good, before its chunks"
    assert out["merged"] == []
    assert out["after"] == 0


async def _open(swarm: Swarm, client: int, route: str, declared: int, num_chunks: int | None = None) -> Any:
    _, reader, writer = await swarm.clients[client].call_binary_stream_handler(
        PeerID.from_base58(swarm.server_id), protocol_name(route)
    )
    writer.write(encode_preamble(Status.REQUEST, declared, CHUNK, num_chunks=num_chunks))
    await writer.drain()
    return reader, writer


async def _send(writer: Any, body: bytes, chunk: int = CHUNK) -> None:
    try:
        for start in range(0, len(body), chunk):
            writer.write(struct.pack(">I", len(body[start : start + chunk])) + body[start : start + chunk])
            await asyncio.wait_for(writer.drain(), 10)
    except (ConnectionError, asyncio.TimeoutError):
        pass  # refused and hung up on: the answer says why


async def _answer(reader: Any) -> tuple[Status, str] | None:
    try:
        status, body = await asyncio.wait_for(
            read_message(
                reader, max_bytes=4096, config=CONFIG, statuses=frozenset({Status.OK, Status.ERROR})
            ),
            30,
        )
    except (ProtocolError, asyncio.TimeoutError, ConnectionError):
        return None
    return status, body.decode(errors="replace")


async def _chunk_past_the_cap(swarm: Swarm) -> dict[str, Any]:
    caps = fragment_server_limits(
        {"cut": Route(swarm.merge, FRAME)}, fragment_frame_bytes=FRAME, max_fragments_in_flight=1
    )
    server = swarm.server("cut", caps)
    await server.start()
    try:
        a_reader, a = await _open(swarm, 0, "cut", FRAME)
        b_reader, b = await _open(swarm, 1, "cut", FRAME)
        spy = server.limiter
        assert isinstance(spy, AdmissionSpy)
        await _until(lambda: len(spy.admissions) == 2, 30, "both requests admitted (nothing held yet)")
        assert all(spy.admissions)
        body_a, body_b = _body(0), _body(1)
        await _send(a, body_a[: FRAME // 2])
        await _until(lambda: server.limiter.bytes_in_flight == FRAME // 2, 60, "half of A held")
        sending = asyncio.ensure_future(_send(b, body_b))  # B passes the cap at its chunk 37: refused midway
        b_answer = await _answer(b_reader)
        sending.cancel()
        b.close()
        await _send(a, body_a[FRAME // 2 :])
        a_answer = await _answer(a_reader)
        a.close()
        await _until(lambda: server.limiter.bytes_in_flight == 0, 10, "every byte given back")
    finally:
        await server.stop()
    return {
        "a": a_answer,
        "b": b_answer,
        "merged": list(swarm.merged),
        "cap": caps.max_bytes_in_flight_total,
        "peak": server.limiter.stats().peak_bytes_in_flight,
        "a_peer": swarm.clients[0].peer_id.to_base58(),
    }


def test_a_chunk_past_the_cap_refuses_its_request_and_nothing_of_it_is_merged(
    loop_thread: Any, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.INFO, logger="protocol.rpc"):
        out = loop_thread.run(_in_swarm(tmp_path, _chunk_past_the_cap), timeout_s=200)
    assert out["b"] == (Status.ERROR, f"throttled: {limits.GLOBAL_BYTES_IN_FLIGHT}"), out["b"]
    assert out["a"] == (Status.OK, "merged"), out["a"]
    assert out["merged"] == [(out["a_peer"], blake3.blake3(_body(0)).digest())], "only A's request merged"
    assert out["cap"] == FRAME and out["peak"] <= out["cap"]
    assert re.search(r"refused a request from \S+ at chunk 37 of 72: global bytes in flight", caplog.text)


# ------------------------------------------------------------------------------------------------ declare and stall


def _rss_kib() -> int:
    match = re.search(r"^VmRSS:\s+(\d+) kB", Path("/proc/self/status").read_text(), re.M)
    return int(match.group(1)) if match else 0


async def _declare_and_stall(swarm: Swarm) -> dict[str, Any]:
    caps = fragment_server_limits(
        {"stall": Route(swarm.merge, FRAME)}, fragment_frame_bytes=FRAME, max_fragments_in_flight=2
    )
    server = swarm.server("stall", caps)
    await server.start()
    honest = _body(2)
    try:
        before = _rss_kib()
        stalled = [await _open(swarm, i, "stall", FRAME) for i in range(2)]
        for _, writer in stalled:
            await _send(writer, b"\x01" * 2 * CHUNK)  # 2 of 72 chunks, then nothing
        await _until(lambda: server.limiter.bytes_in_flight == 4 * CHUNK, 30, "the stalled chunks held")
        held, grown_kib = server.limiter.bytes_in_flight, _rss_kib() - before
        answer = await call_framed(
            swarm.clients[2],
            swarm.server_id,
            "stall",
            honest,
            max_response_bytes=64,
            timeout_s=60,
            config=CONFIG,
        )
        for _, writer in stalled:
            writer.close()
        await _until(lambda: server.limiter.bytes_in_flight == 0, 30, "the stalled requests given back")
    finally:
        await server.stop()
    return {
        "held": held,
        "grown_kib": grown_kib,
        "answer": bytes(answer),
        "merged": list(swarm.merged),
        "honest": swarm.clients[2].peer_id.to_base58(),
    }


def test_peers_that_declare_the_largest_request_and_stall_hold_only_what_they_sent(
    loop_thread: Any, tmp_path: Path, record_property: Any
) -> None:
    """Two peers declare 72 MiB each and stall after 2 chunks: they hold 4 MiB of the 144 MiB budget, not all of it
    (with the declared size reserved, an honest request was locked out: `test_chunk_accounting.py`'s control), the
    receiver's memory grew by about what arrived (its buffers used to be allocated whole at the declared size), and an honest
    72 MiB request merges meanwhile."""
    out = loop_thread.run(_in_swarm(tmp_path, _declare_and_stall), timeout_s=200)
    record_property(
        "declare_and_stall", {"held_mib": out["held"] / MiB, "rss_growth_mib": out["grown_kib"] / 1024}
    )
    assert out["held"] == 4 * CHUNK
    assert out["grown_kib"] < 48 * 1024, out["grown_kib"]  # < one declared request, let alone two
    assert out["answer"] == b"merged"
    assert out["merged"] == [(out["honest"], blake3.blake3(_body(2)).digest())]


# ------------------------------------------------------------------------------------------------ broken streams


def _oversize(writer: Any) -> None:  # a chunk longer than the stream's chunk size
    writer.write(struct.pack(">I", 2 * CHUNK) + b"\x01" * (2 * CHUNK))


def _overlong(writer: Any) -> None:  # 4 chunks of 1 MiB where 3.5 MiB were declared
    writer.write((struct.pack(">I", CHUNK) + b"\x01" * CHUNK) * 4)


def _truncated(writer: Any) -> None:  # 2 of the 4 declared chunks, then the sender hangs up
    writer.write((struct.pack(">I", CHUNK) + b"\x01" * CHUNK) * 2)


def _short_chunks(writer: Any) -> None:  # the 4 declared chunks, but of 0.5 MiB each: 2 of the 4 MiB declared
    writer.write((struct.pack(">I", CHUNK // 2) + b"\x01" * (CHUNK // 2)) * 4)


BROKEN = {  # declared bytes, declared chunks (None: what the bytes need), what is sent, the typed refusal
    "oversize chunk": (4 * CHUNK, None, _oversize, "malformed"),
    "more than declared": (7 * CHUNK // 2, 4, _overlong, "more than declared"),
    "truncated": (4 * CHUNK, None, _truncated, "stream closed early"),
    "chunks short of the declared size": (4 * CHUNK, None, _short_chunks, "size mismatch"),
}


async def _broken(swarm: Swarm, kind: str) -> dict[str, Any]:
    declared, num_chunks, write, _ = BROKEN[kind]
    caps = fragment_server_limits(
        {"broken": Route(swarm.merge, FRAME)}, fragment_frame_bytes=FRAME, max_fragments_in_flight=2
    )
    server = swarm.server("broken", caps)
    await server.start()
    try:
        reader, writer = await _open(swarm, 0, "broken", declared, num_chunks)
        write(writer)
        if kind == "truncated":
            await writer.drain()
            await _until(lambda: server.limiter.bytes_in_flight == 2 * CHUNK, 20, "two chunks held")
            writer.close()
            answer = None
        else:
            answer = await _answer(reader)
            writer.close()
        await _until(lambda: bool(swarm.rejected), 20, "the refusal")
        await _until(lambda: server.limiter.bytes_in_flight == 0, 10, "every byte given back")
    finally:
        await server.stop()
    return {"answer": answer, "rejected": [e.reason for _, e in swarm.rejected], "merged": list(swarm.merged)}


@pytest.mark.parametrize("kind", list(BROKEN))
def test_broken_streams_are_refused_typed_nothing_merged_and_every_byte_given_back(
    loop_thread: Any, tmp_path: Path, kind: str
) -> None:
    reason = BROKEN[kind][3]
    out = loop_thread.run(_in_swarm(tmp_path, lambda swarm: _broken(swarm, kind)), timeout_s=120)
    assert out["merged"] == []
    assert out["rejected"] == [reason], out
    if kind != "truncated":
        assert out["answer"] == (Status.ERROR, reason), out
