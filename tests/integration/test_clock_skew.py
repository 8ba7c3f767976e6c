"""Clock skew (reliability.md §6, R9): a peer whose clock is off is refused with the reason "clock skew" past the
limit, accepted within it, and never struck for it, over real hivemind daemons on loopback.

- Envelopes: SKEWED sends signed frames to SERVER over a `FramedServer` stream, dated +30 s (accepted), then +5 min
  and -5 min (refused, reason "clock skew", no strike). Negative control: the same peer's tampered frames *are*
  struck, so the zero is the blame rule at work, not a strike counter that never counts.
- DHT records: a writer dates its heartbeats +30 s (seen by a validating reader) and +5 min (refused by the reader's
  validator with reason "clock skew", never seen). Control: a +5 min expiration with an honest `sent_at` is
  accepted, so the refusal is the writer's clock, not the record's lifetime.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from hivemind.p2p import P2P
from hivemind.utils import get_dht_time

from node.config import LOOPBACK_LISTEN, NetworkConfig
from node.swarm import start_dht
from protocol.codec import TensorLimits
from protocol.dht_io import SwarmRecords
from protocol.envelope import Context, Direction, Kind, max_frame_bytes, open_frame, seal
from protocol.errors import RemoteRefused
from protocol.identity import NodeIdentity
from protocol.manifest import RunManifest, SignedManifest
from protocol.records import Heartbeat, HivenodeRecordValidator, RunRules
from protocol.replay import ReplayGuard
from protocol.rpc import FramedServer, PeerStrikes, Route, call_framed

pytestmark = [pytest.mark.integration, pytest.mark.timeout(90)]

RUN_ID = "skew-test"
LIMITS = TensorLimits(max_bytes=1 << 16)
FRAMES_PER_OFFSET = 10
ACCEPTED_OFFSET_S = 30.0
REFUSED_OFFSETS_S = (300.0, -300.0)  # five minutes either way
OWNER = NodeIdentity.generate()
MANIFEST = RunManifest()
SIGNED = SignedManifest.sign(MANIFEST, OWNER)
RULES = RunRules.from_manifest(SIGNED, MANIFEST)


@dataclasses.dataclass
class Link:
    server_id: NodeIdentity
    skewed_id: NodeIdentity
    server_p2p: P2P
    skewed_p2p: P2P
    server: FramedServer
    strikes: PeerStrikes
    accepted: list[float]  # timestamps of the frames the server accepted


@pytest.fixture(scope="module", autouse=True)
def _torch_shm_manager() -> Iterator[None]:
    """hivemind's futures use torch shared memory; start its manager before the tests (see test_dht_abuse)."""
    keep = torch.empty(1, dtype=torch.uint8).share_memory_()
    yield
    del keep


@pytest.fixture(scope="module")
def link(loop_thread: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Link]:
    tmp = tmp_path_factory.mktemp("skew")
    server_id = NodeIdentity.load_or_create(tmp / "server.key")
    skewed_id = NodeIdentity.load_or_create(tmp / "skewed.key")
    guard, strikes, accepted = ReplayGuard(), PeerStrikes(), []
    expect = Context(
        run_id=RUN_ID, kind=Kind.ACTIVATION, receiver=server_id.peer_id, stage=0, direction=Direction.FORWARD
    )

    async def handle(frame: bytearray, remote_peer: str) -> bytes:
        header, _ = open_frame(
            frame, remote_peer=remote_peer, expect=expect, limits=LIMITS, replay=guard, now=time.time()
        )
        accepted.append(header.timestamp)
        return b"ok"

    async def setup() -> Link:
        loopback = ["/ip4/127.0.0.1/tcp/0"]
        server_p2p = await P2P.create(
            identity_path=str(server_id.path), check_if_identity_free=False, host_maddrs=loopback
        )
        skewed_p2p = await P2P.create(
            initial_peers=await server_p2p.get_visible_maddrs(),
            identity_path=str(skewed_id.path),
            check_if_identity_free=False,
            host_maddrs=loopback,
        )
        server = FramedServer(server_p2p, {"act": Route(handle, max_frame_bytes(LIMITS))}, strikes=strikes)
        await server.start()
        return Link(server_id, skewed_id, server_p2p, skewed_p2p, server, strikes, accepted)

    state = loop_thread.run(setup())
    try:
        yield state
    finally:
        loop_thread.run(_teardown(state))


async def _teardown(link: Link) -> None:
    await link.server.stop()
    await link.skewed_p2p.shutdown()
    await link.server_p2p.shutdown()


def _send(loop_thread: Any, link: Link, frame: bytes) -> str:
    """'ok', or the reason the server refused the frame with."""
    coro = call_framed(
        link.skewed_p2p, link.server_id.peer_id, "act", frame, max_response_bytes=64, timeout_s=10
    )
    try:
        return bytes(loop_thread.run(coro, timeout_s=20)).decode()
    except RemoteRefused as e:
        return e.reason


def _frame(link: Link, microbatch: int, offset_s: float) -> bytes:
    ctx = Context(
        run_id=RUN_ID,
        kind=Kind.ACTIVATION,
        receiver=link.server_id.peer_id,
        stage=0,
        direction=Direction.FORWARD,
    )
    now = time.time() + offset_s  # the sender's clock
    return seal(link.skewed_id, ctx, microbatch=microbatch, step=1, now=now, tensor=torch.randn(4))


def test_envelopes_within_the_skew_are_accepted_beyond_it_refused_never_struck(
    loop_thread: Any, link: Link
) -> None:
    peer = link.skewed_id.peer_id
    answers = [_send(loop_thread, link, _frame(link, i, ACCEPTED_OFFSET_S)) for i in range(FRAMES_PER_OFFSET)]
    assert answers == ["ok"] * FRAMES_PER_OFFSET  # +30 s: 0 rejections
    for k, offset in enumerate(REFUSED_OFFSETS_S):
        base = 1000 * (k + 1)
        answers = [_send(loop_thread, link, _frame(link, base + i, offset)) for i in range(FRAMES_PER_OFFSET)]
        assert answers == ["clock skew"] * FRAMES_PER_OFFSET  # +-5 min: 100 % refused, with the reason
    assert link.strikes.count(peer) == 0  # and never a strike for it
    assert len(link.accepted) == FRAMES_PER_OFFSET

    # Negative control: the same peer's tampered frames are refused *and* struck, one strike each.
    for i in range(FRAMES_PER_OFFSET):
        bad = bytearray(_frame(link, 5000 + i, 0.0))
        bad[-1] ^= 0x01  # a payload byte: the signed digest no longer matches
        assert _send(loop_thread, link, bad) == "digest mismatch"
    assert link.strikes.count(peer) == FRAMES_PER_OFFSET
    assert link.strikes.count(peer, "clock skew") == 0


# ---- DHT records ------------------------------------------------------------------------------------------------


async def _skew_rejections(_dht: Any, node: Any) -> dict[str, int]:
    """Inside a DHT process: how many records its hivenode validator refused, by reason."""
    out: dict[str, int] = {}
    for validator in node.protocol.record_validator._validators:
        if isinstance(validator, HivenodeRecordValidator):
            for reason, count in validator.rejections.items():
                out[reason] = out.get(reason, 0) + count
    return out


def test_dht_records_from_a_clock_five_minutes_ahead_are_refused_as_clock_skew(tmp_path: Path) -> None:
    network = NetworkConfig(listen=(LOOPBACK_LISTEN,), join_timeout_s=20, request_timeout_s=5)
    ids = {
        name: NodeIdentity.load_or_create(tmp_path / f"{name}.key")
        for name in ("reader", "near", "far", "ok")
    }
    started: list[Any] = []
    try:
        reader = start_dht(ids["reader"], [], network, HivenodeRecordValidator([RULES]))
        started.append(reader)
        maddrs = [str(m) for m in reader.get_visible_maddrs()]
        # A client-mode writer keeps nothing itself: whatever is stored lives on the validating reader.
        writer = start_dht(ids["near"], maddrs, network, HivenodeRecordValidator([RULES]), client_mode=True)
        started.append(writer)

        async def scenario() -> tuple[list[bool], set[str]]:
            now = get_dht_time()
            stored = []
            for name, offset_s, sent_offset_s in (
                ("near", 30.0, 30.0),
                ("far", 300.0, 300.0),
                ("ok", 300.0, 0.0),
            ):
                records = SwarmRecords(writer, RULES, ids[name], timeout_s=5)
                heartbeat = Heartbeat(role="learner", sent_at=now + sent_offset_s)
                stored.append(await records.publish_heartbeat(heartbeat, expiration=now + offset_s + 4.0))
            seen = {p.peer_id for p in await SwarmRecords(reader, RULES, ids["reader"]).list_peers()}
            return stored, seen

        stored, seen = asyncio.run(asyncio.wait_for(scenario(), 30))
        rejections = reader.run_coroutine(_skew_rejections)
        assert stored == [True, False, True]
        assert ids["near"].peer_id in seen  # +30 s: accepted and visible
        assert ids["far"].peer_id not in seen  # +5 min: refused ...
        assert rejections.get("clock skew", 0) >= 1  # ... as clock skew
        assert (
            ids["ok"].peer_id in seen
        )  # control: a +5 min expiration alone is fine; the writer's clock is not
    finally:
        for dht in started:
            dht.shutdown()
