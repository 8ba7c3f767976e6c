"""Reachability and recovery with real `python -m bootstrap` / `python -m node` processes on loopback.

- A node that announces an address nobody can dial (a closed port) is dialed back by the bootstrap at start,
  learns it is unreachable, says in one line what to open or set, reserves a slot on the bootstrap's relay and
  runs in relay mode (reached through the bootstrap's circuit), heartbeating into the swarm. Control: a node
  announcing the port it really listens on is found reachable (direct) and says nothing. Counted: one reach check
  per node at the bootstrap, with its result. With `--no-relay` on the bootstrap the same node runs in client
  mode and says why (the relay case of issue 19 item 3; the namespaced version is test_relay_netns.py).
- Both the bootstrap and two nodes sit behind WAN proxies (tools/wan_proxy.py) and announce them; the
  proxies partition everything, then heal. The node with our re-dialer notices it lost its bootstrap, re-dials the
  bootstrap with exponential backoff (each failed attempt logged), and is back in the swarm soon after the heal.
  Negative control: the node whose peer check never runs (hivemind alone) is still out of the swarm well after the
  heal, because hivemind never re-contacts its initial peers by itself.
"""

from __future__ import annotations

import json
import logging
import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.integration.procs import Bootstrap, Procs, free_port, get_json, procs, wait_until
from tools.wan_proxy import LinkProfile, ProxyThread

logger = logging.getLogger(__name__)
pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]

ADVICE = re.compile(r"peers cannot dial this node directly .* --announce /ip4/127\.0\.0\.1/tcp/(\d+)")
HEARTBEAT_PERIOD_S = 2.0  # the built-in default run
PARTITION_S = 8.0  # long enough for every peer to be dropped and a few re-dials to fail
RECOVERY_S = 30.0  # after the heal, the re-dialing node is back within this


def _events(state_dir: Path) -> list[dict[str, Any]]:
    path = state_dir / "events.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _event(state_dir: Path, name: str) -> dict[str, Any] | None:
    return next((e for e in _events(state_dir) if e["event"] == name), None)


def _peers(bootstrap: Bootstrap) -> dict[str, dict[str, Any]]:
    return {p["peer_id"]: p for p in bootstrap.swarm()["peers"]}


def _peer_id(group: Procs, node: Any) -> str:
    return get_json(node.status_url)["peer_id"]


@pytest.fixture
def group(tmp_path: Path) -> Iterator[Procs]:
    with procs(tmp_path) as started:
        yield started


def test_an_unreachable_node_is_relayed_by_the_bootstrap_and_says_what_to_open(group: Procs) -> None:
    bootstrap = group.start_bootstrap()
    dead_port = free_port()  # nothing listens here: whoever dials it is refused
    live_port = free_port()
    unreachable = group.start_node(
        "--join",
        bootstrap.maddr,
        "--role",
        "learner",
        "--announce",
        f"/ip4/127.0.0.1/tcp/{dead_port}",
        state="unreachable",
    )
    reachable = group.start_node(
        "--join",
        bootstrap.maddr,
        "--role",
        "learner",
        "--listen",
        f"/ip4/127.0.0.1/tcp/{live_port}",
        "--announce",
        f"/ip4/127.0.0.1/tcp/{live_port}",
        state="reachable",
    )
    root = group.root
    bad = wait_until(lambda: _event(root / "unreachable", "reachability"), 30, what="the reachability event")
    good = wait_until(lambda: _event(root / "reachable", "reachability"), 30, what="the control's event")

    # The unreachable node: one line of advice naming the port to open and the flag to set, then relay mode.
    advice = [line for line in unreachable.stderr().splitlines() if "peers cannot dial this node" in line]
    assert len(advice) == 1, advice
    match = ADVICE.search(advice[0])
    assert match and int(match.group(1)) == dead_port, advice[0]
    assert bad["reachable"] is False and bad["client_mode"] is False
    assert bad["checked"] == [f"/ip4/127.0.0.1/tcp/{dead_port}"] and bad["dialable"] == []
    unreachable_id = _peer_id(group, unreachable)
    mode = _event(root / "unreachable", "connectivity")
    assert mode is not None and mode["mode"] == "relay" and "using relay" in mode["reason"], mode
    assert mode["addresses"] == [f"{bootstrap.maddr}/p2p-circuit/p2p/{unreachable_id}"]
    status = get_json(unreachable.status_url)["connectivity"]
    assert status["mode"] == "relay" and status["relays"] == [bootstrap.maddr.rsplit("/p2p/", 1)[1]]
    assert "client mode" not in unreachable.stderr()  # the old, misleading line for a relayed node
    # ... and it takes part: its heartbeats, announcing the circuit, reach the swarm.
    listed = wait_until(
        lambda: _peers(bootstrap).get(unreachable_id), 20, what="the relayed node in the swarm"
    )
    assert listed["maddrs"] == mode["addresses"], listed
    assert listed["mode"] == "relay", listed  # the swarm view tells a relayed peer from a direct one

    # Control: announcing the port it listens on, a node is reachable, and nobody is told to open anything.
    assert good["reachable"] is True and good["client_mode"] is False
    assert good["dialable"] == [f"/ip4/127.0.0.1/tcp/{live_port}"]
    assert "peers cannot dial this node" not in reachable.stderr()
    direct = _event(root / "reachable", "connectivity")
    assert direct is not None and direct["mode"] == "direct" and "dialed us back" in direct["reason"], direct
    reachable_id = _peer_id(group, reachable)
    control = wait_until(lambda: _peers(bootstrap).get(reachable_id), 20, what="the control in the swarm")
    assert control["mode"] == "direct", control

    # Counted at the bootstrap: exactly one check per node, with the result each node acted on.
    checks = re.findall(r"reach check for (\S+): (\d) of (\d) address", bootstrap.stderr())
    by_peer = {peer: (int(ok), int(total)) for peer, ok, total in checks}
    assert len(checks) == 2, checks
    assert by_peer[unreachable_id[-8:]] == (0, 1)
    assert by_peer[reachable_id[-8:]] == (1, 1)


def test_without_a_relay_an_unreachable_node_runs_in_client_mode_and_says_why(group: Procs) -> None:
    """Negative control of the relay above: `--no-relay` on the bootstrap, nothing else changes."""
    bootstrap = group.start_bootstrap("--no-relay")
    bootstrap.wait_line(r"^relay: off", 5)
    dead_port = free_port()
    node = group.start_node(
        "--join",
        bootstrap.maddr,
        "--role",
        "learner",
        "--announce",
        f"/ip4/127.0.0.1/tcp/{dead_port}",
        state="client",
    )
    mode = wait_until(
        lambda: _event(group.root / "client", "connectivity"), 30, what="the connectivity event"
    )
    assert mode["mode"] == "client" and "no relay granted a reservation" in mode["reason"], mode
    assert _event(group.root / "client", "reachability")["client_mode"] is True  # type: ignore[index]
    assert get_json(node.status_url)["connectivity"]["mode"] == "client"
    node_id = _peer_id(group, node)
    listed = wait_until(lambda: _peers(bootstrap).get(node_id), 20, what="the client-mode node in the swarm")
    assert listed["mode"] == "client", listed


def _write_config(path: Path, *, peer_check_period_s: float) -> Path:
    path.write_text(
        f"[network]\npeer_check_period_s = {peer_check_period_s}\nredial_min_s = 0.5\nredial_max_s = 4.0\n"
    )
    return path


def test_a_partitioned_node_redials_the_bootstrap_with_backoff_and_recovers(
    group: Procs, tmp_path: Path
) -> None:
    ports = {name: free_port() for name in ("bootstrap", "redialer", "control")}
    proxies = {
        name: ProxyThread(
            target_host="127.0.0.1", target_port=port, profile=LinkProfile(delay_s=0.005, seed=i)
        )
        for i, (name, port) in enumerate(ports.items())
    }
    try:
        for proxy in proxies.values():
            proxy.start()
        announce = {name: f"/ip4/127.0.0.1/tcp/{proxy.port}" for name, proxy in proxies.items()}
        bootstrap = group.start_bootstrap(
            "--listen", f"/ip4/127.0.0.1/tcp/{ports['bootstrap']}", "--announce", announce["bootstrap"]
        )
        assert f"/tcp/{proxies['bootstrap'].port}/" in bootstrap.maddr  # everyone dials it through its proxy
        nodes = {}
        for name, period_s in (("redialer", 0.5), ("control", 3600.0)):
            config = _write_config(tmp_path / f"{name}.toml", peer_check_period_s=period_s)
            nodes[name] = group.start_node(
                "--join",
                bootstrap.maddr,
                "--role",
                "stage",
                "--stage",
                "0",
                "--config",
                str(config),
                "--listen",
                f"/ip4/127.0.0.1/tcp/{ports[name]}",
                "--announce",
                announce[name],
                state=name,
            )
        ids = {name: _peer_id(group, node) for name, node in nodes.items()}
        wait_until(lambda: set(ids.values()) <= set(_peers(bootstrap)), 30, what="both nodes in the swarm")

        for proxy in proxies.values():
            proxy.partition(True)
        partitioned_at = time.monotonic()
        redialer = nodes["redialer"]
        wait_until(
            lambda: re.search(r"lost every (peer|bootstrap)", redialer.stderr()),
            30,
            what="the node to notice",
        )
        wait_until(
            lambda: len(re.findall(r"re-dial attempt \d+", redialer.stderr())) >= 2,
            30,
            what="two failed re-dials during the partition",
        )
        time.sleep(max(0.0, PARTITION_S - (time.monotonic() - partitioned_at)))  # hold the partition
        cut = {name: proxy.stats.partition_drops for name, proxy in proxies.items()}
        for proxy in proxies.values():
            proxy.partition(False)
        healed_at = time.monotonic()
        healed_dht_time = time.time()

        wait_until(lambda: "reconnected to the swarm" in redialer.stderr(), RECOVERY_S, what="the re-dial")
        fresh = lambda name: _peers(bootstrap).get(ids[name], {}).get("sent_at", 0.0) > healed_dht_time  # noqa: E731
        wait_until(lambda: fresh("redialer"), RECOVERY_S, what="a heartbeat from after the heal")
        recovered_s = time.monotonic() - healed_at

        # Negative control: without re-dialing, hivemind alone does not come back (given as long again).
        time.sleep(max(0.0, recovered_s + 2 * HEARTBEAT_PERIOD_S - (time.monotonic() - healed_at)))
        assert not fresh("control"), "the control rejoined without re-dialing: the test proves nothing"
        assert not re.search(r"lost every (peer|bootstrap)", nodes["control"].stderr())

        # Counted: the partition cut or refused traffic on the links; the re-dialer's attempts back off.
        assert all(count >= 1 for count in cut.values()), cut
        delays = [
            float(d) for d in re.findall(r"re-dial attempt \d+: .* next in ([\d.]+) s", redialer.stderr())
        ]
        # Exponential: 0.5 -> 1 -> 2 -> 4 s, then held at the 4 s ceiling (each with up to 10 % jitter).
        assert len(delays) >= 2 and all(
            b >= 1.5 * a for a, b in zip(delays[:3], delays[1:3], strict=False)
        ), delays
        assert all(0.5 <= d <= 4.0 * 1.1 for d in delays), delays
        lost = [
            e for e in _events(group.root / "redialer") if e["event"] in ("peers_lost", "peers_recovered")
        ]
        assert [e["event"] for e in lost] == ["peers_lost", "peers_recovered"]
        logger.warning(
            "partition %.1f s: re-dial delays %s; re-dialing node back %.1f s after the heal; proxy drops %s",
            healed_at - partitioned_at,
            delays,
            recovered_s,
            cut,
        )
    finally:
        for proxy in proxies.values():
            proxy.stop()
