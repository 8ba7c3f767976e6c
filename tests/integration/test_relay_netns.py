"""A stage replica nobody can dial joins through the bootstrap's relay and serves the pipeline (issue 19 item 3).

The test makes a network namespace behind a veth pair: the namespace reaches the swarm (10.77.N.1, the root side of
the veth) and the swarm reaches the namespace's veth address (its status API), but the replica listens for libp2p
only on 10.88.N.2, an address on the namespace's loopback that the root side has an `unreachable` route to: like a
volunteer behind NAT, it can dial out and cannot be dialed (checked directly below, with a fresh daemon). The
swarm runs in the root namespace: bootstrap and syncer on 10.77.N.1, the verifier and a stage-0 replica on loopback,
which the namespace cannot reach (else the replica's own DHT connections to the verifier would carry its work, as
a first version of this test found: libp2p reuses a connection whichever side opened it). The namespaced node is
the only stage-1 replica, so every microbatch the verifier completes went through the bootstrap's relay.

- With the relay (the bootstrap's default) the replica reports relay mode, the bootstrap's circuit is its address,
  and it applies microbatches and is credited verified tokens.
- Negative control, `python -m bootstrap --no-relay`: the same replica reports client mode ("no relay granted a
  reservation") and the verifier completes no microbatch through it.

Skipped, with the reason, where namespaces cannot be made (not root, no `ip`, no CAP_NET_ADMIN).
"""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from node.swarm.reachability import probe_circuit, probe_dial
from tests.integration.procs import (
    PIPELINE_RUN,
    Node,
    Procs,
    environment,
    procs,
    read_events,
    wait_until,
)

pytestmark = [pytest.mark.integration, pytest.mark.timeout(400)]

STAGE_ENV = "context_timeout_s=30,compute_threads=1"
VERIFIER_ENV = (
    "microbatch_size=4,max_in_flight=2,eval_every_s=30,eval_batches=1,receipt_every_s=2,"
    "retry.hop_timeout_s=10,routing.failure_cooldown_s=5"
)
JOIN_S = 120.0  # five cold interpreters importing torch and hivemind on a loaded 2-core box
SERVE_S = 150.0  # from every node up to the relayed replica's first applied microbatch
SUSTAINED = 20  # microbatches after the first ones: several times what one relayed connection may carry
CONTROL_S = 60.0  # the negative control's window: longer than the relayed arm needed (printed by it)


@dataclass(frozen=True)
class Namespace:
    name: str
    outer: str  # the root side of the veth: where the swarm listens
    inner: str  # the namespace's veth address: its status API
    hidden: str  # where the namespaced node listens for libp2p: the root side cannot route to it

    def prefix(self) -> list[str]:
        return ["ip", "netns", "exec", self.name]


def _ip(*args: str, ns: str | None = None) -> None:
    argv = ["ip", "netns", "exec", ns, "ip", *args] if ns else ["ip", *args]
    subprocess.run(argv, check=True, capture_output=True, text=True, timeout=10)


def _cannot_make_namespaces() -> str | None:
    if os.geteuid() != 0:
        return "network namespaces need root (CAP_NET_ADMIN)"
    if shutil.which("ip") is None:
        return "no `ip` command (iproute2)"
    return None


@pytest.fixture
def namespace() -> Iterator[Namespace]:
    if reason := _cannot_make_namespaces():
        pytest.skip(reason)
    n = os.getpid() % 200 + 20
    ns = Namespace(f"hvrelay{n}", f"10.77.{n}.1", f"10.77.{n}.2", f"10.88.{n}.2")
    outer_if, inner_if = f"hvr{n}", f"hvn{n}"
    try:
        _ip("netns", "add", ns.name)
    except (subprocess.CalledProcessError, OSError) as e:
        pytest.skip(f"cannot make a network namespace here: {getattr(e, 'stderr', e)}")
    try:
        _ip("link", "add", outer_if, "type", "veth", "peer", "name", inner_if)
        _ip("link", "set", inner_if, "netns", ns.name)
        _ip("addr", "add", f"{ns.outer}/24", "dev", outer_if)
        _ip("link", "set", outer_if, "up")
        _ip("route", "add", "unreachable", f"{ns.hidden}/32")  # else the default route would carry the dial
        _ip("addr", "add", f"{ns.inner}/24", "dev", inner_if, ns=ns.name)
        _ip("link", "set", inner_if, "up", ns=ns.name)
        _ip("link", "set", "lo", "up", ns=ns.name)
        _ip("addr", "add", f"{ns.hidden}/32", "dev", "lo", ns=ns.name)
        _ip("route", "add", "default", "via", ns.outer, ns=ns.name)
        yield ns
    finally:
        subprocess.run(
            ["ip", "route", "del", "unreachable", f"{ns.hidden}/32"], capture_output=True, timeout=10
        )
        subprocess.run(
            ["ip", "netns", "del", ns.name], capture_output=True, timeout=10
        )  # takes the veth along
        subprocess.run(["ip", "link", "del", outer_if], capture_output=True, timeout=10)


def _status(node: Node) -> dict[str, Any]:
    return node.try_status()


def _swarm(group: Procs, ns: Namespace, *bootstrap_args: str) -> tuple[Any, Node, Node]:
    """Bootstrap and syncer on the veth's root side (the namespace reaches them), the verifier and a stage-0
    replica on the root namespace's loopback (the namespace cannot reach them: the replica in it can never open a
    connection to the verifier that the verifier would then reuse); the stage-1 replica in `ns`."""
    outer = ("--listen", f"/ip4/{ns.outer}/tcp/0")
    run_path = PIPELINE_RUN.write_authorizing(group.root, syncers=["syncer"], verifiers=["verifier"])
    bootstrap = group.start_bootstrap("--run", str(run_path), *outer, *bootstrap_args)
    assert ns.outer in bootstrap.maddr, bootstrap.maddr
    others = [
        group.join_node(bootstrap, "syncer", *outer, state="syncer", wait=False),
        group.join_node(
            bootstrap, "stage", stage=0, state="stage0", wait=False
        ),  # loopback: the harness default
        group.join_node(bootstrap, "verifier", state="verifier", wait=False),
    ]
    group.prefix = ns.prefix()
    hidden = group.join_node(
        bootstrap,
        "stage",
        "--listen",
        f"/ip4/{ns.hidden}/tcp/0",
        "--http",
        f"{ns.inner}:0",
        stage=1,
        state="natted",
        wait=False,
    )
    group.prefix = []
    for node in [*others, hidden]:
        group.wait_node(node, timeout_s=JOIN_S)
    return bootstrap, others[2], hidden


def _dial_directly(maddr: str, peer_id: str) -> bool | None:
    return asyncio.run(probe_dial(maddr, peer_id, timeout_s=10.0))


def test_a_node_nobody_can_dial_serves_its_stage_through_the_bootstraps_relay(
    tmp_path: Path, namespace: Namespace
) -> None:
    with procs(tmp_path) as group, environment(HIVENODE_STAGE=STAGE_ENV, HIVENODE_VERIFIER=VERIFIER_ENV):
        bootstrap, verifier, hidden = _swarm(group, namespace)
        bootstrap.wait_line(r"^relay: on", 5)
        up_at = time.monotonic()
        status = hidden.status()
        connectivity = status["connectivity"]
        assert connectivity["mode"] == "relay", (
            connectivity,
            hidden.stderr()[-3000:],
            bootstrap.stderr()[-3000:],
        )
        assert "not reachable, using relay" in connectivity["reason"]
        circuit = connectivity["addresses"][0]
        relay_id = bootstrap.maddr.rsplit("/p2p/", 1)[1]
        assert circuit == f"{bootstrap.maddr}/p2p-circuit/p2p/{status['peer_id']}"
        assert connectivity["relays"] == [relay_id]
        events = read_events(tmp_path / "natted", "connectivity")
        assert events and events[-1]["mode"] == "relay", events
        assert not any("client mode" in line for line in hidden.stderr().splitlines()), hidden.stderr()
        # the premise: its own address cannot be dialed from here, its circuit can
        checked = read_events(tmp_path / "natted", "reachability")[-1]["checked"]
        assert checked and all(namespace.hidden in m for m in checked), checked
        assert _dial_directly(checked[0], status["peer_id"]) is not True
        assert asyncio.run(probe_circuit(circuit, timeout_s=10.0))
        wait_until(  # the swarm view is the DHT's: the relayed node's heartbeat may lag its join by a period
            lambda: status["peer_id"] in {p["peer_id"] for p in bootstrap.swarm()["peers"]},
            30,
            what="the relayed node in the bootstrap's swarm view",
            interval_s=1.0,
        )
        served = wait_until(
            lambda: (s := _status(hidden)).get("microbatches_applied", 0) > 0 and s,
            SERVE_S,
            what="the relayed stage-1 replica applying microbatches",
            interval_s=1.0,
        )
        print(
            f"\nrelayed replica applied {served['microbatches_applied']} microbatches "
            f"{time.monotonic() - up_at:.0f} s after every node was up"
        )
        wait_until(
            lambda: _status(hidden).get("verified_tokens", 0) > 0,
            60,
            what="the relayed replica credited verified tokens",
            interval_s=1.0,
        )
        # Past one relayed connection's budget: p2pd's relay resets a circuit after 128 KiB (libp2p's default
        # limits; ~32 KiB of activations and gradients per microbatch here), and the replica keeps serving.
        first_at, first = time.monotonic(), _status(hidden)["microbatches_applied"]
        sustained = wait_until(
            lambda: (n := _status(hidden).get("microbatches_applied", 0)) >= first + SUSTAINED and n,
            SERVE_S,
            what=f"{SUSTAINED} more microbatches through the relay",
            interval_s=1.0,
        )
        print(f"then {sustained - first} more in {time.monotonic() - first_at:.0f} s")
        assert verifier.status()["double_applied"] == 0


def test_without_the_relay_the_same_node_is_a_client_and_serves_nothing(
    tmp_path: Path, namespace: Namespace
) -> None:
    """Negative control: `--no-relay` on the bootstrap; nothing else changes."""
    with procs(tmp_path) as group, environment(HIVENODE_STAGE=STAGE_ENV, HIVENODE_VERIFIER=VERIFIER_ENV):
        bootstrap, verifier, hidden = _swarm(group, namespace, "--no-relay")
        bootstrap.wait_line(r"^relay: off", 5)
        connectivity = hidden.status()["connectivity"]
        assert connectivity["mode"] == "client", connectivity
        assert "no relay granted a reservation" in connectivity["reason"]
        circuit = f"{bootstrap.maddr}/p2p-circuit/p2p/{hidden.status()['peer_id']}"
        assert not asyncio.run(probe_circuit(circuit, timeout_s=10.0))
        deadline = time.monotonic() + CONTROL_S
        while time.monotonic() < deadline:
            assert _status(hidden).get("microbatches_applied", 0) == 0
            time.sleep(2.0)
        assert _status(hidden).get("verified_tokens", 0) == 0
        assert verifier.status()["applied_per_stage"].get("1", 0) == 0
