"""A tampered run manifest met through the DHT, not through a bootstrap URL: hivemind drops the record our validator
refuses before `get` returns, so the joining node used to wait out its join timeout and then say it "found no run
manifest". It now names the tampering at once. Controls, on the same path (`discover_run` against a real validating
DHT joined to the peer holding the record): the untampered manifest is found, and with the report switched off the
tampered one costs the whole join timeout and an error that does not name it."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import hivemind
import pytest
from hivemind.utils import get_dht_time

from node import swarm
from node.config import LOOPBACK_LISTEN, NetworkConfig, NodeConfig
from protocol import keys
from protocol.errors import JoinError, ManifestRejected
from protocol.identity import NodeIdentity
from protocol.manifest import OwnerPins, RunManifest, SignedManifest
from protocol.records import HivenodeRecordValidator, make_envelope
from tests.integration.procs import run_cli

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

JOIN_TIMEOUT_S = 120.0  # what the node would wait if it could not tell a tampered manifest from a missing one
REPORT_BOUND_S = 60.0  # a cold interpreter importing torch and hivemind on a loaded 2-core box, one lookup
OWNER = NodeIdentity.generate()
SIGNED = SignedManifest.sign(RunManifest(), OWNER)
TAMPERED = SignedManifest(
    SIGNED.manifest_bytes.replace(b"default", b"evilrun"), SIGNED.owner, SIGNED.signature
)


@contextmanager
def plain_dht_holding(signed: SignedManifest) -> Iterator[str]:
    """A plain hivemind DHT peer (no validator: it keeps whatever it is given) holding `signed` under the discovery
    key, as the owner's record; yields its multiaddr."""
    dht = hivemind.DHT(host_maddrs=["/ip4/127.0.0.1/tcp/0"], start=True)
    try:
        expiration = get_dht_time() + 600
        body = {"signed": signed.to_wire()}
        envelope = make_envelope(OWNER, keys.discovery_key(), OWNER.peer_id, body, expiration)
        assert dht.store(keys.discovery_key(), envelope, expiration, subkey=OWNER.peer_id)
        yield str(dht.get_visible_maddrs()[0])
    finally:
        dht.shutdown()


def node_config(tmp_path: Path) -> Path:
    path = tmp_path / "node.toml"
    # learners train slowly here: keep the 2 cores for the test
    path.write_text(f"[learner]\nmin_step_s = 0.5\n[network]\njoin_timeout_s = {JOIN_TIMEOUT_S}\n")
    return path


def test_a_tampered_manifest_in_the_dht_is_named_at_once(tmp_path: Path) -> None:
    assert TAMPERED.manifest_bytes != SIGNED.manifest_bytes
    with plain_dht_holding(TAMPERED) as maddr:
        result = run_cli(
            "node",
            *("--state-dir", str(tmp_path / "state"), "--config", str(node_config(tmp_path))),
            *("--join", maddr),
            root=tmp_path,
            timeout_s=JOIN_TIMEOUT_S + 30,
        )
    errors = [line for line in result.stderr_lines if line.startswith("error: ")]
    assert result.returncode == 1, result.stderr
    assert len(errors) == 1 and result.stderr_lines[-1] == errors[0], result.stderr
    assert "Traceback" not in result.stderr, result.stderr
    for fragment in ("no valid run manifest", "not signed by its claimed owner", OWNER.peer_id, "tampered"):
        assert fragment in errors[0], errors[0]
    assert result.elapsed_s < REPORT_BOUND_S, f"took {result.elapsed_s:.1f} s: {errors[0]}"


def discover(tmp_path: Path, maddr: str, join_timeout_s: float) -> tuple[SignedManifest | Exception, float]:
    """`discover_run` as a joining node runs it, from a real validating DHT whose only peer is `maddr`: what it
    returned or raised, and how long it took (the DHT's start not included)."""
    network = NetworkConfig(listen=(LOOPBACK_LISTEN,), join_timeout_s=join_timeout_s, request_timeout_s=5.0)
    config = NodeConfig(join=(maddr,), state_dir=tmp_path / "state", network=network)
    identity = NodeIdentity.load_or_create(tmp_path / "identity.key")
    dht = swarm.start_dht(identity, [maddr], network, HivenodeRecordValidator())
    pins = OwnerPins(tmp_path / OwnerPins.FILENAME)
    start = time.monotonic()
    try:
        outcome: SignedManifest | Exception = asyncio.run(
            swarm.discover_run(dht, swarm.JoinPlan((maddr,)), config, pins)
        )
    except (ManifestRejected, JoinError) as e:
        outcome = e
    finally:
        dht.shutdown()
    return outcome, time.monotonic() - start


@pytest.mark.parametrize("case", ["tampered", "tampered, report off", "untampered"])
def test_discovery_names_a_tampered_manifest_and_only_then(
    tmp_path: Path, case: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    join_timeout_s = 8.0
    if case == "tampered, report off":

        async def no_report(dht: object, timeout_s: float) -> None:
            return None

        monkeypatch.setattr(swarm.discovery, "_refuse_tampered_manifests", no_report)
    with plain_dht_holding(SIGNED if case == "untampered" else TAMPERED) as maddr:
        outcome, elapsed_s = discover(tmp_path, maddr, join_timeout_s)
    if case == "untampered":
        assert outcome == SIGNED
    elif case == "tampered":
        assert isinstance(outcome, ManifestRejected), outcome
        assert "not signed by its claimed owner" in str(outcome) and OWNER.peer_id in str(outcome)
        assert elapsed_s < join_timeout_s / 2
    else:  # the attack wins what it can: the whole timeout, and an error that blames the entry point
        assert isinstance(outcome, JoinError) and "found no run manifest" in str(outcome), outcome
        assert elapsed_s >= join_timeout_s - 2
