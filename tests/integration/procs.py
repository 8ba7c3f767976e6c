"""Real `python -m bootstrap` / `python -m node` / `hivemind-dht` processes on loopback, for integration tests.

Every process gets its own temp state dir, listens on port 0, and is killed (with the DHT process and p2pd it
forked, which live in their own process group) by `Procs.close()`; use the `procs` context manager or call
`close()` in a finally. Waits poll HTTP APIs or output lines against deadlines; nothing sleeps blindly.

What the swarms of several tests share is built here, so that each test says only what differs: `RunSpec` (a
test run's run.toml: a tiny model and quick syncs; `PIPELINE_RUN` for stage/verifier swarms),
`write_node_toml` (a node's `--config`), `Procs.join_node` (a node joined to a bootstrap with the usual flags),
`proxied_addrs` (a `WanProxy` in front of each node), `read_events` and `environment`.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import AsyncIterator, Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, TypeVar

from protocol.identity import NodeIdentity
from protocol.manifest import parse_run_toml
from tools.proctree import descendants, is_alive, reap
from tools.wan_proxy import LinkProfile, ProxyThread

T = TypeVar("T")
REPO_ROOT = Path(__file__).resolve().parents[2]
PYTHON = sys.executable
HIVEMIND_DHT = str(Path(PYTHON).with_name("hivemind-dht"))
START_TIMEOUT_S = 40.0  # a cold `python -m node` imports torch and hivemind: seconds on a loaded 2-core box
_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def child_env(state_root: Path) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONUNBUFFERED"] = "1"
    env["HIVENODE_STATE_DIR"] = str(state_root)  # nothing a test starts may touch ~/.local/state
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    return env


def wait_until(predicate: Callable[[], T], timeout_s: float, *, what: str, interval_s: float = 0.1) -> T:
    """Poll `predicate` until it returns something truthy; fail with `what` and the last value at the deadline."""
    deadline = time.monotonic() + timeout_s
    last: Any = None
    while True:
        try:
            last = predicate()
        except (OSError, ValueError) as e:  # HTTP not up yet, connection reset, half-written JSON
            last = e
        if last and not isinstance(last, Exception):
            return last
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s:.1f} s waiting for {what}; last: {last!r}")
        time.sleep(interval_s)


def get_json(url: str, timeout_s: float = 3.0) -> Any:
    with urllib.request.urlopen(url, timeout=timeout_s) as response:
        return json.loads(response.read())


def get_text(url: str, timeout_s: float = 3.0) -> str:
    with urllib.request.urlopen(url, timeout=timeout_s) as response:
        return response.read().decode()


@dataclass
class Proc:
    """One started process: its stdout lines (collected by a thread) and its stderr file."""

    name: str
    popen: subprocess.Popen[str]
    stderr_path: Path
    lines: list[str] = field(default_factory=list)
    known_pids: set[int] = field(default_factory=set)  # the process and what it forked (DHT process, p2pd)
    started_at: float = field(default_factory=time.monotonic)  # when it was launched
    exited_at: float | None = None  # time.monotonic() when wait_exit saw the process end
    _cond: threading.Condition = field(default_factory=threading.Condition)

    def __post_init__(self) -> None:
        self.known_pids.add(self.popen.pid)
        threading.Thread(target=self._pump, name=f"stdout-{self.name}", daemon=True).start()

    def _pump(self) -> None:
        assert self.popen.stdout is not None
        for line in self.popen.stdout:
            with self._cond:
                self.lines.append(_ANSI.sub("", line.rstrip("\n")))
                self._cond.notify_all()
        with self._cond:
            self._cond.notify_all()

    @property
    def pid(self) -> int:
        return self.popen.pid

    def stderr(self) -> str:
        return self.stderr_path.read_text(errors="replace") if self.stderr_path.exists() else ""

    def remember_children(self) -> None:
        self.known_pids.update(descendants(self.pid))

    def wait_line(
        self, pattern: str, timeout_s: float = START_TIMEOUT_S, *, source: str = "stdout"
    ) -> re.Match[str]:
        """The first line (stdout, or stderr) matching `pattern`; fail early if the process exits first."""
        regex = re.compile(pattern)
        deadline = time.monotonic() + timeout_s
        while True:
            lines = (
                self.lines if source == "stdout" else [_ANSI.sub("", s) for s in self.stderr().splitlines()]
            )
            for line in list(lines):
                if match := regex.search(line):
                    return match
            if self.popen.poll() is not None and source == "stdout":
                raise AssertionError(
                    f"{self.name} exited ({self.popen.returncode}) before {pattern!r}:\n{self.stderr()}"
                )
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise AssertionError(
                    f"{self.name}: no line matching {pattern!r} in {timeout_s} s:\n{self.stderr()}"
                )
            with self._cond:
                self._cond.wait(min(remaining, 0.2))

    def signal(self, signum: int) -> None:
        self.remember_children()
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, signum)

    def wait_exit(self, timeout_s: float) -> int:
        """Wait for the process to exit, then (briefly) for what it forked, which winds down after it."""
        self.remember_children()
        code = self.popen.wait(timeout=timeout_s)
        self.exited_at = time.monotonic()
        settle(self.known_pids - {self.pid})
        return code


@dataclass
class Node(Proc):
    status_url: str = ""

    def status(self) -> dict[str, Any]:
        return get_json(self.status_url)

    def try_status(self) -> dict[str, Any]:
        """The status, or {} while the API does not answer (starting, stopped, or slow on a busy box)."""
        return get_status(self.status_url) or {}


@dataclass
class Bootstrap(Proc):
    maddr: str = ""
    http_url: str = ""  # http://127.0.0.1:PORT

    def swarm(self) -> dict[str, Any]:
        return get_json(self.http_url + "/api/swarm")

    def peer_ids(self) -> set[str]:
        return {p["peer_id"] for p in self.swarm()["peers"]}


LOOPBACK_LISTEN = "/ip4/127.0.0.1/tcp/0"


def loopback(args: Sequence[str]) -> list[str]:
    """`args` with `--listen` on loopback unless they name one: the nodes' default is every interface (a public
    swarm), and tests stay on loopback."""
    return list(args) if "--listen" in args else [*args, "--listen", LOOPBACK_LISTEN]


class Procs:
    """Starts processes under `root` (a temp dir) and kills every one of them, and their children, on close()."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.started: list[Proc] = []
        self._count = 0
        self.prefix: list[
            str
        ] = []  # put before the next nodes' command (`ip netns exec NS`: test_relay_netns)

    def _spawn(self, cls: type[Proc], name: str, argv: list[str], **fields: Any) -> Any:
        self._count += 1
        name = f"{name}{self._count}"
        stderr_path = self.root / f"{name}.stderr"
        with stderr_path.open("w") as stderr:
            popen = subprocess.Popen(
                argv,
                cwd=REPO_ROOT,
                env=child_env(self.root / "state-default"),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=stderr,
                text=True,
                start_new_session=True,  # a test's Ctrl+C or a group kill never reaches past its own processes
            )
        proc = cls(name=name, popen=popen, stderr_path=stderr_path, **fields)
        self.started.append(proc)
        return proc

    def start_bootstrap(
        self, *args: str, state: str | None = None, wait: bool = True, owner_roles: bool = False
    ) -> Bootstrap:
        """`python -m bootstrap`; without `owner_roles` it runs no syncer or verifier of its own (`--no-syncer
        --no-verifier`): most tests start the roles they need themselves, with keys they authorize."""
        state_dir = self.root / (state or f"bootstrap{self._count + 1}")
        argv = [PYTHON, "-m", "bootstrap", "--state-dir", str(state_dir), *loopback(args)]
        if not owner_roles:
            argv += ["--no-syncer", "--no-verifier"]
        proc: Bootstrap = self._spawn(Bootstrap, "bootstrap", argv)
        if wait:
            self.wait_bootstrap(proc)
        return proc

    def wait_bootstrap(self, proc: Bootstrap, timeout_s: float = START_TIMEOUT_S) -> Bootstrap:
        proc.http_url = proc.wait_line(r"^dashboard: (http://\S+?)/?$", timeout_s).group(1)
        proc.maddr = proc.wait_line(r"^(/ip4/\S+/p2p/\S+)$", timeout_s).group(1)
        proc.remember_children()
        return proc

    def start_node(self, *args: str, state: str | None = None, wait: bool = True, light: bool = True) -> Node:
        """`python -m node --state-dir <root/state> args`; `light` (unless args name a --config) slows learners."""
        state_dir = self.root / (state or f"node{self._count + 1}")
        if (
            light and "--config" not in args
        ):  # learners in membership tests train, but slowly: keep the 2 cores for the test
            light = self.root / "light-node.toml"
            light.write_text("[learner]\nmin_step_s = 0.5\n")
            args = (*args, "--config", str(light))
        argv = [*self.prefix, PYTHON, "-m", "node", "--state-dir", str(state_dir), *loopback(args)]
        proc: Node = self._spawn(Node, "node", argv)
        if wait:
            self.wait_node(proc)
        return proc

    def join_node(
        self,
        bootstrap: Bootstrap,
        role: str,
        *args: str,
        stage: int | None = None,
        config: Path | None = None,
        identity: Path | None = None,
        max_steps: int | None = None,
        state: str | None = None,
        wait: bool = True,
    ) -> Node:
        """`python -m node --join <bootstrap> --role <role>` and the usual flags; `args` go last, as given."""
        flags = ["--join", bootstrap.maddr, "--role", role]
        if stage is not None:
            flags += ["--stage", str(stage)]
        if config is not None:
            flags += ["--config", str(config)]
        if max_steps is not None:
            flags += ["--max-steps", str(max_steps)]
        if identity is not None:
            flags += ["--identity", str(identity)]
        return self.start_node(*flags, *args, state=state, wait=wait)

    def wait_node(self, proc: Node, timeout_s: float = START_TIMEOUT_S) -> Node:
        proc.status_url = proc.wait_line(r"^status: (http://\S+)$", timeout_s).group(1)
        proc.remember_children()
        return proc

    def start_hivemind_dht(self, initial_peer: str) -> Proc:
        """A plain `hivemind-dht` peer (no hivenode validator) joined to `initial_peer`; `.maddr` once up."""
        argv = [HIVEMIND_DHT, "--host_maddrs", "/ip4/127.0.0.1/tcp/0", "--initial_peers", initial_peer]
        argv += ["--refresh_period", "600"]
        return self._spawn(Proc, "hivemind-dht", argv)

    def close(self) -> None:
        for proc in self.started:
            proc.remember_children()
        for proc in self.started:
            for pid in sorted(proc.known_pids):
                _kill_if_ours(pid, proc.pid)
        for proc in self.started:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.popen.wait(timeout=5)
            if proc.popen.stdout is not None:
                proc.popen.stdout.close()


_MARKERS = (b"p2pd", b"-m\x00node", b"-m\x00bootstrap", b"hivemind", b"torch_shm_manager")


def _kill_if_ours(pid: int, main_pid: int | None = None) -> None:
    """SIGKILL `pid` if it is still one of the processes we started (pids can be reused)."""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return
    if pid == main_pid or any(marker in cmdline for marker in _MARKERS):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    reap([pid])  # orphans are re-parented to the test process, a subreaper (tests/integration/conftest.py)


def settle(pids: set[int], timeout_s: float = 5.0) -> None:
    """Give exiting helper processes (DHT process, p2pd, torch_shm_manager) `timeout_s` to go, then kill them."""
    deadline = time.monotonic() + timeout_s
    while any(is_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    for pid in pids:
        if is_alive(pid):
            _kill_if_ours(pid)
        reap([pid])


@contextlib.contextmanager
def procs(root: Path) -> Iterator[Procs]:
    group = Procs(root)
    try:
        yield group
    finally:
        group.close()


@dataclass(frozen=True)
class CliResult:
    returncode: int
    stdout: str
    stderr: str
    elapsed_s: float

    @property
    def stderr_lines(self) -> list[str]:
        return [line for line in self.stderr.splitlines() if line.strip()]


def run_cli(module: str, *args: str, root: Path, timeout_s: float = 60.0) -> CliResult:
    """Run `python -m <module> args` to completion (bounded); on timeout, kill it and its children and fail."""
    start = time.monotonic()
    root.mkdir(parents=True, exist_ok=True)
    out_path, err_path = root / f"cli-{os.getpid()}-{start}.out", root / f"cli-{os.getpid()}-{start}.err"
    with out_path.open("w") as out, err_path.open("w") as err:
        popen = subprocess.Popen(
            [PYTHON, "-m", module, *args],
            cwd=REPO_ROOT,
            env=child_env(root / "state-default"),
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=err,
            text=True,
            start_new_session=True,
        )
    forked: set[int] = set()
    while popen.poll() is None:  # poll, so we learn what it forks before it can orphan anything
        forked.update(descendants(popen.pid))
        if time.monotonic() - start > timeout_s:
            for pid in [popen.pid, *forked]:
                _kill_if_ours(pid, popen.pid)
            popen.wait()
            raise AssertionError(f"`python -m {module} {' '.join(args)}` did not finish within {timeout_s} s")
        time.sleep(0.05)
    elapsed_s = time.monotonic() - start
    settle(forked)
    return CliResult(popen.returncode, out_path.read_text(), err_path.read_text(), elapsed_s)


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get_status(url: str) -> dict[str, Any] | None:
    try:
        return get_json(url)
    except (urllib.error.URLError, OSError, ValueError):
        return None


# ---------------------------------------------------------------------------------------------------- run and node files


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)  # a float keeps its point (1.0), so TOML reads it back as a float
    if isinstance(value, str):
        return json.dumps(value)  # a JSON string is a TOML basic string
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    raise TypeError(f"no TOML for {value!r}")


def toml_text(top: Mapping[str, Any], tables: Mapping[str, Mapping[str, Any]]) -> str:
    """TOML with top-level keys, then one `[table]` each: all that run.toml and node configs use."""
    lines = [f"{key} = {_toml_value(value)}" for key, value in top.items()]
    for table, values in tables.items():
        lines.append(f"[{table}]")
        lines += [f"{key} = {_toml_value(value)}" for key, value in values.items()]
    return "\n".join(lines) + "\n"


@dataclass(frozen=True)
class RunSpec:
    """A test run's run.toml: a tiny model (2 layers x 32, context 32) and quick decoupled-DiLoCo syncs, so a
    swarm of several processes fits on two busy cores. Tests change what they need with `dataclasses.replace`."""

    name: str
    seed: int = 0
    num_stages: int = 1
    heartbeat_period_s: float = 1.0
    authorized_syncers: tuple[str, ...] = ()  # peer ids
    authorized_verifiers: tuple[str, ...] = ()
    vocab_size: int = 256
    context_len: int = 32
    num_layers: int = 2
    width: int = 32
    num_heads: int = 2
    lr: float = 0.003  # [inner]
    batch_size: int = 4
    weight_decay: float = 0.01
    max_batch: int = 64  # [wire], the manifest's default
    num_fragments: int = 2  # [diloco]
    sync_every_steps: int = 8
    overlap_steps: int = 1
    min_sync_interval_s: float = 0.0
    mode: str = "decoupled"
    sync_learners: int = 4  # M, the learners mode "sync" waits for (the manifest's default)
    outer_codec: tuple[tuple[str, str | int], ...] = ()  # [outer_codec] settings; empty: the default (fp32)
    # [admission]: the default mode (a proof-of-work) at a difficulty each learner solves in milliseconds
    admission: tuple[tuple[str, str | int], ...] = (("mode", "pow"), ("pow_bits", 12))

    @property
    def model(self) -> dict[str, int]:
        keys = ("vocab_size", "context_len", "num_layers", "width", "num_heads")
        return {key: getattr(self, key) for key in keys}

    def toml(self) -> str:
        top = {
            "name": self.name,
            "seed": self.seed,
            "num_stages": self.num_stages,
            "heartbeat_period_s": self.heartbeat_period_s,
            "authorized_syncers": self.authorized_syncers,
            "authorized_verifiers": self.authorized_verifiers,
        }
        tables = {
            "model": self.model,
            "inner": {"lr": self.lr, "batch_size": self.batch_size, "weight_decay": self.weight_decay},
            "wire": {"max_batch": self.max_batch},
            "diloco": {
                "num_fragments": self.num_fragments,
                "sync_every_steps": self.sync_every_steps,
                "overlap_steps": self.overlap_steps,
                "min_sync_interval_s": self.min_sync_interval_s,
                "mode": self.mode,
                "sync_learners": self.sync_learners,
            },
        }
        if self.outer_codec:
            tables["outer_codec"] = dict(self.outer_codec)
        if self.admission:
            tables["admission"] = dict(self.admission)
        return toml_text(top, tables)

    def write_run_toml(self, path: Path) -> Path:
        text = self.toml()
        parse_run_toml(text)  # fail here, readably, not in a bootstrap's stderr
        path.write_text(text)
        return path

    def write_authorizing(
        self, root: Path, *, syncers: Sequence[str] = (), verifiers: Sequence[str] = ()
    ) -> Path:
        """`root/run.toml` authorizing the nodes of those state names: each one's key is created where
        `Procs(root).start_node(..., state=name)` finds it (`<root>/<name>/identity.key`)."""

        def peer_ids(names: Sequence[str]) -> tuple[str, ...]:
            return tuple(NodeIdentity.load_or_create(root / name / "identity.key").peer_id for name in names)

        run = replace(self, authorized_syncers=peer_ids(syncers), authorized_verifiers=peer_ids(verifiers))
        return run.write_run_toml(root / "run.toml")


async def call_framed_once_found(
    p2p: Any, peer_id: str, route: str, frame: bytes, *, max_response_bytes: int, find_s: float = 30.0
) -> bytes:
    """`protocol.rpc.call_framed` from a test's own daemon, started a moment ago on the bootstrap alone: it finds
    `peer_id` through the DHT, and until it has, opening the stream fails ("failed to find any peer in table";
    CI, once). Nothing reached the peer then, so the call is made again, for up to `find_s`."""
    import asyncio

    from hivemind.p2p.p2p_daemon_bindings.utils import ControlFailure

    from protocol.rpc import call_framed

    deadline = time.monotonic() + find_s
    while True:
        try:
            return await call_framed(
                p2p, peer_id, route, frame, max_response_bytes=max_response_bytes, timeout_s=20
            )
        except ControlFailure:
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.5)


async def start_daemons(paths: Sequence[Path], maddrs: Sequence[str]) -> list[Any]:
    """One hivemind `P2P` daemon per identity file, on loopback, joined to `maddrs`, started together; none is left
    running if one fails to start. Each Sybil of a test needs its own: a signed frame or a DHT store must come
    from the daemon of the identity that signed it (the Noise-authenticated caller)."""
    import asyncio

    from hivemind.p2p import P2P

    from node.config import LOOPBACK_LISTEN

    started = await asyncio.gather(
        *(
            P2P.create(
                initial_peers=list(maddrs),
                identity_path=str(path),
                check_if_identity_free=False,
                host_maddrs=[LOOPBACK_LISTEN],
            )
            for path in paths
        ),
        return_exceptions=True,
    )
    daemons = [p for p in started if isinstance(p, P2P)]
    failed = [e for e in started if isinstance(e, BaseException)]
    if failed:
        await asyncio.gather(*(p.shutdown() for p in daemons), return_exceptions=True)
        raise failed[0]
    return daemons


@contextlib.asynccontextmanager
async def pipeline_over_daemons(
    services: Mapping[str, Any], driver: Any, verifier: NodeIdentity, tmp: Path
) -> AsyncIterator[None]:
    """Serve in-process stage services (peer id -> `StageService`, as `build_pipeline` and the pipeline harness
    make them) each on a daemon of its own key behind a `FramedServer`, and send `driver`'s requests over
    `FramedTransport` from `verifier`'s daemon: the pipeline over real streams on loopback. The services are served
    as they are on entry (swap a liar in before); every daemon is shut down on exit."""
    import asyncio

    from node.pipeline.transport import FramedTransport
    from protocol.rpc import FramedServer

    keys = {peer: tmp / f"stage-{i}.key" for i, peer in enumerate(services)}
    for peer, path in keys.items():
        path.write_bytes(services[peer].identity.to_libp2p_bytes())
    (tmp / "verifier.key").write_bytes(verifier.to_libp2p_bytes())
    stages = await start_daemons(list(keys.values()), [])
    daemons = list(stages)
    servers = [FramedServer(p2p, services[peer].routes()) for peer, p2p in zip(keys, stages, strict=True)]
    try:
        maddrs = [str(m) for p2p in stages for m in await p2p.get_visible_maddrs()]
        daemons += await start_daemons([tmp / "verifier.key"], maddrs)
        for server in servers:
            await server.start()
        driver.hops.transport = FramedTransport(daemons[-1])
        yield
    finally:
        await asyncio.gather(*(server.stop() for server in servers), return_exceptions=True)
        await asyncio.gather(*(p2p.shutdown() for p2p in daemons), return_exceptions=True)


# Stage replicas and a verifier: layers 64 wide, microbatches of up to 8, a stage's syncs every 20 steps and at
# most every 2 s; fragments and overlap at the manifest's defaults.
PIPELINE_RUN = RunSpec(
    name="pipeline-test",
    num_stages=2,
    width=64,
    batch_size=8,
    max_batch=8,
    num_fragments=4,
    sync_every_steps=20,
    overlap_steps=2,
    min_sync_interval_s=2.0,
)
# What most test nodes' configs share: learners skip held-out evals and keep to one thread (many processes on 2
# cores); syncers skip evals and checkpoints and recover within a second; after a cut, nodes re-dial within seconds.
QUIET_LEARNER: dict[str, Any] = {"eval_every_steps": 0, "torch_threads": 1}
QUIET_SYNCER: dict[str, Any] = {"recovery_s": 1.0, "eval_every_merges": 0, "checkpoint_every_merges": 1000}
QUICK_REDIAL: dict[str, Any] = {"peer_check_period_s": 1.0, "redial_min_s": 0.5, "redial_max_s": 4.0}


def write_node_toml(path: Path, **tables: Mapping[str, Any]) -> Path:
    """A node's `--config` file, one `[table]` per keyword: `write_node_toml(p, learner={"min_step_s": 0.1})`."""
    path.write_text(toml_text({}, tables))
    return path


def proxied_addrs(names: Sequence[str]) -> tuple[dict[str, ProxyThread], dict[str, list[str]]]:
    """A started `WanProxy` (clean link) in front of each named node, and the node's `--listen` (its own port)
    and `--announce` (the proxy's port) args: every connection to the node crosses its proxy."""
    ports = {name: free_port() for name in names}
    proxies = {
        name: ProxyThread(target_host="127.0.0.1", target_port=port, profile=LinkProfile(seed=i))
        for i, (name, port) in enumerate(ports.items())
    }
    try:
        for proxy in proxies.values():
            proxy.start()
    except BaseException:
        for proxy in proxies.values():
            proxy.stop()
        raise
    addrs = {
        name: [
            "--listen",
            f"/ip4/127.0.0.1/tcp/{ports[name]}",
            "--announce",
            f"/ip4/127.0.0.1/tcp/{proxies[name].port}",
        ]
        for name in names
    }
    return proxies, addrs


def read_events(state_dir: Path, kind: str | None = None) -> list[dict[str, Any]]:
    """A node's event log (`<state_dir>/events.jsonl`), those of `kind` only if given; a line still being
    written is skipped."""
    path = state_dir / "events.jsonl"
    if not path.exists():
        return []
    events = []
    for line in path.read_text().splitlines():
        with contextlib.suppress(json.JSONDecodeError):
            events.append(json.loads(line))
    return [e for e in events if kind is None or e.get("event") == kind]


@contextlib.contextmanager
def environment(**values: str) -> Iterator[None]:
    """Set environment variables (seen by every process started meanwhile) and restore them after."""
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
