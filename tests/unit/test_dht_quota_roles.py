"""The DHT store quota's known peers (`QuotaDHTProtocol._has_role`): the roles of the runs its validators know,
read through hivemind's composite validator as `DHT.add_validators` extends it in the DHT process. No sockets."""

from __future__ import annotations

from hivemind.dht.validation import CompositeValidator

from node.swarm.dht import QuotaDHTProtocol
from protocol import limits
from protocol.identity import NodeIdentity
from protocol.limits import QuotaConfig
from protocol.manifest import RunManifest, SignedManifest, authorize
from protocol.records import HivenodeRecordValidator, RunRules

NOW = 1_800_000_000.0
OWNER, SYNCER = NodeIdentity.generate(), NodeIdentity.generate()
MANIFEST = authorize(RunManifest(), syncers=[SYNCER.peer_id])
SIGNED = SignedManifest.sign(MANIFEST, OWNER)
RULES = RunRules.from_manifest(SIGNED, MANIFEST)


def _protocol() -> QuotaDHTProtocol:
    QuotaDHTProtocol.quota_config = QuotaConfig(
        max_records_per_peer=2, max_records_total=4, reserved_records_total=2, max_tracked_peers=4
    )
    try:
        protocol = QuotaDHTProtocol(_initialized_with_create=True)
    finally:
        QuotaDHTProtocol.quota_config = None
    # as hivemind's DHTNode builds it: a node starts with a validator that knows no run yet
    protocol.record_validator = CompositeValidator([HivenodeRecordValidator()])
    return protocol


def _store(protocol: QuotaDHTProtocol, peer: str, now: float) -> limits.Admission:
    assert protocol.store_quota is not None
    return protocol.store_quota.admit_store(peer, b"key", 10, now + 60.0, now)


def test_the_run_roles_are_known_once_the_run_is_added_and_not_before() -> None:
    protocol = _protocol()
    assert sum(bool(_store(protocol, f"sybil{i}", NOW)) for i in range(4) for _ in range(2)) == 2
    # control: while the run is unknown its syncer is a guest like the Sybils, and the guests' pool is full
    assert _store(protocol, SYNCER.peer_id, NOW).reason == limits.GUEST_STORE_RECORDS
    # what `DHT.add_validators` runs in the DHT process once the node found its run
    assert protocol.record_validator is not None
    protocol.record_validator.extend([HivenodeRecordValidator([RULES])])
    assert _store(protocol, SYNCER.peer_id, NOW + 1) and _store(protocol, OWNER.peer_id, NOW + 1)
    # the roles took the reserve: the whole budget is spent now
    assert _store(protocol, "sybil9", NOW + 1).reason == limits.GLOBAL_STORE_RECORDS
