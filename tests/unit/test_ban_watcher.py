"""BanWatcher under heartbeat floods (issue 18 item 4): a round reads ban records in bounded batches, each on the
round's deadline, and goes on from where the last stopped, so a ban among thousands of fake peers is found within
a few rounds; the old all-or-nothing read (every peer in one DHT call) timed out round after round and never
found it. Our own notices are re-published only until ban_ttl_s. No sockets: a fake DHT whose reads take time
in proportion to the peers they ask about."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterable
from types import SimpleNamespace

import pytest

from node.swarm.bans import BanWatchConfig, BanWatcher, ban_watcher_for, poll_order
from protocol.identity import NodeIdentity
from protocol.manifest import RunManifest
from protocol.records import BanNotice, BanRecord

pytestmark = pytest.mark.timeout(60)

V1, V2 = NodeIdentity.generate().peer_id, NodeIdentity.generate().peer_id
OFFENDER = "offender-peer"
FLOOD = [f"fake{i:05d}" for i in range(3000)]  # heartbeats of a flood: peers that do not exist
PER_PEER_S = 0.0005  # a DHT read of n peers takes n x this (3000 at once: 1.5 s)


class SlowRecords:
    """`SwarmRecords.list_bans`/`publish_ban` of a DHT whose reads cost time per peer asked about."""

    def __init__(self, now: float) -> None:
        self.bans = {
            OFFENDER: [
                BanRecord(
                    verifier=v, notice=BanNotice(offender=OFFENDER, reason="flagged"), expires_at=now + 600
                )
                for v in (V1, V2)
            ]
        }
        self.published: list[tuple[str, float]] = []

    async def list_bans(self, offenders: Iterable[str]) -> dict[str, list[BanRecord]]:
        asked = sorted(set(offenders))
        await asyncio.sleep(PER_PEER_S * len(asked))
        return {o: self.bans[o] for o in asked if o in self.bans}

    async def publish_ban(self, notice: BanNotice, *, expiration: float) -> bool:
        self.published.append((notice.offender, expiration))
        return True


def _watcher(records: SlowRecords, config: BanWatchConfig, clock: list[float]) -> BanWatcher:
    return BanWatcher(
        records,
        authorized_verifiers=(V1, V2),
        bans_required=2,
        run_id="r" * 40,
        config=config,
        clock=lambda: clock[0],
    )


async def _rounds_until_banned(watcher: BanWatcher, peers: list[str], rounds: int) -> int | None:
    for round_ in range(1, rounds + 1):
        await watcher.poll(peers)
        if watcher.is_banned(OFFENDER):
            return round_
    return None


def test_a_ban_among_a_heartbeat_flood_is_found_in_a_few_bounded_rounds() -> None:
    clock = [1000.0]
    peers = [*FLOOD, OFFENDER]  # sorted last: the rotation must get there
    config = BanWatchConfig(timeout_s=0.5, max_poll_peers=512, poll_batch=32)
    watcher = _watcher(SlowRecords(clock[0]), config, clock)
    found = asyncio.run(_rounds_until_banned(watcher, peers, rounds=20))
    assert found is not None and found <= 12, found


def test_control_the_all_or_nothing_read_never_finds_it_under_the_same_flood() -> None:
    clock = [1000.0]
    peers = [*FLOOD, OFFENDER]
    # the old behaviour: every peer in one DHT read, on one deadline
    config = BanWatchConfig(timeout_s=0.5, max_poll_peers=10**6, poll_batch=10**6)
    watcher = _watcher(SlowRecords(clock[0]), config, clock)
    assert asyncio.run(_rounds_until_banned(watcher, peers, rounds=3)) is None
    assert watcher.batches_timed_out == 3


def test_poll_order_puts_our_offenders_first_and_rotates_the_rest() -> None:
    peers = ["a", "b", "c", "d", "e"]
    assert poll_order(peers, ["x"], "", 3) == ["x", "a", "b"]
    assert poll_order(peers, ["x"], "b", 4) == ["x", "c", "d", "e"]
    assert poll_order(peers, [], "d", 3) == ["e", "a", "b"]  # wraps around


def test_our_notices_are_republished_only_until_ban_ttl() -> None:
    clock = [1000.0]
    records = SlowRecords(clock[0])
    watcher = _watcher(records, BanWatchConfig(ban_ttl_s=100.0), clock)
    watcher.outbox.append(BanNotice(offender="learner-x", reason="poisoned", issued_at=clock[0]))
    asyncio.run(watcher.publish_pending())
    clock[0] += 50.0
    asyncio.run(watcher.publish_pending())  # re-published, with the same expiration (not renewed)
    assert records.published == [("learner-x", 1100.0), ("learner-x", 1100.0)]
    clock[0] += 51.0
    asyncio.run(watcher.publish_pending())
    assert len(records.published) == 2 and "learner-x" not in watcher.published


@pytest.mark.parametrize("bans_required", [0, 1], ids=["default-auto", "one-signature-control"])
def test_a_nodes_watcher_needs_two_verifiers_by_default_once_two_are_authorized(bans_required: int) -> None:
    """Issue 18 item 4, `bans_required` defaults to 2 where two or more verifiers exist: the watcher a node builds
    from its manifest (`ban_watcher_for`) does not act on one verifier's notice. Control: `bans_required = 1`, the
    same lone notice bans."""
    records = SlowRecords(time.time())  # the watcher a node builds reads the wall clock
    records.bans[OFFENDER] = records.bans[OFFENDER][:1]  # V1's notice alone
    manifest = RunManifest(authorized_verifiers=(V1, V2), bans_required=bans_required)
    events: list[str] = []
    ctx = SimpleNamespace(
        records=records,
        manifest=manifest,
        run_id="r" * 40,
        events=SimpleNamespace(emit=lambda name, **_: events.append(name)),
    )
    watcher = ban_watcher_for(ctx)  # type: ignore[arg-type]
    asyncio.run(watcher.poll([OFFENDER]))
    assert watcher.is_banned(OFFENDER) == (bans_required == 1)
    assert ("ban_enforced" in events) == (bans_required == 1)
