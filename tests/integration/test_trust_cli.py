"""`python -m node trust list|forget` as a user runs them: real subprocesses on a temp --state-dir (no network)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from protocol.identity import NodeIdentity
from protocol.manifest import OwnerPins, RunManifest, SignedManifest
from tests.integration.procs import run_cli

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]
CLI_BOUND_S = 30.0  # a cold interpreter importing torch and hivemind on a loaded 2-core box


def trust(state: Path, *args: str) -> tuple[int, str, str]:
    result = run_cli(
        "node", "trust", *args, "--state-dir", str(state), root=state.parent, timeout_s=CLI_BOUND_S
    )
    assert "Traceback" not in result.stderr, result.stderr
    return result.returncode, result.stdout, result.stderr


def test_trust_list_then_forget_then_forget_an_unknown_run(tmp_path: Path) -> None:
    state = tmp_path / "state"
    runs = [SignedManifest.sign(RunManifest(), NodeIdentity.generate()) for _ in range(2)]
    pins = OwnerPins(state / OwnerPins.FILENAME)
    for signed in runs:
        pins.check_and_pin(signed.run_id, signed.owner, run_name="default", now=1_780_000_000.0)
    code, out, _ = trust(state, "list")
    assert code == 0
    for signed in runs:
        line = next(line for line in out.splitlines() if line.startswith(signed.run_id))
        assert "default" in line and signed.owner[-8:] in line and "2026-05-28 20:26:40 UTC" in line
    code, out, _ = trust(state, "forget", runs[0].run_id)
    assert code == 0 and f"forgot run {runs[0].run_id}" in out
    assert list(json.loads(pins.path.read_text())["pins"]) == [runs[1].run_id]
    code, _, err = trust(state, "forget", runs[0].run_id)
    assert code == 2 and "no pin for run id" in err and "trust list" in err


def test_trust_list_on_an_empty_and_on_an_old_format_state_dir(tmp_path: Path) -> None:
    state = tmp_path / "state"
    code, out, _ = trust(state, "list")
    assert code == 0 and "no pinned runs" in out
    state.mkdir()
    owner = NodeIdentity.generate().peer_id
    (state / OwnerPins.FILENAME).write_text(json.dumps({"runs": {"default": owner}}))
    code, out, _ = trust(state, "list")
    assert code == 0 and "no pinned runs" in out and "old name-keyed" in out and owner[-8:] in out
