"""The replay table under a Sybil flood, over real daemons on loopback (issue 18 item 4: identities cost nothing, so
one signed frame from each of many fresh identities must not lock new honest senders out of a full table).

A server opens signed control frames as every route does (`open_envelope` with its `ReplayGuard`), with a table
of `TABLE_SENDERS` senders. A known learner has sent `established_frames` frames; then `NUM_SYBILS` fresh
identities, each on its own daemon (a frame must come from the daemon of the identity that signed it), send one
frame each, more than the table has room for; then a fresh honest learner sends its first frame. With eviction
(the default) a newcomer Sybil makes room each time: the last Sybil and the honest newcomer are answered, the known
learner stays in the table, and an evicted Sybil's frame sent again is still refused (the floor replaces its
history). Negative control: `evict_when_full = False` (the table before the fix): the Sybils hold every free slot
and the honest newcomer is refused, "replay table full", for as long as their frames stay fresh (`max_skew_s`).
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import pytest

from node.diloco.sync_client import control_limits
from protocol.envelope import Context, Kind, max_frame_bytes, open_envelope, seal
from protocol.errors import RemoteRefused
from protocol.identity import NodeIdentity
from protocol.limits import LimitsConfig, RateLimit
from protocol.replay import ReplayConfig, ReplayGuard
from protocol.rpc import FramedServer, call_framed
from tests.integration.procs import start_daemons

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

RUN_ID = "r" * 40
ROUTE = "control"
TABLE_SENDERS = 4  # the table's room (4,096 by default: as many fresh daemons would not fit a test)
NUM_SYBILS = 4  # the known learner and 3 Sybils fill the table; the 4th Sybil finds it full
FAST = RateLimit(rate_per_s=1000.0, burst=1000.0)
LIMITS = LimitsConfig(default_rate=FAST, global_rate=None)
SCENARIO_S = 60.0


def _guard(evict: bool) -> ReplayGuard:
    return ReplayGuard(ReplayConfig(max_senders=TABLE_SENDERS, evict_when_full=evict))


def _server(p2p: Any, guard: ReplayGuard) -> FramedServer:
    server_id = p2p.peer_id.to_base58()

    async def handle(frame: bytearray, remote_peer: str) -> bytes:
        expect = Context(run_id=RUN_ID, kind=Kind.CONTROL, receiver=server_id)
        open_envelope(
            frame,
            remote_peer=remote_peer,
            expect=expect,
            limits=control_limits(),
            replay=guard,
            now=time.time(),
        )
        return b"ok"

    return FramedServer(p2p, {ROUTE: (handle, max_frame_bytes(control_limits()))}, limits=LIMITS)


def _frame(identity: NodeIdentity, server: str, step: int) -> bytes:
    context = Context(run_id=RUN_ID, kind=Kind.CONTROL, receiver=server)
    return bytes(seal(identity, context, microbatch=0, step=step, now=time.time(), meta={"known": [step]}))


async def _send(p2p: Any, server: str, frame: bytes) -> str:
    """'ok', or the reason the server refused the frame with."""
    try:
        answer = await call_framed(p2p, server, ROUTE, frame, max_response_bytes=64, timeout_s=10)
    except RemoteRefused as e:
        return e.reason
    return bytes(answer).decode()


async def _scenario(tmp: Path, guard: ReplayGuard) -> dict[str, Any]:
    names = [*(f"sybil{i}" for i in range(NUM_SYBILS)), "known", "newcomer"]
    ids = {name: NodeIdentity.load_or_create(tmp / f"{name}.key") for name in [*names, "server"]}
    (server_p2p,) = await start_daemons([tmp / "server.key"], [])
    daemons: list[Any] = []
    server = _server(server_p2p, guard)
    target = ids["server"].peer_id
    try:
        await server.start()
        maddrs = [str(m) for m in await server_p2p.get_visible_maddrs()]
        daemons = await start_daemons([tmp / f"{name}.key" for name in names], maddrs)
        p2p = dict(zip(names, daemons, strict=True))
        known_first = _frame(ids["known"], target, 0)
        known = [await _send(p2p["known"], target, known_first)]
        for step in range(1, guard.config.established_frames):
            known.append(await _send(p2p["known"], target, _frame(ids["known"], target, step)))
        sybil_first = _frame(ids["sybil0"], target, 0)
        sybils = [await _send(p2p["sybil0"], target, sybil_first)]
        for name in names[1:NUM_SYBILS]:
            sybils.append(await _send(p2p[name], target, _frame(ids[name], target, 0)))
        return {
            "known": known,
            "sybils": sybils,
            "newcomer": await _send(p2p["newcomer"], target, _frame(ids["newcomer"], target, 0)),
            "known_again": await _send(
                p2p["known"], target, _frame(ids["known"], target, guard.config.established_frames)
            ),
            "known_replay": await _send(p2p["known"], target, known_first),
            "sybil_replay": await _send(p2p["sybil0"], target, sybil_first),
            "held": guard.num_senders,
            "evicted": guard.num_evicted,
        }
    finally:
        await server.stop()
        await asyncio.gather(*(d.shutdown() for d in [*daemons, server_p2p]), return_exceptions=True)


@pytest.mark.parametrize("evict", [True, False], ids=["evict-newcomers", "no-eviction-control"])
def test_a_sybil_flood_cannot_lock_a_new_honest_sender_out_of_the_replay_table(
    loop_thread: Any, tmp_path: Path, evict: bool
) -> None:
    guard = _guard(evict)
    out = loop_thread.run(_scenario(tmp_path, guard), timeout_s=SCENARIO_S)
    assert out["known"] == ["ok"] * guard.config.established_frames, out
    assert out["sybils"][: TABLE_SENDERS - 1] == ["ok"] * (TABLE_SENDERS - 1), out
    # a replay never passes, evicted or not
    assert out["known_replay"] == "replay", out
    assert out["held"] == TABLE_SENDERS, out
    if evict:
        # each newcomer past the table's room evicts the least recently active newcomer, never the known learner
        assert out["sybils"][-1] == "ok" and out["newcomer"] == "ok", out
        assert out["known_again"] == "ok", out
        assert out["evicted"] == 2, out
        # the evicted Sybil's history became the floor: its frame sent again is stale, not accepted
        assert out["sybil_replay"] == "outside replay window", out
    else:
        # the control: the Sybils hold the table, and the honest newcomer is locked out
        assert out["sybils"][-1] == "replay table full", out
        assert out["newcomer"] == "replay table full", out
        assert out["known_again"] == "ok" and out["evicted"] == 0, out
        assert out["sybil_replay"] == "replay", out
