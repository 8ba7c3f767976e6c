"""Real `python -m bootstrap` / `python -m node` / `hivemind-dht` processes on loopback, for integration tests.

Every process gets its own temp state dir, listens on port 0, and is killed (with the DHT process and p2pd it
forked, which live in their own process group) by `Procs.close()`; use the `procs` context manager or call
`close()` in a finally. Waits poll HTTP APIs or output lines against deadlines; nothing sleeps blindly.
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
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from node.proctree import descendants

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


@dataclass
class Bootstrap(Proc):
    maddr: str = ""
    http_url: str = ""  # http://127.0.0.1:PORT

    def swarm(self) -> dict[str, Any]:
        return get_json(self.http_url + "/api/swarm")

    def peer_ids(self) -> set[str]:
        return {p["peer_id"] for p in self.swarm()["peers"]}


class Procs:
    """Starts processes under `root` (a temp dir) and kills every one of them, and their children, on close()."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.started: list[Proc] = []
        self._count = 0

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

    def start_bootstrap(self, *args: str, state: str | None = None, wait: bool = True) -> Bootstrap:
        state_dir = self.root / (state or f"bootstrap{self._count + 1}")
        argv = [PYTHON, "-m", "bootstrap", "--state-dir", str(state_dir), *args]
        proc: Bootstrap = self._spawn(Bootstrap, "bootstrap", argv)
        if wait:
            self.wait_bootstrap(proc)
        return proc

    def wait_bootstrap(self, proc: Bootstrap, timeout_s: float = START_TIMEOUT_S) -> Bootstrap:
        proc.http_url = proc.wait_line(r"^dashboard: (http://\S+?)/?$", timeout_s).group(1)
        proc.maddr = proc.wait_line(r"^(/ip4/\S+/p2p/\S+)$", timeout_s).group(1)
        proc.remember_children()
        return proc

    def start_node(self, *args: str, state: str | None = None, wait: bool = True) -> Node:
        state_dir = self.root / (state or f"node{self._count + 1}")
        if (
            "--config" not in args
        ):  # learners in membership tests train, but slowly: keep the 2 cores for the test
            light = self.root / "light-node.toml"
            light.write_text("[learner]\nmin_step_s = 0.5\n")
            args = (*args, "--config", str(light))
        argv = [PYTHON, "-m", "node", "--state-dir", str(state_dir), *args]
        proc: Node = self._spawn(Node, "node", argv)
        if wait:
            self.wait_node(proc)
        return proc

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


def is_alive(pid: int) -> bool:
    """Running (a zombie has exited; it only waits to be reaped)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2] != "Z"


def _kill_if_ours(pid: int, main_pid: int | None = None) -> None:
    """SIGKILL `pid` if it is still one of the processes we started (pids can be reused)."""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return
    if pid == main_pid or any(marker in cmdline for marker in _MARKERS):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    _reap(pid)


def _reap(pid: int) -> None:
    # orphans are re-parented to the test process when it is a subreaper (tests/integration/conftest.py)
    with contextlib.suppress(ChildProcessError, OSError):
        os.waitpid(pid, os.WNOHANG)


def settle(pids: set[int], timeout_s: float = 5.0) -> None:
    """Give exiting helper processes (DHT process, p2pd, torch_shm_manager) `timeout_s` to go, then kill them."""
    deadline = time.monotonic() + timeout_s
    while any(is_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    for pid in pids:
        if is_alive(pid):
            _kill_if_ours(pid)
        _reap(pid)


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
