"""Signed records through real hivemind DHTs on loopback: what honest peers write is seen by others; what an
attacker writes (another peer's subkey, an unknown key, a far-future expiration, an out-of-schema value, an
unauthorized role) is refused by every validating peer and never shown to anyone."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Awaitable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import hivemind
import pytest
from hivemind.utils import get_dht_time

from node.config import LOOPBACK_LISTEN, NetworkConfig
from node.swarm import start_dht
from protocol import keys
from protocol.dht_io import SwarmRecords, fetch_discovery, fetch_manifest, publish_discovery
from protocol.identity import NodeIdentity
from protocol.manifest import RunManifest, SignedManifest, authorize
from protocol.records import (
    BanNotice,
    Heartbeat,
    HivenodeRecordValidator,
    MeasuredThroughputs,
    RunRules,
    SyncerState,
    make_envelope,
)

pytestmark = [pytest.mark.integration, pytest.mark.timeout(90)]
T = TypeVar("T")

OWNER, SYNCER, VERIFIER = NodeIdentity.generate(), NodeIdentity.generate(), NodeIdentity.generate()
ATTACKER, VICTIM = NodeIdentity.generate(), NodeIdentity.generate()
MANIFEST = authorize(RunManifest(), syncers=[SYNCER.peer_id], verifiers=[VERIFIER.peer_id])
SIGNED = SignedManifest.sign(MANIFEST, OWNER)
RULES = RunRules.from_manifest(SIGNED, MANIFEST)
RUN_ID = SIGNED.run_id


@dataclasses.dataclass
class Dhts:
    a: Any  # validating peer, knows the run from the start
    b: Any  # validating peer, learns the run after it started (add_validators)
    evil: Any  # plain hivemind client: no validator, writes whatever it likes
    b_identity: NodeIdentity


def run(coro: Awaitable[T], timeout_s: float = 20.0) -> T:
    return asyncio.run(asyncio.wait_for(coro, timeout_s))  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def dhts(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Dhts]:
    root: Path = tmp_path_factory.mktemp("dht")
    network = NetworkConfig(listen=(LOOPBACK_LISTEN,), join_timeout_s=20, request_timeout_s=5)
    ida = NodeIdentity.load_or_create(root / "a.key")
    idb = NodeIdentity.load_or_create(root / "b.key")
    started = []
    try:
        a = start_dht(ida, [], network, HivenodeRecordValidator([RULES]))
        started.append(a)
        maddrs = [str(m) for m in a.get_visible_maddrs()]
        assert a.peer_id.to_base58() == ida.peer_id  # an Ed25519 identity file gives exactly our peer id
        b = start_dht(idb, maddrs, network, HivenodeRecordValidator())
        started.append(b)
        b.add_validators([HivenodeRecordValidator([RULES])])
        evil = hivemind.DHT(initial_peers=maddrs, start=True, client_mode=True)
        started.append(evil)
        yield Dhts(a, b, evil, idb)
    finally:
        for dht in started:
            dht.shutdown()


def records(dht: Any, identity: NodeIdentity) -> SwarmRecords:
    return SwarmRecords(dht, RULES, identity, timeout_s=5.0)


async def raw_store(dht: Any, raw_key: str, envelope: Any, expiration: float, subkey: str | None) -> bool:
    return bool(await dht.store(raw_key, envelope, expiration, subkey=subkey, return_future=True))


async def raw_get(dht: Any, raw_key: str) -> Any:
    return await dht.get(raw_key, latest=True, return_future=True)


def heartbeat(now: float, **changes: Any) -> dict[str, Any]:
    return dataclasses.replace(Heartbeat(role="learner", sent_at=now), **changes).to_body()


def test_honest_heartbeats_are_seen_by_every_validating_peer(dhts: Dhts) -> None:
    async def scenario() -> None:
        now = get_dht_time()
        hb = Heartbeat(role="stage", stage=1, span=(2, 4), throughput=123.0, http="127.0.0.1:9", sent_at=now)
        assert await records(dhts.b, dhts.b_identity).publish_heartbeat(hb, expiration=now + 10)
        for reader in (dhts.a, dhts.b):
            listed = {p.peer_id: p for p in await records(reader, OWNER).list_peers()}
            assert listed[dhts.b_identity.peer_id].heartbeat == hb

    run(scenario())


def test_a_record_under_another_peers_subkey_is_refused(dhts: Dhts) -> None:
    async def scenario() -> None:
        now = get_dht_time()
        raw = keys.peers_key(RUN_ID)
        forged = make_envelope(ATTACKER, raw, VICTIM.peer_id, heartbeat(now), now + 10)
        assert not await raw_store(dhts.evil, raw, forged, now + 10, VICTIM.peer_id)
        for reader in (dhts.a, dhts.b):
            assert VICTIM.peer_id not in {p.peer_id for p in await records(reader, OWNER).list_peers()}
        # control: the same attacker *can* reach the DHT and store its own record
        own = make_envelope(ATTACKER, raw, ATTACKER.peer_id, heartbeat(now), now + 10)
        assert await raw_store(dhts.evil, raw, own, now + 10, ATTACKER.peer_id)
        assert ATTACKER.peer_id in {p.peer_id for p in await records(dhts.a, OWNER).list_peers()}

    run(scenario())


CASES = ["unknown key", "far-future expiration", "out of schema", "unsigned foreign value"]


@pytest.mark.parametrize("case", CASES)
def test_invalid_records_are_refused_and_invisible(dhts: Dhts, case: str) -> None:
    async def scenario() -> None:
        now = get_dht_time()
        mallory = NodeIdentity.generate()  # signs correctly, with its own key, under its own subkey
        raw, subkey, expiration = keys.peers_key(RUN_ID), mallory.peer_id, now + 10
        body: Any = heartbeat(now)
        if case == "unknown key":
            raw = f"{RUN_ID}/gossip"
        elif case == "far-future expiration":
            expiration = now + 365 * 86400
        elif case == "out of schema":
            body = {**body, "throughput": "fast"}
        value: Any = make_envelope(mallory, raw, subkey, body, expiration)
        if case == "unsigned foreign value":
            raw, subkey, value = f"{RUN_ID}/peers-plain", None, {"role": "learner"}
        assert not await raw_store(dhts.evil, raw, value, expiration, subkey)
        for reader in (dhts.a, dhts.b):
            found = await raw_get(reader, raw)
            if raw == keys.peers_key(
                RUN_ID
            ):  # holds other, valid heartbeats: this one must not be among them
                assert found is None or mallory.peer_id not in found.value
            else:
                assert found is None

    run(scenario())


def test_only_authorized_peers_hold_the_syncer_lease_and_sign_bans(dhts: Dhts) -> None:
    async def scenario() -> None:
        now = get_dht_time()
        lease = SyncerState(lease_until=now + 10, term=1, versions=(0, 0, 0, 0), sent_at=now)
        assert not await records(dhts.evil, ATTACKER).publish_syncer(lease, expiration=now + 10)
        assert await records(dhts.a, SYNCER).publish_syncer(lease, expiration=now + 10)
        syncers = await records(dhts.b, OWNER).list_syncers()
        assert [(s.peer_id, s.state) for s in syncers] == [(SYNCER.peer_id, lease)]

        notice = BanNotice(
            offender=VICTIM.peer_id, reason="3 flags in 20 microbatches", evidence=b"e", issued_at=now
        )
        assert not await records(dhts.evil, ATTACKER).publish_ban(notice, expiration=now + 60)
        assert await records(dhts.b, VERIFIER).publish_ban(notice, expiration=now + 60)
        bans = await records(dhts.a, OWNER).list_bans([VICTIM.peer_id, ATTACKER.peer_id])
        assert list(bans) == [VICTIM.peer_id]
        assert [(r.verifier, r.notice) for r in bans[VICTIM.peer_id]] == [(VERIFIER.peer_id, notice)]

    run(scenario())


def test_manifest_discovery_is_owner_only(dhts: Dhts) -> None:
    async def scenario() -> None:
        now = get_dht_time()
        assert await publish_discovery(dhts.a, OWNER, SIGNED, expiration=now + 60, timeout_s=5)
        assert await records(dhts.a, OWNER).publish_manifest(SIGNED, expiration=now + 60)
        # an attacker re-signs the owner's manifest under the owner's subkey: refused
        forged = make_envelope(
            ATTACKER, keys.discovery_key(), OWNER.peer_id, {"signed": SIGNED.to_wire()}, now + 61
        )
        assert not await raw_store(dhts.evil, keys.discovery_key(), forged, now + 61, OWNER.peer_id)
        found = await fetch_discovery(dhts.b, timeout_s=5, now=get_dht_time())
        assert found == [SIGNED]
        assert await fetch_manifest(dhts.b, RUN_ID, timeout_s=5, now=get_dht_time()) == SIGNED

    run(scenario())


def test_leaving_replaces_the_heartbeat_and_older_expirations_lose(dhts: Dhts) -> None:
    async def scenario() -> None:
        now = get_dht_time()
        leaver = NodeIdentity.generate()
        client = records(dhts.a, leaver)
        assert await client.publish_heartbeat(Heartbeat(role="learner", sent_at=now), expiration=now + 8)
        assert leaver.peer_id in {p.peer_id for p in await client.list_peers()}
        stale = Heartbeat(role="learner", state="training", sent_at=now)
        assert not await client.publish_heartbeat(
            stale, expiration=now + 4
        )  # hivemind keeps the newest expiration
        leaving = Heartbeat(role="learner", state="leaving", leaving=True, sent_at=now)
        assert await client.publish_heartbeat(leaving, expiration=now + 8.001)
        assert leaver.peer_id not in {p.peer_id for p in await records(dhts.b, OWNER).list_peers()}
        everyone = await records(dhts.b, OWNER).list_peers(include_leaving=True)
        assert [p.heartbeat.state for p in everyone if p.peer_id == leaver.peer_id] == ["leaving"]

    run(scenario())


def test_only_authorized_verifiers_publish_measured_throughputs(dhts: Dhts) -> None:
    """Placement trusts `measured` records over announced throughputs (issue 18): a replica vouching for itself
    is refused by every validating peer; the verifier's record is seen by all (control)."""

    async def scenario() -> None:
        now = get_dht_time()
        lie = MeasuredThroughputs(rates={ATTACKER.peer_id: 1e9}, sent_at=now)
        assert not await records(dhts.evil, ATTACKER).publish_measured(lie, expiration=now + 30)
        assert not await records(dhts.b, dhts.b_identity).publish_measured(lie, expiration=now + 30)
        truth = MeasuredThroughputs(rates={ATTACKER.peer_id: 120.0, VICTIM.peer_id: 800.0}, sent_at=now)
        assert await records(dhts.b, VERIFIER).publish_measured(truth, expiration=now + 30)
        for reader in (dhts.a, dhts.b):
            found = await records(reader, OWNER).list_measured()
            assert [(r.verifier, dict(r.measured.rates)) for r in found] == [(VERIFIER.peer_id, truth.rates)]

    run(scenario())
