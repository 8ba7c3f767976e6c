"""Joining and leaving with real processes on loopback: a bootstrap and three nodes; SIGKILL and SIGTERM; a plain
hivemind-dht peer as the entry point; a stable bootstrap multiaddr across restarts."""

from __future__ import annotations

import logging
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.integration.procs import Bootstrap, Node, Procs, free_port, get_text, procs, wait_until
from tools.proctree import cmdline, is_alive

logger = logging.getLogger(__name__)
pytestmark = [pytest.mark.integration, pytest.mark.timeout(150)]

HEARTBEAT_PERIOD_S = 2.0  # the built-in default run
OBSERVE_SLACK_S = 1.0  # the bootstrap answers /api/swarm from a snapshot up to 0.5 s old, plus DHT get time


def alive(pids: set[int]) -> set[int]:
    """Those of `pids` still running (a zombie has exited; it only waits to be reaped)."""
    return {pid for pid in pids if is_alive(pid)}


def describe(pids: set[int]) -> str:
    return ", ".join(f"{pid}:{cmdline(pid, 40)}" for pid in sorted(pids))


def roles_of(bootstrap: Bootstrap) -> dict[str, dict]:
    return {p["peer_id"]: p for p in bootstrap.swarm()["peers"]}


@pytest.fixture(scope="module")
def swarm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Procs, Bootstrap, list[Node]]]:
    with procs(tmp_path_factory.mktemp("join")) as group:
        bootstrap = group.start_bootstrap()
        joins = [("--join", bootstrap.http_url), ("--join", bootstrap.maddr), ("--join", bootstrap.maddr)]
        nodes = [
            group.start_node(*join, wait=False) for join in joins
        ]  # started together, as volunteers would
        for node in nodes:
            group.wait_node(node)
        yield group, bootstrap, nodes


def test_three_nodes_join_and_the_bootstrap_lists_them_with_roles(swarm) -> None:
    group, bootstrap, nodes = swarm
    ids = {
        node.status()["peer_id"] for node in nodes
    }  # one joined via the bootstrap's URL, two via its multiaddr
    assert len(ids) == 3

    def all_listed() -> dict[str, dict]:
        listed = roles_of(bootstrap)
        return listed if ids <= set(listed) else {}

    listed = wait_until(all_listed, 30, what="3 nodes listed")
    since_launch_s = time.monotonic() - min(node.started_at for node in nodes)
    print(f"\nthree nodes listed by the bootstrap {since_launch_s:.1f} s after their processes were launched")
    assert since_launch_s < 30.0
    for peer_id in ids:
        entry = listed[peer_id]
        assert (entry["role"], entry["stage"]) == ("learner", None)  # the learner role trains on its own
        assert entry["http"] and entry["maddrs"] and entry["version"]
    assert listed[bootstrap.swarm()["peers"][0]["peer_id"]]  # the bootstrap lists itself too
    document = bootstrap.swarm()
    assert {"run_id", "peers", "bans", "syncer", "bootstrap_maddrs", "events", "history"} <= set(document)
    assert document["bootstrap_maddrs"] == [bootstrap.maddr]


def test_node_status_and_metrics_endpoints(swarm) -> None:
    _, bootstrap, nodes = swarm
    status = nodes[0].status()
    for key in ("peer_id", "role", "run_id", "stage", "state", "inner_step", "tokens", "loss"):
        assert key in status
    assert status["run_id"] == bootstrap.swarm()["run_id"]
    assert status["role"] == "learner" and "not built" not in str(status.get("note", ""))
    metrics = get_text(nodes[0].status_url.replace("/api/status", "/metrics"))
    assert "hivenode_heartbeats_total" in metrics
    assert "hivenode_swarm_peers" in get_text(bootstrap.http_url + "/metrics")
    assert "hivenode" in get_text(bootstrap.http_url + "/")
    assert get_text(bootstrap.http_url + "/api/status").startswith("{")


def test_sigkilled_node_disappears_within_two_heartbeat_periods(swarm) -> None:
    _, bootstrap, nodes = swarm
    victim = nodes[2]
    peer_id = victim.status()["peer_id"]
    wait_until(lambda: peer_id in roles_of(bootstrap), 10, what="victim listed")
    forked = set(victim.known_pids) - {victim.pid}
    victim.signal(signal.SIGKILL)
    killed_at = time.monotonic()
    wait_until(
        lambda: peer_id not in roles_of(bootstrap),
        4 * HEARTBEAT_PERIOD_S,
        what="victim gone",
        interval_s=0.05,
    )
    gone_after_s = time.monotonic() - killed_at
    logger.info(
        "SIGKILLed node left the swarm listing after %.2f s (period %.1f s)", gone_after_s, HEARTBEAT_PERIOD_S
    )
    print(
        f"\nSIGKILL -> gone from /api/swarm in {gone_after_s:.2f} s (heartbeat period {HEARTBEAT_PERIOD_S} s)"
    )
    assert gone_after_s <= 2 * HEARTBEAT_PERIOD_S + OBSERVE_SLACK_S
    # the DHT process and p2pd it left behind notice the parent is gone and exit by themselves
    wait_until(lambda: not alive(forked), 10, what=f"orphans gone: {describe(forked)}")


def test_sigterm_exits_within_seconds_and_leaves_the_swarm(swarm) -> None:
    _, bootstrap, nodes = swarm
    leaver = nodes[1]
    peer_id = leaver.status()["peer_id"]
    wait_until(lambda: peer_id in roles_of(bootstrap), 10, what="leaver listed")
    leaver.signal(signal.SIGTERM)
    signalled_at = time.monotonic()
    exit_s = gone_s = None
    while (exit_s is None or gone_s is None) and time.monotonic() - signalled_at < 10:
        if exit_s is None and leaver.popen.poll() is not None:
            exit_s = time.monotonic() - signalled_at
        if gone_s is None and peer_id not in roles_of(bootstrap):
            gone_s = time.monotonic() - signalled_at
        time.sleep(0.05)
    assert exit_s is not None and gone_s is not None, (exit_s, gone_s)
    print(f"\nSIGTERM -> exit in {exit_s:.2f} s, gone from /api/swarm in {gone_s:.2f} s")
    assert leaver.wait_exit(timeout_s=1) == 0
    assert exit_s < 5.0
    assert gone_s < HEARTBEAT_PERIOD_S  # it announced leaving: no need to wait for its record to expire
    assert "announced leaving" in leaver.stderr()
    assert "Traceback" not in leaver.stderr()


def test_a_plain_hivemind_dht_peer_is_a_valid_entry_point(tmp_path: Path) -> None:
    with procs(tmp_path) as group:
        bootstrap = group.start_bootstrap()
        relay = group.start_hivemind_dht(bootstrap.maddr)
        relay_maddr = relay.wait_line(r"--initial_peers (/ip4/127\.0\.0\.1/\S+)", source="stderr").group(1)
        node = group.start_node("--join", relay_maddr)
        peer_id = node.status()["peer_id"]
        wait_until(lambda: peer_id in roles_of(bootstrap), 20, what="node listed via hivemind-dht")
        assert node.status()["run_id"] == bootstrap.swarm()["run_id"]


def test_bootstrap_multiaddr_is_stable_across_restarts(tmp_path: Path) -> None:
    port = free_port()
    listen = ("--listen", f"/ip4/127.0.0.1/tcp/{port}", "--maddrs-file", str(tmp_path / "maddrs.txt"))
    with procs(tmp_path) as group:
        first = group.start_bootstrap(*listen, state="bootstrap-state")
        run_id = first.swarm()["run_id"]
        first.signal(signal.SIGTERM)
        assert first.wait_exit(timeout_s=10) == 0
        second = group.start_bootstrap(*listen, state="bootstrap-state")
        assert second.maddr == first.maddr
        assert second.swarm()["run_id"] == run_id  # same owner key, same run.toml: same run
        assert (tmp_path / "maddrs.txt").read_text().split() == [second.maddr]
