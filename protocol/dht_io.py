"""The async client over a hivemind DHT for our signed records: `SwarmRecords` (one run's heartbeats, syncer
leases, manifest and bans), the well-known discovery record, and the reasons the DHT process refused manifests.

Every call is bounded by a timeout, and every record the DHT returns is re-checked with `check_envelope`
(`protocol.records`) before it is used.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from hivemind.utils import ValueWithExpiration, get_dht_time

from protocol import keys
from protocol.errors import RecordRejected
from protocol.identity import NodeIdentity
from protocol.manifest import SignedManifest
from protocol.records import (
    BanNotice,
    BanRecord,
    Heartbeat,
    HivenodeRecordValidator,
    MeasuredRecord,
    MeasuredThroughputs,
    PeerRecord,
    RecordLimits,
    RunRules,
    SyncerRecord,
    SyncerState,
    VerifiedRecord,
    check_envelope,
    make_envelope,
)

logger = logging.getLogger(__name__)


async def _bounded(awaitable: Any, timeout_s: float) -> Any:
    return await asyncio.wait_for(awaitable, timeout_s)


def _entries(found: Any) -> list[tuple[str | None, Any, float]]:
    """(subkey, value, expiration) triples of a DHT.get result (a dictionary value or a plain one)."""
    if found is None:
        return []
    value = found.value
    if isinstance(value, dict) and value and all(isinstance(v, ValueWithExpiration) for v in value.values()):
        return [(subkey, item.value, item.expiration_time) for subkey, item in value.items()]
    return [(None, value, found.expiration_time)]


def _verified(
    raw_key: str, found: Any, *, now: float, runs: Mapping[str, RunRules], limits: RecordLimits
) -> list[VerifiedRecord]:
    """Re-check what the DHT process returned (defence in depth: the same checks its validator ran)."""
    out = []
    for subkey, value, expiration in _entries(found):
        if subkey is not None and not isinstance(subkey, str):
            continue
        try:
            out.append(
                check_envelope(
                    value,
                    key_id=keys.key_id(raw_key),
                    subkey=subkey,
                    expiration=expiration,
                    now=now,
                    runs=runs,
                    limits=limits,
                )
            )
        except RecordRejected as e:  # a record we cannot verify is one we do not use
            logger.debug("ignoring an unverifiable record under %s: %s", raw_key[:12], e)
    return out


async def publish_discovery(
    dht: Any, owner: NodeIdentity, signed: SignedManifest, *, expiration: float, timeout_s: float
) -> bool:
    """Publish `signed` under the well-known discovery key (subkey = owner) so nodes with only a multiaddr find it."""
    body, expiration = {"signed": signed.to_wire()}, float(expiration)
    envelope = make_envelope(owner, keys.discovery_key(), owner.peer_id, body, expiration)
    future = dht.store(keys.discovery_key(), envelope, expiration, subkey=owner.peer_id, return_future=True)
    return bool(await _bounded(future, timeout_s))


async def fetch_discovery(
    dht: Any, *, timeout_s: float, now: float, limits: RecordLimits | None = None
) -> list[SignedManifest]:
    """Every signed manifest bootstraps published on this DHT (at most one per owner), already verified."""
    found = await _bounded(dht.get(keys.discovery_key(), latest=True, return_future=True), timeout_s)
    verified = _verified(keys.discovery_key(), found, now=now, runs={}, limits=limits or RecordLimits())
    return [SignedManifest.from_wire(record.body["signed"]) for record in verified]


async def fetch_manifest(
    dht: Any, run_id: str, *, timeout_s: float, now: float, limits: RecordLimits | None = None
) -> SignedManifest | None:
    """The owner-signed manifest stored under `<run_id>/manifest`, if any (its hash is checked against run_id)."""
    raw_key = keys.manifest_key(run_id)
    found = await _bounded(dht.get(raw_key, latest=True, return_future=True), timeout_s)
    verified = _verified(raw_key, found, now=now, runs={}, limits=limits or RecordLimits())
    return SignedManifest.from_wire(verified[0].body["signed"]) if verified else None


async def manifest_rejections(dht: Any, *, timeout_s: float) -> list[str]:
    """Why the validator of `dht` (in hivemind's DHT process) refused manifest and discovery records it was shown,
    oldest first. hivemind drops a refused record before `get` returns, so this is how a node that finds no valid
    manifest learns that it found a tampered one."""
    return list(await _bounded(dht.run_coroutine(_manifest_rejections_in_dht, return_future=True), timeout_s))


async def _manifest_rejections_in_dht(dht: Any, node: Any) -> list[str]:
    validator = node.protocol.record_validator  # runs inside the DHT process: a CompositeValidator or ours
    found: list[str] = []
    for candidate in getattr(validator, "_validators", [validator]):
        if isinstance(candidate, HivenodeRecordValidator):
            found += candidate.manifest_rejections
    return found


class SwarmRecords:
    """Typed, signed reads and writes of one run's records. `identity` signs what this process writes.

    Every call is bounded by `timeout_s` (asyncio.TimeoutError past it). Must be used from inside a running
    event loop: hivemind futures bind to the loop that creates them.
    """

    def __init__(
        self,
        dht: Any,
        rules: RunRules,
        identity: NodeIdentity,
        *,
        timeout_s: float = 5.0,
        limits: RecordLimits | None = None,
        clock: Callable[[], float] = get_dht_time,
    ) -> None:
        self.dht, self.rules, self.identity = dht, rules, identity
        self.run_id = rules.run_id
        self.timeout_s = timeout_s
        self.limits = limits or RecordLimits()
        self.clock = clock

    async def _store(
        self, raw_key: str, subkey: str | None, body: Mapping[str, Any], expiration: float
    ) -> bool:
        expiration = float(expiration)  # signed as a float; the DHT must carry the very same number
        envelope = make_envelope(self.identity, raw_key, subkey, body, expiration)
        future = self.dht.store(raw_key, envelope, expiration, subkey=subkey, return_future=True)
        return bool(await _bounded(future, self.timeout_s))

    async def _get(self, raw_key: str) -> list[VerifiedRecord]:
        found = await _bounded(self.dht.get(raw_key, latest=True, return_future=True), self.timeout_s)
        return _verified(raw_key, found, now=self.clock(), runs={self.run_id: self.rules}, limits=self.limits)

    async def publish_heartbeat(self, heartbeat: Heartbeat, *, expiration: float) -> bool:
        """Store this peer's heartbeat; False if refused (e.g. an earlier record of ours expires later)."""
        return await self._store(
            keys.peers_key(self.run_id), self.identity.peer_id, heartbeat.to_body(), expiration
        )

    async def list_peers(self, *, include_leaving: bool = False) -> list[PeerRecord]:
        """Live peers of the run, by peer id; peers that announced leaving are left out unless asked for."""
        records = [
            PeerRecord(peer_id=r.signer, heartbeat=Heartbeat.from_body(r.body), expires_at=r.expiration)
            for r in await self._get(keys.peers_key(self.run_id))
        ]
        records = [r for r in records if include_leaving or not r.heartbeat.leaving]
        return sorted(records, key=lambda r: r.peer_id)

    async def publish_manifest(self, signed: SignedManifest, *, expiration: float) -> bool:
        if signed.run_id != self.run_id or signed.owner != self.identity.peer_id:
            raise ValueError("only the owner can publish this run's manifest")
        return await self._store(
            keys.manifest_key(self.run_id), None, {"signed": signed.to_wire()}, expiration
        )

    async def publish_syncer(self, state: SyncerState, *, expiration: float) -> bool:
        return await self._store(
            keys.syncer_key(self.run_id), self.identity.peer_id, state.to_body(), expiration
        )

    async def list_syncers(self) -> list[SyncerRecord]:
        return [
            SyncerRecord(peer_id=r.signer, state=_syncer_state(r.body), expires_at=r.expiration)
            for r in await self._get(keys.syncer_key(self.run_id))
        ]

    async def publish_measured(self, measured: MeasuredThroughputs, *, expiration: float) -> bool:
        """Store what this verifier measured of each stage replica (refused unless it is an authorized verifier)."""
        return await self._store(
            keys.measured_key(self.run_id), self.identity.peer_id, measured.to_body(), expiration
        )

    async def list_measured(self) -> list[MeasuredRecord]:
        """The authorized verifiers' measurements, one record per verifier."""
        return [
            MeasuredRecord(
                verifier=r.signer,
                measured=MeasuredThroughputs(rates=dict(r.body["rates"]), sent_at=r.body["sent_at"]),
                expires_at=r.expiration,
            )
            for r in await self._get(keys.measured_key(self.run_id))
        ]

    async def publish_ban(self, notice: BanNotice, *, expiration: float) -> bool:
        raw_key = keys.bans_key(self.run_id, notice.offender)
        return await self._store(raw_key, self.identity.peer_id, notice.to_body(), expiration)

    async def get_bans(self, offender: str) -> list[BanRecord]:
        """Ban notices against `offender`, one per verifier that signed one."""
        return [
            BanRecord(verifier=r.signer, notice=BanNotice(**r.body), expires_at=r.expiration)
            for r in await self._get(keys.bans_key(self.run_id, offender))
        ]

    async def list_bans(self, offenders: Iterable[str]) -> dict[str, list[BanRecord]]:
        """Ban notices for each of `offenders` that has any (bans are keyed by offender, so ask per peer)."""
        offenders = sorted(set(offenders))
        results = await asyncio.gather(*(self.get_bans(o) for o in offenders), return_exceptions=True)
        return {o: r for o, r in zip(offenders, results, strict=True) if isinstance(r, list) and r}


def _syncer_state(body: Mapping[str, Any]) -> SyncerState:
    values = dict(body)
    values["versions"] = tuple(values["versions"])
    return SyncerState(**values)
