"""The swarm a new user gets from the README: `python -m bootstrap` and `python -m node --join <maddr>`, no flags.

The bootstrap runs the owner's syncer and (the default run has two pipeline stages) verifier as children with
keys it authorizes, so two plain joins train together: they become the two stages' replicas (the second moves
to the stage nobody took if both picked the same one), the verifier drives them, and the syncer merges what
they push. Then the volunteer's side of trust: one state dir joins two unrelated default swarms in turn.
"""

from __future__ import annotations

import signal
import time
from pathlib import Path
from typing import Any

import pytest

from protocol.identity import NodeIdentity
from protocol.manifest import OwnerPins
from tests.integration.procs import Node, get_json, get_text, procs, run_cli, wait_until

pytestmark = [pytest.mark.integration, pytest.mark.timeout(420)]

JOIN_S = 120.0  # five cold interpreters importing torch and hivemind on a loaded 2-core box
MERGE_S = 180.0  # from both joins to a merged version applied on both (about 40 s measured on an idle box)


def applied_versions(node: Node) -> dict[str, int]:
    """The global version of each fragment this node holds (a stage's `diloco`, a learner's `versions`)."""
    status: dict[str, Any] = node.try_status()
    versions = (status.get("diloco") or {}).get("versions") or status.get("versions") or {}
    return {str(k): int(v) for k, v in versions.items()}


def test_a_plain_bootstrap_and_two_plain_joins_merge_and_both_apply_the_merges(tmp_path: Path) -> None:
    with procs(tmp_path) as group:
        bootstrap = group.start_bootstrap(owner_roles=True, state="bootstrap")
        for role in ("syncer", "verifier"):  # printed for the owner, after the dashboard line
            bootstrap.wait_line(rf"^owner's {role}: 12D3KooW\w+ \(log: .*/roles/{role}/node\.log\)$", 10)
        settings = bootstrap.swarm()["settings"]
        listed = wait_until(
            lambda: (
                all(r["pid"] for r in owner_roles(bootstrap.http_url)) and owner_roles(bootstrap.http_url)
            ),
            10,
            what="the owner's roles started",
        )
        roles = {r["role"]: r for r in listed}
        assert settings["authorized_syncers"] == [roles["syncer"]["peer_id"]]
        assert settings["authorized_verifiers"] == [roles["verifier"]["peer_id"]]
        started = time.monotonic()
        volunteers = [
            group.start_node("--join", bootstrap.maddr, light=False, wait=False, state=f"v{i}")
            for i in range(2)
        ]
        for node in volunteers:
            group.wait_node(node, timeout_s=JOIN_S)
        first = wait_until(
            lambda: (
                all(max(applied_versions(n).values(), default=0) > 0 for n in volunteers)
                and [applied_versions(n) for n in volunteers]
            ),
            MERGE_S,
            what="both volunteers applying a merged version",
            interval_s=1.0,
        )
        merged_after_s = time.monotonic() - started
        stages = sorted(n.status()["stage"] for n in volunteers)
        assert stages == [0, 1], stages  # both stages served, however the two joins first landed
        wait_until(
            lambda: all(
                sum(applied_versions(n).values()) > sum(held.values())
                for n, held in zip(volunteers, first, strict=True)
            ),
            MERGE_S,
            what="both volunteers applying later merges too",
            interval_s=1.0,
        )
        print(
            f"\nfirst merge applied on both volunteers {merged_after_s:.0f} s after the joins; versions {first}"
        )
        ids = {n.status()["peer_id"] for n in volunteers}
        credited = wait_until(
            lambda: (
                {
                    r["peer_id"]
                    for r in get_json(bootstrap.http_url + "/api/leaderboard")["peers"]
                    if r["verified_tokens"] > 0 and r["accepted"] > 0 and r["uptime_s"] > 0
                }
                >= ids
            ),
            20,
            what="both volunteers credited in the bootstrap's ledger",
        )
        assert credited
        exported = get_text(bootstrap.http_url + "/api/leaderboard.csv").splitlines()
        assert exported[0].startswith("peer_id,role,verified_tokens") and len(exported) >= 3
        mine = run_cli(
            "node", "status", bootstrap.http_url, "--state-dir", str(tmp_path / "v0"), root=tmp_path
        )
        assert mine.returncode == 0, mine.stderr
        credit = next(line for line in mine.stdout.splitlines() if line.startswith("credit of "))
        assert " 0 verified tokens" not in credit and "why:" not in mine.stdout, mine.stdout
        bootstrap.signal(signal.SIGTERM)
        assert bootstrap.wait_exit(40) == 0
        for role in roles.values():  # the children ended with it
            assert not Path(f"/proc/{role['pid']}").exists() or _is_zombie(role["pid"]), role


def test_without_the_owner_roles_a_volunteer_is_told_it_trains_alone(tmp_path: Path) -> None:
    """Negative control of the test above: `--no-syncer --no-verifier` is the swarm the README used to give."""
    with procs(tmp_path) as group:
        bootstrap = group.start_bootstrap(state="bootstrap")  # the harness default: --no-syncer --no-verifier
        settings = bootstrap.swarm()["settings"]
        assert settings["authorized_syncers"] == settings["authorized_verifiers"] == []
        assert owner_roles(bootstrap.http_url) == []
        volunteer = group.start_node("--join", bootstrap.maddr, state="v")
        assert volunteer.status()["role"] == "learner"
        volunteer.wait_line("authorizes no syncer: training locally", 30, source="stderr")
        # and `node status` tells the volunteer why its credit is zero
        peer_id = volunteer.status()["peer_id"]
        wait_until(
            lambda: peer_id in get_text(bootstrap.http_url + "/api/leaderboard.csv"),
            20,
            what="the volunteer in the ledger",
        )
        mine = run_cli(
            "node", "status", bootstrap.http_url, "--state-dir", str(tmp_path / "v"), root=tmp_path
        )
        assert mine.returncode == 0, mine.stderr
        assert f"credit of {peer_id}: 0 verified tokens" in mine.stdout, mine.stdout
        assert "why: waiting for a syncer" in mine.stdout, mine.stdout


def test_one_volunteer_state_dir_joins_two_unrelated_default_swarms_in_turn(tmp_path: Path) -> None:
    """Every default run is named "default"; pins are per run id, so the second swarm (another owner) is trusted
    as a new run, said out loud, and both pins are listed. (A changed owner for a pinned run id is refused:
    tests/integration/test_cli.py::test_a_run_id_pinned_to_another_owner_is_refused_with_the_fix.)"""
    pins = OwnerPins(tmp_path / "volunteer" / OwnerPins.FILENAME)
    run_ids = []
    with procs(tmp_path) as group:
        for n in range(2):
            bootstrap = group.start_bootstrap(owner_roles=True, state=f"owner{n}")
            run_ids.append(bootstrap.swarm()["run_id"])
            volunteer = group.start_node("--join", bootstrap.maddr, state="volunteer")
            assert volunteer.status()["run_id"] == run_ids[n]
            volunteer.signal(signal.SIGTERM)
            assert volunteer.wait_exit(20) == 0
            bootstrap.signal(signal.SIGTERM)
            assert bootstrap.wait_exit(40) == 0
        assert run_ids[0] != run_ids[1]
        assert {p.run_id for p in pins.pins()} == set(run_ids)
        assert {p.run_name for p in pins.pins()} == {"default"}
        assert "another pinned run of that name" in volunteer.stderr()


def owner_roles(http_url: str) -> list[dict[str, Any]]:
    """The bootstrap's children as its /api/status lists them."""
    roles: list[dict[str, Any]] = get_json(http_url + "/api/status")["owner_roles"]
    return roles


def _is_zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def test_an_external_authorized_syncer_beside_the_owners_is_its_standby(tmp_path: Path) -> None:
    """`--authorize-syncer` still works with the owner's syncer running: the external key joins as a standby
    that mirrors the active one (the failover itself: test_diloco.py::test_syncer_failover)."""
    key = tmp_path / "external.key"
    external = NodeIdentity.load_or_create(key).peer_id
    with procs(tmp_path) as group:
        bootstrap = group.start_bootstrap(
            "--authorize-syncer", external, "--no-verifier", owner_roles=True, state="bootstrap"
        )
        ours = wait_until(lambda: owner_roles(bootstrap.http_url), 10, what="the owner's syncer")[0][
            "peer_id"
        ]
        assert sorted(bootstrap.swarm()["settings"]["authorized_syncers"]) == sorted([ours, external])
        wait_until(
            lambda: [
                s for s in bootstrap.swarm()["syncer"] if s["peer_id"] == ours and s["state"] == "active"
            ],
            JOIN_S,
            what="the owner's syncer active",
        )
        standby = group.start_node("--join", bootstrap.maddr, "--role", "syncer", "--identity", str(key))
        assert standby.status()["peer_id"] == external
        wait_until(lambda: standby.try_status().get("state") == "standby", 30, what="the external standby")
