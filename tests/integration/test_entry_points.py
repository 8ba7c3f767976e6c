"""The public entry points against a live bootstrap (#19 item 6), each with its negative control.

* /api/swarm lists as bootstraps only the peers the owner signed into the manifest: a heartbeat that merely
  claims role=bootstrap (Mallory's, signed by her own key, so the DHT accepts it as her heartbeat) is not listed;
  the same heartbeat from a peer the manifest names (`--authorize-bootstrap`) is.
* A join through a bootstrap URL dials only the bootstraps of the run the URL's signed manifest describes: a
  URL whose unsigned `bootstrap_maddrs` points at Mallory is refused before anything is dialled; the same
  document pointing at the genuine bootstrap joins.
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path

import pytest
from hivemind.utils import get_dht_time

from node.config import LOOPBACK_LISTEN, NetworkConfig
from node.swarm import start_dht
from protocol.dht_io import SwarmRecords
from protocol.identity import NodeIdentity
from protocol.manifest import SignedManifest
from protocol.records import Heartbeat, HivenodeRecordValidator, RunRules
from tests.integration.procs import Bootstrap, procs, run_cli, wait_until

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

CLI_BOUND_S = 60.0


def claim_bootstrap_role(
    bootstrap: Bootstrap, identity: NodeIdentity, announced: str, listed_s: float
) -> bool:
    """Heartbeat as role=bootstrap from `identity`, announcing `announced`; True once /api/swarm lists the peer
    (its heartbeat arrived), and whether `announced` became a bootstrap is for the caller to read."""

    async def run() -> bool:
        signed = SignedManifest.from_b64(bootstrap.swarm()["manifest"])
        rules = RunRules.from_manifest(signed, signed.verify())
        dht = start_dht(
            identity,
            [bootstrap.maddr],
            NetworkConfig(listen=(LOOPBACK_LISTEN,)),
            HivenodeRecordValidator([rules]),
        )
        try:
            records = SwarmRecords(dht, rules, identity)
            beat = Heartbeat(role="bootstrap", state="serving", maddrs=(announced,), sent_at=get_dht_time())
            assert await records.publish_heartbeat(beat, expiration=get_dht_time() + 120)
            return bool(
                await asyncio.to_thread(
                    wait_until,
                    lambda: identity.peer_id in {p["peer_id"] for p in bootstrap.swarm()["peers"]},
                    listed_s,
                    what="the claimed heartbeat in /api/swarm",
                )
            )
        finally:
            dht.shutdown()

    return asyncio.run(run())


def test_a_heartbeat_claiming_the_bootstrap_role_is_listed_only_if_the_manifest_names_it(
    tmp_path: Path,
) -> None:
    mallory = NodeIdentity.load_or_create(tmp_path / "mallory.key")
    second = NodeIdentity.load_or_create(tmp_path / "second.key")
    mallory_maddr = f"/ip4/203.0.113.66/tcp/4001/p2p/{mallory.peer_id}"
    second_maddr = f"/ip4/203.0.113.2/tcp/4001/p2p/{second.peer_id}"
    with procs(tmp_path) as group:
        bootstrap = group.start_bootstrap("--authorize-bootstrap", second.peer_id)
        assert bootstrap.swarm()["settings"]["bootstraps"] == [second.peer_id]
        assert claim_bootstrap_role(bootstrap, mallory, mallory_maddr, 20)
        peers = {p["peer_id"]: p for p in bootstrap.swarm()["peers"]}
        assert peers[mallory.peer_id]["role"] == "bootstrap"  # the claim is there, as her heartbeat
        assert bootstrap.swarm()["bootstrap_maddrs"] == [bootstrap.maddr]  # but lists nothing of hers
        # negative control: the same claim from a peer the owner signed in as a bootstrap is listed
        assert claim_bootstrap_role(bootstrap, second, second_maddr, 20)
        assert bootstrap.swarm()["bootstrap_maddrs"] == [bootstrap.maddr, second_maddr]


class _Serve(BaseHTTPRequestHandler):
    body = b"{}"

    def do_GET(self) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.end_headers()
        self.wfile.write(self.body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def relay_url() -> Iterator[tuple[type[_Serve], str]]:
    """An HTTP server on loopback that answers every GET with `handler.body` (a bootstrap URL in between)."""
    handler = type("Handler", (_Serve,), {})
    server = HTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, name="url-in-between", daemon=True)
    thread.start()
    try:
        yield handler, f"http://127.0.0.1:{server.server_port}"
    finally:
        server.shutdown()
        server.server_close()


def test_a_join_through_a_url_dials_only_the_signed_bootstraps(tmp_path: Path, relay_url) -> None:  # noqa: ANN001
    handler, url = relay_url
    with procs(tmp_path) as group:
        bootstrap = group.start_bootstrap()
        genuine = bootstrap.swarm()
        mallory = group.start_hivemind_dht(bootstrap.maddr)  # a live peer, so a dial would succeed
        mallory_maddr = mallory.wait_line(r"--initial_peers (/ip4/127\.0\.0\.1/\S+)", source="stderr").group(
            1
        )
        handler.body = json.dumps({**genuine, "bootstrap_maddrs": [mallory_maddr]}).encode()
        result = run_cli(
            "node", "--join", url, "--state-dir", str(tmp_path / "v1"), root=tmp_path, timeout_s=CLI_BOUND_S
        )
        assert result.returncode == 1, result.stderr
        assert (
            "lists no bootstrap of the run it serves" in result.stderr and "refusing to dial" in result.stderr
        )
        assert "Traceback" not in result.stderr
        # negative control: the same document listing the genuine bootstrap is followed into the run
        handler.body = json.dumps({**genuine, "bootstrap_maddrs": [bootstrap.maddr]}).encode()
        volunteer = group.start_node("--join", url, state="v2")
        assert volunteer.status()["run_id"] == genuine["run_id"]
