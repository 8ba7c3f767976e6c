"""Stream slots reserved for a stage's verifiers, over real daemons on loopback (#18: Sybils held every slot).

A server with 8 stream slots (4 per peer) serves one route. Two fresh identities open every stream they can and
hold each open (a request started, never finished: what a long-poll or a stalled upload looks like). Then the
verifier calls. With the verifier preferred, guests share 4 slots at 2 each and the verifier gets in; with
nobody preferred (the negative control), the two guests hold all 8 slots and the verifier is refused.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
from hivemind.p2p import P2P, PeerID

from protocol.identity import NodeIdentity
from protocol.limits import LimitsConfig, RateLimit
from protocol.rpc import FramedServer, Status, StreamConfig, call_framed, encode_preamble, protocol_name

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

LOOPBACK = ["/ip4/127.0.0.1/tcp/0"]
FAST = RateLimit(rate_per_s=1000.0, burst=1000.0)
LIMITS = LimitsConfig(
    default_rate=FAST,
    global_rate=None,
    max_streams_per_peer=4,
    max_streams_total=8,
    reserved_streams=4,
    max_streams_per_guest=2,
)


async def _echo(frame: bytearray, remote_peer: str) -> bytes:
    return b"ok"


async def _p2p(path: Path, initial_peers: list[Any] | None = None) -> P2P:
    NodeIdentity.load_or_create(path)
    return await P2P.create(
        initial_peers=initial_peers,
        identity_path=str(path),
        check_if_identity_free=False,
        host_maddrs=LOOPBACK,
    )


async def _hold_streams(p2p: P2P, server: str, count: int) -> list[Any]:
    held = []
    for _ in range(count):
        _, _, writer = await p2p.call_binary_stream_handler(PeerID.from_base58(server), protocol_name("work"))
        writer.write(encode_preamble(Status.REQUEST, 10, 1 << 20))  # a request begun and never finished
        await writer.drain()
        held.append(writer)
    return held


async def _scenario(tmp: Path, preferred: bool) -> tuple[int, str]:
    server_p2p = await _p2p(tmp / "server.key")
    maddrs = await server_p2p.get_visible_maddrs()
    sybils = [await _p2p(tmp / f"sybil{i}.key", maddrs) for i in range(2)]
    verifier_p2p = await _p2p(tmp / "verifier.key", maddrs)
    verifier = NodeIdentity.load_or_create(tmp / "verifier.key").peer_id
    server = FramedServer(
        server_p2p, {"work": (_echo, 1024)}, config=StreamConfig(chunk_timeout_s=20), limits=LIMITS
    )
    if preferred:
        server.limiter.prefer(lambda peer: peer == verifier)
    await server.start()
    server_id = NodeIdentity.load_or_create(tmp / "server.key").peer_id
    held = []
    try:
        for sybil in sybils:
            held += await _hold_streams(sybil, server_id, 4)
        deadline = asyncio.get_running_loop().time() + 10
        want = 4 if preferred else 8  # the guests' share, or every slot
        while server.limiter.stats().num_open_streams < want:
            assert asyncio.get_running_loop().time() < deadline, server.limiter.stats()
            await asyncio.sleep(0.02)
        held_open = server.limiter.stats().num_open_streams
        try:
            answer = await call_framed(
                verifier_p2p, server_id, "work", b"x", max_response_bytes=64, timeout_s=10
            )
            outcome = bytes(answer).decode()
        except Exception as e:
            outcome = f"refused: {getattr(e, 'reason', type(e).__name__)}"
        return held_open, outcome
    finally:
        for writer in held:
            writer.close()
        await server.stop()
        for p2p in (verifier_p2p, *sybils, server_p2p):
            await p2p.shutdown()


@pytest.mark.parametrize("preferred", [True, False], ids=["verifier-preferred", "nobody-preferred-control"])
def test_sybil_streams_cannot_lock_the_verifier_out(
    loop_thread: Any, tmp_path: Path, preferred: bool
) -> None:
    held_open, outcome = loop_thread.run(_scenario(tmp_path, preferred), timeout_s=90)
    if preferred:
        assert held_open == 4  # 2 identities x 2 guest streams: the other 4 slots stay reserved
        assert outcome == "ok", outcome
    else:
        assert held_open == 8  # the guests hold every slot
        assert outcome.startswith("refused"), outcome
