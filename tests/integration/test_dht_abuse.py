"""DHT storage spam (reliability.md §6, D2) against a real hivemind DHT peer on loopback.

One attacker peer (a plain hivemind DHT: it validates nothing and talks to the victim's store RPC directly) tries to
store 100,000 small records in batches of 1,000, eight 1 MiB values, 100 records that expire a year ahead, and 100
hivenode records signed correctly but out of schema, as fast as the victim answers. The victim runs what every
hivenode peer runs (`node.swarm.start_dht`: the record validator and `QuotaDHTProtocol`'s per-peer store quota); an
honest peer keeps storing its heartbeat and looking records up meanwhile.

Oracles: the quota's arithmetic is exact (every refusal has its reason and count, and exactly `max_records_per_peer`
records pass per window); the victim's storage never holds more of the attacker's records than the quota admitted,
and none outside the schema; honest lookups stay fast. Negative control: a victim that accepts foreign records (a
DHT shared with other hivemind applications, `allow_foreign=True`) stores the whole flood and the year-ahead
records when it has no quota, and at most the quota with it.

A Sybil flood (`test_a_sybil_flood_leaves_the_known_peers_share_of_the_global_budget`): fresh identities, each on
its own daemon and within its per-peer quota, store valid records until the global record budget is spent; the
run's authorized syncer must still store. Negative control: without the reservation it is refused. Then
(`test_a_learner_whose_heartbeat_carries_its_admission_proof_stores_under_the_flood`) the same flood against a run
that charges a proof-of-work: an honest learner whose heartbeat carries its valid proof still stores it; control:
the same learner without the proof in its heartbeat is refused with the Sybils.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import os
import re
import statistics
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple

import hivemind
import msgpack
import pytest
from hivemind.dht.routing import DHTID
from hivemind.p2p import P2P, PeerID
from hivemind.proto import dht_pb2
from hivemind.utils import MSGPackSerializer, get_dht_time

from node.config import LOOPBACK_LISTEN, NetworkConfig
from node.swarm import dht_quota_stats, dht_store_quota, start_dht
from protocol import keys
from protocol.admission import AdmissionSpec, solve
from protocol.dht_io import SwarmRecords
from protocol.identity import NodeIdentity
from protocol.limits import (
    EXPIRATION_TOO_FAR,
    GLOBAL_STORE_RECORDS,
    GUEST_STORE_RECORDS,
    INVALID_RECORD,
    SUBKEYS,
    QuotaConfig,
    QuotaStats,
)
from protocol.manifest import RunManifest, SignedManifest, authorize
from protocol.records import Heartbeat, HivenodeRecordValidator, RunRules, make_envelope
from tests.integration.procs import start_daemons

logger = logging.getLogger(__name__)

pytestmark = [pytest.mark.integration, pytest.mark.timeout(150)]

OWNER, MALLORY = NodeIdentity.generate(), NodeIdentity.generate()
MANIFEST = RunManifest()
SIGNED = SignedManifest.sign(MANIFEST, OWNER)
RULES = RunRules.from_manifest(SIGNED, MANIFEST)
RUN_ID = SIGNED.run_id

NUM_SPAM = 100_000  # small foreign records, the bulk of the flood
BATCH = 1_000  # records per store request (~100 KiB, far under hivemind's 4 MiB message cap)
NUM_BIG = 8  # 1 MiB values, one per request
NUM_FAR = 100  # records expiring a year ahead
NUM_SCHEMA = 100  # hivenode records signed by their own key but out of schema
YEAR_S = 365 * 86400.0
QUOTA: QuotaConfig = dht_store_quota()  # what every hivenode peer runs
LOOKUP_SAMPLES = 30
REPUBLISH_S = 0.5
RSS_BOUND_MIB = (
    16  # the victim's DHT process grows less than this under the quota (the flood stored: ~48 MiB alone)
)
FLOOD_DEADLINE_S = 90.0


# ---- run inside the DHT processes (functions are pickled by reference into them) ------------------------------


def _plan(now: float) -> list[tuple[str, list[tuple[bytes, bytes, bytes, float]]]]:
    """(phase, [(key id, subkey tag, value bytes, expiration)]) batches, in the order they are sent."""
    from hivemind.dht.protocol import DHTProtocol

    regular = DHTProtocol.IS_REGULAR_VALUE
    big = [
        ("big", [(DHTID.generate(source=f"big{i}").to_bytes(), regular, os.urandom(1 << 20), now + 60)])
        for i in range(NUM_BIG)
    ]
    far_items = [
        (DHTID.generate(source=f"far{i}").to_bytes(), regular, msgpack.packb({"far": i}), now + YEAR_S)
        for i in range(NUM_FAR)
    ]
    raw = keys.peers_key(RUN_ID)
    schema = []
    for i in range(NUM_SCHEMA):
        body = {**Heartbeat(role="learner", sent_at=now).to_body(), "throughput": "fast", "i": i}
        envelope = make_envelope(MALLORY, raw, MALLORY.peer_id, body, now + 10)
        tag = MSGPackSerializer.dumps(MALLORY.peer_id)
        schema.append((keys.key_id(raw), tag, MSGPackSerializer.dumps(envelope), now + 10))
    spam = []
    for start in range(0, NUM_SPAM, BATCH):
        items = [
            (DHTID.generate(source=f"spam{i}").to_bytes(), regular, msgpack.packb({"spam": i}), now + 60)
            for i in range(start, min(NUM_SPAM, start + BATCH))
        ]
        spam.append(("spam", items))
    return [*big, ("far", far_items), ("schema", schema), *spam]


async def _flood_coro(_dht: Any, node: Any, victim: str) -> dict[str, Any]:
    """The attacker: store every planned batch on the victim as fast as it answers; count what it was told."""
    from hivemind.p2p import PeerID
    from hivemind.proto import dht_pb2

    peer = PeerID.from_base58(victim)
    stub = node.protocol.get_stub(peer)
    sent: dict[str, int] = {}
    stored: dict[str, int] = {}
    start = time.monotonic()
    for phase, items in _plan(get_dht_time()):
        request = dht_pb2.StoreRequest(
            keys=[k for k, _, _, _ in items],
            subkeys=[t for _, t, _, _ in items],
            values=[v for _, _, v, _ in items],
            expiration_time=[e for _, _, _, e in items],
            in_cache=[False] * len(items),
            peer=node.protocol.node_info,
        )
        response = await stub.rpc_store(request, timeout=30)
        sent[phase] = sent.get(phase, 0) + len(items)
        stored[phase] = stored.get(phase, 0) + sum(response.store_ok)
    return {"sent": sent, "stored": stored, "seconds": time.monotonic() - start}


async def _census(_dht: Any, node: Any) -> dict[str, Any]:
    """Inside the victim: what its storage holds (records, bytes, how many expire more than a day ahead)."""
    now = get_dht_time()
    records = far = num_bytes = 0
    for _key, item in node.protocol.storage.items():
        value = item.value
        entries = (
            [(v.value, v.expiration_time) for _, v in value.items()]
            if hasattr(value, "items")
            else [(value, item.expiration_time)]
        )
        for blob, expiration in entries:
            records += 1
            num_bytes += len(blob)
            far += expiration > now + 86400
    return {"records": records, "bytes": num_bytes, "far": far}


# ---- the test's side ------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Swarm:
    victim: Any
    honest: Any
    attacker: Any
    honest_records: SwarmRecords


def _rss_kib(pid: int) -> int:
    match = re.search(r"^VmRSS:\s+(\d+) kB", Path(f"/proc/{pid}/status").read_text(), re.M)
    return int(match.group(1)) if match else 0


@pytest.fixture(scope="module", autouse=True)
def _torch_shm_manager() -> Iterator[None]:
    """Start torch's shared-memory manager (hivemind's futures use it) before any test, so the reaper counts it as
    the module's, not as a process a test leaked: killing it under a live process aborts that process."""
    import torch

    keep = torch.empty(1, dtype=torch.uint8).share_memory_()
    yield
    del keep


@pytest.fixture
def swarm_factory(tmp_path: Path) -> Iterator[Any]:
    started: list[Any] = []
    network = NetworkConfig(listen=(LOOPBACK_LISTEN,), join_timeout_s=20, request_timeout_s=5)

    def make(
        *, quota: bool, allow_foreign: bool, validate_first: bool = True, quota_config: QuotaConfig = QUOTA
    ) -> Swarm:
        victim_id = NodeIdentity.load_or_create(tmp_path / f"victim{len(started)}.key")
        honest_id = NodeIdentity.load_or_create(tmp_path / f"honest{len(started)}.key")
        validator = HivenodeRecordValidator([RULES], allow_foreign=allow_foreign)
        if quota:
            victim = start_dht(
                victim_id, [], network, validator, store_quota=quota_config, validate_first=validate_first
            )
        else:
            victim = _start_without_quota(victim_id, network, validator)
        started.append(victim)
        maddrs = [str(m) for m in victim.get_visible_maddrs()]
        honest = start_dht(honest_id, maddrs, network, HivenodeRecordValidator([RULES]))
        started.append(honest)
        attacker = hivemind.DHT(initial_peers=maddrs, start=True, client_mode=True)
        started.append(attacker)
        return Swarm(victim, honest, attacker, SwarmRecords(honest, RULES, honest_id, timeout_s=5.0))

    try:
        yield make
    finally:
        for dht in started:
            dht.shutdown()


def _start_without_quota(identity: NodeIdentity, network: NetworkConfig, validator: Any) -> Any:
    """The negative control's victim: everything as `start_dht`, but hivemind's stock store handler."""
    return hivemind.DHT(
        start=True,
        record_validators=[validator],
        identity_path=str(identity.path),
        check_if_identity_free=False,
        host_maddrs=list(network.listen),
    )


async def _lookup_latencies(swarm: Swarm, samples: int) -> list[float]:
    out = []
    for _ in range(samples):
        start = time.perf_counter()
        peers = await swarm.honest_records.list_peers()
        out.append(time.perf_counter() - start)
        assert peers, "the honest peer lost its own heartbeat"
    return out


async def _publish(swarm: Swarm) -> bool:
    now = get_dht_time()
    return await swarm.honest_records.publish_heartbeat(
        Heartbeat(role="learner", sent_at=now), expiration=now + 30
    )


def _p99(values: list[float]) -> float:
    return sorted(values)[max(0, int(0.99 * len(values)) - 1)]


def _flood(swarm: Swarm) -> tuple[dict[str, Any], list[float]]:
    """Run the flood in the attacker's process while the honest peer looks records up and re-stores its heartbeat
    (every REPUBLISH_S: faster than the 2 s heartbeat, inside its own quota); bounded by FLOOD_DEADLINE_S."""
    victim = swarm.victim.peer_id.to_base58()
    future = swarm.attacker.run_coroutine(functools.partial(_flood_coro, victim=victim), return_future=True)
    latencies: list[float] = []
    republished: list[bool] = []
    deadline = time.monotonic() + FLOOD_DEADLINE_S
    last_publish = -REPUBLISH_S
    while not future.done() and time.monotonic() < deadline:
        latencies += asyncio.run(_lookup_latencies(swarm, 1))
        if time.monotonic() - last_publish >= REPUBLISH_S:
            last_publish = time.monotonic()
            republished.append(asyncio.run(_publish(swarm)))
    assert all(republished), "an honest heartbeat was refused during the flood"
    return future.result(timeout=max(1.0, deadline - time.monotonic())), latencies


@dataclasses.dataclass(frozen=True)
class Outcome:
    result: dict[str, Any]  # what the attacker sent and was told was stored, per phase
    baseline: list[float]  # honest lookup latencies before the flood
    during: list[float]  # ... while it ran
    after: list[float]  # ... right after it
    rss_growth_kib: int  # the victim's DHT process


def _run_flood(swarm: Swarm) -> Outcome:
    assert asyncio.run(_publish(swarm))
    baseline = asyncio.run(_lookup_latencies(swarm, LOOKUP_SAMPLES))
    rss_before = _rss_kib(swarm.victim.pid)
    result, during = _flood(swarm)
    after = asyncio.run(_lookup_latencies(swarm, LOOKUP_SAMPLES))
    return Outcome(result, baseline, during, after, _rss_kib(swarm.victim.pid) - rss_before)


def test_a_storage_flood_is_held_to_the_quota_and_the_schema(swarm_factory: Any) -> None:
    swarm = swarm_factory(quota=True, allow_foreign=False)
    outcome = _run_flood(swarm)
    result = outcome.result
    stats: QuotaStats = dht_quota_stats(swarm.victim)
    census = swarm.victim.run_coroutine(_census)
    attacker = swarm.attacker.peer_id.to_base58()
    mine = stats.rejected_by_peer.get(attacker, {})
    _log("quota, strict schema", outcome, stats, census)

    assert result["sent"] == {"big": NUM_BIG, "far": NUM_FAR, "schema": NUM_SCHEMA, "spam": NUM_SPAM}
    assert result["seconds"] < QUOTA.window_s  # the whole flood fell inside one quota window
    # Every record is validated before it may count toward a quota: none of the attacker's is a valid hivenode
    # record (foreign, oversized, out of schema), so all are refused as invalid and the quota admits none of them.
    # (A peer's table entry starts with its first admitted record, so the attacker has none: the global counts
    # are its refusals, the honest peer is never refused.)
    total = NUM_BIG + NUM_FAR + NUM_SCHEMA + NUM_SPAM
    assert stats.rejected_by_reason == {INVALID_RECORD: total}, stats.rejected_by_reason
    assert mine == {}
    assert swarm.honest.peer_id.to_base58() not in stats.rejected_by_peer
    assert sum(result["stored"].values()) == 0
    assert census["far"] == 0
    assert census["records"] <= 2  # the honest heartbeat (and nothing else)
    # Honest peers barely notice: their stores went through (checked in `_flood`), lookups during the flood stay
    # well under a second, and right after it they are back at the baseline's p99 (2x, with a 50 ms floor).
    assert max(outcome.during) < 1.0, outcome.during
    assert _p99(outcome.after) <= max(2 * _p99(outcome.baseline), _p99(outcome.baseline) + 0.05)


@pytest.mark.parametrize("quota", [True, False], ids=["quota", "no-quota-control"])
def test_a_shared_dht_without_the_quota_stores_the_whole_flood(swarm_factory: Any, quota: bool) -> None:
    swarm = swarm_factory(quota=quota, allow_foreign=True)
    outcome = _run_flood(swarm)
    census = swarm.victim.run_coroutine(_census)
    stats = dht_quota_stats(swarm.victim) if quota else None
    _log(f"allow_foreign, quota={quota}", outcome, stats, census)
    stored = outcome.result["stored"]
    assert stored.get("big", 0) == 0  # the validator's own size cap refuses 1 MiB values in both cases
    if quota:
        # At most the per-peer budget entered storage; nothing that outlives the horizon cap.
        assert stored.get("spam", 0) <= QUOTA.max_records_per_peer  # out-of-schema records never count
        assert stats is not None and stats.rejected_by_reason.get(EXPIRATION_TOO_FAR) == NUM_FAR
        assert stats.rejected_by_reason.get(INVALID_RECORD) == NUM_BIG + NUM_SCHEMA
        assert stored.get("far", 0) == 0 and census["far"] == 0
        assert census["records"] <= QUOTA.max_records_per_peer + 2
        assert outcome.rss_growth_kib < RSS_BOUND_MIB * 1024
    else:
        # The control: the attack wins. Every spam record and every year-ahead record is stored.
        assert stored.get("spam", 0) == NUM_SPAM
        assert stored.get("far", 0) == NUM_FAR and census["far"] == NUM_FAR
        assert census["records"] >= NUM_SPAM
        # A stored flood costs memory: ~1 MB of record bytes held (the quota arm holds ~2 kB). Not judged by RSS:
        # alone the victim's grows ~48 MiB, but in the whole suite the DHT process is forked from a pytest process
        # whose freed heap it inherits, and it grew 14 MiB (CI) or less.
        assert census["bytes"] >= NUM_SPAM * 8


async def _junk_subkeys_coro(_dht: Any, node: Any, victim: str, count: int) -> int:
    """The attacker: `count` unsigned junk subkeys under the run's peer directory; how many the victim stored."""
    from hivemind.p2p import PeerID
    from hivemind.proto import dht_pb2

    now = get_dht_time()
    key = keys.key_id(keys.peers_key(RUN_ID))
    request = dht_pb2.StoreRequest(
        keys=[key] * count,
        subkeys=[MSGPackSerializer.dumps(f"junk{i}") for i in range(count)],
        values=[msgpack.packb({"junk": i}) for i in range(count)],
        expiration_time=[now + 300] * count,
        in_cache=[False] * count,
        peer=node.protocol.node_info,
    )
    response = await node.protocol.get_stub(PeerID.from_base58(victim)).rpc_store(request, timeout=30)
    return sum(response.store_ok)


@pytest.mark.parametrize("validate_first", [True, False], ids=["validated-first", "quota-first-control"])
def test_junk_subkeys_cannot_lock_the_peer_directory(swarm_factory: Any, validate_first: bool) -> None:
    """Junk under `<run>/peers` must not count toward its subkey cap: the cap would then refuse honest
    heartbeats for as long as the junk claims to live. Control: counted before validation, the junk wins."""
    config = dataclasses.replace(QUOTA, max_subkeys_per_key=16)
    swarm = swarm_factory(quota=True, allow_foreign=False, validate_first=validate_first, quota_config=config)
    victim = swarm.victim.peer_id.to_base58()
    stored = swarm.attacker.run_coroutine(functools.partial(_junk_subkeys_coro, victim=victim, count=32))
    assert stored == 0  # the validator keeps junk out of storage either way
    stats: QuotaStats = dht_quota_stats(swarm.victim)
    if validate_first:
        assert stats.rejected_by_reason.get(INVALID_RECORD) == 32
        assert asyncio.run(_publish(swarm)), "an honest heartbeat was refused after the junk"
        assert asyncio.run(swarm.honest_records.list_peers())
    else:  # the junk filled the subkey cap before hivemind's validators refused it: honest peers are locked out
        assert stats.rejected_by_reason.get(SUBKEYS) == 32 - config.max_subkeys_per_key
        assert not asyncio.run(_publish(swarm))


def _log(name: str, outcome: Outcome, stats: QuotaStats | None, census: dict[str, Any]) -> None:
    ms = [
        (statistics.median(v) * 1e3, _p99(v) * 1e3) for v in (outcome.baseline, outcome.during, outcome.after)
    ]
    logger.warning(
        "%s: attacker sent %s in %.1f s, victim accepted %s; quota refused %s (admitted %s); victim storage %s, "
        "DHT process RSS %+.1f MiB; honest lookup median/p99 ms: before %.1f/%.1f, during %.1f/%.1f, "
        "after %.1f/%.1f",
        name,
        outcome.result["sent"],
        outcome.result["seconds"],
        outcome.result["stored"],
        None if stats is None else stats.rejected_by_reason,
        None if stats is None else stats.num_admitted,
        census,
        outcome.rss_growth_kib / 1024,
        *[x for pair in ms for x in pair],
    )


# ---- a Sybil flood of fresh identities against the global record budget ---------------------------------------

SYNCER = NodeIdentity.generate()
ROLES_MANIFEST = authorize(RunManifest(), syncers=[SYNCER.peer_id])
ROLES_SIGNED = SignedManifest.sign(ROLES_MANIFEST, OWNER)
ROLES_RULES = RunRules.from_manifest(ROLES_SIGNED, ROLES_MANIFEST)
NUM_SYBILS = 8
SYBIL_RECORDS = 4  # each Sybil's whole per-peer budget
SYBIL_TOTAL = 24  # the victim's global records per window: six Sybils' budgets
SYBIL_RESERVED = 12  # ... of which the run's roles keep this many
SYBIL_SCENARIO_S = 60.0


def _own_heartbeats(
    identity: NodeIdentity, count: int, now: float, run: SignedManifest, proof: int | None
) -> dht_pb2.StoreRequest:
    """`count` heartbeats `identity` signed under its own subkey of `run`'s peer directory, carrying `proof` (the
    identity's admission proof; None: none): valid records."""
    raw = keys.peers_key(run.run_id)
    body = Heartbeat(role="learner", sent_at=now, admission=proof).to_body()
    # each expires after the last, so hivemind's storage takes every one (a newer expiration wins)
    expirations = [now + 30 + i for i in range(count)]
    return dht_pb2.StoreRequest(
        keys=[keys.key_id(raw)] * count,
        subkeys=[MSGPackSerializer.dumps(identity.peer_id)] * count,
        values=[
            MSGPackSerializer.dumps(make_envelope(identity, raw, identity.peer_id, body, e))
            for e in expirations
        ],
        expiration_time=expirations,
        in_cache=[False] * count,
    )


async def _store_from(
    p2p: P2P,
    victim: str,
    identity: NodeIdentity,
    count: int,
    run: SignedManifest = ROLES_SIGNED,
    proof: int | None = None,
) -> list[bool]:
    """`identity`'s own daemon stores `count` of its heartbeats (of `run`, carrying `proof`) on the victim's store
    RPC; what the victim answered."""
    request = _own_heartbeats(identity, count, get_dht_time(), run, proof)
    response = await p2p.call_protobuf_handler(
        PeerID.from_base58(victim), "DHTProtocol.rpc_store", request, dht_pb2.StoreResponse
    )
    return list(response.store_ok)


async def _sybils_then_syncer(
    tmp: Path,
    victim: Any,
    last: NodeIdentity = SYNCER,
    run: SignedManifest = ROLES_SIGNED,
    proof: int | None = None,
) -> tuple[int, list[bool]]:
    """NUM_SYBILS fresh identities store their whole per-peer budget of `run`'s heartbeats (without a proof) on
    the victim, one after the other; then `last` (the run's authorized syncer) stores one heartbeat carrying
    `proof`. The Sybil records the victim stored, and `last`'s answer."""
    sybils = [NodeIdentity.load_or_create(tmp / f"sybil{i}.key") for i in range(NUM_SYBILS)]
    last_path = tmp / "last.key"
    last_path.write_bytes(last.to_libp2p_bytes())
    maddrs = [str(m) for m in victim.get_visible_maddrs()]
    daemons = await start_daemons([*(s.path for s in sybils if s.path is not None), last_path], maddrs)
    target = victim.peer_id.to_base58()
    try:
        stored = 0
        for p2p, sybil in zip(daemons, sybils, strict=False):
            stored += sum(await _store_from(p2p, target, sybil, SYBIL_RECORDS, run))
        return stored, await _store_from(daemons[-1], target, last, 1, run, proof)
    finally:
        await asyncio.gather(*(p.shutdown() for p in daemons), return_exceptions=True)


class FloodOutcome(NamedTuple):
    stored: int  # the Sybils' records the victim stored
    last_ok: list[bool]  # the last identity's store (the syncer's, or the learner's)
    stats: QuotaStats
    listed: list[Any]  # the victim's peer records after the flood (SwarmRecords.list_peers)
    elapsed_s: float


def _flood_victim(
    tmp_path: Path,
    config: QuotaConfig,
    rules: RunRules,
    *,
    learned_late: bool,
    last: NodeIdentity = SYNCER,
    run: SignedManifest | None = None,
    proof: int | None = None,
) -> FloodOutcome:
    """A victim DHT with `config` as its store quota, knowing `rules` from its start or (`learned_late`, as a
    joining node) only once started; the Sybil flood, then `last`'s one store; what the victim stored and lists."""
    network = NetworkConfig(listen=(LOOPBACK_LISTEN,), join_timeout_s=20, request_timeout_s=5)
    identity = NodeIdentity.load_or_create(tmp_path / "victim.key")
    known = [] if learned_late else [rules]
    victim = start_dht(identity, [], network, HivenodeRecordValidator(known), store_quota=config)
    try:
        if learned_late:
            victim.add_validators([HivenodeRecordValidator([rules])])
        start = time.monotonic()
        scenario = _sybils_then_syncer(tmp_path, victim, last, run or ROLES_SIGNED, proof)
        stored, last_ok = asyncio.run(asyncio.wait_for(scenario, SYBIL_SCENARIO_S))
        elapsed = time.monotonic() - start
        stats: QuotaStats = dht_quota_stats(victim)
        listed = asyncio.run(SwarmRecords(victim, rules, identity, timeout_s=5.0).list_peers())
    finally:
        victim.shutdown()
    return FloodOutcome(stored, last_ok, stats, listed, elapsed)


@pytest.mark.parametrize("reserved", [SYBIL_RESERVED, 0], ids=["roles-reserved", "no-reservation-control"])
def test_a_sybil_flood_leaves_the_known_peers_share_of_the_global_budget(
    tmp_path: Path, reserved: int
) -> None:
    """8 fresh identities with 4 valid records each against a victim whose global budget is 24 records a window;
    the victim learns the run after its start, as a joining node does. With 12 reserved for the run's roles, the
    Sybils get the guests' 12 and the syncer's heartbeat is stored and listed; without (the control), six Sybils
    spend the whole budget and the syncer is refused until the window slides."""
    config = dataclasses.replace(
        QUOTA,
        max_records_per_peer=SYBIL_RECORDS,
        max_records_total=SYBIL_TOTAL,
        reserved_records_total=reserved,
        admitted_records_total=0,
    )
    stored, syncer_ok, stats, listed, elapsed = _flood_victim(
        tmp_path, config, ROLES_RULES, learned_late=True
    )
    logger.warning(
        "sybil flood, reserved=%d: %d Sybil records stored, syncer %s, quota refused %s, in %.1f s",
        reserved,
        stored,
        syncer_ok,
        stats.rejected_by_reason,
        elapsed,
    )
    assert elapsed < config.window_s  # every store fell inside one quota window
    sent = NUM_SYBILS * SYBIL_RECORDS
    listed_ids = {p.peer_id for p in listed}
    if reserved:
        guests_pool = SYBIL_TOTAL - SYBIL_RESERVED
        assert stored == guests_pool and stats.num_admitted_guests == guests_pool
        assert stats.rejected_by_reason == {GUEST_STORE_RECORDS: sent - guests_pool}
        assert syncer_ok == [True]
        assert SYNCER.peer_id in listed_ids
    else:
        # the control: the attack wins, six Sybils spend the whole budget and the syncer is locked out
        assert stored == SYBIL_TOTAL
        assert stats.rejected_by_reason == {GLOBAL_STORE_RECORDS: sent - SYBIL_TOTAL + 1}
        assert syncer_ok == [False]
        assert SYNCER.peer_id not in listed_ids
    assert len(listed_ids) == stored // SYBIL_RECORDS + (SYNCER.peer_id in listed_ids)


# ---- ... and an honest learner whose heartbeat carries its admission proof ------------------------------------

ADMIT_BITS = 16  # ~65,000 hashes: tens of ms here, where the run's default (22) takes seconds
ADMIT_MANIFEST = dataclasses.replace(ROLES_MANIFEST, admission=AdmissionSpec(mode="pow", pow_bits=ADMIT_BITS))
ADMIT_SIGNED = SignedManifest.sign(ADMIT_MANIFEST, OWNER)
ADMIT_RULES = RunRules.from_manifest(ADMIT_SIGNED, ADMIT_MANIFEST)
ADMITTED_SHARE = 4  # of the 12 reserved records, what admitted heartbeats may use
LEARNER = NodeIdentity.generate()


@pytest.mark.parametrize("with_proof", [True, False], ids=["proof-in-heartbeat", "no-proof-control"])
def test_a_learner_whose_heartbeat_carries_its_admission_proof_stores_under_the_flood(
    tmp_path: Path, with_proof: bool
) -> None:
    """The Sybil flood above (8 fresh identities, 4 valid heartbeats each, budget 24 with 12 reserved, 4 of which
    for admitted heartbeats) against a run that charges a 16-bit proof-of-work; then an honest learner, no role in
    the manifest, stores its heartbeat carrying its valid proof: stored and listed. Control: the same heartbeat
    without the proof is a guest's, refused as the Sybils' overflow is."""
    config = dataclasses.replace(
        QUOTA,
        max_records_per_peer=SYBIL_RECORDS,
        max_records_total=SYBIL_TOTAL,
        reserved_records_total=SYBIL_RESERVED,
        admitted_records_total=ADMITTED_SHARE,
    )
    proof = solve(ADMIT_SIGNED.run_id, LEARNER.peer_id, ADMIT_BITS) if with_proof else None
    stored, learner_ok, stats, listed, elapsed = _flood_victim(
        tmp_path, config, ADMIT_RULES, learned_late=False, last=LEARNER, run=ADMIT_SIGNED, proof=proof
    )
    logger.warning(
        "sybil flood vs an admitted learner, proof=%s: %d Sybil records stored, learner %s, quota refused %s, "
        "admitted by proof %d, in %.1f s",
        with_proof,
        stored,
        learner_ok,
        stats.rejected_by_reason,
        stats.num_admitted_by_proof,
        elapsed,
    )
    assert elapsed < config.window_s
    guests_pool = SYBIL_TOTAL - SYBIL_RESERVED
    assert stored == guests_pool and stats.num_admitted_guests == guests_pool
    listed_beats = {p.peer_id: p.heartbeat for p in listed}
    if with_proof:
        assert learner_ok == [True] and stats.num_admitted_by_proof == 1
        assert stats.rejected_by_reason == {GUEST_STORE_RECORDS: NUM_SYBILS * SYBIL_RECORDS - guests_pool}
        assert listed_beats[LEARNER.peer_id].admission == proof
    else:
        # the control: without the proof the learner is one more guest, and the flood spent the guests' pool
        assert learner_ok == [False] and stats.num_admitted_by_proof == 0
        assert stats.rejected_by_reason == {GUEST_STORE_RECORDS: NUM_SYBILS * SYBIL_RECORDS - guests_pool + 1}
        assert LEARNER.peer_id not in listed_beats
