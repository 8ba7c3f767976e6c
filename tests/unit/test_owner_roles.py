"""The bootstrap's own syncer and verifier: which it runs, their keys in the manifest it signs, restart backoff."""

from __future__ import annotations

from pathlib import Path

import pytest

from bootstrap.owner_roles import Backoff, child_argv, local_join_maddr, planned_roles
from bootstrap.server import read_run
from node.config import BootstrapConfig, load_bootstrap_config
from protocol.identity import NodeIdentity
from protocol.manifest import RunManifest, SignedManifest


def test_a_plain_bootstrap_runs_a_syncer_and_for_a_pipeline_run_a_verifier(tmp_path: Path) -> None:
    config = BootstrapConfig(state_dir=tmp_path)
    assert planned_roles(config, RunManifest(num_stages=2)) == ("syncer", "verifier")
    assert planned_roles(config, RunManifest(num_stages=1)) == ("syncer",)  # nothing for a verifier to drive
    no_syncer = load_bootstrap_config(["--state-dir", str(tmp_path), "--no-syncer"], environ={})
    assert planned_roles(no_syncer, RunManifest()) == ("verifier",)
    neither = load_bootstrap_config(["--no-syncer", "--no-verifier"], environ={})
    assert planned_roles(neither, RunManifest()) == ()
    from_env = load_bootstrap_config([], environ={"HIVENODE_BOOTSTRAP": "run_verifier=false"})
    assert planned_roles(from_env, RunManifest()) == ("syncer",)


def test_the_signed_manifest_authorizes_the_keys_it_created_and_stays_the_same_run(tmp_path: Path) -> None:
    external = NodeIdentity.generate().peer_id
    config = BootstrapConfig(state_dir=tmp_path, authorize_syncers=(external,))
    manifest, roles = read_run(config)
    by_role = {r.role: r for r in roles}
    assert by_role["syncer"].peer_id in manifest.authorized_syncers
    assert external in manifest.authorized_syncers  # the external syncer path: a standby beside ours
    assert manifest.authorized_verifiers == (by_role["verifier"].peer_id,)
    key = by_role["syncer"].state_dir / "identity.key"
    assert key == tmp_path / "roles" / "syncer" / "identity.key"
    assert NodeIdentity.load(key).peer_id == by_role["syncer"].peer_id
    # a restart reuses the keys: the same manifest, so (with the same owner) the same run id
    owner = NodeIdentity.generate()
    again, _ = read_run(config)
    assert SignedManifest.sign(again, owner).run_id == SignedManifest.sign(manifest, owner).run_id
    # opting out authorizes nothing of ours
    plain, none = read_run(BootstrapConfig(state_dir=tmp_path / "b", run_syncer=False, run_verifier=False))
    assert none == () and plain.authorized_syncers == plain.authorized_verifiers == ()


def test_children_join_us_on_loopback_with_their_own_state_dir(tmp_path: Path) -> None:
    maddrs = ("/ip4/192.0.2.7/tcp/4001/p2p/X", "/ip4/127.0.0.1/tcp/4001/p2p/X")
    assert local_join_maddr(maddrs) == maddrs[1]
    assert local_join_maddr(maddrs[:1]) == maddrs[0]
    _, roles = read_run(BootstrapConfig(state_dir=tmp_path))
    argv = child_argv(roles[0], maddrs[1], tmp_path / "node.toml")
    assert argv[1:] == [
        "-m", "node", "--join", maddrs[1], "--role", "syncer",
        "--state-dir", str(tmp_path / "roles" / "syncer"), "--config", str(tmp_path / "node.toml"),
    ]  # fmt: skip


def test_restart_backoff_doubles_for_quick_exits_and_resets_after_a_healthy_run() -> None:
    backoff = Backoff(base_s=2.0, max_s=10.0, reset_after_s=60.0)
    assert [backoff.after_exit(1.0) for _ in range(5)] == [2.0, 4.0, 8.0, 10.0, 10.0]
    assert backoff.after_exit(61.0) == 2.0  # it ran a minute: healthy, so a prompt restart
    assert backoff.after_exit(1.0) == 4.0
    with pytest.raises(ValueError):
        Backoff(base_s=0.0)


def test_a_child_that_exits_is_restarted_and_stop_ends_a_running_one(tmp_path: Path, monkeypatch) -> None:  # noqa: ANN001
    """Real child processes (a tiny Python in place of `python -m node`): one exits at once and is restarted
    after its backoff; one runs until the stop, which SIGTERMs it; nothing is left running."""
    import asyncio
    import sys

    from bootstrap import owner_roles
    from bootstrap.owner_roles import OwnerRole, OwnerRoles

    programs = {"syncer": "raise SystemExit(3)", "verifier": "import time; time.sleep(60)"}
    monkeypatch.setattr(
        owner_roles, "child_argv", lambda role, join, config: [sys.executable, "-c", programs[role.role]]
    )
    roles = tuple(OwnerRole(name, tmp_path / name, f"peer-{name}") for name in programs)
    kept = OwnerRoles(roles, "/ip4/127.0.0.1/tcp/1/p2p/X", stop_timeout_s=5.0, backoff=Backoff(base_s=0.1))

    async def scenario() -> None:
        stop = asyncio.Event()
        running = asyncio.ensure_future(kept.run(stop))
        deadline = asyncio.get_running_loop().time() + 20
        while kept.starts["syncer"] < 3 and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.05)
        stop.set()
        await asyncio.wait_for(running, 10)

    asyncio.run(scenario())
    status = {s["role"]: s for s in kept.status()}
    assert status["syncer"]["starts"] >= 3 and status["syncer"]["last_exit"] in (
        3,
        -15,
    )  # -15: a restart stopped
    assert status["verifier"]["starts"] == 1 and status["verifier"]["last_exit"] == -15  # SIGTERM at the stop
    assert (tmp_path / "syncer" / "node.log").exists()
