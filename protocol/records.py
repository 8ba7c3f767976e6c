"""Signed, schema-checked DHT records: the validator every hivenode DHT runs, and the typed records.

Every value we store is an envelope `{"k": raw key, "b": body bytes, "s": Ed25519 signature}`. The signature is
made by the key the record kind names (the subkey's peer id; the owner for the manifest) over
`(raw key, subkey, body bytes, expiration)`, so a record can be neither moved to another key or subkey nor kept
alive past the expiration its author chose. The DHT only shows a validator the hash of the key, hence the raw
key inside the envelope: the validator re-hashes it and compares.

Records are signed here, in the calling process, not in `sign_value` inside hivemind's DHT process: the private
key then never has to be pickled into that process, and the validator holds no secret (`sign_value` is the
identity). `check_envelope` is the pure core (the clock is an argument); `HivenodeRecordValidator` wraps it for
hivemind and runs on every store a peer asks of us and on every record a peer returns to us.

Known limitation (hivemind): a peer that answers a `get` with a dictionary containing even one invalid subkey
has its whole answer dropped, so a non-validating DHT peer (a plain `hivemind-dht`) holding a forged entry hides
that key's other entries it holds from us; replicas on validating peers are unaffected.

The async client over a DHT (`SwarmRecords`, `publish_discovery`, `fetch_discovery`, `fetch_manifest`,
`manifest_rejections`) lives in `protocol.dht_io`; its names are re-exported here.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections import Counter, deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import msgpack
from hivemind.dht.protocol import DHTProtocol
from hivemind.dht.validation import DHTRecord, RecordValidatorBase
from hivemind.utils import get_dht_time

from protocol import keys
from protocol.admission import MAX_NONCE, AdmissionSpec, pays_admission
from protocol.errors import ProtocolError, RecordRejected
from protocol.identity import SIGNATURE_SIZE, NodeIdentity, verify_signature
from protocol.keys import KeyKind
from protocol.manifest import RunManifest, SignedManifest, run_bootstraps

logger = logging.getLogger(__name__)

_SIGN_DOMAIN = b"hivenode-record-v1\x00"
ROLES = ("bootstrap", "learner", "stage", "verifier", "syncer")
PEER_STATES = ("joining", "idle", "training", "serving", "verifying", "syncing", "standby", "leaving")
SYNCER_STATES = ("active", "standby")
# how others reach a peer (node.swarm.relay.Mode): dialed at its own addresses, through a relay's circuit, or not at
# all (it serves nothing). A heartbeat may omit it (written before the field existed): shown as `UNKNOWN_MODE`.
CONNECTIVITY_MODES = ("direct", "relay", "client")
UNKNOWN_MODE = "unknown"
MAX_MADDRS = 8
MAX_FRAGMENTS = 1024
MAX_MANIFEST_REJECTIONS = 8
MAX_MEASURED_REPLICAS = (
    128  # replicas one `measured` record may carry (~70 bytes each: well under the value cap)
)


@dataclass(frozen=True, kw_only=True, slots=True)
class RecordLimits:
    """Caps every validator applies; identical on every peer of a run."""

    max_value_bytes: int = 24 * 1024  # whole signed envelope (a manifest is at most 16 KiB)
    max_evidence_bytes: int = 8 * 1024  # opaque ban evidence
    clock_skew_s: float = 60.0  # tolerated writer clock offset (as envelopes and hivemind auth allow)
    max_ttl_manifest_s: float = 3600.0  # manifest and discovery records; bootstraps re-publish
    max_ttl_peer_s: float = 300.0  # heartbeats
    max_ttl_syncer_s: float = 300.0  # syncer lease records
    max_ttl_ban_s: float = 7 * 86400.0  # bans; verifiers re-publish while the ban holds

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if not isinstance(value, int | float) or value <= 0:
                raise ValueError(f"RecordLimits.{f.name} must be positive, got {value!r}")

    def max_ttl_s(self, kind: KeyKind) -> float:
        if kind in (KeyKind.MANIFEST, KeyKind.DISCOVERY):
            return self.max_ttl_manifest_s
        if kind in (KeyKind.PEERS, KeyKind.MEASURED):  # both re-published every few seconds
            return self.max_ttl_peer_s
        if kind is KeyKind.SYNCER:
            return self.max_ttl_syncer_s
        return self.max_ttl_ban_s


@dataclass(frozen=True, kw_only=True, slots=True)
class RunRules:
    """What a validator must know about a run to check its records (all of it committed to by the run id)."""

    run_id: str
    owner: str
    authorized_syncers: frozenset[str]
    authorized_verifiers: frozenset[str]
    num_stages: int
    num_layers: int
    # the run's entry points as its owner signed them (`manifest.run_bootstraps`: the owner key and `bootstraps`)
    bootstraps: frozenset[str] = frozenset()
    # what an identity pays to contribute (the manifest's `[admission]`); open by default: then a proof in a
    # heartbeat admits nobody to the DHT budget reserved for known peers (`heartbeat_admits`)
    admission: AdmissionSpec = dataclasses.field(default_factory=lambda: AdmissionSpec(mode="open"))

    @classmethod
    def from_manifest(cls, signed: SignedManifest, manifest: RunManifest) -> RunRules:
        return cls(
            run_id=signed.run_id,
            owner=signed.owner,
            authorized_syncers=frozenset(manifest.authorized_syncers),
            authorized_verifiers=frozenset(manifest.authorized_verifiers),
            num_stages=manifest.num_stages,
            num_layers=manifest.model["num_layers"],
            bootstraps=run_bootstraps(signed, manifest),
            admission=manifest.admission,
        )

    def roles(self) -> frozenset[str]:
        """The peer ids the run's signed manifest gives a role: owner, bootstraps, authorized syncers and
        verifiers. A fresh identity is none of them, whatever it pays."""
        return frozenset({self.owner, *self.bootstraps, *self.authorized_syncers, *self.authorized_verifiers})


# ---- body schemas: exact keys, strict types (bool is not an int, an int is not a float) ----

Check = Callable[[object], bool]


def _str(max_len: int, choices: tuple[str, ...] | None = None) -> Check:
    return lambda v: isinstance(v, str) and len(v) <= max_len and (choices is None or v in choices)


def _int(lo: int, hi: int = 2**63 - 1) -> Check:
    return lambda v: isinstance(v, int) and not isinstance(v, bool) and lo <= v <= hi


def _float(lo: float = 0.0, hi: float = math.inf) -> Check:
    return lambda v: isinstance(v, float) and math.isfinite(v) and lo <= v <= hi


def _bool(v: object) -> bool:
    return isinstance(v, bool)


def _bytes(max_len: int) -> Check:
    return lambda v: isinstance(v, bytes) and len(v) <= max_len


def _rates(max_items: int) -> Check:
    """A map of peer-id-sized strings to finite, non-negative floats (tokens/s), at most `max_items` of them."""

    def run(v: object) -> bool:
        return (
            isinstance(v, dict)
            and len(v) <= max_items
            and all(isinstance(k, str) and 0 < len(k) <= 64 for k in v)
            and all(_float()(x) for x in v.values())
        )

    return run


def _optional(check: Check) -> Check:
    return lambda v: v is None or check(v)


def _list(check: Check, max_items: int, exact: int | None = None) -> Check:
    def run(v: object) -> bool:
        if not isinstance(v, list) or len(v) > max_items or (exact is not None and len(v) != exact):
            return False
        return all(check(item) for item in v)

    return run


def _signed_manifest(v: object) -> bool:
    return isinstance(v, dict) and set(v) == {"manifest", "owner", "signature"}


HEARTBEAT_SCHEMA: dict[str, Check] = {
    "role": _str(16, ROLES),
    "stage": _optional(_int(0, 4096)),
    "span": _optional(_list(_int(0, 1 << 20), 2, exact=2)),  # [first layer, end layer)
    "device": _str(32),
    "throughput": _float(),  # tokens/s
    "load": _float(0.0, 1e6),  # busy fraction (may exceed 1 when queued)
    "http": _str(128),  # host:port of the status API, "" if none
    "state": _str(16, PEER_STATES),
    "leaving": _bool,
    "maddrs": _list(_str(256), MAX_MADDRS),
    "inner_step": _int(0),
    "tokens": _int(0),
    "loss": _optional(_float(-1e9, 1e9)),
    "version": _str(32),
    "sent_at": _float(),
    "mode": _str(16, CONNECTIVITY_MODES),  # optional (HEARTBEAT_OPTIONAL); "unknown" is never sent
    # optional: the peer's admission proof, the nonce of protocol.admission (sent once solved, in mode pow). Only
    # its type is checked here: a weak or foreign proof leaves the record valid, its peer just not admitted
    # (`heartbeat_admits`), as the peer of a heartbeat without one
    "admission": _int(0, MAX_NONCE),
}
# keys a body may leave out: fields added after the first release, so heartbeats of older nodes still validate
HEARTBEAT_OPTIONAL = frozenset({"mode", "admission"})
SYNCER_SCHEMA: dict[str, Check] = {
    "lease_until": _float(),  # DHT time the lease ends
    "term": _int(0),  # lease generation; a standby takes over with term + 1
    "versions": _list(_int(0), MAX_FRAGMENTS),  # current version per fragment index
    "http": _str(128),
    "state": _str(16, SYNCER_STATES),
    "sent_at": _float(),
}
MANIFEST_SCHEMA: dict[str, Check] = {"signed": _signed_manifest}
MEASURED_SCHEMA: dict[str, Check] = {
    "rates": _rates(
        MAX_MEASURED_REPLICAS
    ),  # stage replica peer id -> tokens/s the verifier measured end to end
    "sent_at": _float(),
}


def _ban_schema(limits: RecordLimits) -> dict[str, Check]:
    return {
        "offender": _str(64),
        "reason": _str(256),
        "evidence": _bytes(limits.max_evidence_bytes),
        "stage": _optional(_int(0, 4096)),
        "issued_at": _float(),
    }


def _check_schema(
    kind: KeyKind, body: object, schema: Mapping[str, Check], optional: frozenset[str] = frozenset()
) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise RecordRejected(f"{kind.value} body is not a map", reason="schema")
    missing, extra = sorted(set(schema) - set(body) - optional), sorted(set(body) - set(schema))
    if missing or extra:
        raise RecordRejected(
            f"{kind.value} body keys: missing {missing}, unexpected {extra}", reason="schema"
        )
    bad = [name for name, check in schema.items() if name in body and not check(body[name])]
    if bad:
        raise RecordRejected(f"{kind.value} body has bad fields {bad}", reason="schema")
    return body


# ---- the pure core ----


@dataclass(frozen=True, slots=True)
class VerifiedRecord:
    key: keys.ParsedKey
    subkey: str | None
    signer: str
    body: dict[str, Any]
    expiration: float


def _record_signing_bytes(raw_key: str, subkey: str | None, body: bytes, expiration: float) -> bytes:
    return _SIGN_DOMAIN + msgpack.packb([raw_key, subkey, body, expiration], use_bin_type=True)


def make_envelope(
    identity: NodeIdentity, raw_key: str, subkey: str | None, body: Mapping[str, Any], expiration: float
) -> dict[str, Any]:
    """The DHT value for `body` under (`raw_key`, `subkey`), signed by `identity`."""
    body_bytes = msgpack.packb(dict(body), use_bin_type=True)
    signature = identity.sign(_record_signing_bytes(raw_key, subkey, body_bytes, float(expiration)))
    return {"k": raw_key, "b": body_bytes, "s": signature}


def _unpack(blob: bytes, max_bytes: int) -> object:
    try:
        return msgpack.unpackb(
            blob, raw=False, strict_map_key=True, max_bin_len=max_bytes, max_str_len=max_bytes, max_ext_len=0
        )
    except (ValueError, TypeError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError) as e:
        raise RecordRejected(f"value does not decode: {e}", reason="malformed") from None


def decode_envelope(value_bytes: bytes, limits: RecordLimits) -> dict[str, Any]:
    if len(value_bytes) > limits.max_value_bytes:
        raise RecordRejected(
            f"value of {len(value_bytes)} bytes over {limits.max_value_bytes}", reason="too large"
        )
    envelope = _unpack(value_bytes, limits.max_value_bytes)
    if not isinstance(envelope, dict) or set(envelope) != {"k", "b", "s"}:
        raise RecordRejected("value is not a hivenode record envelope", reason="foreign")
    return envelope


def decode_subkey(subkey_bytes: bytes) -> str | None:
    if subkey_bytes in DHTProtocol.RESERVED_SUBKEYS:
        return None
    subkey = _unpack(subkey_bytes, 256)
    if not isinstance(subkey, str):
        raise RecordRejected("subkey is not a string", reason="malformed")
    return subkey


def _expected_signer(
    parsed: keys.ParsedKey, subkey: str | None, body: dict[str, Any], rules: RunRules | None
) -> str:
    """Who must have signed a record of this kind; also checks kind-specific authorization and bounds."""
    kind = parsed.kind
    if kind is KeyKind.MANIFEST:
        if subkey is not None:
            raise RecordRejected("the manifest takes no subkey", reason="subkey")
        return _manifest_owner(body, parsed.run_id)
    if subkey is None or not keys.is_peer_id(subkey):
        raise RecordRejected(f"{kind.value} records need a peer-id subkey", reason="subkey")
    if kind is KeyKind.DISCOVERY:
        if _manifest_owner(body, None) != subkey:
            raise RecordRejected("discovery subkey is not the manifest owner", reason="subkey")
        return subkey
    assert rules is not None  # run kinds are only checked against a known run
    if kind is KeyKind.PEERS:
        _check_heartbeat_bounds(body, rules)
    elif kind is KeyKind.SYNCER and subkey not in rules.authorized_syncers:
        raise RecordRejected(f"{subkey[-8:]} is not an authorized syncer", reason="unauthorized")
    elif kind is KeyKind.MEASURED and subkey not in rules.authorized_verifiers:
        # placement trusts these figures over the replicas' own: only the run's verifiers may write them
        raise RecordRejected(f"{subkey[-8:]} is not an authorized verifier", reason="unauthorized")
    elif kind is KeyKind.BANS:
        # syncers sign learner bans (their evidence kind is checked where notices are counted: verification.bans)
        if subkey not in rules.authorized_verifiers and subkey not in rules.authorized_syncers:
            raise RecordRejected(
                f"{subkey[-8:]} is not an authorized verifier or syncer", reason="unauthorized"
            )
        if body["offender"] != parsed.offender:
            raise RecordRejected("ban offender differs from its key", reason="schema")
    return subkey


def _manifest_owner(body: dict[str, Any], run_id: str | None) -> str:
    try:
        signed = SignedManifest.from_wire(body["signed"])
        signed.verify()
    except ProtocolError as e:
        raise RecordRejected(str(e), reason="manifest") from None
    if run_id is not None and signed.run_id != run_id:
        raise RecordRejected("manifest does not hash to its run id", reason="run id")
    return signed.owner


def _check_heartbeat_bounds(body: dict[str, Any], rules: RunRules) -> None:
    if body["stage"] is not None and body["stage"] >= rules.num_stages:
        raise RecordRejected(f"stage {body['stage']} outside the run's {rules.num_stages}", reason="schema")
    span = body["span"]
    if span is not None and not 0 <= span[0] < span[1] <= rules.num_layers:
        raise RecordRejected(f"span {span} outside the run's {rules.num_layers} layers", reason="schema")


def heartbeat_admits(record: VerifiedRecord, rules: RunRules, sender: str) -> bool:
    """Whether a checked record of `rules`' run shows that `sender`, who stores it, paid the run's admission cost:
    it is `sender`'s own heartbeat (signed by it: a replayed heartbeat of an admitted peer shows nothing of its
    sender) and carries a valid proof for `sender` (`protocol.admission.pays_admission`: never in mode open; in
    mode allowlist the sender's listing is what counts)."""
    return (
        record.key.kind is KeyKind.PEERS
        and record.signer == sender
        and pays_admission(rules.admission, rules.run_id, sender, record.body.get("admission"))
    )


def _claims_admission(envelope: Mapping[str, Any], sender: str, runs: Mapping[str, RunRules]) -> bool:
    """`heartbeat_admits`'s test before the signature is checked: is the envelope a heartbeat of a run we know
    whose body holds a valid proof for `sender`? One hash; a Sybil without a proof costs no signature check."""
    try:
        parsed = keys.parse_key(envelope["k"])
    except ValueError:
        return False
    rules = runs.get(parsed.run_id) if parsed.run_id is not None else None
    if parsed.kind is not KeyKind.PEERS or rules is None:
        return False
    body = _unpack(envelope["b"], len(envelope["b"]))
    proof = body.get("admission") if isinstance(body, dict) else None
    return pays_admission(rules.admission, rules.run_id, sender, proof)


def _schema_for(kind: KeyKind, limits: RecordLimits) -> Mapping[str, Check]:
    if kind is KeyKind.PEERS:
        return HEARTBEAT_SCHEMA
    if kind is KeyKind.SYNCER:
        return SYNCER_SCHEMA
    if kind is KeyKind.BANS:
        return _ban_schema(limits)
    if kind is KeyKind.MEASURED:
        return MEASURED_SCHEMA
    return MANIFEST_SCHEMA


def check_envelope(
    envelope: Mapping[str, Any],
    *,
    key_id: bytes,
    subkey: str | None,
    expiration: float,
    now: float,
    runs: Mapping[str, RunRules],
    limits: RecordLimits,
) -> VerifiedRecord:
    """Check one record completely; raise RecordRejected (with a short `reason`) on the first failure."""
    if not isinstance(envelope, Mapping):
        raise RecordRejected("value is not a hivenode record envelope", reason="foreign")
    raw_key, body_bytes, signature = envelope.get("k"), envelope.get("b"), envelope.get("s")
    if not (isinstance(raw_key, str) and isinstance(body_bytes, bytes) and isinstance(signature, bytes)):
        raise RecordRejected("envelope fields have wrong types", reason="malformed")
    if len(signature) != SIGNATURE_SIZE:
        raise RecordRejected("signature has the wrong size", reason="malformed")
    try:
        parsed = keys.parse_key(raw_key)
    except ValueError as e:
        raise RecordRejected(str(e), reason="unknown key") from None
    if keys.key_id(raw_key) != key_id:
        raise RecordRejected("record is stored under another key than it names", reason="key mismatch")
    if not isinstance(expiration, float) or not math.isfinite(expiration):
        raise RecordRejected("expiration is not a finite float", reason="expiration")
    horizon = now + limits.max_ttl_s(parsed.kind) + limits.clock_skew_s
    if expiration > horizon:
        raise RecordRejected(
            f"expiration {expiration - now:.0f} s ahead is past the cap", reason="expiration"
        )
    rules = runs.get(parsed.run_id) if parsed.run_id is not None else None
    if parsed.kind not in (KeyKind.MANIFEST, KeyKind.DISCOVERY) and rules is None:
        raise RecordRejected(f"record of unknown run {raw_key[:8]}", reason="unknown run")
    optional = HEARTBEAT_OPTIONAL if parsed.kind is KeyKind.PEERS else frozenset()
    body = _check_schema(
        parsed.kind, _unpack(body_bytes, limits.max_value_bytes), _schema_for(parsed.kind, limits), optional
    )
    signer = _expected_signer(parsed, subkey, body, rules)
    if not verify_signature(
        signer, _record_signing_bytes(raw_key, subkey, body_bytes, expiration), signature
    ):
        raise RecordRejected(
            f"{parsed.kind.value} record not signed by {signer[-8:]}", reason="bad signature"
        )
    _check_written_at(parsed.kind, body, now, limits)
    return VerifiedRecord(parsed, subkey, signer, body, expiration)


def _check_written_at(kind: KeyKind, body: Mapping[str, Any], now: float, limits: RecordLimits) -> None:
    """A record its author dated in our future comes from a clock that is off: refuse it as "clock skew" (a reason
    nobody is struck for), or its short-lived record would outlive its author's intent by the skew. Checked after
    the signature, so the reason is only ever given for authentic records."""
    written_at = body.get("sent_at", body.get("issued_at"))
    if isinstance(written_at, float) and written_at > now + limits.clock_skew_s:
        raise RecordRejected(
            f"{kind.value} record written {written_at - now:+.0f} s ahead of our clock "
            f"(limit {limits.clock_skew_s:g} s)",
            reason="clock skew",
        )


def _manifest_record_kind(key_id: bytes, envelope: object) -> str | None:
    """The kind of place ("discovery" or "manifest") where a record under `key_id` keeps a run manifest, if any."""
    if key_id == keys.key_id(keys.discovery_key()):
        return "discovery"
    raw_key = envelope.get("k") if isinstance(envelope, dict) else None
    if not isinstance(raw_key, str):
        return None
    try:
        manifest_key = keys.parse_key(raw_key).kind is KeyKind.MANIFEST
    except ValueError:
        return None
    return "manifest" if manifest_key and keys.key_id(raw_key) == key_id else None


class HivenodeRecordValidator(RecordValidatorBase):  # type: ignore[misc]  # hivemind ships no types
    """hivemind validator for every hivenode record. Instances merge, so runs can be added after the DHT started
    (`dht.add_validators([HivenodeRecordValidator([rules])])`). Records that are not hivenode envelopes are
    rejected unless `allow_foreign` (for a DHT shared with other hivemind applications)."""

    def __init__(
        self,
        runs: Iterable[RunRules] = (),
        *,
        limits: RecordLimits | None = None,
        allow_foreign: bool = False,
    ) -> None:
        self._runs = {rules.run_id: rules for rules in runs}
        self._roles = frozenset().union(*(rules.roles() for rules in self._runs.values()))
        self._limits = limits or RecordLimits()
        self._allow_foreign = allow_foreign
        self.rejections: Counter[str] = Counter()
        # Why recent manifest and discovery records were refused: a joining node that finds no valid manifest
        # names the tampering from these instead of waiting out its join timeout (`manifest_rejections`).
        self.manifest_rejections: deque[str] = deque(maxlen=MAX_MANIFEST_REJECTIONS)

    def validate(self, record: DHTRecord) -> bool:
        envelope = None
        try:
            envelope = decode_envelope(record.value, self._limits)
            check_envelope(
                envelope,
                key_id=record.key,
                subkey=decode_subkey(record.subkey),
                expiration=record.expiration_time,
                now=get_dht_time(),
                runs=self._runs,
                limits=self._limits,
            )
        except RecordRejected as e:
            if e.reason == "foreign" and self._allow_foreign:
                return True
            self.rejections[e.reason] += 1
            logger.debug("rejected a DHT record: %s", e)
            where = _manifest_record_kind(record.key, envelope)
            if where is not None:
                self.manifest_rejections.append(f"{where} record: {str(e)[:300]}")
            return False
        except Exception:  # a bug in a check must not let the record through, nor kill the DHT handler
            self.rejections["error"] += 1
            logger.exception("record validation failed unexpectedly")
            return False
        return True

    @property
    def priority(self) -> int:
        return 5  # checks whole values; never transforms them

    def merge_with(self, other: RecordValidatorBase) -> bool:
        if not isinstance(other, HivenodeRecordValidator):
            return False
        self._runs.update(other._runs)
        self._roles = frozenset().union(*(rules.roles() for rules in self._runs.values()))
        self._allow_foreign = self._allow_foreign or other._allow_foreign
        return True

    def admits_store(self, sender: str, record: DHTRecord) -> bool:
        """Whether `record`, which `sender` asks us to store, is `sender`'s own valid heartbeat for a run we know
        carrying its admission proof (`heartbeat_admits`): the DHT store quota lets that store use the admitted
        share of its reserve (`QuotaConfig.admitted_records_total`). The record is checked in full (signature
        included), after a one-hash test of its proof. A replicated dictionary is never asked: it is a guest's."""
        try:
            if decode_subkey(record.subkey) != sender:
                return False
            envelope = decode_envelope(record.value, self._limits)
            if not isinstance(envelope.get("k"), str) or not isinstance(envelope.get("b"), bytes):
                return False
            if not _claims_admission(envelope, sender, self._runs):
                return False
            verified = check_envelope(
                envelope,
                key_id=record.key,
                subkey=sender,
                expiration=record.expiration_time,
                now=get_dht_time(),
                runs=self._runs,
                limits=self._limits,
            )
        except RecordRejected:
            return False
        rules = self._runs.get(verified.key.run_id or "")
        return rules is not None and heartbeat_admits(verified, rules, sender)

    def has_role(self, peer_id: str) -> bool:
        """Whether a run this validator knows names `peer_id` in its signed manifest (`RunRules.roles`): the DHT
        store quota's known peers (`QuotaDHTProtocol`)."""
        return peer_id in self._roles


# ---- typed records ----


@dataclass(frozen=True, kw_only=True, slots=True)
class Heartbeat:
    """What a peer announces about itself every heartbeat period (body of a `peers` record)."""

    role: str
    state: str = "idle"
    stage: int | None = None
    span: tuple[int, int] | None = None
    device: str = "cpu"
    throughput: float = 0.0  # tokens/s
    load: float = 0.0
    http: str = ""
    leaving: bool = False
    maddrs: tuple[str, ...] = ()
    inner_step: int = 0
    tokens: int = 0
    loss: float | None = None
    version: str = ""
    sent_at: float = 0.0
    mode: str = UNKNOWN_MODE  # one of CONNECTIVITY_MODES, or UNKNOWN_MODE (not sent: older nodes' validators
    # refuse keys they do not know, so a node that cannot say its mode keeps the old body)
    # the peer's admission proof (protocol.admission's nonce) once it has one; None: not sent
    admission: int | None = None

    def __post_init__(self) -> None:
        if self.mode != UNKNOWN_MODE and self.mode not in CONNECTIVITY_MODES:
            raise RecordRejected(
                f"heartbeat mode {self.mode!r} is not one of {CONNECTIVITY_MODES}", reason="schema"
            )
        if self.admission is not None and not HEARTBEAT_SCHEMA["admission"](self.admission):
            raise RecordRejected(f"heartbeat admission proof {self.admission!r} is no nonce", reason="schema")

    def to_body(self) -> dict[str, Any]:
        body = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        body["span"] = list(self.span) if self.span is not None else None
        body["maddrs"] = list(self.maddrs)
        for name in ("throughput", "load", "sent_at"):
            body[name] = float(body[name])
        body["loss"] = float(self.loss) if self.loss is not None else None
        if self.mode == UNKNOWN_MODE:
            del body["mode"]
        if self.admission is None:
            del body["admission"]
        return body

    @classmethod
    def from_body(cls, body: Mapping[str, Any]) -> Heartbeat:
        """The heartbeat of a checked body; a body without `mode` (an older node's) has mode `UNKNOWN_MODE`, one
        without `admission` no proof (None)."""
        values = dict(body)
        values["span"] = tuple(values["span"]) if values["span"] is not None else None
        values["maddrs"] = tuple(values["maddrs"])
        return cls(**values)


@dataclass(frozen=True, kw_only=True, slots=True)
class PeerRecord:
    peer_id: str
    heartbeat: Heartbeat
    expires_at: float

    def to_json(self) -> dict[str, Any]:
        # the mode always shows, "unknown" included, so views need not know which bodies may omit it
        body = {**self.heartbeat.to_body(), "mode": self.heartbeat.mode}
        return {"peer_id": self.peer_id, **body, "expires_at": self.expires_at}


@dataclass(frozen=True, kw_only=True, slots=True)
class SyncerState:
    """Body of a `syncer` record: the lease an authorized syncer holds and the fragment versions it serves."""

    lease_until: float
    term: int = 0
    versions: tuple[int, ...] = ()
    http: str = ""
    state: str = "active"
    sent_at: float = 0.0

    def to_body(self) -> dict[str, Any]:
        return {
            "lease_until": float(self.lease_until),
            "term": self.term,
            "versions": list(self.versions),
            "http": self.http,
            "state": self.state,
            "sent_at": float(self.sent_at),
        }


@dataclass(frozen=True, kw_only=True, slots=True)
class SyncerRecord:
    peer_id: str
    state: SyncerState
    expires_at: float

    def to_json(self) -> dict[str, Any]:
        return {"peer_id": self.peer_id, **self.state.to_body(), "expires_at": self.expires_at}


@dataclass(frozen=True, kw_only=True, slots=True)
class BanNotice:
    """Body of a `bans/<offender>` record written by one authorized verifier (or syncer, for a learner ban)."""

    offender: str
    reason: str
    evidence: bytes = b""
    stage: int | None = None
    issued_at: float = 0.0

    def to_body(self) -> dict[str, Any]:
        return {
            "offender": self.offender,
            "reason": self.reason,
            "evidence": self.evidence,
            "stage": self.stage,
            "issued_at": float(self.issued_at),
        }


@dataclass(frozen=True, kw_only=True, slots=True)
class BanRecord:
    verifier: str
    notice: BanNotice
    expires_at: float

    def to_json(self) -> dict[str, Any]:
        body = self.notice.to_body()
        body["evidence"] = body["evidence"].hex()
        return {"verifier": self.verifier, **body, "expires_at": self.expires_at}


@dataclass(frozen=True, kw_only=True, slots=True)
class MeasuredThroughputs:
    """Body of a `measured` record: the tokens/s one authorized verifier measured for each stage replica it drove
    (end to end: compute, network and queueing), which placement trusts over the replicas' own announcements."""

    rates: Mapping[str, float]
    sent_at: float = 0.0

    def to_body(self) -> dict[str, Any]:
        return {"rates": {p: float(r) for p, r in self.rates.items()}, "sent_at": float(self.sent_at)}


@dataclass(frozen=True, kw_only=True, slots=True)
class MeasuredRecord:
    verifier: str
    measured: MeasuredThroughputs
    expires_at: float

    def to_json(self) -> dict[str, Any]:
        return {"verifier": self.verifier, **self.measured.to_body(), "expires_at": self.expires_at}
