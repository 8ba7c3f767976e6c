"""The command lines, as a user meets them: every failure is one `error:` line on stderr, a non-zero exit, and no
hang; plus the owner's workflow (keygen -> authorize -> join) and `python -m node status`."""

from __future__ import annotations

import json
import signal
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path

import pytest

from protocol.identity import IdentityLock, NodeIdentity
from protocol.manifest import OwnerPins, RunManifest, SignedManifest
from tests.integration.procs import Bootstrap, CliResult, Procs, free_port, procs, run_cli, wait_until

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

ERROR_BOUND_S = 30.0  # includes a cold interpreter importing torch and hivemind on a loaded 2-core box
EXIT_FAILED, EXIT_USAGE = 1, 2


def assert_one_line_error(result: CliResult, code: int, *fragments: str) -> None:
    errors = [line for line in result.stderr_lines if line.startswith("error: ")]
    assert result.returncode == code, result.stderr
    assert len(errors) == 1 and result.stderr_lines[-1] == errors[0], result.stderr
    assert "Traceback" not in result.stderr, result.stderr
    for fragment in fragments:
        assert fragment in errors[0], errors[0]
    assert result.elapsed_s < ERROR_BOUND_S


def node(tmp_path: Path, *args: str, timeout_s: float = ERROR_BOUND_S) -> CliResult:
    return run_cli("node", "--state-dir", str(tmp_path / "state"), *args, root=tmp_path, timeout_s=timeout_s)


def dead_maddr() -> str:
    return f"/ip4/127.0.0.1/tcp/{free_port()}/p2p/{NodeIdentity.generate().peer_id}"


# ---- failures before or instead of joining ----


def test_bad_multiaddr(tmp_path: Path) -> None:
    # the other malformed shapes are unit-tested on check_multiaddr; this is the path through the CLI
    assert_one_line_error(node(tmp_path, "--join", "not-a-multiaddr"), EXIT_USAGE, "is not a multiaddr")


def test_unreachable_bootstrap_fails_fast(tmp_path: Path) -> None:
    result = node(tmp_path, "--join", dead_maddr())
    assert_one_line_error(result, EXIT_FAILED, "cannot reach the swarm")


def test_unreadable_identity(tmp_path: Path) -> None:
    bad = tmp_path / "bad.key"
    bad.write_bytes(b"not a key")
    result = node(tmp_path, "--join", dead_maddr(), "--identity", str(bad))
    assert_one_line_error(result, EXIT_FAILED, "not an Ed25519 key")


def test_identity_in_use_by_another_process(tmp_path: Path) -> None:
    key = tmp_path / "shared.key"
    NodeIdentity.load_or_create(key)
    with IdentityLock(key):
        result = node(tmp_path, "--join", dead_maddr(), "--identity", str(key))
    assert_one_line_error(result, EXIT_FAILED, "already in use")


class _FakeBootstrap(BaseHTTPRequestHandler):
    body = b"{}"
    status = 200

    def do_GET(self) -> None:
        self.send_response(self.status)
        self.send_header("Content-Type", "application/json")
        self.end_headers()
        self.wfile.write(self.body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def fake_bootstrap() -> Iterator[tuple[type[_FakeBootstrap], str]]:
    handler = type("Handler", (_FakeBootstrap,), {})
    server = HTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, name="fake-bootstrap", daemon=True)
    thread.start()
    try:
        yield handler, f"http://127.0.0.1:{server.server_port}"
    finally:
        server.shutdown()
        server.server_close()


def test_tampered_manifest_from_a_bootstrap_url(tmp_path: Path, fake_bootstrap) -> None:
    handler, url = fake_bootstrap
    signed = SignedManifest.sign(RunManifest(), NodeIdentity.generate())
    tampered = SignedManifest(
        signed.manifest_bytes.replace(b"default", b"evilrun"), signed.owner, signed.signature
    )
    handler.body = json.dumps({"bootstrap_maddrs": [dead_maddr()], "manifest": tampered.to_b64()}).encode()
    result = node(tmp_path, "--join", url)
    assert_one_line_error(result, EXIT_FAILED, "not signed by its claimed owner", "tampered")


def test_a_url_that_is_not_a_bootstrap(tmp_path: Path, fake_bootstrap) -> None:
    handler, url = fake_bootstrap
    handler.status = 404
    assert_one_line_error(node(tmp_path, "--join", url), EXIT_FAILED, "answered HTTP 404")


def test_bootstrap_with_a_bad_run_file(tmp_path: Path) -> None:
    run = tmp_path / "run.toml"
    run.write_text('name = "x"\nnum_stages = 99\n')
    result = run_cli("bootstrap", "--run", str(run), "--state-dir", str(tmp_path / "b"), root=tmp_path)
    assert_one_line_error(result, EXIT_USAGE, "run.toml", "num_stages")


def test_bootstrap_never_invents_a_missing_owner_key(tmp_path: Path) -> None:
    missing = tmp_path / "owner.key"
    result = run_cli(
        "bootstrap", "--owner-key", str(missing), "--state-dir", str(tmp_path / "b"), root=tmp_path
    )
    assert_one_line_error(result, EXIT_FAILED, "cannot read identity", str(missing))
    assert not missing.exists()


# ---- with a live bootstrap: the owner's workflow ----


@pytest.fixture(scope="module")
def owner_swarm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Procs, Bootstrap, Path, str]]:
    root = tmp_path_factory.mktemp("cli")
    syncer_key = root / "syncer.key"
    keygen = run_cli("node", "keygen", "--identity", str(syncer_key), root=root)
    assert keygen.returncode == 0, keygen.stderr
    syncer_id = keygen.stdout.strip()
    assert syncer_id == NodeIdentity.load(syncer_key).peer_id
    with procs(root) as group:
        bootstrap = group.start_bootstrap("--authorize-syncer", syncer_id, "--authorize-verifier", syncer_id)
        yield group, bootstrap, syncer_key, syncer_id


def test_an_authorized_key_on_auto_becomes_the_syncer(owner_swarm, tmp_path: Path) -> None:
    group, bootstrap, syncer_key, syncer_id = owner_swarm
    settings = bootstrap.swarm()["settings"]
    assert settings["authorized_syncers"] == settings["authorized_verifiers"] == [syncer_id]
    syncer = group.start_node(
        "--join", bootstrap.maddr, "--identity", str(syncer_key), state=f"{tmp_path.name}-s"
    )
    status = syncer.status()
    assert (status["peer_id"], status["role"]) == (syncer_id, "syncer")
    assert "not built" not in str(status.get("note", ""))  # the syncer role exists: it does its work
    listed = wait_until(
        lambda: [p for p in bootstrap.swarm()["peers"] if p["peer_id"] == syncer_id], 15, what="syncer listed"
    )
    assert listed[0]["role"] == "syncer"
    syncer.signal(signal.SIGTERM)
    assert syncer.wait_exit(10) == 0


def test_an_unauthorized_verifier_is_refused_with_the_fix(owner_swarm, tmp_path: Path) -> None:
    _, bootstrap, _, _ = owner_swarm
    result = node(tmp_path, "--join", bootstrap.maddr, "--role", "verifier")
    assert_one_line_error(result, EXIT_USAGE, "not an authorized verifier", "--authorize-verifier")


def test_a_run_id_pinned_to_another_owner_is_refused_with_the_fix(owner_swarm, tmp_path: Path) -> None:
    _, bootstrap, _, _ = owner_swarm
    run_id = bootstrap.swarm()["run_id"]
    state = tmp_path / "state"
    other = NodeIdentity.generate().peer_id
    OwnerPins(state / OwnerPins.FILENAME).check_and_pin(run_id, other, run_name="default")
    result = node(tmp_path, "--join", bootstrap.maddr)
    assert_one_line_error(result, EXIT_FAILED, f"run {run_id}", "pinned to owner", other, "trust forget")


def test_a_volunteer_of_another_default_swarm_joins_this_one(owner_swarm) -> None:
    """Name-keyed pins refused this: the state dir already trusts another owner's run named "default"."""
    group, bootstrap, _, _ = owner_swarm
    state = group.root / "volunteer"
    other_run = SignedManifest.sign(RunManifest(), NodeIdentity.generate())
    pins = OwnerPins(state / OwnerPins.FILENAME)
    pins.check_and_pin(other_run.run_id, other_run.owner, run_name="default")
    volunteer = group.start_node("--join", bootstrap.maddr, state="volunteer")
    run_id = volunteer.status()["run_id"]
    assert {p.run_id for p in pins.pins()} == {other_run.run_id, run_id}
    assert "another pinned run of that name" in volunteer.stderr()
    volunteer.signal(signal.SIGTERM)
    assert volunteer.wait_exit(10) == 0


def test_status_subcommand_by_url_and_by_multiaddr(owner_swarm, tmp_path: Path) -> None:
    _, bootstrap, _, _ = owner_swarm
    run_id = bootstrap.swarm()["run_id"]
    for target in (bootstrap.http_url, bootstrap.maddr):
        result = run_cli("node", "status", target, root=tmp_path, timeout_s=ERROR_BOUND_S)
        assert result.returncode == 0, result.stderr
        assert f"run default ({run_id})" in result.stdout
        assert "bootstrap" in result.stdout and "live peer(s)" in result.stdout
