"""A seeded fault schedule over real processes: the chaos harness the demo's `--chaos`, the goodput benchmark and
the integration tests share.

Three kinds of fault, each aimed at a named process:

* `kill`: SIGKILL a learner (or stage), restart it with the same command line (same identity and state dir)
  after `duration_s`;
* `stop`: SIGSTOP a process for `duration_s`, then SIGCONT (a straggler: alive, but makes no progress);
* `kill_syncer`: SIGKILL whichever syncer is active at that moment (a standby must take over), restart it
  after `duration_s` (it comes back as a standby).

`plan_faults` draws a schedule from a seed (pure, deterministic); `ChaosRunner` executes it against a
`Controller` (anything that can signal and restart processes by name) and counts every fault it injected;
`ChaosReport.check(plan)` says whether what was injected is exactly what was planned; `announcement(phase,
injected)` is what to say as each fault starts and ends (the demo prints it and puts it on the dashboard's
events). `ProcessGroup` is a
small `Controller` over `subprocess` for callers that do not have their own process management.
"""

from __future__ import annotations

import contextlib
import logging
import os
import random
import signal
import subprocess
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, Protocol

from tools.proctree import descendants

logger = logging.getLogger(__name__)

FaultKind = Literal["kill", "stop", "kill_syncer"]
SYNCER_TARGET = "syncer"  # kill_syncer's target: resolved to the active syncer when the fault fires


@dataclass(frozen=True, kw_only=True, slots=True)
class Fault:
    at_s: float  # seconds after the chaos clock starts
    kind: FaultKind
    target: str  # process name; SYNCER_TARGET for kill_syncer
    duration_s: float  # kill: restart delay; stop: how long the process stays stopped


@dataclass(frozen=True, kw_only=True, slots=True)
class ChaosConfig:
    """How many faults of each kind, over how long; one seed makes the schedule reproducible."""

    seed: int = 0
    duration_s: float = 90.0  # length of the window faults fall in
    learner_kills: int = 1
    stragglers: int = 2
    syncer_kills: int = 1
    restart_delay_s: float = 3.0  # a killed process is started again this long after the kill
    stop_s: float = 4.0  # how long a straggler stays stopped
    margin_s: float = 8.0  # no fault starts in the first or last margin_s seconds
    min_gap_s: float = 6.0  # faults start at least this far apart (each can be seen on its own)
    min_syncer_gap_s: float = 25.0  # syncer kills this far apart: the restarted one is a standby again

    def __post_init__(self) -> None:
        for name in ("learner_kills", "stragglers", "syncer_kills", "seed"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"ChaosConfig.{name} must be an int >= 0, got {value!r}")
        for name in ("duration_s", "restart_delay_s", "stop_s", "margin_s", "min_gap_s", "min_syncer_gap_s"):
            value = getattr(self, name)
            if not isinstance(value, int | float) or value < 0:
                raise ValueError(f"ChaosConfig.{name} must be >= 0, got {value!r}")
        if self.duration_s <= 2 * self.margin_s:
            raise ValueError("ChaosConfig.duration_s must exceed twice margin_s")

    @property
    def num_faults(self) -> int:
        return self.learner_kills + self.stragglers + self.syncer_kills


def plan_faults(config: ChaosConfig, learners: Sequence[str], *, max_tries: int = 10_000) -> list[Fault]:
    """Draw fault start times uniformly in [margin, duration - margin - fault length], at least `min_gap_s`
    apart; learners are drawn uniformly for kills and stops. Same config and names -> same schedule.
    Raises ValueError if the faults cannot fit (too many for the window)."""
    if not learners and (config.learner_kills or config.stragglers):
        raise ValueError("learner faults need at least one learner")
    rng = random.Random(config.seed)
    kill: tuple[FaultKind, float] = ("kill", config.restart_delay_s)
    stop: tuple[FaultKind, float] = ("stop", config.stop_s)
    kill_syncer: tuple[FaultKind, float] = ("kill_syncer", config.restart_delay_s)
    kinds = [kill] * config.learner_kills + [stop] * config.stragglers + [kill_syncer] * config.syncer_kills
    for _ in range(max_tries):
        starts = []
        for _kind, length in kinds:
            high = config.duration_s - config.margin_s - length
            if high < config.margin_s:
                raise ValueError(f"a {length} s fault does not fit a {config.duration_s} s window")
            starts.append(rng.uniform(config.margin_s, high))
        ordered = sorted(starts)
        syncer_kills = sorted(
            at for at, (kind, _) in zip(starts, kinds, strict=True) if kind == "kill_syncer"
        )
        spaced = all(b - a >= config.min_gap_s for a, b in zip(ordered, ordered[1:], strict=False))
        if spaced and all(
            b - a >= config.min_syncer_gap_s for a, b in zip(syncer_kills, syncer_kills[1:], strict=False)
        ):
            break
    else:
        raise ValueError(
            f"{len(kinds)} faults do not fit {config.duration_s} s with gaps of {config.min_gap_s} s"
        )
    faults = []
    for (kind, length), at in zip(kinds, starts, strict=True):
        target = SYNCER_TARGET if kind == "kill_syncer" else rng.choice(list(learners))
        faults.append(Fault(at_s=round(at, 3), kind=kind, target=target, duration_s=length))
    return sorted(faults, key=lambda f: f.at_s)


class Controller(Protocol):
    """What the runner needs from whoever owns the processes."""

    def signal(self, name: str, signum: int) -> None:
        """Send `signum` to process `name` (its main pid)."""

    def restart(self, name: str) -> None:
        """Start process `name` again with its original command line."""

    def active_syncer(self) -> str:
        """Name of the syncer process that holds the lease now."""


@dataclass(slots=True)
class Injected:
    fault: Fault
    target: str  # the resolved process name
    injected_at_s: float  # chaos-clock time of the signal
    ended_at_s: float | None = None  # restart or SIGCONT
    error: str = ""


@dataclass(slots=True)
class ChaosReport:
    injected: list[Injected] = field(default_factory=list)

    def counts(self) -> dict[str, int]:
        return dict(Counter(i.fault.kind for i in self.injected if not i.error and i.ended_at_s is not None))

    def check(self, plan: Sequence[Fault]) -> bool:
        """True when every planned fault was injected and ended (restart or SIGCONT), none failed."""
        return self.counts() == dict(Counter(f.kind for f in plan)) and len(self.injected) == len(plan)

    def to_json(self) -> list[dict[str, object]]:
        return [
            {
                "kind": i.fault.kind,
                "target": i.target,
                "planned_at_s": i.fault.at_s,
                "injected_at_s": round(i.injected_at_s, 3),
                "ended_at_s": round(i.ended_at_s, 3) if i.ended_at_s is not None else None,
                "duration_s": i.fault.duration_s,
                "error": i.error,
            }
            for i in self.injected
        ]


ACTIONS: dict[str, str] = {"kill": "kill", "stop": "stall", "kill_syncer": "kill the active syncer"}


def announcement(phase: str, injected: Injected) -> dict[str, object]:
    """What to say when a fault starts (`phase` "inject", as `ChaosRunner.on_event` calls it) or ends ("end"):
    `phase` ("start" or "end"), `kind`, `target`, `at_s` (chaos-clock time), `error` and one line of `text`."""
    fault, target = injected.fault, injected.target
    if phase == "inject":
        at_s = injected.injected_at_s
        then = "restart" if fault.kind != "stop" else "resume"
        signum = "SIGSTOP" if fault.kind == "stop" else "SIGKILL"
        text = f"fault: {ACTIONS[fault.kind]} {target} ({signum}); {then} in {fault.duration_s:g} s"
        if injected.error:
            text = f"fault: {ACTIONS[fault.kind]} {target} could not be injected: {injected.error}"
    else:
        at_s = injected.ended_at_s if injected.ended_at_s is not None else injected.injected_at_s
        done = "resumed (SIGCONT)" if fault.kind == "stop" else "restarted"
        text = f"recovery: {target} {done} after {at_s - injected.injected_at_s:.1f} s"
        if injected.error:
            text = f"recovery: {target} failed: {injected.error}"
    return {
        "phase": "start" if phase == "inject" else "end",
        "kind": fault.kind,
        "target": target,
        "at_s": round(at_s, 3),
        "error": injected.error,
        "text": text,
    }


class ChaosRunner:
    """Executes a plan against a controller on a thread of its own (`start`, `join`), or inline (`run`)."""

    def __init__(
        self,
        plan: Sequence[Fault],
        controller: Controller,
        *,
        clock: Callable[[], float] = time.monotonic,
        wait: Callable[[float], bool] | None = None,
        on_event: Callable[[str, Injected], None] | None = None,
    ) -> None:
        """`wait(seconds)` pauses and returns True if the run was cancelled meanwhile (default: a real wait
        on the cancel event); tests pass a fake clock and a wait that returns at once."""
        self.plan = sorted(plan, key=lambda f: f.at_s)
        self.controller = controller
        self.clock = clock
        self.on_event = on_event
        self.report = ChaosReport()
        self._stop = threading.Event()
        self._wait = wait or self._stop.wait
        self._thread: threading.Thread | None = None
        self._started_at = 0.0

    def start(self) -> None:
        self._started_at = self.clock()
        self._thread = threading.Thread(target=self._run, name="chaos", daemon=True)
        self._thread.start()

    def run(self) -> ChaosReport:
        self._started_at = self.clock()
        self._run()
        return self.report

    def join(self, timeout_s: float | None = None) -> ChaosReport:
        if self._thread is not None:
            self._thread.join(timeout_s)
        return self.report

    def cancel(self) -> None:
        self._stop.set()

    def _now(self) -> float:
        return self.clock() - self._started_at

    def _wait_until(self, at_s: float) -> bool:
        """Sleep until chaos time `at_s`; False if cancelled."""
        while (remaining := at_s - self._now()) > 0:
            if self._wait(min(remaining, 0.5)) or self._stop.is_set():
                return False
        return True

    def _run(self) -> None:
        # Ends are scheduled events too: a restart may fall after the next fault's start.
        ends: list[tuple[float, Injected]] = []
        for fault in self.plan:
            if not self._finish_ends_before(fault.at_s, ends):
                return
            if not self._wait_until(fault.at_s):
                return
            injected = self._inject(fault)
            if injected.error == "":
                ends.append((fault.at_s + fault.duration_s, injected))
        self._finish_ends_before(float("inf"), ends)

    def _finish_ends_before(self, at_s: float, ends: list[tuple[float, Injected]]) -> bool:
        for end_at, injected in sorted(ends, key=lambda e: e[0]):
            if end_at > at_s:
                break
            if not self._wait_until(end_at):
                return False
            self._end(injected)
            ends.remove((end_at, injected))
        return True

    def _inject(self, fault: Fault) -> Injected:
        target = fault.target
        injected = Injected(fault=fault, target=target, injected_at_s=self._now())
        try:
            if fault.kind == "kill_syncer":
                target = injected.target = self.controller.active_syncer()
            signum = signal.SIGSTOP if fault.kind == "stop" else signal.SIGKILL
            self.controller.signal(target, signum)
        except Exception as e:  # a fault that could not be injected is reported, never retried silently
            injected.error = f"{type(e).__name__}: {e}"
            logger.warning("chaos: %s on %s failed: %s", fault.kind, target, injected.error)
        self.report.injected.append(injected)
        logger.info("chaos: %s %s at %.1f s", fault.kind, target, injected.injected_at_s)
        if self.on_event is not None:
            self.on_event("inject", injected)
        return injected

    def _end(self, injected: Injected) -> None:
        try:
            if injected.fault.kind == "stop":
                self.controller.signal(injected.target, signal.SIGCONT)
            else:
                self.controller.restart(injected.target)
            injected.ended_at_s = self._now()
        except Exception as e:
            injected.error = f"end failed: {type(e).__name__}: {e}"
            logger.warning(
                "chaos: ending %s on %s failed: %s", injected.fault.kind, injected.target, injected.error
            )
        if self.on_event is not None:
            self.on_event("end", injected)


# ---------------------------------------------------------------------------------------------- processes


@dataclass
class _Managed:
    argv: list[str]
    log_path: Path
    popen: subprocess.Popen[bytes] | None = None
    restarts: int = 0


class ProcessGroup:
    """Named child processes started from fixed command lines; signal, restart, and kill them with what they
    fork (a node's DHT process and p2pd). A `Controller` for `ChaosRunner`; `active_syncer` is a callable the
    owner supplies (it knows how to ask the swarm)."""

    def __init__(
        self,
        log_dir: Path,
        *,
        env: dict[str, str] | None = None,
        cwd: Path | None = None,
        active_syncer: Callable[[], str] | None = None,
    ) -> None:
        self.log_dir = log_dir
        self.env = env
        self.cwd = cwd
        self._active_syncer = active_syncer
        self._procs: dict[str, _Managed] = {}
        self._known_pids: set[int] = set()
        self._lock = threading.Lock()

    def start(self, name: str, argv: Sequence[str]) -> subprocess.Popen[bytes]:
        with self._lock:
            current = self._procs.get(name)
            if current is not None and current.popen is not None and current.popen.poll() is None:
                raise ValueError(f"process {name!r} is already running")
            managed = self._procs.get(name) or _Managed(
                argv=list(argv), log_path=self.log_dir / f"{name}.log"
            )
            managed.argv = list(argv)
            self._procs[name] = managed
            return self._launch(managed)

    def _launch(self, managed: _Managed) -> subprocess.Popen[bytes]:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        with managed.log_path.open("ab") as log:
            managed.popen = subprocess.Popen(
                managed.argv,
                cwd=self.cwd,
                env=self.env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        self._known_pids.add(managed.popen.pid)
        return managed.popen

    def pid(self, name: str) -> int:
        popen = self._procs[name].popen
        if popen is None:
            raise ValueError(f"process {name!r} was never started")
        return popen.pid

    def names(self) -> list[str]:
        return list(self._procs)

    def signal(self, name: str, signum: int) -> None:
        self._remember_children()
        pid = self.pid(name)
        os.kill(pid, signum)
        if signum == signal.SIGKILL:
            popen = self._procs[name].popen
            assert popen is not None
            with contextlib.suppress(subprocess.TimeoutExpired):
                popen.wait(timeout=5)

    def restart(self, name: str) -> None:
        with self._lock:
            managed = self._procs[name]
            if managed.popen is not None and managed.popen.poll() is None:
                raise ValueError(f"process {name!r} is still running")
            managed.restarts += 1
            self._launch(managed)

    def active_syncer(self) -> str:
        if self._active_syncer is None:
            raise ValueError("this ProcessGroup was given no way to find the active syncer")
        return self._active_syncer()

    def alive(self, name: str) -> bool:
        popen = self._procs[name].popen
        return popen is not None and popen.poll() is None

    def log(self, name: str) -> str:
        path = self._procs[name].log_path
        return path.read_text(errors="replace") if path.exists() else ""

    def _remember_children(self) -> None:
        for managed in self._procs.values():
            if managed.popen is not None:
                self._known_pids.update(descendants(managed.popen.pid))

    def terminate_all(self, grace_s: float = 5.0) -> None:
        """SIGTERM every running process (SIGCONT first, in case it is stopped), SIGKILL what is left after
        `grace_s`, then kill whatever they forked that is still alive."""
        self._remember_children()
        running = [m.popen for m in self._procs.values() if m.popen is not None and m.popen.poll() is None]
        for popen in running:
            with contextlib.suppress(ProcessLookupError):
                os.kill(popen.pid, signal.SIGCONT)
                os.kill(popen.pid, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for popen in running:
            with contextlib.suppress(subprocess.TimeoutExpired):
                popen.wait(timeout=max(0.0, deadline - time.monotonic()))
            if popen.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(popen.pid, signal.SIGKILL)
                popen.wait()
        time.sleep(0.5)  # forked DHT processes notice their parent is gone within half a second
        for pid in self._known_pids:
            if _is_ours(pid):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            with contextlib.suppress(ChildProcessError, OSError):
                os.waitpid(pid, os.WNOHANG)


def _is_ours(pid: int) -> bool:
    """Still one of the kinds of process we start (pids can be reused by unrelated processes)."""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False
    return any(marker in cmdline for marker in (b"p2pd", b"-m\x00node", b"-m\x00bootstrap", b"hivemind"))
