"""DHT keys and signed records: what the validator accepts and, above all, what it refuses (no sockets)."""

from __future__ import annotations

import dataclasses
from typing import Any

import msgpack
import pytest
from hivemind.dht.protocol import DHTProtocol
from hivemind.dht.validation import DHTRecord
from hivemind.utils import MSGPackSerializer

from protocol import keys
from protocol.errors import RecordRejected
from protocol.identity import NodeIdentity
from protocol.manifest import RunManifest, SignedManifest, authorize
from protocol.records import (
    CONNECTIVITY_MODES,
    MAX_MEASURED_REPLICAS,
    UNKNOWN_MODE,
    BanNotice,
    Heartbeat,
    HivenodeRecordValidator,
    MeasuredThroughputs,
    PeerRecord,
    RecordLimits,
    RunRules,
    SyncerState,
    check_envelope,
    make_envelope,
)

NOW = 1_800_000_000.0
LIMITS = RecordLimits()

OWNER = NodeIdentity.generate()
PEER = NodeIdentity.generate()
OTHER = NodeIdentity.generate()
SYNCER = NodeIdentity.generate()
VERIFIER = NodeIdentity.generate()
MANIFEST = authorize(RunManifest(), syncers=[SYNCER.peer_id], verifiers=[VERIFIER.peer_id])
SIGNED = SignedManifest.sign(MANIFEST, OWNER)
RULES = RunRules.from_manifest(SIGNED, MANIFEST)
RUN_ID = SIGNED.run_id
RUNS = {RUN_ID: RULES}


def heartbeat(**changes: Any) -> Heartbeat:
    base = Heartbeat(
        role="learner", state="training", device="cpu", throughput=100.0, http="127.0.0.1:1", sent_at=NOW
    )
    return dataclasses.replace(base, **changes)


def check(
    envelope: dict[str, Any], raw_key: str, subkey: str | None, expiration: float = NOW + 5, **kw: Any
) -> Any:
    return check_envelope(
        envelope,
        key_id=kw.pop("key_id", keys.key_id(raw_key)),
        subkey=subkey,
        expiration=expiration,
        now=kw.pop("now", NOW),
        runs=kw.pop("runs", RUNS),
        limits=LIMITS,
    )


def signed_heartbeat(
    identity: NodeIdentity = PEER, subkey: str | None = None, expiration: float = NOW + 5, **body
):
    raw_key = keys.peers_key(RUN_ID)
    sub = subkey or identity.peer_id
    return make_envelope(identity, raw_key, sub, heartbeat(**body).to_body(), expiration), raw_key, sub


def reason_of(fn: Any) -> str:
    with pytest.raises(RecordRejected) as info:
        fn()
    return info.value.reason


# ---- keys ----


def test_keys_are_prefixed_by_run_id_and_parse_back() -> None:
    assert keys.peers_key(RUN_ID) == f"{RUN_ID}/peers"
    assert keys.parse_key(keys.manifest_key(RUN_ID)) == keys.ParsedKey(keys.KeyKind.MANIFEST, RUN_ID)
    assert keys.parse_key(keys.syncer_key(RUN_ID)).kind is keys.KeyKind.SYNCER
    ban = keys.parse_key(keys.bans_key(RUN_ID, PEER.peer_id))
    assert (ban.kind, ban.run_id, ban.offender) == (keys.KeyKind.BANS, RUN_ID, PEER.peer_id)
    assert keys.parse_key(keys.discovery_key()).run_id is None


@pytest.mark.parametrize(
    "raw",
    [
        f"{RUN_ID}/gossip",
        f"{RUN_ID}/peers/extra",
        f"{RUN_ID}/bans/not-a-peer-id",
        f"{RUN_ID}/bans",
        "deadbeef/peers",
        "peers",
        f"{RUN_ID.upper()}/peers",
    ],
)
def test_unknown_keys_do_not_parse(raw: str) -> None:
    with pytest.raises(ValueError):
        keys.parse_key(raw)


def test_key_builders_refuse_bad_parts() -> None:
    with pytest.raises(ValueError):
        keys.peers_key("not-a-run")
    with pytest.raises(ValueError):
        keys.bans_key(RUN_ID, "QmNotEd25519")


# ---- accepted records ----


def test_a_peer_heartbeat_under_its_own_subkey_is_accepted() -> None:
    envelope, raw_key, sub = signed_heartbeat()
    record = check(envelope, raw_key, sub)
    assert record.signer == PEER.peer_id
    assert Heartbeat.from_body(record.body) == heartbeat()


def test_heartbeat_round_trips_every_field() -> None:
    full = heartbeat(
        stage=1, span=(2, 4), maddrs=("/ip4/1.2.3.4/tcp/5",), loss=2.5, inner_step=7, tokens=99, mode="relay"
    )
    assert Heartbeat.from_body(full.to_body()) == full
    envelope, raw_key, sub = signed_heartbeat(stage=1, span=(2, 4), loss=2.5)
    assert check(envelope, raw_key, sub).body["span"] == [2, 4]


@pytest.mark.parametrize("mode", CONNECTIVITY_MODES)
def test_a_heartbeat_carries_its_connectivity_mode(mode: str) -> None:
    envelope, raw_key, sub = signed_heartbeat(mode=mode)
    record = check(envelope, raw_key, sub)
    assert record.body["mode"] == mode
    parsed = Heartbeat.from_body(record.body)
    assert parsed.mode == mode and parsed == heartbeat(mode=mode)
    assert PeerRecord(peer_id=sub, heartbeat=parsed, expires_at=NOW + 5).to_json()["mode"] == mode


def test_a_heartbeat_without_a_mode_still_validates_and_reads_unknown() -> None:
    """An older node's heartbeat (no `mode` key) is accepted; its mode shows as unknown. A node that cannot say
    its mode writes that same older body, which older validators (exact keys) accept too."""
    body = heartbeat().to_body()
    assert "mode" not in body  # unknown is never sent
    raw_key = keys.peers_key(RUN_ID)
    record = check(make_envelope(PEER, raw_key, PEER.peer_id, body, NOW + 5), raw_key, PEER.peer_id)
    parsed = Heartbeat.from_body(record.body)
    assert parsed.mode == UNKNOWN_MODE
    assert (
        PeerRecord(peer_id=PEER.peer_id, heartbeat=parsed, expires_at=NOW + 5).to_json()["mode"] == "unknown"
    )
    # only the optional key may be left out: a missing required key is still refused
    del body["version"]
    envelope = make_envelope(PEER, raw_key, PEER.peer_id, body, NOW + 5)
    assert reason_of(lambda: check(envelope, raw_key, PEER.peer_id)) == "schema"


@pytest.mark.parametrize("mode", ["satellite", "unknown", "", "Relay", "r" * 17, 1, None, b"relay", True])
def test_a_heartbeat_with_a_bad_mode_is_refused(mode: Any) -> None:
    raw_key = keys.peers_key(RUN_ID)
    body = heartbeat().to_body()
    control = make_envelope(PEER, raw_key, PEER.peer_id, {**body, "mode": "relay"}, NOW + 5)
    assert (
        check(control, raw_key, PEER.peer_id).body["mode"] == "relay"
    )  # the same body with a known mode passes
    envelope = make_envelope(PEER, raw_key, PEER.peer_id, {**body, "mode": mode}, NOW + 5)
    assert reason_of(lambda: check(envelope, raw_key, PEER.peer_id)) == "schema"


def test_a_heartbeat_with_a_bad_mode_cannot_be_built_or_parsed() -> None:
    assert reason_of(lambda: heartbeat(mode="satellite")) == "schema"
    body = {**heartbeat().to_body(), "mode": "satellite"}
    assert reason_of(lambda: Heartbeat.from_body(body)) == "schema"


def test_the_wire_modes_are_the_modes_a_node_decides() -> None:
    from node.swarm.relay import Mode

    assert tuple(m.value for m in Mode) == CONNECTIVITY_MODES and UNKNOWN_MODE not in CONNECTIVITY_MODES


def test_manifest_syncer_ban_and_discovery_records_are_accepted() -> None:
    raw = keys.manifest_key(RUN_ID)
    assert check(make_envelope(OWNER, raw, None, {"signed": SIGNED.to_wire()}, NOW + 60), raw, None, NOW + 60)
    raw = keys.syncer_key(RUN_ID)
    body = SyncerState(lease_until=NOW + 10, term=1, versions=(3, 4), sent_at=NOW).to_body()
    assert check(make_envelope(SYNCER, raw, SYNCER.peer_id, body, NOW + 10), raw, SYNCER.peer_id, NOW + 10)
    raw = keys.bans_key(RUN_ID, PEER.peer_id)
    body = BanNotice(offender=PEER.peer_id, reason="flags", evidence=b"x" * 100, issued_at=NOW).to_body()
    assert check(
        make_envelope(VERIFIER, raw, VERIFIER.peer_id, body, NOW + 60), raw, VERIFIER.peer_id, NOW + 60
    )
    raw = keys.discovery_key()
    envelope = make_envelope(OWNER, raw, OWNER.peer_id, {"signed": SIGNED.to_wire()}, NOW + 60)
    assert check(envelope, raw, OWNER.peer_id, NOW + 60, runs={}).signer == OWNER.peer_id


# ---- refused records ----


def test_writing_under_another_peers_subkey_is_refused() -> None:
    envelope, raw_key, _ = signed_heartbeat(identity=OTHER, subkey=PEER.peer_id)
    assert reason_of(lambda: check(envelope, raw_key, PEER.peer_id)) == "bad signature"


def test_a_signed_record_cannot_move_to_another_subkey_key_or_expiration() -> None:
    envelope, raw_key, sub = signed_heartbeat()
    assert reason_of(lambda: check(envelope, raw_key, OTHER.peer_id)) == "bad signature"
    assert reason_of(lambda: check(envelope, raw_key, sub, expiration=NOW + 6)) == "bad signature"
    other_key = keys.syncer_key(RUN_ID)
    assert reason_of(lambda: check(envelope, raw_key, sub, key_id=keys.key_id(other_key))) == "key mismatch"


def test_a_tampered_body_is_refused() -> None:
    envelope, raw_key, sub = signed_heartbeat()
    body = msgpack.unpackb(envelope["b"])
    body["throughput"] = 1e9
    forged = {**envelope, "b": msgpack.packb(body)}
    assert reason_of(lambda: check(forged, raw_key, sub)) == "bad signature"


def test_unknown_key_under_our_prefix_is_refused() -> None:
    raw = f"{RUN_ID}/gossip"
    envelope = make_envelope(PEER, raw, PEER.peer_id, heartbeat().to_body(), NOW + 5)
    assert reason_of(lambda: check(envelope, raw, PEER.peer_id)) == "unknown key"


def test_records_of_an_unknown_run_are_refused_except_self_certifying_manifests() -> None:
    envelope, raw_key, sub = signed_heartbeat()
    assert reason_of(lambda: check(envelope, raw_key, sub, runs={})) == "unknown run"
    raw = keys.manifest_key(RUN_ID)
    manifest_envelope = make_envelope(OWNER, raw, None, {"signed": SIGNED.to_wire()}, NOW + 60)
    assert check(manifest_envelope, raw, None, NOW + 60, runs={}).signer == OWNER.peer_id


@pytest.mark.parametrize("ahead_s", [LIMITS.max_ttl_peer_s + LIMITS.clock_skew_s + 1, 365 * 86400.0])
def test_far_future_expirations_are_refused(ahead_s: float) -> None:
    envelope, raw_key, sub = signed_heartbeat(expiration=NOW + ahead_s)
    assert reason_of(lambda: check(envelope, raw_key, sub, expiration=NOW + ahead_s)) == "expiration"


@pytest.mark.parametrize(
    "mutate",
    [
        lambda b: b.pop("role"),  # missing key
        lambda b: b.update(extra=1),  # unexpected key
        lambda b: b.update(throughput=100),  # int where a float is required
        lambda b: b.update(inner_step=True),  # bool is not an int
        lambda b: b.update(role="overlord"),  # not a role
        lambda b: b.update(state="x" * 17),  # not a state
        lambda b: b.update(throughput=float("nan")),  # not finite
        lambda b: b.update(throughput=-1.0),  # negative
        lambda b: b.update(span=[1]),  # span is a pair
        lambda b: b.update(maddrs=["/ip4/1.1.1.1/tcp/1"] * 9),  # too many
        lambda b: b.update(http=b"bytes"),  # bytes where str is required
        lambda b: b.update(stage=2),  # the run has 2 stages: 0 and 1
        lambda b: b.update(span=[0, 5]),  # the run has 4 layers
    ],
)
def test_out_of_schema_heartbeats_are_refused(mutate: Any) -> None:
    raw_key = keys.peers_key(RUN_ID)
    body = heartbeat().to_body()
    mutate(body)
    envelope = make_envelope(PEER, raw_key, PEER.peer_id, body, NOW + 5)
    assert reason_of(lambda: check(envelope, raw_key, PEER.peer_id)) == "schema"


def test_only_authorized_syncers_and_verifiers_write_their_keys() -> None:
    raw = keys.syncer_key(RUN_ID)
    body = SyncerState(lease_until=NOW + 10, sent_at=NOW).to_body()
    envelope = make_envelope(PEER, raw, PEER.peer_id, body, NOW + 10)
    assert reason_of(lambda: check(envelope, raw, PEER.peer_id, NOW + 10)) == "unauthorized"
    raw = keys.bans_key(RUN_ID, OTHER.peer_id)
    body = BanNotice(offender=OTHER.peer_id, reason="x", issued_at=NOW).to_body()
    envelope = make_envelope(PEER, raw, PEER.peer_id, body, NOW + 10)
    assert reason_of(lambda: check(envelope, raw, PEER.peer_id, NOW + 10)) == "unauthorized"


def test_a_ban_must_name_the_offender_of_its_key_and_cap_its_evidence() -> None:
    raw = keys.bans_key(RUN_ID, OTHER.peer_id)
    body = BanNotice(offender=PEER.peer_id, reason="x", issued_at=NOW).to_body()
    envelope = make_envelope(VERIFIER, raw, VERIFIER.peer_id, body, NOW + 10)
    assert reason_of(lambda: check(envelope, raw, VERIFIER.peer_id, NOW + 10)) == "schema"
    big = BanNotice(
        offender=OTHER.peer_id, reason="x", evidence=b"e" * (LIMITS.max_evidence_bytes + 1)
    ).to_body()
    envelope = make_envelope(VERIFIER, raw, VERIFIER.peer_id, big, NOW + 10)
    assert reason_of(lambda: check(envelope, raw, VERIFIER.peer_id, NOW + 10)) == "schema"


def test_manifest_records_need_the_owner_and_the_matching_run_id() -> None:
    raw = keys.manifest_key(RUN_ID)
    forged = SignedManifest.sign(MANIFEST, OTHER)  # same settings, another owner: another run id
    envelope = make_envelope(OTHER, raw, None, {"signed": forged.to_wire()}, NOW + 60)
    assert reason_of(lambda: check(envelope, raw, None, NOW + 60)) == "run id"
    tampered = dataclasses.replace(
        SIGNED, manifest_bytes=SIGNED.manifest_bytes.replace(b"default", b"defaulT")
    )
    envelope = make_envelope(OWNER, raw, None, {"signed": tampered.to_wire()}, NOW + 60)
    assert reason_of(lambda: check(envelope, raw, None, NOW + 60)) == "manifest"
    envelope = make_envelope(OTHER, raw, None, {"signed": SIGNED.to_wire()}, NOW + 60)
    assert reason_of(lambda: check(envelope, raw, None, NOW + 60)) == "bad signature"


def test_discovery_subkey_must_be_the_manifest_owner() -> None:
    raw = keys.discovery_key()
    envelope = make_envelope(OTHER, raw, OTHER.peer_id, {"signed": SIGNED.to_wire()}, NOW + 60)
    assert reason_of(lambda: check(envelope, raw, OTHER.peer_id, NOW + 60, runs={})) == "subkey"


def test_malformed_envelopes_are_refused() -> None:
    envelope, raw_key, sub = signed_heartbeat()
    assert reason_of(lambda: check({**envelope, "s": b"short"}, raw_key, sub)) == "malformed"
    assert reason_of(lambda: check({**envelope, "k": 5}, raw_key, sub)) == "malformed"
    assert reason_of(lambda: check({**envelope, "b": b"\xc1"}, raw_key, sub)) == "malformed"
    assert reason_of(lambda: check("not a map", raw_key, sub)) == "foreign"  # type: ignore[arg-type]


# ---- the hivemind validator ----


def dht_record(envelope: Any, raw_key: str, subkey: str | None, expiration: float) -> DHTRecord:
    subkey_bytes = DHTProtocol.IS_REGULAR_VALUE if subkey is None else MSGPackSerializer.dumps(subkey)
    return DHTRecord(keys.key_id(raw_key), subkey_bytes, MSGPackSerializer.dumps(envelope), expiration)


def test_validator_checks_what_hivemind_hands_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("protocol.records.get_dht_time", lambda: NOW)
    validator = HivenodeRecordValidator([RULES])
    envelope, raw_key, sub = signed_heartbeat()
    assert validator.validate(dht_record(envelope, raw_key, sub, NOW + 5))
    assert validator.sign_value(dht_record(envelope, raw_key, sub, NOW + 5)) == MSGPackSerializer.dumps(
        envelope
    )
    forged, _, _ = signed_heartbeat(identity=OTHER, subkey=PEER.peer_id)
    assert not validator.validate(dht_record(forged, raw_key, PEER.peer_id, NOW + 5))
    assert not validator.validate(dht_record(envelope, raw_key, sub, NOW + 10 * 365 * 86400))
    assert not validator.validate(dht_record({"plain": 1}, "some-other-app-key", None, NOW + 5))
    oversize = DHTRecord(keys.key_id(raw_key), b"", b"\x00" * (LIMITS.max_value_bytes + 1), NOW + 5)
    assert not validator.validate(oversize)
    assert validator.rejections["bad signature"] == 1 and validator.rejections["too large"] == 1


def test_validators_merge_runs_and_foreign_records_are_opt_in(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("protocol.records.get_dht_time", lambda: NOW)
    validator = HivenodeRecordValidator()
    envelope, raw_key, sub = signed_heartbeat()
    record = dht_record(envelope, raw_key, sub, NOW + 5)
    assert not validator.validate(record)  # unknown run
    assert validator.merge_with(HivenodeRecordValidator([RULES]))
    assert validator.validate(record)
    foreign = dht_record({"plain": 1}, "some-other-app-key", None, NOW + 5)
    assert HivenodeRecordValidator(allow_foreign=True).validate(foreign)


# ---- measured throughputs (issue 18: placement on what verifiers measured) ----


def signed_measured(identity: NodeIdentity = VERIFIER, body: dict[str, Any] | None = None, **kw: Any) -> Any:
    raw_key = keys.measured_key(RUN_ID)
    if body is None:
        body = MeasuredThroughputs(rates={PEER.peer_id: 812.5, OTHER.peer_id: 0.0}, sent_at=NOW).to_body()
    expiration = kw.pop("expiration", NOW + 5)
    envelope = make_envelope(identity, raw_key, identity.peer_id, body, expiration)
    return lambda: check(envelope, raw_key, identity.peer_id, expiration, **kw)


def test_a_verifier_measured_record_is_accepted_and_parses_back() -> None:
    assert keys.parse_key(keys.measured_key(RUN_ID)).kind is keys.KeyKind.MEASURED
    record = signed_measured()()
    assert record.signer == VERIFIER.peer_id
    assert record.body["rates"] == {PEER.peer_id: 812.5, OTHER.peer_id: 0.0}


def test_only_authorized_verifiers_write_measured_throughputs() -> None:
    for impostor in (PEER, SYNCER, OWNER):  # a replica vouching for itself, the syncer, even the owner
        assert reason_of(signed_measured(impostor)) == "unauthorized"
    assert signed_measured(VERIFIER)().signer == VERIFIER.peer_id  # control


@pytest.mark.parametrize(
    "rates",
    [
        {PEER.peer_id: -1.0},
        {PEER.peer_id: float("nan")},
        {PEER.peer_id: float("inf")},
        {PEER.peer_id: 5},  # an int is not a float
        {PEER.peer_id: True},
        {"": 1.0},
        {"x" * 65: 1.0},
        [1.0],
        {f"peer-{i}": 1.0 for i in range(129)},  # over MAX_MEASURED_REPLICAS
    ],
)
def test_measured_records_have_a_strict_schema(rates: Any) -> None:
    assert reason_of(signed_measured(body={"rates": rates, "sent_at": NOW})) == "schema"


def test_measured_records_refuse_extra_keys_and_long_expirations() -> None:
    good = MeasuredThroughputs(rates={PEER.peer_id: 1.0}, sent_at=NOW).to_body()
    assert reason_of(signed_measured(body={**good, "note": "hi"})) == "schema"
    assert reason_of(signed_measured(body={"rates": good["rates"]})) == "schema"
    full = {
        f"12D3KooW{i:056d}"[:52]: 1e6 + i for i in range(MAX_MEASURED_REPLICAS)
    }  # the cap fits the value cap
    assert signed_measured(body={"rates": full, "sent_at": NOW})().signer == VERIFIER.peer_id
    far = NOW + LIMITS.max_ttl_peer_s + LIMITS.clock_skew_s + 10
    assert reason_of(signed_measured(expiration=far)) == "expiration"


def test_the_validator_names_the_run_roles_the_store_quota_reserves_for() -> None:
    """Owner, bootstraps, authorized syncers and verifiers of a known run have a role (the DHT store quota's
    known peers); any other identity, and everyone while the run is unknown, is a guest."""
    bootstrap = NodeIdentity.generate()
    manifest = dataclasses.replace(MANIFEST, bootstraps=(bootstrap.peer_id,))
    signed = SignedManifest.sign(manifest, OWNER)
    validator = HivenodeRecordValidator()
    assert not any(validator.has_role(p.peer_id) for p in (OWNER, SYNCER, VERIFIER, bootstrap, PEER))
    validator.merge_with(HivenodeRecordValidator([RunRules.from_manifest(signed, manifest)]))
    assert all(validator.has_role(p.peer_id) for p in (OWNER, SYNCER, VERIFIER, bootstrap))
    assert not validator.has_role(PEER.peer_id) and not validator.has_role(OTHER.peer_id)
