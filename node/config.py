"""Node settings: the one loader. Every setting is a field of a frozen dataclass, one per component, and each
component is one node.toml table (`Component`): `[network]` and `[http]` here, one per role (`[learner]`,
`[syncer]`, `[stage_options]`, `[verifier]`), listed where the roles are known (`node.__main__.components`).

Precedence, lowest first: the dataclass defaults < node.toml (`--config`) < the environment < command-line flags.
* node.toml: top-level keys (`join`, `role`, `stage`, ...) and one table per component; nested settings as dotted
  keys or sub-tables (`rebalance.dwell_s = 60` under `[stage_options]`).
* the environment: one variable per table (`Component.env`, e.g. `HIVENODE_STAGE`) of "key=value,..." pairs,
  nested fields with a dot ("rebalance.dwell_s=60"); values are read as the setting's type.
* flags: `--join`, `--role`, ... for top-level keys; `--http` sets `[http]`, `--listen` / `--announce` `[network]`.
`HIVENODE_STATE_DIR` moves the default state directory (it is the default, not a setting: `state_dir` wins).

An unknown key stops the node with a `ConfigError` naming the key, where it came from (the file or the variable)
and the valid keys. `python -m node config --defaults` prints every setting with its default, unit and help (the
comment beside the field); docs/config.md is generated from the same function (`reference_markdown`).

The bootstrap's settings (`BootstrapConfig`) go through the same machinery (`layered_config`): defaults <
bootstrap.toml (`python -m bootstrap --config`, its keys at the top level) < `HIVENODE_BOOTSTRAP` < its flags
(`load_bootstrap_config`). They live here rather than in bootstrap/ so that docs/config.md covers both processes
from one generator (bootstrap/ imports node.config; the reverse would be a cycle).
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import functools
import inspect
import io
import json
import os
import sys
import textwrap
import tokenize
import typing
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from protocol.errors import ConfigError
from protocol.keys import is_run_id

if TYPE_CHECKING:
    from verification.tap import SentinelTapConfig

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - pyproject pulls tomli on 3.10
    import tomli as tomllib

ROLE_CHOICES = ("auto", "learner", "stage", "verifier", "syncer")
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")
# every interface, a random port: a volunteer on the internet is dialable (or relayed) without flags; hivemind's own
# default is loopback only, which made every internet joiner a client without saying so. Tests pass LOOPBACK_LISTEN.
DEFAULT_LISTEN = "/ip4/0.0.0.0/tcp/0"
LOOPBACK_LISTEN = "/ip4/127.0.0.1/tcp/0"
STATE_DIR_ENV = "HIVENODE_STATE_DIR"  # read once in default_state_dir(), never at import
BOOTSTRAP_STATE_DIR = (
    f"${STATE_DIR_ENV}/bootstrap, else $XDG_STATE_HOME/hivenode/bootstrap (~/.local/state/hivenode/bootstrap)"
)
T = TypeVar("T")


def default_state_dir(component: str) -> Path:
    """`$HIVENODE_STATE_DIR/<component>`, else `$XDG_STATE_HOME/hivenode/<component>` (~/.local/state/...)."""
    if base := os.environ.get(STATE_DIR_ENV):
        return Path(base).expanduser() / component
    xdg = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(xdg) / "hivenode" / component


def parse_host_port(text: str) -> tuple[str, int]:
    """`HOST:PORT` (port 0 = any free port) -> (host, port); raise ConfigError."""
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ConfigError(f"expected HOST:PORT (e.g. 127.0.0.1:0), got {text!r}")
    return host.strip("[]"), int(port)


def _positive(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
        raise ValueError(f"{name} must be a positive number, got {value!r}")


@dataclass(frozen=True, kw_only=True, slots=True)
class NetworkConfig:
    """The libp2p/DHT side of a node."""

    listen: tuple[str, ...] = (DEFAULT_LISTEN,)  # multiaddrs the DHT listens on
    announce: tuple[str, ...] = ()  # multiaddrs others should dial (public IP, explicit port)
    join_timeout_s: float = (
        30.0  # bounds: daemon start with its first bootstrap contact; finding the manifest
    )
    request_timeout_s: float = 5.0  # bounds: each DHT store/get and each HTTP fetch of a bootstrap URL
    client_mode: bool = False  # True: do not serve DHT requests (for nodes others cannot dial)
    # libp2p circuit relays: reach relayed peers through relays, and relay for others (p2pd does both or neither)
    use_relay: bool = True
    # when a bootstrap cannot dial us back, reserve a slot on a bootstrap's relay and serve through it (relay mode);
    # false, or no relay grants one: client mode (train and push, serve nothing)
    use_auto_relay: bool = True
    relay_wait_s: float = 10.0  # bounds: getting a relay reservation and seeing a probe reach us through it
    check_reachability: bool = (
        True  # at start, ask a bootstrap to dial us back; unreachable -> relay or client
    )
    # Losing the bootstraps (a partition, a dead uplink): hivemind never re-dials its initial peers on its own, so
    # we check the routing table this often and re-dial them with exponential backoff between these bounds.
    peer_check_period_s: float = 5.0
    redial_min_s: float = 1.0  # first pause before re-dialing the bootstraps
    redial_max_s: float = 60.0  # longest pause between re-dials

    def __post_init__(self) -> None:
        _positive("network.join_timeout_s", self.join_timeout_s)
        _positive("network.request_timeout_s", self.request_timeout_s)
        for name in ("peer_check_period_s", "redial_min_s", "redial_max_s", "relay_wait_s"):
            _positive(f"network.{name}", getattr(self, name))
        if self.redial_max_s < self.redial_min_s:
            raise ValueError("network.redial_max_s must be >= network.redial_min_s")
        if not self.listen or not all(isinstance(m, str) and m.startswith("/") for m in self.listen):
            raise ValueError(f"network.listen must be multiaddrs, got {self.listen!r}")
        if not all(isinstance(m, str) and m.startswith("/") for m in self.announce):
            raise ValueError(f"network.announce must be multiaddrs, got {self.announce!r}")


@dataclass(frozen=True, kw_only=True, slots=True)
class HttpConfig:
    """Where the status API (`/api/status`, `/metrics`) listens."""

    host: str = "127.0.0.1"  # interface of the status API (0.0.0.0: every interface)
    port: int = 0  # 0 = any free port; the chosen one is printed and announced in the heartbeat

    def __post_init__(self) -> None:
        if isinstance(self.port, bool) or not isinstance(self.port, int) or not 0 <= self.port <= 65535:
            raise ValueError(f"http.port must be in [0, 65535], got {self.port!r}")
        if not isinstance(self.host, str) or not self.host:
            raise ValueError("http.host must be a non-empty string")


@dataclass(frozen=True, kw_only=True, slots=True)
class BootstrapConfig:
    """Everything `python -m bootstrap` needs; build with `load_bootstrap_config`. It sits here, beside the node's
    settings, so that one loader reads both and docs/config.md lists both (bootstrap/ imports node.config)."""

    state_dir: Path = field(
        default_factory=lambda: default_state_dir("bootstrap"), metadata={"shown": BOOTSTRAP_STATE_DIR}
    )  # identity, maddrs, the swarm's event log
    identity_path: Path | None = None  # DHT identity; none = <state_dir>/identity.key
    owner_key_path: Path | None = None  # key that signs the manifest; none = the identity
    run_path: Path | None = None  # run.toml; none = the built-in default run
    tokenizer_path: Path | None = None  # a BPE tokenizer.json: its hash goes in the manifest, peers fetch it
    # a folder of token shards (`python -m bootstrap data prepare`): its index hash goes in the manifest and the
    # shards are served by hash at /api/data/; none = the run's own data spec (the built-in corpus by default)
    data_dir: Path | None = None
    authorize_syncers: tuple[str, ...] = ()  # peer ids added to the manifest's authorized syncers
    authorize_verifiers: tuple[str, ...] = ()  # peer ids added to the manifest's authorized verifiers
    # peer ids of the run's other bootstraps (ours is added when its key is not the owner's): only these are
    # listed in /api/swarm and vouch for the run to joining nodes
    authorize_bootstraps: tuple[str, ...] = ()
    # the owner's own syncer, a child `python -m node --role syncer` whose key (<state_dir>/roles/syncer/) is
    # created here and authorized in the manifest: with it, a default swarm merges; false = the owner runs one
    run_syncer: bool = True
    run_verifier: bool = True  # the same for a verifier, when the run has pipeline stages
    roles_config_path: Path | None = None  # node.toml (`--config`) for those children; none = node defaults
    listen: tuple[str, ...] = (DEFAULT_LISTEN,)  # DHT listen multiaddrs; a fixed port: a stable multiaddr
    announce: tuple[str, ...] = ()  # multiaddrs to announce (public IP, explicit port)
    join: tuple[str, ...] = ()  # other bootstraps or hivemind-dht peers to connect to
    http_host: str = "127.0.0.1"  # interface of the dashboard and the status API
    http_port: int = 0  # 0 = any free port (printed)
    maddrs_file: Path | None = None  # where to write our multiaddrs, one per line
    republish_period_s: float = 60.0  # manifest and discovery records are re-published this often
    manifest_ttl_periods: float = 10.0  # ... and expire this many periods after each publish
    join_timeout_s: float = 30.0  # bounds the DHT start (and its first contact with --join peers)
    request_timeout_s: float = 5.0  # bounds each DHT store/get
    swarm_cache_s: float = 0.5  # /api/swarm answers from a snapshot at most this old (bounds DHT load)
    serve_reach_checks: bool = True  # dial joining nodes back so they learn whether peers can reach them
    # relay connections to nodes others cannot dial (libp2p circuit relay v2; they reserve a slot here)
    relay: bool = True
    # bounds the fetch of the active syncer's /api/status (merge details)
    syncer_status_timeout_s: float = 2.0
    shutdown_timeout_s: float = 5.0  # bounds: announcing leave, cancelling tasks
    log_level: str = "INFO"  # DEBUG | INFO | WARNING | ERROR

    def __post_init__(self) -> None:
        for name in ("republish_period_s", "manifest_ttl_periods", "join_timeout_s", "request_timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive")
        if self.swarm_cache_s < 0 or self.shutdown_timeout_s <= 0:
            raise ValueError("swarm_cache_s must be >= 0 and shutdown_timeout_s positive")
        if not 0 <= self.http_port <= 65535:
            raise ValueError(f"http port must be in [0, 65535], got {self.http_port}")
        if self.log_level not in LOG_LEVELS:
            raise ValueError(f"log_level must be one of {LOG_LEVELS}, got {self.log_level!r}")

    @property
    def identity_file(self) -> Path:
        return self.identity_path or self.state_dir / "identity.key"


@dataclass(frozen=True, kw_only=True, slots=True)
class NodeConfig:
    """Everything `python -m node` needs; build with `load_node_config`."""

    join: tuple[str, ...]  # multiaddrs (with /p2p/<peer id>) or http(s) URLs of a bootstrap's /api/swarm
    state_dir: Path  # identity, pinned owners, event log
    role: str = "auto"  # auto | learner | stage | verifier | syncer (node.roles.registry.choose_role: auto)
    stage: int | None = None  # pipeline stage for role `stage`; none = the least served
    device: str = "auto"  # auto | cpu | cuda | cuda:N | mps: where every role computes (auto: the best)
    identity_path: Path | None = None  # Ed25519 key file; none = <state_dir>/identity.key
    data: str | None = None  # corpus override (file, directory, dataset name); none = the run's data spec
    max_steps: int | None = None  # stop after this many inner steps (roles that step); none = never
    run_id: str | None = None  # which run to join when the DHT hosts several
    log_level: str = "INFO"  # DEBUG | INFO | WARNING | ERROR
    progress: bool = True  # the join's progress on the console (a live line on a terminal); false: --quiet
    shutdown_timeout_s: float = 5.0  # bounds: announcing leave, cancelling tasks, stopping the DHT
    network: NetworkConfig = field(default_factory=NetworkConfig)
    http: HttpConfig = field(default_factory=HttpConfig)
    # A role's settings as given (file and environment merged, keys and types checked by the loader); the role
    # builds its dataclass from them (`component_config`), since some defaults are the run's (syncer leases).
    learner: dict[str, Any] = field(default_factory=dict)
    syncer: dict[str, Any] = field(default_factory=dict)
    stage_options: dict[str, Any] = field(default_factory=dict)
    verifier: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for table in ROLE_TABLES:
            if not isinstance(getattr(self, table), dict):
                raise ValueError(f"[{table}] must be a table")
        if not self.join:
            raise ValueError("at least one --join MADDR_OR_URL is needed")
        if self.role not in ROLE_CHOICES:
            raise ValueError(f"role must be one of {ROLE_CHOICES}, got {self.role!r}")
        if self.stage is not None and (isinstance(self.stage, bool) or not isinstance(self.stage, int)):
            raise ValueError(f"stage must be an int, got {self.stage!r}")
        if self.stage is not None and self.stage < 0:
            raise ValueError(f"stage must be >= 0, got {self.stage}")
        if not isinstance(self.device, str) or not _is_device(self.device):
            raise ValueError(f"device must be auto, cpu, cuda, cuda:N or mps, got {self.device!r}")
        if self.max_steps is not None and (
            isinstance(self.max_steps, bool) or not isinstance(self.max_steps, int) or self.max_steps < 1
        ):
            raise ValueError(f"max_steps must be an int >= 1, got {self.max_steps!r}")
        if self.run_id is not None and not is_run_id(self.run_id):
            raise ValueError(f"run_id must be 40 hex characters, got {self.run_id!r}")
        if self.log_level not in LOG_LEVELS:
            raise ValueError(f"log_level must be one of {LOG_LEVELS}, got {self.log_level!r}")
        _positive("shutdown_timeout_s", self.shutdown_timeout_s)

    @property
    def identity_file(self) -> Path:
        return self.identity_path or self.state_dir / "identity.key"


def _is_device(device: str) -> bool:
    """A `--device` this loader accepts; whether this machine has it is `node.context.resolve_device`'s check."""
    return device in ("auto", "cpu", "mps", "cuda") or (device.startswith("cuda:") and device[5:].isdigit())


ROLE_TABLES = ("learner", "syncer", "stage_options", "verifier")


@dataclass(frozen=True, slots=True)
class Component:
    """One node.toml table: the dataclass it fills and the environment variable that overrides it."""

    table: str  # also the NodeConfig field it fills
    config_type: type  # a dataclass whose fields all have defaults
    env: str  # "key=value,..." overrides
    help: str
    # Defaults that depend on the run: the config for a heartbeat period (the syncer's lease timing). Such a
    # table is checked at load for keys and types only; the role checks the rest once it knows the run.
    heartbeat_default: Callable[[float], Any] | None = None


NODE_COMPONENTS = (
    Component("network", NetworkConfig, "HIVENODE_NETWORK", "the libp2p/DHT side of a node"),
    Component("http", HttpConfig, "HIVENODE_HTTP", "where the status API (/api/status, /metrics) listens"),
)
# node.toml names of NodeConfig fields that differ from the field (the path is the key file, not "identity_path")
RENAMES = {"identity": "identity_path"}
FLAGS = {  # node.toml key -> the flag that sets it (one source for the reference and the --help defaults)
    "join": "--join",
    "role": "--role",
    "stage": "--stage",
    "device": "--device",
    "identity": "--identity",
    "state_dir": "--state-dir",
    "data": "--data",
    "max_steps": "--max-steps",
    "log_level": "--log-level",
    "progress": "--quiet",
    "http.host": "--http",
    "http.port": "--http",
    "network.listen": "--listen",
    "network.announce": "--announce",
}
SHOWN_DEFAULTS = {  # defaults that are not a constant
    "join": "(required)",
    "state_dir": f"${STATE_DIR_ENV}/node, else $XDG_STATE_HOME/hivenode/node (~/.local/state/hivenode/node)",
    "identity": "<state_dir>/identity.key",
}


# ---------------------------------------------------------------------------------------------------- the CLI


def build_run_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m node",
        description="Join a hivenode training swarm. Subcommands: keygen, status, demo, config, trust (see "
        "`python -m node config -h`, `python -m node trust -h`). Settings: defaults < node.toml (--config) < HIVENODE_<TABLE> environment "
        "variables < these flags; every one is in docs/config.md.",
    )
    add = parser.add_argument
    add(
        "--join",
        action="append",
        metavar="MADDR_OR_URL",
        help="bootstrap multiaddr or http URL (repeatable; required)",
    )
    add("--role", choices=ROLE_CHOICES, help="what this node does (default: auto)")
    add("--stage", type=int, help="pipeline stage for --role stage (default: the least served)")
    add(
        "--device",
        help="where every role computes: auto | cpu | cuda | cuda:N | mps (default: auto, the best available: "
        "cuda, else mps, else cpu)",
    )
    add("--identity", type=Path, metavar="PATH", help="Ed25519 key file (default: <state-dir>/identity.key)")
    add(
        "--state-dir",
        type=Path,
        metavar="DIR",
        help=f"identity, pinned owners, event log (default: {default_state_dir('node')})",
    )
    add("--http", metavar="HOST:PORT", help="status API address (default: 127.0.0.1:0, any free port)")
    add(
        "--listen",
        action="append",
        metavar="MADDR",
        help=f"libp2p listen multiaddr (repeatable; default: {DEFAULT_LISTEN}; public: /ip4/0.0.0.0/tcp/31338)",
    )
    add(
        "--announce",
        action="append",
        metavar="MADDR",
        help="multiaddr others should dial: public IP and a fixed port (repeatable; default: none)",
    )
    add("--data", metavar="PATH", help="training data: file, directory or dataset name (default: the run's)")
    add("--max-steps", type=int, metavar="N", help="stop after N inner steps (default: never)")
    add("--config", type=Path, metavar="node.toml", help="settings file (default: none); flags win over it")
    add("--log-level", choices=LOG_LEVELS, help="default: INFO")
    add(
        "--quiet",
        dest="progress",
        action="store_false",
        default=None,
        help="no progress line on the console, log lines only (default: a live line on a terminal)",
    )
    return parser


def _cli_layer(args: argparse.Namespace) -> _Layer:
    flags = {
        "join": args.join,
        "role": args.role,
        "stage": args.stage,
        "device": args.device,
        "identity": args.identity,
        "state_dir": args.state_dir,
        "data": args.data,
        "max_steps": args.max_steps,
        "log_level": args.log_level,
        "progress": args.progress,
    }
    tables: dict[str, dict[str, Any]] = {}
    if args.http is not None:
        host, port = parse_host_port(args.http)
        tables["http"] = {"host": host, "port": port}
    network = {"listen": args.listen, "announce": args.announce}
    if any(v is not None for v in network.values()):
        tables["network"] = {k: v for k, v in network.items() if v is not None}
    return _Layer("the command line", {k: v for k, v in flags.items() if v is not None}, tables)


# ---------------------------------------------------------------------------------------------------- loading


@dataclass(frozen=True, slots=True)
class _Layer:
    """What one source (the file, one environment variable, the flags) says."""

    source: str
    top: dict[str, Any]
    tables: dict[str, dict[str, Any]]


def load_node_config(
    argv: Sequence[str],
    *,
    environ: Mapping[str, str] | None = None,
    components: Sequence[Component] = NODE_COMPONENTS,
) -> NodeConfig:
    """Parse `python -m node` flags over the environment over `--config`; raise ConfigError. `components`: the
    tables known (`node.__main__.components()` adds the roles')."""
    args = build_run_parser().parse_args(list(argv))
    environ = os.environ if environ is None else environ
    layers = [_mapping_layer(str(args.config), _read_toml(args.config), components)] if args.config else []
    for component in components:
        if text := environ.get(component.env, "").strip():
            table = parse_overrides(text, component.env)
            _check_keys(component.config_type(), table, component.table, component.env)
            layers.append(_Layer(component.env, {}, {component.table: table}))
    layers.append(_cli_layer(args))
    return _build(layers, components)


def config_from_mapping(
    data: Mapping[str, Any], components: Sequence[Component] = NODE_COMPONENTS, source: str = "the settings"
) -> NodeConfig:
    """A NodeConfig from a node.toml-shaped mapping alone; raise ConfigError on anything unknown or invalid."""
    return _build([_mapping_layer(source, data, components)], components)


def _read_toml(path: Path) -> dict[str, Any]:
    try:
        return tomllib.loads(path.read_text())
    except OSError as e:
        raise ConfigError(f"cannot read config {path}: {e.strerror or e}") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"config {path} is not valid TOML: {e}") from None


def _top_keys() -> list[str]:
    names = [
        f.name for f in dataclasses.fields(NodeConfig) if f.name not in ("network", "http", *ROLE_TABLES)
    ]
    back = {new: old for old, new in RENAMES.items()}
    return [back.get(name, name) for name in names]


def _mapping_layer(source: str, data: Mapping[str, Any], components: Sequence[Component]) -> _Layer:
    by_table = {c.table: c for c in components}
    top_keys = _top_keys()
    top: dict[str, Any] = {}
    tables: dict[str, dict[str, Any]] = {}
    for key, value in data.items():
        if key in by_table:
            _check_keys(by_table[key].config_type(), value, key, source)
            tables[key] = dict(value)
        elif key in top_keys:
            top[key] = value
        else:
            valid = ", ".join([*top_keys, *(f"[{t}]" for t in by_table)])
            raise ConfigError(f"unknown setting {key!r} in {source}; valid keys: {valid}")
    return _Layer(source, top, tables)


def _build(layers: Sequence[_Layer], components: Sequence[Component]) -> NodeConfig:
    top: dict[str, Any] = {}
    tables: dict[str, dict[str, Any]] = {}
    sources: dict[str, list[str]] = {}
    for layer in layers:
        top.update(layer.top)
        for name, table in layer.tables.items():
            tables[name] = _merge(tables.get(name, {}), table)
            sources.setdefault(name, []).append(layer.source)
    values = _top_values(top)
    for component in components:
        settings = tables.get(component.table, {})
        where = ", ".join(sources.get(component.table, [])) or "defaults"
        built = _settle(component, settings, where)
        values[component.table] = settings if component.table in ROLE_TABLES else built
    try:
        return NodeConfig(**values)
    except (ValueError, TypeError) as e:
        raise ConfigError(str(e)) from None


def _top_values(top: Mapping[str, Any]) -> dict[str, Any]:
    values = {RENAMES.get(key, key): value for key, value in top.items()}
    join = values.get("join") or ()
    values["join"] = tuple([join] if isinstance(join, str) else join)
    for key in ("state_dir", "identity_path"):
        if values.get(key) is not None:
            values[key] = Path(str(values[key])).expanduser()
    values.setdefault("state_dir", default_state_dir("node"))
    return values


def _settle(component: Component, settings: Mapping[str, Any], where: str) -> Any:
    """The component's config from `settings` (ConfigError naming where they came from)."""
    default = component.config_type()
    try:
        if component.heartbeat_default is not None:
            _changes(default, settings, component.table)  # the rest needs the run (see Component)
            return default
        return _apply(default, settings, component.table)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"[{component.table}] ({where}): {e}") from None


def component_config(
    default: T,
    settings: Mapping[str, Any] | None = None,
    *,
    table: str,
    env: str | None = None,
    environ: Mapping[str, str] | None = None,
) -> T:
    """`default` with a component's settings applied (a node.toml table, nested tables for nested settings),
    then the `env` variable's "key=value,..." from `environ` (the node's loader has already merged it into
    NodeConfig's tables: roles pass none). Raises ConfigError naming the bad setting."""
    layers = [(f"[{table}]", dict(settings or {}))]
    if env and (text := (environ or {}).get(env, "").strip()):
        layers.append((env, parse_overrides(text, env)))
    return layered_config(default, layers, table=table)


def layered_config(default: T, layers: Sequence[tuple[str, Mapping[str, Any]]], *, table: str = "") -> T:
    """`default` with each (source, settings) layer applied over the ones before it, lowest first. Raises
    ConfigError naming an unknown key, its source and the valid keys, or a bad value and the sources merged.
    `table` prefixes the keys in messages ("" for a file that is the component's alone: bootstrap.toml)."""
    merged: dict[str, Any] = {}
    for source, values in layers:
        _check_keys(default, values, table, source)
        merged = _merge(merged, values)
    try:
        return _apply(default, merged, table)
    except (TypeError, ValueError) as e:
        where = ", ".join(source for source, _ in layers) or "defaults"
        raise ConfigError(f"{f'[{table}] ' if table else ''}({where}): {e}") from None


# ---------------------------------------------------------------------------------------------------- the run's SENTINEL

SENTINEL_SUBTABLES = ("ledger", "spot")  # run.toml [sentinel.ledger], [sentinel.spot]


def run_sentinel_config(table: Mapping[str, Any], source: str = "the run manifest") -> SentinelTapConfig:
    """The run's SENTINEL policy (run.toml `[sentinel]`) over the defaults: the monitor's settings
    (`verification.sentinel.SentinelConfig`) at the top, the ledger's (`LedgerConfig`) in `[sentinel.ledger]`,
    the spot checks' (`SpotCheckConfig`) in `[sentinel.spot]`. A verifier has no local SENTINEL settings: every
    verifier of a run applies the run's, so none can loosen them. The bootstrap checks them before it signs the
    manifest; ConfigError names the key, `source` and the valid keys."""
    from verification.ledger import LedgerConfig  # verification/ pulls in torch: only where it is needed
    from verification.sentinel import SentinelConfig
    from verification.spotcheck import SpotCheckConfig
    from verification.tap import SentinelTapConfig

    monitor = {k: v for k, v in table.items() if k not in SENTINEL_SUBTABLES}
    try:
        _check_keys(SentinelConfig(), monitor, "sentinel", source)
    except ConfigError as e:
        raise ConfigError(f"{e}; sub-tables: {', '.join(SENTINEL_SUBTABLES)}") from None
    return SentinelTapConfig(
        sentinel=layered_config(SentinelConfig(), [(source, monitor)], table="sentinel"),
        ledger=layered_config(LedgerConfig(), [(source, table.get("ledger", {}))], table="sentinel.ledger"),
        spot=layered_config(SpotCheckConfig(), [(source, table.get("spot", {}))], table="sentinel.spot"),
    )


# ---------------------------------------------------------------------------------------------------- the bootstrap

BOOTSTRAP = Component(
    "bootstrap",
    BootstrapConfig,
    "HIVENODE_BOOTSTRAP",
    "settings of the run owner's entry point, `python -m bootstrap`",
)
BOOTSTRAP_FLAGS = {  # BootstrapConfig field -> the flag that sets it
    "state_dir": "--state-dir",
    "identity_path": "--identity",
    "owner_key_path": "--owner-key",
    "run_path": "--run",
    "authorize_syncers": "--authorize-syncer",
    "authorize_verifiers": "--authorize-verifier",
    "authorize_bootstraps": "--authorize-bootstrap",
    "run_syncer": "--no-syncer",
    "run_verifier": "--no-verifier",
    "relay": "--no-relay",
    "roles_config_path": "--roles-config",
    "listen": "--listen",
    "announce": "--announce",
    "join": "--join",
    "http_host": "--http",
    "http_port": "--http",
    "maddrs_file": "--maddrs-file",
    "log_level": "--log-level",
}


def _add_owner_switches(parser: argparse.ArgumentParser) -> None:
    """The bootstrap's `--no-...` switches: what it runs for the swarm unless told not to."""
    add = parser.add_argument
    add(
        "--no-syncer",
        dest="run_syncer",
        action="store_false",
        default=None,
        help="do not run the owner's syncer (authorize yours with --authorize-syncer)",
    )
    add(
        "--no-verifier",
        dest="run_verifier",
        action="store_false",
        default=None,
        help="do not run the owner's verifier (pipeline runs; authorize yours with --authorize-verifier)",
    )
    add(
        "--no-relay",
        dest="relay",
        action="store_false",
        default=None,
        help="do not relay for undialable nodes",
    )


def build_bootstrap_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m bootstrap",
        description="Run a hivenode bootstrap peer. Settings: defaults < bootstrap.toml (--config) < "
        f"{BOOTSTRAP.env} environment variable < these flags; every one is in docs/config.md.",
    )
    add = parser.add_argument
    add("--run", type=Path, metavar="run.toml", help="run settings (default: the built-in default run)")
    add("--listen", action="append", metavar="MADDR", help=f"DHT listen multiaddr (default {DEFAULT_LISTEN})")
    add("--announce", action="append", metavar="MADDR", help="public multiaddr to announce (repeatable)")
    add(
        "--join", action="append", metavar="MADDR", help="another bootstrap or hivemind-dht peer (repeatable)"
    )
    add("--identity", type=Path, metavar="PATH", help="DHT key (default: <state-dir>/identity.key)")
    add("--owner-key", type=Path, metavar="PATH", help="key that signs the manifest (default: --identity)")
    add("--authorize-syncer", action="append", metavar="PEER_ID", help="add an authorized syncer")
    add("--authorize-verifier", action="append", metavar="PEER_ID", help="add an authorized verifier")
    add("--authorize-bootstrap", action="append", metavar="PEER_ID", help="add another bootstrap of the run")
    _add_owner_switches(parser)
    add("--roles-config", type=Path, metavar="node.toml", help="settings of the owner's syncer and verifier")
    add("--http", metavar="HOST:PORT", help="HTTP address (default 127.0.0.1:0)")
    add("--maddrs-file", type=Path, metavar="PATH", help="write our multiaddrs here, one per line")
    add(
        "--tokenizer",
        type=Path,
        metavar="tokenizer.json",
        help="the run's BPE tokenizer (python -m bootstrap tokenizer train); default: raw bytes",
    )
    add("--data-dir", type=Path, metavar="DIR", help="token shards to serve (bootstrap data prepare)")
    add(
        "--state-dir",
        type=Path,
        metavar="DIR",
        help=f"identity and state (default: {default_state_dir('bootstrap')})",
    )
    add(
        "--config",
        type=Path,
        metavar="bootstrap.toml",
        help="settings file (default: none); flags win over it",
    )
    add("--log-level", choices=LOG_LEVELS, help="default: INFO")
    return parser


def load_bootstrap_config(
    argv: Sequence[str], *, environ: Mapping[str, str] | None = None
) -> BootstrapConfig:
    """Parse `python -m bootstrap` flags over `HIVENODE_BOOTSTRAP` over `--config` over the defaults; raise
    ConfigError (argparse exits 2 on a malformed command line)."""
    args = build_bootstrap_parser().parse_args(list(argv))
    environ = os.environ if environ is None else environ
    layers: list[tuple[str, Mapping[str, Any]]] = []
    if args.config is not None:
        layers.append((str(args.config), _read_toml(args.config)))
    if text := environ.get(BOOTSTRAP.env, "").strip():
        layers.append((BOOTSTRAP.env, parse_overrides(text, BOOTSTRAP.env)))
    layers.append(("the command line", _bootstrap_flags(args)))
    return layered_config(BootstrapConfig(), layers)


def _bootstrap_flags(args: argparse.Namespace) -> dict[str, Any]:
    given = {
        "state_dir": args.state_dir,
        "identity_path": args.identity,
        "owner_key_path": args.owner_key,
        "run_path": args.run,
        "tokenizer_path": args.tokenizer,
        "data_dir": args.data_dir,
        "authorize_syncers": args.authorize_syncer,
        "authorize_verifiers": args.authorize_verifier,
        "authorize_bootstraps": args.authorize_bootstrap,
        "run_syncer": args.run_syncer,
        "run_verifier": args.run_verifier,
        "relay": args.relay,
        "roles_config_path": args.roles_config,
        "listen": args.listen,
        "announce": args.announce,
        "join": args.join,
        "maddrs_file": args.maddrs_file,
        "log_level": args.log_level,
    }
    if args.http is not None:
        given["http_host"], given["http_port"] = parse_host_port(args.http)
    return {key: value for key, value in given.items() if value is not None}


def parse_overrides(text: str, source: str) -> dict[str, Any]:
    """ "key=value,a.b=value" (";" also separates) -> {"key": "value", "a": {"b": "value"}}; ConfigError."""
    out: dict[str, Any] = {}
    for item in filter(None, (part.strip() for part in text.replace(";", ",").split(","))):
        key, sep, raw = item.partition("=")
        path = [part.strip() for part in key.split(".")]
        if not sep or not all(path):
            raise ConfigError(f"{source}: {item!r} is not key=value")
        node = out
        for part in path[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"{source}: {key.strip()!r} is set both as a value and as a table")
        node[path[-1]] = raw.strip()
    return out


def _merge(base: Mapping[str, Any], top: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in top.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), Mapping):
            out[key] = _merge(out[key], value)
        else:
            out[key] = value
    return out


def _check_keys(obj: object, values: object, where: str, source: str) -> None:
    """Every key of `values` names a field of the dataclass `obj` (tables for nested ones); ConfigError."""
    if not isinstance(values, Mapping):
        raise ConfigError(f"[{where}] in {source} must be a table, got {values!r}")
    names = [f.name for f in dataclasses.fields(obj)]  # type: ignore[arg-type]
    for key, value in values.items():
        if key not in names:
            within = f" in [{where}] of" if where else " in"
            raise ConfigError(f"unknown setting {key!r}{within} {source}; valid keys: {', '.join(names)}")
        current = getattr(obj, key)
        if dataclasses.is_dataclass(current):
            _check_keys(current, value, _dotted(where, key), source)
        elif isinstance(value, Mapping):
            raise ConfigError(f"{_dotted(where, key)} in {source} is a value, not a table")


def _dotted(where: str, key: str) -> str:
    return f"{where}.{key}" if where else key


def _changes(obj: Any, values: Mapping[str, Any], where: str) -> dict[str, Any]:
    changes: dict[str, Any] = {}
    for key, raw in values.items():
        current = getattr(obj, key)
        name = _dotted(where, key)
        if dataclasses.is_dataclass(current):
            changes[key] = _apply(current, raw, name)
        elif isinstance(current, Path) or (current is None and _is_path_field(type(obj), key)):
            changes[key] = _path(name, raw)
        else:
            changes[key] = _coerce(name, current, raw)
    return changes


def _is_path_field(cls: type, key: str) -> bool:
    """Whether the field is a Path (or Path | None): a None default says nothing about the type."""
    try:
        hint = typing.get_type_hints(cls).get(key)
    except NameError:  # an annotation naming a type imported for type checking only
        return False
    return hint is Path or Path in typing.get_args(hint)


def _path(name: str, raw: object) -> Path:
    if not isinstance(raw, str | Path) or not str(raw):
        raise ValueError(f"{name} must be a path, got {raw!r}")
    return Path(raw).expanduser()


def _apply(obj: T, values: Mapping[str, Any], where: str) -> T:
    """One `replace` per dataclass, so that settings checked together (a lease and its renewal) change together."""
    return dataclasses.replace(obj, **_changes(obj, values, where)) if values else obj  # type: ignore[type-var]


def _coerce(name: str, current: object, raw: object) -> object:
    """`raw` (text from the environment, or a TOML value) as the type of the setting's default."""
    if isinstance(current, bool):
        if isinstance(raw, bool):
            return raw
        if str(raw).lower() not in ("true", "false", "1", "0"):
            raise ValueError(f"{name} must be true or false, got {raw!r}")
        return str(raw).lower() in ("true", "1")
    if isinstance(raw, bool):
        raise ValueError(f"{name} cannot be set to {raw!r}")
    if isinstance(current, int):
        return _number(name, raw, int)
    if isinstance(current, float):
        return _number(name, raw, float)
    if isinstance(current, str) and isinstance(raw, str):
        return raw
    if isinstance(current, tuple) and isinstance(raw, list | tuple) and all(isinstance(v, str) for v in raw):
        return tuple(raw)
    if isinstance(current, tuple):
        raise ValueError(f"{name} must be a list of strings, got {raw!r}")
    raise ValueError(f"{name} cannot be set to {raw!r}")


def _number(name: str, raw: object, kind: type[int] | type[float]) -> int | float:
    try:
        value = float(raw) if isinstance(raw, str) and kind is float else raw
        if isinstance(value, str):
            value = int(value)
        if isinstance(value, float) and kind is int and not value.is_integer():
            raise ValueError
        if not isinstance(value, int | float):
            raise ValueError
        return kind(value)
    except (ValueError, OverflowError):
        noun = "an int" if kind is int else "a number"
        raise ValueError(f"{name} must be {noun}, got {raw!r}") from None


# ---------------------------------------------------------------------------------------------------- reference


@dataclass(frozen=True, slots=True)
class Option:
    """One setting as `python -m node config --defaults` and docs/config.md show it."""

    key: str  # dotted within its table
    type: str
    default: str  # as TOML, or a description where it is not a constant (then not settable as shown)
    unit: str
    help: str
    flag: str = ""
    literal: bool = True  # `default` is a TOML value


def _unit(name: str) -> str:
    for suffix, unit in (("_per_s", "1/s"), ("_s", "s"), ("_bytes", "bytes")):
        if name.endswith(suffix):
            return unit
    return "path" if name.endswith(("_dir", "_path")) else ""


def _toml_value(value: object) -> str | None:
    if isinstance(value, bool | int | float | str):
        return json.dumps(value)
    if isinstance(value, tuple | list) and all(isinstance(v, str) for v in value):
        return json.dumps(list(value))
    return None


def _options(obj: Any, prefix: str = "", derived: Any = None) -> list[Option]:
    """Every leaf setting of the dataclass instance `obj`, nested ones as dotted keys. `derived(hb)`: the
    config for a heartbeat period, for defaults that scale with it."""
    helps = field_help(obj.__class__)
    out: list[Option] = []
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if dataclasses.is_dataclass(value):
            out += _options(value, f"{prefix}{f.name}.")
            continue
        shown, literal = _toml_value(value), True
        if "shown" in f.metadata:  # a default that depends on the machine (the state directory)
            shown, literal = str(f.metadata["shown"]), False
        if derived is not None and getattr(derived(1.0), f.name) != getattr(derived(2.0), f.name):
            shown, literal = f"{getattr(derived(1.0), f.name):g} x the run's heartbeat_period_s", False
        if shown is None:
            shown, literal = "none", False
        out.append(
            Option(
                f"{prefix}{f.name}", str(f.type), shown, _unit(f.name), helps.get(f.name, ""), literal=literal
            )
        )
    return out


def _top_options() -> list[Option]:
    helps = field_help(NodeConfig)
    back = {new: old for old, new in RENAMES.items()}
    out: list[Option] = []
    for f in dataclasses.fields(NodeConfig):
        key = back.get(f.name, f.name)
        if key not in _top_keys():
            continue
        default = None if f.default is dataclasses.MISSING else _toml_value(f.default)
        shown = SHOWN_DEFAULTS.get(key) or default or "none"
        literal = key not in SHOWN_DEFAULTS and default is not None
        out.append(
            Option(key, str(f.type), shown, _unit(key), helps.get(f.name, ""), FLAGS.get(key, ""), literal)
        )
    return out


def reference(components: Sequence[Component]) -> list[tuple[Component | None, list[Option]]]:
    """(component, its options) for the top level (None) and each table, in node.toml order."""
    out: list[tuple[Component | None, list[Option]]] = [(None, _top_options())]
    for c in components:
        options = _options(c.config_type(), derived=c.heartbeat_default)
        flagged = [dataclasses.replace(o, flag=FLAGS.get(f"{c.table}.{o.key}", "")) for o in options]
        out.append((c, flagged))
    return out


def reference_text(components: Sequence[Component]) -> str:
    """Every setting as a commented node.toml (defaults that are not constants are commented out)."""
    lines = [
        "# hivenode node settings with their defaults (python -m node config --defaults).",
        "# Precedence: defaults < node.toml (--config) < environment < command-line flags.",
    ]
    for component, options in reference(components):
        lines.append("")
        if component is not None:
            lines.append(f'[{component.table}]  # {component.help}; env {component.env}="key=value,..."')
        for o in options:
            notes = [f"[{o.unit}]" if o.unit else "", f"({o.flag})" if o.flag else "", o.help]
            setting = f"{o.key} = {o.default}" if o.literal else f"# {o.key}: {o.default}"
            lines.append(f"{setting}  # {' '.join(n for n in notes if n)}".rstrip(" #"))
    return "\n".join(lines) + "\n"


MARKDOWN_HEAD = """\
# Node and bootstrap configuration

Generated by `python -m node config --markdown > docs/config.md` from the settings dataclasses (defaults, and the
comment beside each field as its help); `tests/unit/test_config.py` fails when this file is stale.

A node's settings come from four places; each overrides the one before:

1. the defaults below;
2. `node.toml`, given with `--config`: the top-level keys and one table per component (nested settings as dotted
   keys, `rebalance.dwell_s = 60` under `[stage_options]`, or as sub-tables);
3. the environment: one variable per table, `key=value` pairs separated by commas, nested settings with a dot
   (`HIVENODE_STAGE="max_contexts=64,rebalance.dwell_s=60"`);
4. command-line flags (the column "flag"; `--http HOST:PORT` sets both `[http]` keys).

An unknown key, or a value of the wrong type or out of range, stops the node at start with one line naming the
key, the file or variable it came from and the valid keys (exit code 2). `HIVENODE_STATE_DIR` only moves the
default state directory. `python -m node config --defaults` prints the same settings as a commented node.toml.
The run's own settings (model, optimizer, DiLoCo, stages) are in the run manifest (run.toml), not here. The
bootstrap's settings, loaded the same way, are the last section.
"""


BOOTSTRAP_MARKDOWN_HEAD = """
## Bootstrap (`python -m bootstrap`)

The run owner's entry point (`node.config.BootstrapConfig`) is configured the same way, each place overriding the
one before: the defaults below; `bootstrap.toml` given with `--config` (these keys at its top level, no table);
the environment variable `HIVENODE_BOOTSTRAP` (`key=value` pairs separated by commas,
`HIVENODE_BOOTSTRAP="http_port=8080,republish_period_s=30"`); the flags (`--http HOST:PORT` sets both `http_`
keys). Unknown keys and bad values stop it at start the same way (exit code 2). The run itself is `run_path`'s
run.toml.
"""


def reference_markdown(components: Sequence[Component]) -> str:
    parts = [MARKDOWN_HEAD]
    for component, options in reference(components):
        if component is None:
            parts.append("\n## Top level\n")
        else:
            name = f"{component.config_type.__module__}.{component.config_type.__qualname__}"
            parts.append(
                f"\n## [{component.table}]\n\n{component.help[:1].upper()}{component.help[1:]} "
                f"(`{name}`); environment: `{component.env}`.\n"
            )
        parts.append(_markdown_table(options))
    bootstrap = [
        dataclasses.replace(o, flag=BOOTSTRAP_FLAGS.get(o.key, "")) for o in _options(BootstrapConfig())
    ]
    parts += [BOOTSTRAP_MARKDOWN_HEAD, _markdown_table(bootstrap), RUN_SENTINEL_MARKDOWN_HEAD]
    parts.append(_markdown_table(_run_sentinel_options()))
    return "\n".join(parts) + "\n"


RUN_SENTINEL_MARKDOWN_HEAD = """
## The run's SENTINEL policy (run.toml `[sentinel]`)

Not a node setting: the run owner's, signed into the manifest, and applied by every verifier of the run (a
verifier has no local SENTINEL settings, so none can loosen them; `node.config.run_sentinel_config`). The
monitor's keys go in `[sentinel]`, the ledger's in `[sentinel.ledger]`, the spot checks' in `[sentinel.spot]`
(shown below with that prefix); values are scalars, so the list of voting metrics stays the default. The bootstrap
refuses a run.toml with an unknown key or a bad value here.
"""


def _run_sentinel_options() -> list[Option]:
    from verification.ledger import LedgerConfig
    from verification.sentinel import SentinelConfig
    from verification.spotcheck import SpotCheckConfig

    options = [
        *_options(SentinelConfig()),
        *_options(LedgerConfig(), "ledger."),
        *_options(SpotCheckConfig(), "spot."),
    ]
    return [o for o in options if not o.default.startswith("[")]  # the manifest's table holds scalars only


def _markdown_table(options: Sequence[Option]) -> str:
    rows = ["| key | type | default | unit | flag | description |", "|---|---|---|---|---|---|"]
    for o in options:
        cells = [
            f"`{o.key}`",
            f"`{o.type}`",
            f"`{o.default}`" if o.literal else _md_text(o.default),
            o.unit,
            f"`{o.flag}`" if o.flag else "",
            _md_text(o.help),
        ]
        rows.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    return "\n".join(rows)


def _md_text(text: str) -> str:
    """Plain text in a table cell: `<state_dir>` would read as an HTML tag."""
    return text.replace("<", "&lt;").replace(">", "&gt;")


@functools.cache
def field_help(cls: type) -> dict[str, str]:
    """Field name -> help: `metadata["help"]`, else the comment beside the field (and a comment block just
    above it; a line that continues the previous field's comment stays with that field)."""
    source = textwrap.dedent(inspect.getsource(cls))
    comments: dict[int, str] = {}
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT:
            comments[token.start[0]] = token.string.lstrip("#").strip()
    lines = source.splitlines()
    body = ast.parse(source).body[0]
    assert isinstance(body, ast.ClassDef)
    helps: dict[str, list[str]] = {}
    previous: str | None = None
    last_end = body.body[0].lineno - 1 if body.body else 0
    for stmt in body.body:
        block = [
            comments[n] for n in range(last_end + 1, stmt.lineno) if lines[n - 1].strip().startswith("#")
        ]
        last_end = stmt.end_lineno or stmt.lineno
        if not isinstance(stmt, ast.AnnAssign) or not isinstance(stmt.target, ast.Name):
            continue
        if block and previous and _continues(helps[previous], block[0]):
            helps[previous] += block
            block = []
        trailing = [comments[n] for n in range(stmt.lineno, last_end + 1) if n in comments]
        previous = stmt.target.id
        helps[previous] = block + trailing
    out = {name: " ".join(parts) for name, parts in helps.items()}
    for f in dataclasses.fields(cls):
        if "help" in f.metadata:
            out[f.name] = str(f.metadata["help"])
    return out


def _continues(previous: list[str], line: str) -> bool:
    """A comment line under a field continues that field's comment when it opens with "(" or "..." or the
    field's comment left a parenthesis open."""
    text = " ".join(previous)
    return bool(previous) and (line.startswith(("(", "...")) or text.count("(") > text.count(")"))
