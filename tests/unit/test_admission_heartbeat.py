"""A heartbeat carrying its peer's admission proof (issue 18): the pure rules that count it as an admitted peer's
for the DHT record budget (`StoreQuota`'s admitted share, `HivenodeRecordValidator.admits_store`,
`QuotaDHTProtocol`) and for the syncer's reserved stream slots (`syncer_prefers`). No sockets.

Each rule has its negative controls here: no proof, a weak proof, another peer's proof, a replayed heartbeat, a
forged signature and a run whose admission is open all leave the store a guest's; with the admitted share off,
the flood locks the honest learner out."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace
from typing import Any

import pytest
from hivemind.dht.validation import CompositeValidator, DHTRecord
from hivemind.utils import MSGPackSerializer, get_dht_time

from node.roles.syncer_rpc import admitted_holder, syncer_prefers
from node.swarm.dht import QuotaDHTProtocol
from protocol import keys, limits
from protocol.admission import AdmissionSpec, pays_admission, solve
from protocol.errors import RecordRejected
from protocol.identity import NodeIdentity
from protocol.limits import QuotaConfig, StoreQuota
from protocol.manifest import RunManifest, SignedManifest, authorize
from protocol.records import (
    Heartbeat,
    HivenodeRecordValidator,
    RecordLimits,
    RunRules,
    check_envelope,
    heartbeat_admits,
    make_envelope,
)

pytestmark = pytest.mark.timeout(60)

# ~65,000 hashes (tens of ms); a proof passes for another peer with probability 2^-16, which the controls assume
BITS = 16
OWNER, SYNCER = NodeIdentity.generate(), NodeIdentity.generate()
LEARNER, SYBIL = NodeIdentity.generate(), NodeIdentity.generate()


def _run(spec: AdmissionSpec) -> tuple[SignedManifest, RunManifest, RunRules]:
    manifest = dataclasses.replace(authorize(RunManifest(), syncers=[SYNCER.peer_id]), admission=spec)
    signed = SignedManifest.sign(manifest, OWNER)
    return signed, manifest, RunRules.from_manifest(signed, manifest)


SIGNED, MANIFEST, RULES = _run(AdmissionSpec(mode="pow", pow_bits=BITS))
RUN = SIGNED.run_id
PROOF = solve(RUN, LEARNER.peer_id, BITS)
SYBIL_PROOF = solve(RUN, SYBIL.peer_id, BITS)


def _weak(peer: str) -> int:
    """A nonce whose proof for `peer` falls short of BITS (most do)."""
    return next(n for n in range(1 << 20) if not pays_admission(RULES.admission, RUN, peer, n))


# ---- the pure rule: protocol.admission.pays_admission ----


def test_a_valid_proof_pays_and_no_weak_or_foreign_proof_does() -> None:
    spec = RULES.admission
    assert pays_admission(spec, RUN, LEARNER.peer_id, PROOF)
    # controls: nothing, a weak nonce, a malformed one, another peer's proof, another run's
    assert not pays_admission(spec, RUN, LEARNER.peer_id, None)
    assert not pays_admission(spec, RUN, LEARNER.peer_id, _weak(LEARNER.peer_id))
    assert not pays_admission(spec, RUN, LEARNER.peer_id, True)
    assert not pays_admission(spec, RUN, SYBIL.peer_id, PROOF)


def test_open_admission_admits_nobody_and_an_allowlist_its_listed_peers() -> None:
    # open: anybody is admitted, so being admitted sets no peer apart from a free identity
    assert not pays_admission(AdmissionSpec(mode="open"), RUN, LEARNER.peer_id, PROOF)
    listed = AdmissionSpec(mode="allowlist", allowlist=(LEARNER.peer_id,))
    assert pays_admission(listed, RUN, LEARNER.peer_id, None)
    assert not pays_admission(listed, RUN, SYBIL.peer_id, SYBIL_PROOF)


# ---- the heartbeat field ----


def _heartbeat_record(
    author: NodeIdentity, admission: Any, *, run: SignedManifest = SIGNED, now: float = 1_800_000_000.0
) -> tuple[bytes, bytes, bytes, float]:
    """(key id, subkey tag, value, expiration) of `author`'s heartbeat carrying `admission` in its body, as a
    store request carries it."""
    raw = keys.peers_key(run.run_id)
    body = Heartbeat(role="learner", sent_at=now).to_body()
    if admission is not None:
        body["admission"] = admission
    expiration = now + 4.0
    envelope = make_envelope(author, raw, author.peer_id, body, expiration)
    return (
        keys.key_id(raw),
        MSGPackSerializer.dumps(author.peer_id),
        MSGPackSerializer.dumps(envelope),
        expiration,
    )


def _check(record: tuple[bytes, bytes, bytes, float], rules: RunRules = RULES) -> Any:
    key, tag, value, expiration = record
    return check_envelope(
        MSGPackSerializer.loads(value),
        key_id=key,
        subkey=MSGPackSerializer.loads(tag),
        expiration=expiration,
        now=expiration - 4.0,
        runs={rules.run_id: rules},
        limits=RecordLimits(),
    )


def test_the_proof_round_trips_and_is_left_out_of_a_body_without_one() -> None:
    beat = Heartbeat(role="learner", admission=PROOF)
    assert Heartbeat.from_body(beat.to_body()) == beat
    assert "admission" not in Heartbeat(role="learner").to_body()
    assert Heartbeat.from_body(Heartbeat(role="learner").to_body()).admission is None


@pytest.mark.parametrize("bad", [True, -1, 2**63, "12", 1.0])
def test_a_malformed_proof_makes_the_heartbeat_invalid(bad: object) -> None:
    with pytest.raises(RecordRejected, match="admission"):
        Heartbeat(role="learner", admission=bad)  # type: ignore[arg-type]
    with pytest.raises(RecordRejected, match="bad fields"):
        _check(_heartbeat_record(LEARNER, bad))


def test_a_weak_proof_leaves_the_heartbeat_valid_but_its_peer_not_admitted() -> None:
    weak = _check(_heartbeat_record(LEARNER, _weak(LEARNER.peer_id)))
    assert not heartbeat_admits(weak, RULES, LEARNER.peer_id)
    assert heartbeat_admits(_check(_heartbeat_record(LEARNER, PROOF)), RULES, LEARNER.peer_id)
    # control: the valid heartbeat stored by another sender (a replay) shows nothing of that sender
    assert not heartbeat_admits(_check(_heartbeat_record(LEARNER, PROOF)), RULES, SYBIL.peer_id)


# ---- the validator: admits_store ----


def _admits(sender: str, record: tuple[bytes, bytes, bytes, float], rules: RunRules = RULES) -> bool:
    key, tag, value, expiration = record
    validator = HivenodeRecordValidator([rules])
    return validator.admits_store(sender, DHTRecord(key, tag, value, expiration))


def test_the_validator_admits_a_senders_own_heartbeat_with_its_proof_only() -> None:
    now = float(get_dht_time())
    assert _admits(LEARNER.peer_id, _heartbeat_record(LEARNER, PROOF, now=now))
    assert not _admits(LEARNER.peer_id, _heartbeat_record(LEARNER, None, now=now))
    assert not _admits(LEARNER.peer_id, _heartbeat_record(LEARNER, _weak(LEARNER.peer_id), now=now))
    # another peer's proof in the Sybil's own heartbeat
    assert not _admits(SYBIL.peer_id, _heartbeat_record(SYBIL, PROOF, now=now))
    # the learner's heartbeat replayed by the Sybil
    assert not _admits(SYBIL.peer_id, _heartbeat_record(LEARNER, PROOF, now=now))
    # a valid proof under a forged signature: the Sybil signs a heartbeat under the learner's subkey
    key, _tag, _value, expiration = _heartbeat_record(LEARNER, PROOF, now=now)
    raw = keys.peers_key(RUN)
    body = {**Heartbeat(role="learner", sent_at=now).to_body(), "admission": PROOF}
    forged = MSGPackSerializer.dumps(make_envelope(SYBIL, raw, LEARNER.peer_id, body, expiration))
    assert not _admits(LEARNER.peer_id, (key, MSGPackSerializer.dumps(LEARNER.peer_id), forged, expiration))
    # a run whose admission is open admits nobody by heartbeat
    signed, _, open_rules = _run(AdmissionSpec(mode="open"))
    assert not _admits(LEARNER.peer_id, _heartbeat_record(LEARNER, PROOF, run=signed, now=now), open_rules)


# ---- the store quota's admitted share ----


def _quota(admitted_total: int) -> StoreQuota:
    config = QuotaConfig(
        max_records_per_peer=2,
        max_records_total=8,
        reserved_records_total=4,
        admitted_records_total=admitted_total,
        max_tracked_peers=8,
    )
    return StoreQuota(config, known=lambda peer: peer == SYNCER.peer_id)


def _store(quota: StoreQuota, peer: str, now: float, *, admitted: bool = False) -> limits.Admission:
    return quota.admit_store(peer, b"key", 10, now + 60.0, now, admitted=admitted)


@pytest.mark.parametrize("admitted_total", [2, 0], ids=["admitted-share", "no-share-control"])
def test_an_admitted_store_outlasts_the_flood_and_leaves_the_roles_their_share(admitted_total: int) -> None:
    quota, now = _quota(admitted_total), 1000.0
    assert sum(bool(_store(quota, f"sybil{i}", now)) for i in range(4) for _ in range(2)) == 4
    honest = _store(quota, LEARNER.peer_id, now, admitted=True)
    if not admitted_total:
        # the control: without the share the admitted learner is a guest, and the flood filled the guests' pool
        assert honest.reason == limits.GUEST_STORE_RECORDS
        return
    assert honest and _store(quota, "admitted2", now, admitted=True)
    # the share is spent: a third admitted identity spills into the full guests' pool ...
    assert _store(quota, "admitted3", now, admitted=True).reason == limits.GUEST_STORE_RECORDS
    # ... and the run's syncer keeps the rest of the reserve
    assert _store(quota, SYNCER.peer_id, now) and _store(quota, SYNCER.peer_id, now)
    assert quota.stats().num_admitted_by_proof == 2
    # the share frees as the window slides
    assert _store(quota, "admitted3", now + 61.0, admitted=True)


def test_the_admitted_share_must_fit_the_reserve() -> None:
    with pytest.raises(ValueError, match="admitted_records_total"):
        QuotaConfig(
            max_records_total=8, reserved_records_total=2, admitted_records_total=3, max_tracked_peers=8
        )


# ---- QuotaDHTProtocol: the store handler's admission, with the real record bytes ----


def _protocol() -> QuotaDHTProtocol:
    QuotaDHTProtocol.quota_config = QuotaConfig(
        max_records_per_peer=2,
        max_records_total=8,
        reserved_records_total=4,
        admitted_records_total=2,
        max_tracked_peers=8,
    )
    try:
        protocol = QuotaDHTProtocol(_initialized_with_create=True)
    finally:
        QuotaDHTProtocol.quota_config = None
    protocol.record_validator = CompositeValidator([HivenodeRecordValidator([RULES])])
    return protocol


def _dht_store(protocol: QuotaDHTProtocol, sender: NodeIdentity, admission: Any, now: float) -> bool:
    assert protocol.store_quota is not None
    key, tag, value, expiration = _heartbeat_record(sender, admission, now=now)
    return protocol._admit(protocol.store_quota, sender.peer_id, key, tag, value, expiration, now)


@pytest.mark.parametrize("proof", [True, False], ids=["with-proof", "no-proof-control"])
def test_the_store_handler_takes_an_admitted_heartbeat_under_a_sybil_flood(proof: bool) -> None:
    protocol, now = _protocol(), float(get_dht_time())
    sybils = [NodeIdentity.generate() for _ in range(4)]
    # the flood: fresh identities' valid heartbeats without a proof fill the guests' pool (4 of 8)
    flooded = [_dht_store(protocol, s, None, now + i * 1e-3) for s in sybils for i in range(2)]
    assert sum(flooded) == 4
    stored = _dht_store(protocol, LEARNER, PROOF if proof else None, now)
    assert stored is proof
    assert protocol.store_quota is not None
    stats = protocol.store_quota.stats()
    assert stats.num_admitted_by_proof == int(proof)
    if not proof:
        assert stats.rejected_by_reason[limits.GUEST_STORE_RECORDS] == 5


# ---- the syncer's reserved stream slots ----


def _syncer(spec: AdmissionSpec, live: dict[str, Heartbeat]) -> Any:
    _, manifest, rules = _run(spec)
    ctx = SimpleNamespace(manifest=manifest, run_id=rules.run_id)
    return SimpleNamespace(ctx=ctx, core=None, live=live), rules.run_id


def test_the_syncer_prefers_a_live_learner_whose_heartbeat_carries_its_proof() -> None:
    spec = AdmissionSpec(mode="pow", pow_bits=BITS)
    _, _, rules = _run(spec)
    proof = solve(rules.run_id, LEARNER.peer_id, BITS)
    live = {
        LEARNER.peer_id: Heartbeat(role="learner", admission=proof),
        SYBIL.peer_id: Heartbeat(role="learner", admission=proof),  # the learner's proof: not the Sybil's
    }
    role, run_id = _syncer(spec, live)
    assert syncer_prefers(role, LEARNER.peer_id)
    assert syncer_prefers(role, SYNCER.peer_id)  # an authorized syncer, as before
    # controls: another peer's proof, a heartbeat without one, a peer that is not live
    assert not syncer_prefers(role, SYBIL.peer_id)
    assert not admitted_holder(spec, run_id, LEARNER.peer_id, Heartbeat(role="learner"))
    assert not syncer_prefers(role, "12D3KooWnotlive")
    # open admission: a proof prefers nobody
    open_role, _ = _syncer(AdmissionSpec(mode="open"), live)
    assert not syncer_prefers(open_role, LEARNER.peer_id)
