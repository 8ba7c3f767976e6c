"""Relays: the bootstrap relays for nodes others cannot dial, and a node says how it is connected.

Three pure parts and one patch:

* `daemon_maddr_bytes` / `DaemonMaddr`: hivemind's multiaddr codec writes a `/p2p/<peer id>` component as a CIDv1
  (`0x01 0x72 <multihash>`), while p2pd (go-multiaddr) reads the bare multihash; every `connect` that hands the
  daemon an address with a `/p2p/` part (every relay circuit `/p2p/<relay>/p2p-circuit/p2p/<peer>`) fails with
  "length greater than remaining number of bytes in buffer". `DaemonMaddr` is a `Multiaddr` whose bytes are the
  daemon's encoding; pass it wherever an address goes to `p2p._client.connect`.
* `relay_flags` / `relay_options`: what p2pd needs that hivemind's `P2P.create` cannot pass (a JSON config that
  really turns relaying off, `-relayDiscovery=0`), added to the daemon's command line by `install_daemon_flags`
  inside the DHT process.
* `decide_connectivity`: direct / relay / client, with the reason, from what the reach check and the relay wait saw.
"""

from __future__ import annotations

import io
import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Any

from hivemind.utils.multiaddr import Multiaddr
from hivemind.utils.multiaddr.transforms import bytes_iter

_P2P_CODE = 0x01A5  # the multiaddr protocol code of /p2p/ (alias /ipfs/)
_CIDV1_LIBP2P_KEY = b"\x01\x72"  # CID version 1, multicodec libp2p-key: what hivemind's codec prepends
CIRCUIT = "p2p-circuit"


def _uvarint(value: int) -> bytes:
    """Unsigned LEB128, the multiformats varint."""
    out = bytearray()
    while True:
        byte, value = value & 0x7F, value >> 7
        out.append(byte | (0x80 if value else 0))
        if not value:
            return bytes(out)


def daemon_maddr_bytes(maddr: str | Multiaddr) -> bytes:
    """The binary multiaddr p2pd reads: hivemind's encoding with each /p2p/ value as the bare peer-id multihash."""
    raw = Multiaddr(maddr).to_bytes() if isinstance(maddr, str) else Multiaddr.to_bytes(maddr)
    out = io.BytesIO()
    for offset, proto, _codec, part in bytes_iter(raw):
        if proto.code != _P2P_CODE:
            out.write(_component(raw, offset))
            continue
        multihash = part[len(_CIDV1_LIBP2P_KEY) :] if part.startswith(_CIDV1_LIBP2P_KEY) else part
        out.write(_uvarint(_P2P_CODE) + _uvarint(len(multihash)) + multihash)
    return out.getvalue()


def _component(raw: bytes, offset: int) -> bytes:
    """The bytes of the one component of `raw` that starts at `offset` (code, length prefix and value)."""
    rest = raw[offset:]
    for index, (next_offset, *_rest) in enumerate(bytes_iter(rest)):
        if index == 1:
            return rest[:next_offset]
    return rest


class DaemonMaddr(Multiaddr):
    """A `Multiaddr` that gives p2pd the encoding it reads (see `daemon_maddr_bytes`); prints as usual."""

    def to_bytes(self) -> bytes:
        return daemon_maddr_bytes(Multiaddr(super().to_bytes()))

    __bytes__ = to_bytes


def is_circuit(maddr: str) -> bool:
    return f"/{CIRCUIT}" in maddr


NO_RELAY_CONFIG = {
    "Relay": {"Enabled": False}
}  # p2pd's JSON config (-f): the only switch that turns relaying off


def relay_flags(*, relay: bool, reserve: bool, config_path: Path | None = None) -> dict[str, bool | str]:
    """p2pd flags hivemind cannot pass.

    `relay=False`: no circuit relay at all (we neither relay for others nor dial through relays). hivemind's
    `use_relay=False` gives p2pd `-relay=0`, which p2pd ignores: its built-in config has relaying on, the flag can
    only switch it on, and with it on p2pd always serves as a relay v2 hop (measured: a node reserved a slot and
    was reached through a `-relay=0 -relayService=0` daemon). Only a JSON config (`-f`, written at `config_path`
    by `write_no_relay_config`) with Relay.Enabled=false turns it off. `reserve`: reserve a slot on the static
    relays (the bootstraps) at once: without `-relayDiscovery=0` p2pd looks for relays in the background and
    reserved nothing within 20 s in our trials; with it the first probe through the relay succeeds (~0.5 s, most
    of it the probe's own daemon start)."""
    flags: dict[str, bool | str] = {}
    if not relay:
        if config_path is None:
            raise ValueError("turning the relay off needs a path for p2pd's JSON config")
        flags.update(relay=False, f=str(config_path))
    if reserve:
        flags["relayDiscovery"] = False
    return flags


def write_no_relay_config(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(NO_RELAY_CONFIG))
    return path


def relay_options(
    initial_peers: Sequence[str], *, relay: bool, relayed: bool, config_path: Path | None = None
) -> dict[str, Any]:
    """`DetachedDHT` keyword arguments for relaying: `relay=False` turns circuit relays off (a bootstrap's
    `--no-relay`); `relayed` reserves a slot on the `initial_peers` at once (p2pd needs them named as static
    relays, and would otherwise wait for AutoNAT to call us private; we ask only after a reach check found that
    nobody can dial us)."""
    relayed = relay and relayed and bool(initial_peers)
    if not relay and config_path is not None:
        write_no_relay_config(config_path)
    options: dict[str, Any] = {
        "use_relay": relay,
        "use_auto_relay": relayed,
        "daemon_flags": relay_flags(relay=relay, reserve=relayed, config_path=config_path),
    }
    if relayed:
        options.update(trusted_relays=list(initial_peers), force_reachability="private")
    return options


def install_daemon_flags(flags: Mapping[str, bool | str]) -> None:
    """Append `flags` to every p2pd command line this process starts (call it only in the DHT's own process:
    hivemind's `P2P.create` builds the command line with `_make_process_args` and has no place for them)."""
    from hivemind.p2p import P2P

    original: Callable[..., list[str]] = P2P.__dict__["_make_process_args"].__func__

    def with_flags(*args: Any, **kwargs: Any) -> list[str]:
        return original(*args, **{**kwargs, **flags})

    P2P._make_process_args = staticmethod(with_flags)


class Mode(str, Enum):
    DIRECT = "direct"  # others dial us at our own addresses; we serve
    RELAY = "relay"  # others reach us through a relay's circuit; we serve, more slowly
    CLIENT = "client"  # nobody can reach us: we train and push, but serve nothing


@dataclass(frozen=True, slots=True)
class Connectivity:
    """How others reach this node, and why: shown in the log, on /api/status and in `node status`."""

    mode: Mode
    reason: str
    addresses: tuple[str, ...] = ()  # what others dial: our own addresses, or the relay circuits
    relays: tuple[str, ...] = ()  # peer ids of the relays holding our reservation

    def as_dict(self) -> dict[str, Any]:
        return {
            "mode": self.mode.value,
            "reason": self.reason,
            "addresses": list(self.addresses),
            "relays": list(self.relays),
        }


def relays_of(circuits: Sequence[str]) -> tuple[str, ...]:
    """The relay peer ids in circuit addresses `/.../p2p/<relay>/p2p-circuit[/p2p/<us>]`."""
    found = []
    for maddr in circuits:
        head = maddr.split(f"/{CIRCUIT}", 1)[0]
        if "/p2p/" in head:
            found.append(head.rsplit("/p2p/", 1)[1])
    return tuple(dict.fromkeys(found))


def decide_connectivity(
    *,
    reachable: bool | None,
    checked: bool,
    dialed: Sequence[str],
    circuits: Sequence[str],
    relay_tried: bool,
    client_mode_asked: bool = False,
    unchecked_because: str = "every peer is on this machine's loopback",
) -> Connectivity:
    """Direct, relay or client, with the reason in words a volunteer can act on.

    `reachable`: the reach check's answer (None: nobody could tell); `checked`: whether a check ran at all;
    `dialed`: our addresses it tried (or announce); `circuits`: relay circuit addresses we hold after asking for a
    reservation; `relay_tried`: whether we asked (we do only when unreachable and relays are allowed).
    """
    tried = ", ".join(dialed) or "none"
    if client_mode_asked:
        return Connectivity(Mode.CLIENT, "client mode was asked for (network.client_mode)")
    if not checked:
        return Connectivity(Mode.DIRECT, f"not checked: {unchecked_because}", tuple(dialed))
    if reachable is None:
        return Connectivity(
            Mode.DIRECT, "no bootstrap could check our addresses; serving as announced", tuple(dialed)
        )
    if reachable:
        return Connectivity(Mode.DIRECT, f"a bootstrap dialed us back at {tried}", tuple(dialed))
    if circuits:
        relays = relays_of(circuits)
        return Connectivity(
            Mode.RELAY,
            f"not reachable, using relay: the bootstrap could not dial {tried}; peers reach us through "
            f"{', '.join(r[-8:] for r in relays)}",
            tuple(circuits),
            relays,
        )
    why = (
        "no relay granted a reservation"
        if relay_tried
        else "relays are off (network.use_auto_relay or use_relay = false)"
    )
    return Connectivity(
        Mode.CLIENT,
        f"not reachable and {why}: the bootstrap could not dial {tried}; training and pushing, serving nothing",
    )
