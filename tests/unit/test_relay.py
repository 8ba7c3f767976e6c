"""The pure parts of relaying (node.swarm.relay): the daemon's multiaddr encoding, p2pd's extra flags, and the
direct / relay / client decision with its reason."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hivemind.utils.multiaddr import Multiaddr

from node.config import DEFAULT_LISTEN, LOOPBACK_LISTEN, BootstrapConfig, NetworkConfig
from node.swarm.reachability import Reachability, circuit_addresses
from node.swarm.relay import (
    DaemonMaddr,
    Mode,
    daemon_maddr_bytes,
    decide_connectivity,
    is_circuit,
    relay_flags,
    relay_options,
    relays_of,
)
from protocol.identity import NodeIdentity

RELAY = NodeIdentity.generate().peer_id
PEER = NodeIdentity.generate().peer_id
CIRCUIT = f"/ip4/10.0.0.1/tcp/4001/p2p/{RELAY}/p2p-circuit/p2p/{PEER}"


def _multihash(peer_id: str) -> bytes:
    import base58

    return bytes(base58.b58decode(peer_id))


def test_hivemind_writes_a_cidv1_where_p2pd_reads_the_bare_multihash() -> None:
    """The bug: hivemind's bytes for /p2p/<id> carry the CIDv1 prefix 0x01 0x72, two bytes p2pd does not expect."""
    mh = _multihash(PEER)
    hivemind_bytes = Multiaddr(f"/p2p/{PEER}").to_bytes()
    assert hivemind_bytes.endswith(b"\x01\x72" + mh)  # negative control: what the daemon refuses
    ours = daemon_maddr_bytes(f"/p2p/{PEER}")
    assert ours == b"\xa5\x03" + bytes([len(mh)]) + mh  # code 421 as a varint, length, multihash


def test_the_daemon_encoding_of_a_circuit_keeps_every_other_component() -> None:
    raw = daemon_maddr_bytes(CIRCUIT)
    assert raw.startswith(Multiaddr("/ip4/10.0.0.1/tcp/4001").to_bytes())
    assert raw.count(_multihash(RELAY)) == 1 and raw.endswith(_multihash(PEER))
    assert b"\x01\x72" + _multihash(PEER) not in raw
    assert str(Multiaddr(raw)) == CIRCUIT  # still a multiaddr hivemind reads back to the same text


def test_daemon_maddr_prints_as_usual_and_encodes_for_the_daemon() -> None:
    addr = DaemonMaddr(CIRCUIT)
    assert str(addr) == CIRCUIT
    assert addr.to_bytes() == bytes(addr) == daemon_maddr_bytes(CIRCUIT)
    plain = "/ip4/127.0.0.1/tcp/5"
    assert DaemonMaddr(plain).to_bytes() == Multiaddr(plain).to_bytes()  # nothing to fix without /p2p/


def test_relay_flags_turn_relaying_off_through_a_json_config_and_reserve_at_once(tmp_path: Path) -> None:
    assert relay_flags(relay=True, reserve=False) == {}
    assert relay_flags(relay=True, reserve=True) == {"relayDiscovery": False}
    path = tmp_path / "p2pd.json"
    assert relay_flags(relay=False, reserve=False, config_path=path) == {"relay": False, "f": str(path)}
    with pytest.raises(ValueError):
        relay_flags(relay=False, reserve=False)
    options = relay_options(["/ip4/1.2.3.4/tcp/1/p2p/" + RELAY], relay=False, relayed=True, config_path=path)
    assert (
        options["use_relay"] is False and options["use_auto_relay"] is False
    )  # no relay: nothing to reserve
    assert json.loads(path.read_text()) == {"Relay": {"Enabled": False}}
    options = relay_options(["/ip4/1.2.3.4/tcp/1/p2p/" + RELAY], relay=True, relayed=True)
    assert options["use_auto_relay"] and options["force_reachability"] == "private"
    assert options["trusted_relays"] == ["/ip4/1.2.3.4/tcp/1/p2p/" + RELAY]
    assert (
        relay_options([], relay=True, relayed=True)["use_auto_relay"] is False
    )  # no bootstrap to reserve on


def test_circuits_and_their_relays() -> None:
    entries = [f"/ip4/10.0.0.1/tcp/4001/p2p/{RELAY}", "/ip4/10.0.0.2/tcp/4001", CIRCUIT]
    assert circuit_addresses(entries, PEER) == [f"/ip4/10.0.0.1/tcp/4001/p2p/{RELAY}/p2p-circuit/p2p/{PEER}"]
    assert relays_of([CIRCUIT, CIRCUIT]) == (RELAY,)
    assert is_circuit(CIRCUIT) and not is_circuit("/ip4/1.2.3.4/tcp/1")


@pytest.mark.parametrize(
    ("kwargs", "mode", "words"),
    [
        ({"reachable": True, "checked": True}, Mode.DIRECT, "dialed us back"),
        ({"reachable": None, "checked": True}, Mode.DIRECT, "no bootstrap could check"),
        ({"reachable": None, "checked": False}, Mode.DIRECT, "not checked"),
        (
            {"reachable": False, "checked": True, "circuits": (CIRCUIT,), "relay_tried": True},
            Mode.RELAY,
            "using relay",
        ),
        ({"reachable": False, "checked": True, "relay_tried": True}, Mode.CLIENT, "no relay granted"),
        ({"reachable": False, "checked": True, "relay_tried": False}, Mode.CLIENT, "relays are off"),
        ({"reachable": True, "checked": True, "client_mode_asked": True}, Mode.CLIENT, "was asked for"),
    ],
)
def test_the_mode_and_its_reason(kwargs: dict[str, object], mode: Mode, words: str) -> None:
    args: dict[str, object] = {
        "dialed": ("/ip4/1.2.3.4/tcp/9",),
        "circuits": (),
        "relay_tried": False,
        **kwargs,
    }
    connectivity = decide_connectivity(**args)  # type: ignore[arg-type]
    assert connectivity.mode is mode and words in connectivity.reason, connectivity
    as_dict = connectivity.as_dict()
    assert as_dict["mode"] == mode.value and as_dict["reason"] == connectivity.reason
    if mode is Mode.RELAY:
        assert as_dict["addresses"] == [CIRCUIT] and as_dict["relays"] == [RELAY]
        assert RELAY[-8:] in connectivity.reason
    if mode is Mode.CLIENT and not kwargs.get("client_mode_asked"):
        assert "1.2.3.4" in connectivity.reason  # which of our addresses the bootstrap could not dial


def test_the_advice_no_longer_claims_client_mode() -> None:
    """A relayed node used to log "running in client mode"; the mode line says which mode it is in."""
    advice = Reachability(False, ("/ip4/10.1.0.2/tcp/31338",), observed=("/ip4/5.6.7.8/tcp/1",)).advice(())
    assert "client mode" not in advice
    assert "--listen /ip4/0.0.0.0/tcp/31338 --announce /ip4/5.6.7.8/tcp/31338" in advice


def test_public_defaults() -> None:
    assert DEFAULT_LISTEN == "/ip4/0.0.0.0/tcp/0" and LOOPBACK_LISTEN == "/ip4/127.0.0.1/tcp/0"
    network = NetworkConfig()
    assert network.listen == (DEFAULT_LISTEN,) and network.use_auto_relay and network.use_relay
    assert BootstrapConfig().relay and BootstrapConfig().listen == (DEFAULT_LISTEN,)
    with pytest.raises(ValueError, match="relay_wait_s"):
        NetworkConfig(relay_wait_s=0)


def test_node_status_shows_the_latest_connectivity_from_the_event_log(tmp_path: Path) -> None:
    from node.status.command import last_connectivity, render_connectivity

    assert "unknown" in render_connectivity(last_connectivity(tmp_path))  # never joined: no event log
    lines = [
        {"t": 1, "event": "connectivity", "mode": "direct", "reason": "a bootstrap dialed us back"},
        {"t": 2, "event": "joined"},
        {
            "t": 3,
            "event": "connectivity",
            "mode": "relay",
            "reason": "not reachable, using relay",
            "relays": [RELAY],
        },
    ]
    (tmp_path / "events.jsonl").write_text("\n".join(map(json.dumps, lines)) + "\nnot json\n")
    line = render_connectivity(last_connectivity(tmp_path))
    assert line == f"connectivity: relay (not reachable, using relay); relays: {RELAY}"


def test_no_relay_turns_the_bootstraps_relay_off(tmp_path: Path) -> None:
    from bootstrap.server import _network
    from node.config import load_bootstrap_config

    on = load_bootstrap_config(["--state-dir", str(tmp_path)], environ={})
    off = load_bootstrap_config(["--state-dir", str(tmp_path), "--no-relay"], environ={})
    assert on.relay and not off.relay
    assert _network(on).use_relay and not _network(off).use_relay
