"""Node settings: one frozen `NodeConfig` (with nested network and HTTP configs), built from an optional TOML
file (`--config node.toml`) overlaid by command-line flags. The CLI parser lives here so `__main__` stays thin.

Example node.toml (every key optional; flags win over the file):

    join = ["/ip4/203.0.113.5/tcp/31337/p2p/12D3KooW..."]
    role = "auto"            # auto | learner | stage | verifier | syncer
    stage = 1
    device = "auto"          # auto | cpu | cuda | cuda:N
    state_dir = "~/.local/state/hivenode/node"
    identity = "~/.local/state/hivenode/node/identity.key"
    data = "corpus/"
    max_steps = 1000
    [learner]                # node.roles.learner.LearnerConfig
    min_step_s = 0.25
    [syncer]                 # node.roles.syncer.SyncerConfig
    lease_s = 6.0
    run_id = "..."           # only when the DHT hosts several runs
    log_level = "INFO"
    [network]                # --listen / --announce override listen / announce
    listen = ["/ip4/0.0.0.0/tcp/31338"]
    announce = ["/ip4/203.0.113.9/tcp/31338"]
    use_auto_relay = false   # become reachable through libp2p relays (set on its own when we are unreachable)
    join_timeout_s = 30.0
    request_timeout_s = 5.0
    [http]
    host = "127.0.0.1"
    port = 0
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from protocol.errors import ConfigError
from protocol.keys import is_run_id

if TYPE_CHECKING:
    pass

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - pyproject pulls tomli on 3.10
    import tomli as tomllib

ROLE_CHOICES = ("auto", "learner", "stage", "verifier", "syncer")
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")
DEFAULT_LISTEN = "/ip4/127.0.0.1/tcp/0"  # loopback only, as hivemind: a public node passes its own --listen
STATE_DIR_ENV = "HIVENODE_STATE_DIR"  # read once in default_state_dir(), never at import


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
    use_relay: bool = True  # reach peers behind NAT through libp2p circuit relays (hivemind's default)
    use_auto_relay: bool = False  # become reachable through relays; turned on when others cannot dial us
    check_reachability: bool = True  # at start, ask a bootstrap to dial us back; unreachable -> client mode
    # Losing the bootstraps (a partition, a dead uplink): hivemind never re-dials its initial peers on its own, so
    # we check the routing table this often and re-dial them with exponential backoff between these bounds.
    peer_check_period_s: float = 5.0
    redial_min_s: float = 1.0
    redial_max_s: float = 60.0

    def __post_init__(self) -> None:
        _positive("network.join_timeout_s", self.join_timeout_s)
        _positive("network.request_timeout_s", self.request_timeout_s)
        for name in ("peer_check_period_s", "redial_min_s", "redial_max_s"):
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

    host: str = "127.0.0.1"
    port: int = 0  # 0 = any free port; the chosen one is printed and announced in the heartbeat

    def __post_init__(self) -> None:
        if isinstance(self.port, bool) or not isinstance(self.port, int) or not 0 <= self.port <= 65535:
            raise ValueError(f"http.port must be in [0, 65535], got {self.port!r}")
        if not isinstance(self.host, str) or not self.host:
            raise ValueError("http.host must be a non-empty string")


@dataclass(frozen=True, kw_only=True, slots=True)
class NodeConfig:
    """Everything `python -m node` needs; build with `load_node_config`."""

    join: tuple[str, ...]  # multiaddrs (with /p2p/<peer id>) or http(s) URLs of a bootstrap's /api/swarm
    state_dir: Path  # identity, pinned owners, event log
    role: str = "auto"  # see node.roles.registry.choose_role for what `auto` picks
    stage: int | None = None  # pipeline stage for role `stage`; None = least served
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    identity_path: Path | None = None  # None = <state_dir>/identity.key
    data: str | None = None  # corpus override (file, directory, dataset name); None = the run's data spec
    max_steps: int | None = None  # stop after this many inner steps (roles that step)
    run_id: str | None = None  # which run to join when the DHT hosts several
    log_level: str = "INFO"
    shutdown_timeout_s: float = 5.0  # bounds: announcing leave, cancelling tasks, stopping the DHT
    network: NetworkConfig = field(default_factory=NetworkConfig)
    http: HttpConfig = field(default_factory=HttpConfig)
    # role options, checked by the role itself (node.roles.learner.LearnerConfig, node.roles.syncer.SyncerConfig)
    learner: dict[str, Any] = field(default_factory=dict)
    syncer: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for table in ("learner", "syncer"):
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
        if self.device != "auto" and self.device != "cpu" and not self.device.startswith("cuda"):
            raise ValueError(f"device must be auto, cpu, cuda or cuda:N, got {self.device!r}")
        if self.max_steps is not None and (not isinstance(self.max_steps, int) or self.max_steps < 1):
            raise ValueError(f"max_steps must be an int >= 1, got {self.max_steps!r}")
        if self.run_id is not None and not is_run_id(self.run_id):
            raise ValueError(f"run_id must be 40 hex characters, got {self.run_id!r}")
        if self.log_level not in LOG_LEVELS:
            raise ValueError(f"log_level must be one of {LOG_LEVELS}, got {self.log_level!r}")
        _positive("shutdown_timeout_s", self.shutdown_timeout_s)

    @property
    def identity_file(self) -> Path:
        return self.identity_path or self.state_dir / "identity.key"


def build_run_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m node",
        description="Join a hivenode training swarm. Subcommands: keygen, status, demo (see `python -m node keygen -h`).",
    )
    add = parser.add_argument
    add(
        "--join", action="append", metavar="MADDR_OR_URL", help="bootstrap multiaddr or http URL (repeatable)"
    )
    add("--role", choices=ROLE_CHOICES, help="what this node does (default: auto)")
    add("--stage", type=int, help="pipeline stage for --role stage (default: the least served)")
    add("--device", help="auto | cpu | cuda | cuda:N (default: auto)")
    add("--identity", type=Path, metavar="PATH", help="Ed25519 key file (default: <state-dir>/identity.key)")
    add("--state-dir", type=Path, metavar="DIR", help="identity, pinned owners, event log")
    add("--http", metavar="HOST:PORT", help="status API address (default: 127.0.0.1:0)")
    add(
        "--listen",
        action="append",
        metavar="MADDR",
        help="libp2p listen multiaddr (repeatable; default /ip4/127.0.0.1/tcp/0, e.g. /ip4/0.0.0.0/tcp/31338)",
    )
    add(
        "--announce",
        action="append",
        metavar="MADDR",
        help="multiaddr others should dial: public IP and a fixed port (repeatable)",
    )
    add("--data", metavar="PATH", help="training data override (file, directory, or dataset name)")
    add("--max-steps", type=int, metavar="N", help="stop after N inner steps")
    add("--config", type=Path, metavar="node.toml", help="settings file; flags win over it")
    add("--log-level", choices=LOG_LEVELS, help="default: INFO")
    return parser


def _read_toml(path: Path) -> dict[str, Any]:
    try:
        return tomllib.loads(path.read_text())
    except OSError as e:
        raise ConfigError(f"cannot read config {path}: {e.strerror or e}") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"config {path} is not valid TOML: {e}") from None


def _nested(cls: type, name: str, table: object) -> Any:
    if not isinstance(table, dict):
        raise ConfigError(f"[{name}] must be a table")
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(table) - known)
    if unknown:
        raise ConfigError(f"unknown [{name}] settings {unknown}")
    values = dict(table)
    for key in ("listen", "announce"):
        if key in values:
            if not isinstance(values[key], list):
                raise ConfigError(f"{name}.{key} must be a list of multiaddrs")
            values[key] = tuple(values[key])
    return cls(**values)


def config_from_mapping(data: Mapping[str, Any]) -> NodeConfig:
    """Build a NodeConfig from a node.toml-shaped mapping; raise ConfigError on anything unknown or invalid."""
    values = dict(data)
    renames = {"identity": "identity_path"}
    for old, new in renames.items():
        if old in values:
            values[new] = values.pop(old)
    known = {f.name for f in dataclasses.fields(NodeConfig)}
    unknown = sorted(set(values) - known)
    if unknown:
        raise ConfigError(f"unknown settings {unknown}")
    try:
        if "network" in values:
            values["network"] = _nested(NetworkConfig, "network", values["network"])
        if "http" in values:
            values["http"] = _nested(HttpConfig, "http", values["http"])
        if isinstance(values.get("join"), str):
            values["join"] = [values["join"]]
        values["join"] = tuple(values.get("join") or ())
        for key in ("state_dir", "identity_path"):
            if values.get(key) is not None:
                values[key] = Path(str(values[key])).expanduser()
        values.setdefault("state_dir", default_state_dir("node"))
        return NodeConfig(**values)
    except (ValueError, TypeError) as e:
        raise ConfigError(str(e)) from None


def load_node_config(argv: Sequence[str]) -> NodeConfig:
    """Parse `python -m node` flags (over `--config`, if given) into a NodeConfig; raise ConfigError."""
    args = build_run_parser().parse_args(list(argv))
    data: dict[str, Any] = _read_toml(args.config) if args.config else {}
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
    }
    data.update({k: v for k, v in flags.items() if v is not None})
    if args.http is not None:
        host, port = parse_host_port(args.http)
        data["http"] = {**data.get("http", {}), "host": host, "port": port}
    network = {"listen": args.listen, "announce": args.announce}
    if any(v is not None for v in network.values()):
        table = data.get("network", {})
        if not isinstance(table, dict):
            raise ConfigError("[network] must be a table")
        data["network"] = {**table, **{k: v for k, v in network.items() if v is not None}}
    return config_from_mapping(data)


T = TypeVar("T")


def apply_overrides(config: T, text: str) -> T:
    """`config` with "key=value,..." applied (nested fields as `rebalance.dwell_s=5`); ValueError on typos.

    Values are parsed by the type of the field's current value (int, float, bool, str)."""
    for item in filter(None, (part.strip() for part in text.replace(";", ",").split(","))):
        key, sep, raw = item.partition("=")
        if not sep:
            raise ValueError(f"override {item!r} is not key=value")
        config = _replace_path(config, key.strip().split("."), raw.strip())
    return config


def load_role_config(
    default: T, *, table: Mapping[str, Any] | None, env: str, environ: Mapping[str, str]
) -> T:
    """A role's settings: `default`, then a node.toml table (nested tables for nested settings), then the
    `env` variable's "key=value,..." overrides. Raises ConfigError naming the bad setting."""
    try:
        config = default
        for key, value in _flatten(table or {}):
            config = _replace_path(config, key.split("."), value)
        return apply_overrides(config, environ.get(env, ""))
    except (TypeError, ValueError) as e:
        raise ConfigError(f"{type(default).__name__}: {e}") from None


def _flatten(table: Mapping[str, Any], prefix: str = "") -> list[tuple[str, Any]]:
    out: list[tuple[str, Any]] = []
    for key, value in table.items():
        if isinstance(value, Mapping):
            out.extend(_flatten(value, f"{prefix}{key}."))
        else:
            out.append((f"{prefix}{key}", value))
    return out


def _replace_path(obj: T, path: list[str], raw: object) -> T:
    name = path[0]
    names = {f.name for f in dataclasses.fields(obj)}  # type: ignore[arg-type]
    if name not in names:
        raise ValueError(f"unknown setting {name!r} of {type(obj).__name__} (known: {sorted(names)})")
    current = getattr(obj, name)
    value = _replace_path(current, path[1:], raw) if len(path) > 1 else _coerce(name, current, raw)
    return dataclasses.replace(obj, **{name: value})  # type: ignore[type-var]


def _coerce(name: str, current: object, raw: object) -> object:
    """`raw` (text from the environment, or a TOML value) as the type of the setting's current value."""
    if isinstance(current, bool):
        if isinstance(raw, bool):
            return raw
        if str(raw).lower() not in ("true", "false", "1", "0"):
            raise ValueError(f"{name} must be true or false, got {raw!r}")
        return str(raw).lower() in ("true", "1")
    if isinstance(current, int) and not isinstance(raw, bool):
        return int(raw) if isinstance(raw, (int, str)) else _bad(name, raw)
    if isinstance(current, float) and not isinstance(raw, bool):
        return float(raw) if isinstance(raw, (int, float, str)) else _bad(name, raw)
    if isinstance(current, str) and isinstance(raw, str):
        return raw
    return _bad(name, raw)


def _bad(name: str, raw: object) -> object:
    raise ValueError(f"{name} cannot be set to {raw!r}")
