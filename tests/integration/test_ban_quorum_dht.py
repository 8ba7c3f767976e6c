"""The ban quorum over real hivemind DHTs on loopback (issue 18 item 4: `bans_required` defaults to 2 where two or
more verifiers exist). Two authorized verifiers sign ban notices into one validating DHT peer; the watcher a node
builds from its manifest (`ban_watcher_for`) reads them through another. With the default (`bans_required = 0`:
auto, two signatures) one verifier's notice, read back and visible, bans nobody, and the second one's bans.
Negative control: `bans_required = 1`, the lone notice bans.

BanWatcher under a heartbeat flood (`test_a_ban_among_a_heartbeat_flood_is_found_over_the_dht`): the two
verifiers' notices against one peer, and `FLOOD` other live peer ids (what thousands of fake heartbeats list in the
directory) whose ban records the watcher must read too, each a real DHT get through the watcher's peer (~2 ms a
peer on this box). A round reads batches of `poll_batch` until its deadline and the next goes on from where it
stopped (`poll_order`): the ban is found within a few bounded rounds. Negative control: the old all-or-nothing read
(every peer in one DHT read, on the round's deadline) times out round after round and never finds it."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from node.config import LOOPBACK_LISTEN, NetworkConfig
from node.swarm import start_dht
from node.swarm.bans import BanWatchConfig, BanWatcher, ban_watcher_for
from protocol.dht_io import SwarmRecords
from protocol.identity import NodeIdentity
from protocol.manifest import RunManifest, SignedManifest, authorize
from protocol.records import BanNotice, HivenodeRecordValidator, RunRules

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]
logger = logging.getLogger(__name__)

OWNER, V1, V2 = NodeIdentity.generate(), NodeIdentity.generate(), NodeIdentity.generate()
OFFENDER = NodeIdentity.generate().peer_id


def _rules(bans_required: int) -> tuple[RunManifest, RunRules]:
    manifest = authorize(RunManifest(bans_required=bans_required), verifiers=[V1.peer_id, V2.peer_id])
    return manifest, RunRules.from_manifest(SignedManifest.sign(manifest, OWNER), manifest)


@pytest.fixture
def dht_pair(
    tmp_path: Path, request: pytest.FixtureRequest
) -> Iterator[tuple[Any, Any, RunManifest, RunRules]]:
    # `bans_required` from the test's parameter; 2 (two signatures) when it has none
    manifest, rules = _rules(getattr(request, "param", 2))
    network = NetworkConfig(listen=(LOOPBACK_LISTEN,), join_timeout_s=20, request_timeout_s=5)
    started = []
    try:
        a = start_dht(
            NodeIdentity.load_or_create(tmp_path / "a.key"), [], network, HivenodeRecordValidator([rules])
        )
        started.append(a)
        maddrs = [str(m) for m in a.get_visible_maddrs()]
        b_identity = NodeIdentity.load_or_create(tmp_path / "b.key")
        b = start_dht(b_identity, maddrs, network, HivenodeRecordValidator([rules]))
        started.append(b)
        yield a, b, manifest, rules
    finally:
        for dht in started:
            dht.shutdown()


async def _poll_until(watcher: Any, deadline_s: float) -> bool:
    """Poll the offender until the watcher bans it or `deadline_s` passes; whether it banned."""
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        await watcher.poll([OFFENDER])
        if watcher.is_banned(OFFENDER):
            return True
        await asyncio.sleep(0.2)
    return False


async def _scenario(a: Any, b: Any, manifest: RunManifest, rules: RunRules) -> tuple[bool, int, bool]:
    """(banned after V1's notice alone, V1's records visible to the watcher's peer then, banned after V2's)."""
    expiration = time.time() + 300
    reader = SwarmRecords(b, rules, NodeIdentity.generate(), timeout_s=5.0)
    events: list[str] = []
    ctx = SimpleNamespace(
        records=reader,
        manifest=manifest,
        run_id=rules.run_id,
        events=SimpleNamespace(emit=lambda name, **_: events.append(name)),
    )
    watcher = ban_watcher_for(ctx)  # type: ignore[arg-type]
    notice = BanNotice(offender=OFFENDER, reason="flagged by sentinel", issued_at=time.time())
    assert await SwarmRecords(a, rules, V1, timeout_s=5.0).publish_ban(notice, expiration=expiration)
    seen = 0
    for _ in range(50):
        seen = len(await reader.get_bans(OFFENDER))
        if seen:
            break
        await asyncio.sleep(0.1)
    banned_on_one = await _poll_until(watcher, deadline_s=2.0)
    assert await SwarmRecords(a, rules, V2, timeout_s=5.0).publish_ban(notice, expiration=expiration)
    banned_on_two = banned_on_one or await _poll_until(watcher, deadline_s=10.0)
    assert ("ban_enforced" in events) == banned_on_two
    return banned_on_one, seen, banned_on_two


@pytest.mark.parametrize(
    "dht_pair", [0, 1], ids=["default-two-signatures", "one-signature-control"], indirect=True
)
def test_one_verifiers_notice_bans_nobody_by_default_over_the_dht(
    dht_pair: tuple[Any, Any, RunManifest, RunRules],
) -> None:
    a, b, manifest, rules = dht_pair
    banned_on_one, seen, banned_on_two = asyncio.run(asyncio.wait_for(_scenario(a, b, manifest, rules), 60))
    assert seen == 1  # V1's notice travelled: the watcher's peer reads it
    assert manifest.ban_quorum == (2 if manifest.bans_required == 0 else 1)
    if manifest.bans_required == 0:
        assert not banned_on_one and banned_on_two
    else:
        assert banned_on_one  # the control: a lone verifier bans


FLOOD = sorted(NodeIdentity.generate().peer_id for _ in range(2001))
FLOOD_OFFENDER = FLOOD.pop()  # sorted after every fake peer: the rotation must get through the whole flood
FLOOD_TIMEOUT_S = 0.8  # one round (a batch of 32 reads in ~0.1 s here, the whole flood in ~4.5 s)
FLOOD_ROUNDS = 40  # the batched reads took 7 rounds here at load 8; the bound leaves room for a slower box
CONTROL_ROUNDS = 2
BATCHED = BanWatchConfig(timeout_s=FLOOD_TIMEOUT_S, max_poll_peers=512, poll_batch=32)
ALL_AT_ONCE = BanWatchConfig(timeout_s=FLOOD_TIMEOUT_S, max_poll_peers=10**6, poll_batch=10**6)


async def _flood_rounds(
    a: Any, b: Any, rules: RunRules, config: BanWatchConfig, rounds: int
) -> dict[str, Any]:
    """Both verifiers ban `FLOOD_OFFENDER` through `a`; a watcher reading through `b` polls the flood and the
    offender for up to `rounds` rounds. What it saw: the notices visible, rounds run and their longest, banned."""
    reader = SwarmRecords(b, rules, NodeIdentity.generate(), timeout_s=5.0)
    notice = BanNotice(offender=FLOOD_OFFENDER, reason="flagged by sentinel", issued_at=time.time())
    for verifier in (V1, V2):
        assert await SwarmRecords(a, rules, verifier, timeout_s=5.0).publish_ban(
            notice, expiration=time.time() + 300
        )
    visible, end = 0, time.monotonic() + 10.0
    while visible < 2 and time.monotonic() < end:
        visible = len(await reader.get_bans(FLOOD_OFFENDER))
        await asyncio.sleep(0.1)
    watcher = BanWatcher(
        reader,
        authorized_verifiers=(V1.peer_id, V2.peer_id),
        bans_required=2,
        run_id=rules.run_id,
        config=config,
    )
    peers, longest, run = [*FLOOD, FLOOD_OFFENDER], 0.0, 0
    while run < rounds and not watcher.is_banned(FLOOD_OFFENDER):
        started = time.monotonic()
        await watcher.poll(peers)
        longest, run = max(longest, time.monotonic() - started), run + 1
    return {
        "visible": visible,
        "rounds": run,
        "longest_s": longest,
        "banned": watcher.is_banned(FLOOD_OFFENDER),
        "timed_out": watcher.batches_timed_out,
    }


@pytest.mark.parametrize("batched", [True, False], ids=["batched-rounds", "all-at-once-control"])
def test_a_ban_among_a_heartbeat_flood_is_found_over_the_dht(
    dht_pair: tuple[Any, Any, RunManifest, RunRules], batched: bool
) -> None:
    a, b, _, rules = dht_pair
    config, rounds = (BATCHED, FLOOD_ROUNDS) if batched else (ALL_AT_ONCE, CONTROL_ROUNDS)
    out = asyncio.run(asyncio.wait_for(_flood_rounds(a, b, rules, config, rounds), 60))
    # the notices are there, readable through the watcher's peer: only the flood stands in the way
    assert out["visible"] == 2, out
    logger.info("ban watcher under a flood of %d peers: %s", len(FLOOD), out)
    if batched:
        assert out["banned"] and out["rounds"] >= 2, out  # found, and not in the first round
        # every round ends near its deadline: a batch cut short is a few dozen reads to cancel
        assert out["longest_s"] < FLOOD_TIMEOUT_S + 0.5, out
    else:
        # the control: each round asks for every peer at once, times out, and keeps nothing (cancelling its
        # thousands of reads took seconds past the deadline here: rounds of 6.4 s, 2026-12-08 at load 8)
        assert not out["banned"] and out["timed_out"] == CONTROL_ROUNDS, out
