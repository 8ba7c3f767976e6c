"""The only module that builds and parses DHT keys.

Every key of a run is prefixed by its `run_id` (`<run_id>/<kind>[/<arg>]`); one well-known key outside any run
(`DISCOVERY_KEY`) is where bootstraps publish signed manifests, so a node that only has a multiaddr can find the
run. The DHT itself only ever sees a hash of the key (`key_id`), so every record value also carries its raw key
and the validator checks that the two agree (see `protocol.records`).

| kind      | key                          | subkey              | written by                     |
|-----------|------------------------------|---------------------|--------------------------------|
| manifest  | `<run_id>/manifest`          | none                | the run owner                  |
| peers     | `<run_id>/peers`             | peer id             | that peer (heartbeat)          |
| syncer    | `<run_id>/syncer`            | syncer peer id      | an authorized syncer           |
| bans      | `<run_id>/bans/<offender>`   | verifier peer id    | an authorized verifier         |
| measured  | `<run_id>/measured`          | verifier peer id    | an authorized verifier         |
| discovery | `hivenode/runs`              | owner peer id       | the run owner (via bootstraps) |
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from enum import Enum

from hivemind.dht.routing import DHTID

from protocol.errors import IdentityError
from protocol.identity import public_key_from_peer_id

SEPARATOR = "/"
DISCOVERY_KEY = "hivenode/runs"
RUN_ID_HEX_CHARS = 40
_RUN_ID_RE = re.compile(rf"^[0-9a-f]{{{RUN_ID_HEX_CHARS}}}$")
MAX_RAW_KEY_CHARS = 256


class KeyKind(str, Enum):
    MANIFEST = "manifest"
    PEERS = "peers"
    SYNCER = "syncer"
    BANS = "bans"
    MEASURED = "measured"  # the stage replicas' throughputs one verifier measured end to end
    DISCOVERY = "discovery"


@dataclass(frozen=True, slots=True)
class ParsedKey:
    """A raw key split into its parts; `run_id` is None only for the discovery key."""

    kind: KeyKind
    run_id: str | None
    offender: str | None = None  # bans only


def is_run_id(text: str) -> bool:
    return bool(_RUN_ID_RE.match(text))


def is_peer_id(text: str) -> bool:
    """True for an Ed25519 libp2p peer id (`12D3KooW...`); other key types cannot sign our records."""
    try:
        public_key_from_peer_id(text)
    except IdentityError:
        return False
    return True


def _run_key(run_id: str, *parts: str) -> str:
    if not is_run_id(run_id):
        raise ValueError(f"not a run id: {run_id!r}")
    return SEPARATOR.join((run_id, *parts))


def manifest_key(run_id: str) -> str:
    return _run_key(run_id, KeyKind.MANIFEST.value)


def peers_key(run_id: str) -> str:
    return _run_key(run_id, KeyKind.PEERS.value)


def syncer_key(run_id: str) -> str:
    return _run_key(run_id, KeyKind.SYNCER.value)


def measured_key(run_id: str) -> str:
    return _run_key(run_id, KeyKind.MEASURED.value)


def bans_key(run_id: str, offender: str) -> str:
    if not is_peer_id(offender):
        raise ValueError(f"not an Ed25519 peer id: {offender[:24]!r}")
    return _run_key(run_id, KeyKind.BANS.value, offender)


def discovery_key() -> str:
    return DISCOVERY_KEY


def parse_key(raw: str) -> ParsedKey:
    """Split a raw key; raise ValueError for anything this module would not have built."""
    if len(raw) > MAX_RAW_KEY_CHARS:
        raise ValueError("key too long")
    if raw == DISCOVERY_KEY:
        return ParsedKey(KeyKind.DISCOVERY, None)
    parts = raw.split(SEPARATOR)
    if not is_run_id(parts[0]):
        raise ValueError(f"key {raw[:64]!r} does not start with a run id")
    run_id, rest = parts[0], parts[1:]
    simple = {KeyKind.MANIFEST.value: KeyKind.MANIFEST, KeyKind.PEERS.value: KeyKind.PEERS}
    simple[KeyKind.SYNCER.value] = KeyKind.SYNCER
    simple[KeyKind.MEASURED.value] = KeyKind.MEASURED
    if len(rest) == 1 and rest[0] in simple:
        return ParsedKey(simple[rest[0]], run_id)
    if len(rest) == 2 and rest[0] == KeyKind.BANS.value and is_peer_id(rest[1]):
        return ParsedKey(KeyKind.BANS, run_id, offender=rest[1])
    raise ValueError(f"unknown key {raw[:64]!r} under run {run_id[:8]}")


def key_id(raw: str) -> bytes:
    """The bytes the DHT stores and routes by for `raw` (what a validator sees as `DHTRecord.key`)."""
    routed: bytes = DHTID.generate(source=raw).to_bytes()
    return routed
