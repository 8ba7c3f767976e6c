"""Node settings and the pure parts of the runtime: config parsing, the frozen CLI, role choice, stage balance,
and the task supervisor (no sockets)."""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path

import pytest

from node.config import (
    Component,
    HttpConfig,
    NetworkConfig,
    build_run_parser,
    config_from_mapping,
    field_help,
    load_node_config,
    parse_host_port,
    reference,
    reference_markdown,
)
from node.context import RestartPolicy, TaskSupervisor, short_id
from node.roles.registry import ROLE_FACTORIES, choose_role
from node.swarm import check_multiaddr, pick_run, swarm_url
from protocol.errors import ConfigError, JoinError
from protocol.identity import NodeIdentity
from protocol.manifest import OwnerPins, RunManifest, SignedManifest, authorize
from protocol.records import Heartbeat, PeerRecord

PEER = NodeIdentity.generate().peer_id
MADDR = f"/ip4/127.0.0.1/tcp/4000/p2p/{PEER}"
NOW = 1_800_000_000.0


def test_the_cli_flag_set_is_frozen() -> None:
    # a ratchet: new settings belong in node.toml; change this list only on purpose
    flags = {opt for action in build_run_parser()._actions for opt in action.option_strings}
    assert flags == {
        "-h",
        "--help",
        "--join",
        "--role",
        "--stage",
        "--device",
        "--identity",
        "--state-dir",
        "--http",
        "--data",
        "--max-steps",
        "--config",
        "--log-level",
        "--listen",  # reachability for public nodes (issue 7)
        "--announce",
        "--quiet",  # the join's progress line off (issue 19 item 5): a console choice, not a setting to keep
    }


def test_flags_build_a_config(tmp_path: Path) -> None:
    argv = ["--join", MADDR, "--join", "http://127.0.0.1:8000", "--role", "stage", "--stage", "1"]
    argv += ["--state-dir", str(tmp_path), "--http", "0.0.0.0:8080", "--max-steps", "5", "--device", "cpu"]
    config = load_node_config(argv)
    assert config.join == (MADDR, "http://127.0.0.1:8000")
    assert (config.role, config.stage, config.max_steps, config.device) == ("stage", 1, 5, "cpu")
    assert config.http == HttpConfig(host="0.0.0.0", port=8080)
    assert config.identity_file == tmp_path / "identity.key"
    assert config.network == NetworkConfig()


def test_flags_win_over_the_toml_file(tmp_path: Path) -> None:
    toml = tmp_path / "node.toml"
    toml.write_text(
        f'join = ["{MADDR}"]\nrole = "learner"\nlog_level = "DEBUG"\nidentity = "{tmp_path}/k.key"\n'
        '[network]\nlisten = ["/ip4/0.0.0.0/tcp/31338"]\njoin_timeout_s = 7\n[http]\nport = 9000\n'
    )
    config = load_node_config(["--config", str(toml), "--role", "verifier", "--state-dir", str(tmp_path)])
    assert config.role == "verifier" and config.log_level == "DEBUG"
    assert config.identity_file == tmp_path / "k.key"
    assert config.network.listen == ("/ip4/0.0.0.0/tcp/31338",) and config.network.join_timeout_s == 7
    assert config.http.port == 9000 and config.http.host == "127.0.0.1"


@pytest.mark.parametrize(
    ("data", "fragment"),
    [
        ({}, "at least one --join"),
        ({"join": [MADDR], "colour": "red"}, "unknown setting 'colour' in the settings; valid keys: join,"),
        ({"join": [MADDR], "network": {"speed": 1}}, "unknown setting 'speed' in [network]"),
        ({"join": [MADDR], "role": "king"}, "role must be one of"),
        ({"join": [MADDR], "stage": -1}, "stage must be >= 0"),
        ({"join": [MADDR], "device": "tpu"}, "device must be"),
        ({"join": [MADDR], "max_steps": 0}, "max_steps"),
        ({"join": [MADDR], "run_id": "abc"}, "run_id"),
        ({"join": [MADDR], "http": {"port": 70000}}, "http.port"),
        ({"join": [MADDR], "network": {"join_timeout_s": 0}}, "join_timeout_s"),
        ({"join": [MADDR], "network": {"listen": "/ip4/0.0.0.0/tcp/1"}}, "network.listen must be a list"),
        ({"join": [MADDR], "http": {"port": 1.5}}, "http.port must be an int"),
        ({"join": [MADDR], "http": {"port": {"x": 1}}}, "http.port in the settings is a value, not a table"),
    ],
)
def test_invalid_settings_are_config_errors(tmp_path: Path, data: dict, fragment: str) -> None:
    with pytest.raises(ConfigError) as info:
        config_from_mapping({"state_dir": str(tmp_path), **data})
    assert fragment in str(info.value)


def test_config_is_frozen(tmp_path: Path) -> None:
    config = config_from_mapping({"join": [MADDR], "state_dir": str(tmp_path)})
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.role = "syncer"  # type: ignore[misc]


@pytest.mark.parametrize("text", ["localhost", ":80", "host:", "host:99999", "host:http"])
def test_bad_host_port(text: str) -> None:
    with pytest.raises(ConfigError, match="HOST:PORT"):
        parse_host_port(text)


RSA_PEER = (
    "QmYyQSo1c1Ym7orWxLYvCrM2EmxFTANf8wXmmE7DWjhx5N"  # a valid peer id, but RSA: it cannot sign our records
)


@pytest.mark.parametrize(
    ("bad", "fragment"),
    [
        ("not-a-multiaddr", "is not a multiaddr"),
        ("/ip4/999.0.0.1/tcp/1/p2p/" + PEER, "is not a multiaddr"),
        ("/ip4/127.0.0.1/tcp/4000", "must end in /p2p/<peer id>"),
        ("/ip4/127.0.0.1/tcp/4000/p2p/" + RSA_PEER, "Ed25519"),
    ],
)
def test_join_multiaddrs_are_checked_before_any_network(bad: str, fragment: str) -> None:
    assert check_multiaddr(MADDR) == MADDR
    with pytest.raises(ConfigError) as info:
        check_multiaddr(bad)
    assert fragment in str(info.value)


def test_bootstrap_urls_get_their_api_path() -> None:
    assert swarm_url("http://h:1") == "http://h:1/api/swarm"
    assert swarm_url("http://h:1/") == "http://h:1/api/swarm"
    assert swarm_url("http://h:1/api/swarm") == "http://h:1/api/swarm"
    with pytest.raises(ConfigError):
        swarm_url("http://")


# ---- the one loader: precedence, provenance of errors, the reference and docs/config.md ----

DOCS = Path(__file__).resolve().parents[2] / "docs" / "config.md"


def _components() -> tuple[Component, ...]:
    from node.__main__ import components

    return components()


def test_precedence_is_defaults_then_file_then_environment_then_flags(tmp_path: Path) -> None:
    from node.roles.stage import stage_config

    toml = tmp_path / "node.toml"
    toml.write_text(
        f'join = ["{MADDR}"]\n[http]\nport = 1\n[stage_options]\nmax_contexts = 5\nrebalance.dwell_s = 3\n'
    )
    environ = {"HIVENODE_HTTP": "port=2,host=0.0.0.0", "HIVENODE_STAGE": "max_contexts=6"}
    argv = ["--config", str(toml), "--state-dir", str(tmp_path)]
    config = load_node_config(argv, environ=environ, components=_components())
    assert config.http == HttpConfig(host="0.0.0.0", port=2)  # the environment over the file
    stage = stage_config(config.stage_options)  # the role builds its config from the loaded NodeConfig
    assert (stage.max_contexts, stage.rebalance.dwell_s, stage.sweep_period_s) == (6, 3.0, 5.0)
    config = load_node_config([*argv, "--http", "127.0.0.1:3"], environ=environ, components=_components())
    assert config.http == HttpConfig(host="127.0.0.1", port=3)  # flags over the environment


@pytest.mark.parametrize(
    ("toml", "environ", "fragments"),
    [
        ("[stage_options]\ncolour = 1\n", {}, ["'colour'", "[stage_options]", "node.toml", "max_contexts"]),
        ("[verifier.retry]\ntries = 1\n", {}, ["'tries'", "[verifier.retry]", "node.toml", "max_attempts"]),
        ("", {"HIVENODE_VERIFIER": "colour=1"}, ["'colour'", "HIVENODE_VERIFIER", "microbatch_size"]),
        ("", {"HIVENODE_SYNCER": "lease=1"}, ["'lease'", "HIVENODE_SYNCER", "lease_s"]),
        ("[gossip]\nfanout = 3\n", {}, ["'gossip'", "node.toml", "[stage_options]"]),
        ("[learner]\nmin_step_s = -1\n", {}, ["[learner]", "node.toml", "min_step_s"]),
        ("", {"HIVENODE_STAGE": "max_contexts=many"}, ["stage_options.max_contexts must be an int", "many"]),
        ("", {"HIVENODE_LEARNER": "x"}, ["HIVENODE_LEARNER", "not key=value"]),
    ],
)
def test_bad_keys_and_values_name_where_they_came_from(
    tmp_path: Path, toml: str, environ: dict[str, str], fragments: list[str]
) -> None:
    path = tmp_path / "node.toml"
    path.write_text(f'join = ["{MADDR}"]\n{toml}')
    with pytest.raises(ConfigError) as info:
        load_node_config(["--config", str(path)], environ=environ, components=_components())
    for fragment in fragments:
        assert fragment in str(info.value)


def test_role_tables_whose_defaults_are_the_runs_are_checked_by_the_role() -> None:
    from node.roles.syncer import SyncerConfig

    # lease_s = 1.5 is wrong against the static renewal default (2 s) but right for a run beating every 0.5 s
    config = config_from_mapping({"join": [MADDR], "syncer": {"lease_s": 1.5}}, _components())
    assert SyncerConfig.from_options(config.syncer, heartbeat_period_s=0.5).lease_s == 1.5
    with pytest.raises(ConfigError, match="renew_every_s"):
        SyncerConfig.from_options(config.syncer, heartbeat_period_s=1.0)


def test_docs_config_md_is_generated_from_the_dataclasses(capsys: pytest.CaptureFixture[str]) -> None:
    from node.__main__ import main

    assert main(["config", "--markdown"]) == 0
    assert capsys.readouterr().out == DOCS.read_text(), (
        "stale: python -m node config --markdown > docs/config.md"
    )


def test_the_docs_check_flags_a_setting_missing_from_docs_config_md() -> None:
    from node.roles.verifier import VerifierConfig

    @dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
    class Grown(VerifierConfig):  # type: ignore[misc]
        gossip_fanout: int = 3  # peers each verdict is forwarded to

    grown = [dataclasses.replace(c, config_type=Grown) if c.table == "verifier" else c for c in _components()]
    text = reference_markdown(grown)
    assert text != DOCS.read_text()
    assert "| `gossip_fanout` | `int` | `3` |  |  | peers each verdict is forwarded to |" in text


def test_defaults_print_as_a_node_toml_that_loads_to_the_defaults(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import tomllib

    from node.__main__ import main

    assert main(["config", "--defaults"]) == 0
    data = tomllib.loads(capsys.readouterr().out)
    assert data["stage_options"]["rebalance"]["dwell_s"] == 30.0 and "lease_s" not in data["syncer"]
    base = {"join": [MADDR], "state_dir": str(tmp_path)}
    loaded = config_from_mapping({**data, **base}, _components())
    defaults = config_from_mapping(base, _components())
    assert dataclasses.replace(loaded, learner={}, syncer={}, stage_options={}, verifier={}) == defaults
    units = {o.key: o.unit for _, options in reference(_components()) for o in options}
    assert (
        units["context_timeout_s"] == "s"
        and units["max_steps_per_s"] == "1/s"
        and units["max_contexts"] == ""
    )


def test_help_comes_from_the_comment_beside_each_field() -> None:
    from node.pipeline.routing import RebalanceConfig

    assert field_help(NetworkConfig)["redial_max_s"] == "longest pause between re-dials"
    assert field_help(NetworkConfig)["peer_check_period_s"].startswith("Losing the bootstraps")
    rebalance = field_help(
        RebalanceConfig
    )  # a comment line that continues the one above stays with its field
    assert rebalance["dwell_s"].endswith("before anyone moves")
    assert rebalance["cooldown_s"].startswith("least time between two moves")


def test_every_flag_shows_its_default_in_help(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HIVENODE_STATE_DIR", str(tmp_path))
    helps = {action.dest: action.help or "" for action in build_run_parser()._actions}
    for dest, text in helps.items():
        if dest != "help":
            assert "default" in text or "required" in text, dest
    assert f"(default: {tmp_path / 'node'})" in helps["state_dir"]


@pytest.mark.parametrize(
    ("argv", "fragment"),
    [
        (["--join", "foo"], "--join 'foo' is not a multiaddr"),
        (["--join", "/ip4/127.0.0.1/tcp/4000"], "must end in /p2p/"),
        (["--join", "http://"], "is not a usable URL"),
        (
            ["--join", MADDR, "--listen", "/ip4/1.2.3.4/tcpx/1"],
            "--listen '/ip4/1.2.3.4/tcpx/1' is not a multiaddr",
        ),
        (["--join", MADDR, "--listen", "tcp/1"], "network.listen must be multiaddrs"),
        (["--join", MADDR, "--http", "nohost"], "HOST:PORT"),
        (["--join", MADDR, "--config", "/nonexistent/node.toml"], "cannot read config"),
    ],
)
def test_bad_arguments_stop_the_node_before_anything_is_written(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str], fragment: str
) -> None:
    from node.__main__ import main

    state = tmp_path / "state"
    assert main([*argv, "--state-dir", str(state)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and fragment in err
    assert list(tmp_path.iterdir()) == []  # no state directory, no identity key


def test_no_doc_names_a_setting_that_does_not_exist() -> None:
    root = DOCS.parent.parent
    texts = {p.name: p.read_text() for p in [root / "README.md", *sorted(DOCS.parent.glob("*.md"))]}
    for name, text in texts.items():
        assert "--unsafe-attack" not in text, name
    tables = {c.table for c in _components()}
    for table in ("verifier", "stage_options", "learner", "syncer", "network", "http"):
        assert table in tables


# ---- role choice and stage balance ----


def peer(
    role: str, *, stage: int | None = None, throughput: float = 0.0, leaving: bool = False
) -> PeerRecord:
    hb = Heartbeat(role=role, stage=stage, throughput=throughput, leaving=leaving)
    return PeerRecord(peer_id=NodeIdentity.generate().peer_id, heartbeat=hb, expires_at=NOW + 4)


def test_auto_picks_syncer_only_for_an_authorized_key_with_no_live_syncer() -> None:
    manifest = authorize(RunManifest(), syncers=[PEER])
    assert choose_role("auto", None, PEER, manifest, [], NOW).role == "syncer"
    assert choose_role("auto", None, PEER, manifest, [peer("syncer")], NOW).role == "learner"
    assert choose_role("auto", None, PEER, manifest, [peer("syncer", leaving=True)], NOW).role == "syncer"
    stranger = NodeIdentity.generate().peer_id
    assert choose_role("auto", None, stranger, manifest, [], NOW).role == "learner"


def test_trusted_roles_need_authorization_and_stage_needs_a_valid_index() -> None:
    manifest = RunManifest()
    with pytest.raises(ConfigError, match="--authorize-verifier"):
        choose_role("verifier", None, PEER, manifest, [], NOW)
    with pytest.raises(ConfigError, match="has 2 stages"):
        choose_role("stage", 2, PEER, manifest, [], NOW)
    with pytest.raises(ConfigError, match="--stage only applies"):
        choose_role("learner", 0, PEER, manifest, [], NOW)
    assert choose_role("stage", 1, PEER, manifest, [], NOW).stage == 1


def test_stage_without_index_goes_where_throughput_is_lowest() -> None:
    peers = [
        peer("stage", stage=0, throughput=50.0),
        peer("stage", stage=1, throughput=80.0),
        peer("learner"),
    ]
    assert choose_role("stage", None, PEER, RunManifest(), peers, NOW).stage == 0
    peers.append(peer("stage", stage=0, throughput=100.0, leaving=True))  # leaving replicas do not count
    assert choose_role("stage", None, PEER, RunManifest(), peers, NOW).stage == 0


def test_every_role_name_has_a_module_with_create_role() -> None:
    import importlib

    for name in ROLE_FACTORIES:
        assert callable(importlib.import_module(f"node.roles.{name}").create_role), name


def test_pick_run_prefers_the_asked_run_then_the_only_one_then_the_pinned_one(tmp_path: Path) -> None:
    owner_a, owner_b = NodeIdentity.generate(), NodeIdentity.generate()
    a = SignedManifest.sign(RunManifest(name="a"), owner_a)
    b = SignedManifest.sign(RunManifest(name="b"), owner_b)
    pins = OwnerPins(tmp_path / "pins.json")
    assert pick_run([], run_id=None, pins=pins) is None
    assert pick_run([a, a], run_id=None, pins=pins) == a
    assert pick_run([a, b], run_id=b.run_id, pins=pins) == b
    with pytest.raises(JoinError, match="several runs"):
        pick_run([a, b], run_id=None, pins=pins)
    pins.check_and_pin(b.run_id, owner_b.peer_id, run_name="b")
    assert pick_run([a, b], run_id=None, pins=pins) == b


def test_short_id_tells_ed25519_peers_apart() -> None:
    a, b = NodeIdentity.generate().peer_id, NodeIdentity.generate().peer_id
    assert a[:8] == b[:8] == "12D3KooW"  # why the log prefix uses the tail
    assert short_id(a) != short_id(b) and len(short_id(a)) == 8


# ---- task supervisor ----


def test_supervisor_restarts_then_escalates_and_cancels_on_shutdown() -> None:
    async def scenario() -> None:
        clock = [0.0]
        supervisor = TaskSupervisor(clock=lambda: clock[0])
        calls = {"flaky": 0}
        forever = asyncio.Event()

        async def flaky() -> None:
            calls["flaky"] += 1
            raise RuntimeError("boom")

        supervisor.spawn("flaky", flaky, policy=RestartPolicy(max_restarts=2, backoff_s=0.0))
        supervisor.spawn("idle", forever.wait)
        error = await asyncio.wait_for(asyncio.shield(supervisor.fatal), 5)
        assert isinstance(error, RuntimeError) and calls["flaky"] == 3  # first run + 2 restarts
        assert supervisor.status()["flaky"]["state"] == "failed"
        assert supervisor.status()["idle"]["state"] == "running"
        await supervisor.shutdown(1.0)
        assert supervisor.status()["idle"]["state"] == "cancelled"

    asyncio.run(scenario())


def test_a_task_that_ends_the_node_sets_ended_and_a_quiet_failure_does_not_escalate() -> None:
    async def scenario() -> None:
        supervisor = TaskSupervisor()

        async def done() -> None:
            return None

        async def broken() -> None:
            raise ValueError("x")

        supervisor.spawn("broken", broken, policy=RestartPolicy(max_restarts=0, escalate=False))
        supervisor.spawn("role", done, ends_node=True)
        await asyncio.wait_for(supervisor.ended.wait(), 5)
        await asyncio.sleep(0)
        assert not supervisor.fatal.done()
        assert supervisor.status()["broken"]["state"] == "failed"
        with pytest.raises(ValueError, match="already running"):
            supervisor.spawn("x", asyncio.Event().wait)
            supervisor.spawn("x", asyncio.Event().wait)
        await supervisor.shutdown(1.0)

    asyncio.run(scenario())


# ---- subcommands that start nothing ----


def test_keygen_prints_the_peer_id_and_is_idempotent(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from node.__main__ import main

    key = tmp_path / "keys" / "owner.key"
    assert main(["keygen", "--identity", str(key)]) == 0
    first = capsys.readouterr()
    assert first.out.strip() == NodeIdentity.load(key).peer_id and "new key" in first.err
    assert main(["keygen", "--identity", str(key)]) == 0
    again = capsys.readouterr()
    assert again.out == first.out and "existing key" in again.err


def test_heartbeat_from_a_role_status_always_fits_the_record_schema() -> None:
    from types import SimpleNamespace

    from node.swarm import build_heartbeat
    from protocol import keys
    from protocol.records import RecordLimits, RunRules, check_envelope, make_envelope

    owner, me = NodeIdentity.generate(), NodeIdentity.generate()
    signed = SignedManifest.sign(RunManifest(), owner)
    rules = RunRules.from_manifest(signed, signed.verify())
    ctx = SimpleNamespace(
        role_name="stage",
        stage=1,
        device="cpu",
        http_address="127.0.0.1:5",
        connectivity={"mode": "relay"},
        admission_proof=12345,
    )
    sloppy = {
        "state": "warming up",
        "loss": float("nan"),
        "inner_step": -3,
        "throughput": "fast",
        "load": 0.5,
    }
    hb = build_heartbeat(ctx, sloppy, ["/ip4/127.0.0.1/tcp/1/p2p/" + me.peer_id], now=NOW)  # type: ignore[arg-type]
    assert (hb.state, hb.loss, hb.inner_step, hb.throughput, hb.load, hb.stage) == (
        "idle",
        None,
        0,
        0.0,
        0.5,
        1,
    )
    raw = keys.peers_key(rules.run_id)
    envelope = make_envelope(me, raw, me.peer_id, hb.to_body(), NOW + 4)
    record = check_envelope(
        envelope,
        key_id=keys.key_id(raw),
        subkey=me.peer_id,
        expiration=NOW + 4,
        now=NOW,
        runs={rules.run_id: rules},
        limits=RecordLimits(),
    )
    assert record.signer == me.peer_id
    assert hb.mode == record.body["mode"] == "relay"  # the mode decided at join travels in the heartbeat
    # so does the admission proof once solved (node.swarm.admission.admission_meta sets it)
    assert hb.admission == record.body["admission"] == 12345


# ---- the bootstrap's settings: the same loader and precedence ----


def test_bootstrap_precedence_is_defaults_then_file_then_environment_then_flags(tmp_path: Path) -> None:
    from node.config import BootstrapConfig, load_bootstrap_config

    toml = tmp_path / "bootstrap.toml"
    toml.write_text(
        'run_path = "~/run.toml"\nhttp_port = 1\nrepublish_period_s = 7\nlisten = ["/ip4/0.0.0.0/tcp/31337"]\n'
        f'state_dir = "{tmp_path}"\nserve_reach_checks = false\n'
    )
    environ = {"HIVENODE_BOOTSTRAP": "http_port=2,swarm_cache_s=3"}
    config = load_bootstrap_config(["--config", str(toml)], environ=environ)
    assert config.run_path == Path("~/run.toml").expanduser() and config.state_dir == tmp_path
    assert config.listen == ("/ip4/0.0.0.0/tcp/31337",) and not config.serve_reach_checks
    assert (config.http_port, config.republish_period_s, config.swarm_cache_s) == (
        2,
        7.0,
        3.0,
    )  # env over file
    flags = ["--config", str(toml), "--http", "0.0.0.0:3", "--authorize-syncer", PEER, "--log-level", "DEBUG"]
    config = load_bootstrap_config(flags, environ=environ)
    assert (config.http_host, config.http_port) == ("0.0.0.0", 3)  # flags over the environment
    assert config.authorize_syncers == (PEER,) and config.log_level == "DEBUG"
    defaults = load_bootstrap_config(["--state-dir", str(tmp_path)], environ={})
    assert defaults == BootstrapConfig(state_dir=tmp_path)


@pytest.mark.parametrize(
    ("toml", "environ", "fragments"),
    [
        ("colour = 1\n", {}, ["unknown setting 'colour' in", "bootstrap.toml", "valid keys: state_dir,"]),
        ("", {"HIVENODE_BOOTSTRAP": "colour=1"}, ["'colour'", "HIVENODE_BOOTSTRAP", "republish_period_s"]),
        ("http_port = 70000\n", {}, ["bootstrap.toml", "http port must be in [0, 65535]"]),
        ("", {"HIVENODE_BOOTSTRAP": "join_timeout_s=soon"}, ["HIVENODE_BOOTSTRAP", "join_timeout_s must be"]),
        ("run_path = 3\n", {}, ["run_path must be a path"]),
        ("[bootstrap]\nhttp_port = 1\n", {}, ["bootstrap.toml", "'bootstrap'"]),
    ],
)
def test_bootstrap_bad_keys_and_values_name_where_they_came_from(
    tmp_path: Path, toml: str, environ: dict[str, str], fragments: list[str]
) -> None:
    from node.config import load_bootstrap_config

    path = tmp_path / "bootstrap.toml"
    path.write_text(toml)
    with pytest.raises(ConfigError) as info:
        load_bootstrap_config(["--config", str(path)], environ=environ)
    for fragment in fragments:
        assert fragment in str(info.value)


def test_bootstrap_cli_reports_a_bad_setting_as_a_usage_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from bootstrap.__main__ import EXIT_USAGE, main

    path = tmp_path / "bootstrap.toml"
    path.write_text("colour = 1\n")
    assert main(["--config", str(path)]) == EXIT_USAGE
    assert "unknown setting 'colour'" in capsys.readouterr().err


def test_every_bootstrap_setting_is_in_docs_config_md() -> None:
    from node.config import BOOTSTRAP_FLAGS, BootstrapConfig, build_bootstrap_parser

    text = DOCS.read_text()
    for f in dataclasses.fields(BootstrapConfig):
        assert f"| `{f.name}` |" in text.split("## Bootstrap", 1)[1], f.name
    flags = {opt for action in build_bootstrap_parser()._actions for opt in action.option_strings}
    assert set(BOOTSTRAP_FLAGS.values()) <= flags


# ---- the run's SENTINEL policy (run.toml [sentinel]): read by every verifier, checked by the bootstrap ----


def test_the_runs_sentinel_table_sets_the_monitor_the_ledger_and_the_spot_checks() -> None:
    from node.config import run_sentinel_config
    from verification.tap import SentinelTapConfig

    assert run_sentinel_config({}) == SentinelTapConfig()
    table = {"fence_k": 4, "warmup_checks": 50, "ledger": {"ban_flags": 4}, "spot": {"base_rate": 0.1}}
    config = run_sentinel_config(table)
    assert (config.sentinel.fence_k, config.sentinel.warmup_checks) == (4.0, 50)
    assert config.ledger.ban_flags == 4 and config.spot is not None and config.spot.base_rate == 0.1
    assert config.enabled and config.ledger.window_microbatches == 20  # the rest stays the default


@pytest.mark.parametrize(
    ("table", "fragments"),
    [
        (
            {"window": 64},
            ["unknown setting 'window' in [sentinel] of run.toml", "window_checks", "ledger, spot"],
        ),
        ({"ledger": {"bans": 1}}, ["'bans'", "[sentinel.ledger]", "ban_flags"]),
        ({"spot": 0.5}, ["[sentinel.spot]", "must be a table"]),
        ({"fence_k": "wide"}, ["sentinel.fence_k must be a number"]),
        (
            {"ledger": {"ban_flags": 1, "quarantine_flags": 2}},
            ["[sentinel.ledger]", "quarantine_flags <= ban_flags"],
        ),
    ],
)
def test_a_bad_sentinel_setting_names_the_key_and_the_valid_ones(table: dict, fragments: list[str]) -> None:
    from node.config import run_sentinel_config

    with pytest.raises(ConfigError) as info:
        run_sentinel_config(table, "run.toml")
    for fragment in fragments:
        assert fragment in str(info.value)


def test_the_verifier_applies_the_runs_sentinel_policy() -> None:
    from types import SimpleNamespace

    from node.roles.verifier import VerifierConfig, VerifierRole

    manifest = dataclasses.replace(
        authorize(RunManifest(), verifiers=[PEER]), sentinel={"fence_k": 8.0, "ledger": {"ban_flags": 5}}
    )
    ctx = SimpleNamespace(peer_id=PEER, manifest=manifest, config=None)
    role = VerifierRole(ctx, VerifierConfig(torch_threads=0))  # type: ignore[arg-type]
    assert role.sentinel.sentinel.fence_k == 8.0 and role.sentinel.ledger.ban_flags == 5


def test_the_bootstrap_refuses_a_run_whose_sentinel_table_has_an_unknown_key(tmp_path: Path) -> None:
    from bootstrap.server import load_manifest
    from node.config import BootstrapConfig

    run = tmp_path / "run.toml"
    run.write_text("[sentinel]\nfence_k = 5.0\n[sentinel.ledger]\nban_flag = 3\n")
    with pytest.raises(ConfigError, match=r"'ban_flag' in \[sentinel.ledger\] of .*run.toml"):
        load_manifest(BootstrapConfig(state_dir=tmp_path, run_path=run))
    run.write_text("[sentinel]\nfence_k = 5.0\n")
    assert load_manifest(BootstrapConfig(state_dir=tmp_path, run_path=run)).sentinel == {"fence_k": 5.0}


@pytest.mark.parametrize(
    ("connectivity", "mode"),
    [
        ({"mode": "direct", "reason": "a bootstrap dialed us back"}, "direct"),
        ({"mode": "client", "reason": "no relay granted a reservation"}, "client"),
        ({}, "unknown"),  # not decided (no join yet): the heartbeat keeps the body older nodes write
        ({"mode": "satellite"}, "unknown"),  # never sent: it would be refused
    ],
)
def test_the_heartbeat_mode_is_the_connectivity_decided_at_join(connectivity: dict, mode: str) -> None:
    from node.swarm.membership import connectivity_mode

    assert connectivity_mode(connectivity) == mode
