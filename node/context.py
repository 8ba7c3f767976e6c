"""The node's runtime skeleton: context, supervised background tasks, event log, logging, and the run sequence.

`run_node` is the whole life of a node: identity and its lock -> join (DHT, reachability, manifest, owner pin) ->
heartbeats and status API under a `TaskSupervisor` -> wait for a stop signal, a fatal task, or the role finishing
-> announce leaving -> cancel everything -> stop the DHT. Every wait in it is bounded by a named config timeout.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import sys
import threading
import time
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, NoReturn

from prometheus_client import CollectorRegistry, Counter, Gauge, Info

from node.config import NodeConfig
from protocol.dht_io import SwarmRecords
from protocol.errors import ConfigError
from protocol.identity import NodeIdentity
from protocol.manifest import RunManifest, SignedManifest

logger = logging.getLogger(__name__)
EVENTS_FILENAME = "events.jsonl"
VERSION = "0.1.0"


def short_id(peer_id: str) -> str:
    """A peer id for humans. Every Ed25519 peer id starts with `12D3KooW`, so the tail is what tells them apart."""
    return peer_id[-8:] if peer_id else "--------"


# ---- logging ----


class LogContext(logging.Filter):
    """Adds `[peer role]` to every record; the peer id and role become known during startup."""

    def __init__(self) -> None:
        super().__init__()
        self.peer_id = ""
        self.role = "-"

    def filter(self, record: logging.LogRecord) -> bool:
        record.ctx = f"{short_id(self.peer_id)} {self.role}"
        return True


def setup_logging(level: str, context: LogContext) -> None:
    """Configure logging once, for the whole process (stderr; stdout is for what the user should copy)."""
    handler = logging.StreamHandler()
    handler.addFilter(context)
    handler.setFormatter(
        logging.Formatter("%(asctime)s.%(msecs)03d %(levelname)s [%(ctx)s] %(name)s: %(message)s", "%H:%M:%S")
    )
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
    # hivemind logs through its own handler; keep it quiet unless we debug
    logging.getLogger("hivemind").setLevel(logging.DEBUG if level == "DEBUG" else logging.WARNING)


# ---- event log ----


class EventLog:
    """Append-only JSONL of the events that matter (joined, role, left, task died); one object per line."""

    def __init__(self, path: Path | None, *, peer_id: str, clock: Callable[[], float] = time.time) -> None:
        self.path = path
        self.peer_id = peer_id
        self.clock = clock
        self._file: IO[str] | None = None
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            self._file = path.open("a", buffering=1)

    def emit(self, event: str, **fields: Any) -> None:
        logger.info("event %s %s", event, fields or "")
        if self._file is not None:
            line = {"t": round(self.clock(), 3), "peer": self.peer_id, "event": event, **fields}
            self._file.write(json.dumps(line, default=str) + "\n")

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


# ---- supervised tasks ----


@dataclass(frozen=True, kw_only=True, slots=True)
class RestartPolicy:
    """What to do when a supervised task raises."""

    max_restarts: int = 3  # restarts allowed within window_s before escalating
    window_s: float = 60.0
    backoff_s: float = 1.0  # wait before a restart (doubles per restart in the window)
    escalate: bool = True  # past max_restarts: True = fail the node; False = log and leave the task dead

    def __post_init__(self) -> None:
        if self.max_restarts < 0 or self.window_s <= 0 or self.backoff_s < 0:
            raise ValueError(f"invalid RestartPolicy {self}")


FAIL_FAST = RestartPolicy(max_restarts=0)


@dataclass(slots=True)
class _TaskState:
    name: str
    policy: RestartPolicy
    ends_node: bool
    task: asyncio.Task[None] | None = None
    restarts: list[float] = field(default_factory=list)
    state: str = "running"
    last_error: str | None = None


class TaskSupervisor:
    """Owns every background task of the node: named, logged when it dies, restarted or escalated per policy,
    all cancelled on shutdown. `spawn` is the only way the node starts a background task."""

    def __init__(
        self, events: EventLog | None = None, *, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self._tasks: dict[str, _TaskState] = {}
        self._events = events
        self._clock = clock
        self.fatal: asyncio.Future[BaseException] = asyncio.get_running_loop().create_future()
        self.ended = asyncio.Event()  # set when a task spawned with ends_node=True returns normally
        self.restart_counter: Counter | None = None

    def spawn(
        self,
        name: str,
        factory: Callable[[], Awaitable[None]],
        *,
        policy: RestartPolicy = FAIL_FAST,
        ends_node: bool = False,
    ) -> None:
        """Run `factory()` as task `name`. If `ends_node`, its normal return ends the node (e.g. max steps)."""
        if name in self._tasks and self._tasks[name].state == "running":
            raise ValueError(f"task {name!r} is already running")
        state = _TaskState(name=name, policy=policy, ends_node=ends_node)
        state.task = asyncio.create_task(self._supervise(state, factory), name=name)
        self._tasks[name] = state

    async def _supervise(self, state: _TaskState, factory: Callable[[], Awaitable[None]]) -> None:
        while True:
            try:
                await factory()
            except asyncio.CancelledError:
                state.state = "cancelled"
                raise
            except Exception as e:
                state.last_error = f"{type(e).__name__}: {e}"
                logger.error("task %s died: %s", state.name, state.last_error, exc_info=e)
                if self._events is not None:
                    self._events.emit("task_died", task=state.name, error=state.last_error)
                delay = self._restart_delay(state)
                if delay is None:
                    state.state = "failed"
                    if state.policy.escalate and not self.fatal.done():
                        self.fatal.set_result(e)
                    return
                if self.restart_counter is not None:
                    self.restart_counter.labels(task=state.name).inc()
                logger.warning("restarting task %s in %.1f s", state.name, delay)
                await asyncio.sleep(delay)
                continue
            state.state = "finished"
            if state.ends_node:
                self.ended.set()
            return

    def _restart_delay(self, state: _TaskState) -> float | None:
        now = self._clock()
        recent = [t for t in state.restarts if now - t < state.policy.window_s]
        if len(recent) >= state.policy.max_restarts:
            return None
        state.restarts = [*recent, now]
        return state.policy.backoff_s * 2 ** len(recent)

    def status(self) -> dict[str, dict[str, Any]]:
        return {
            name: {"state": s.state, "restarts": len(s.restarts), "last_error": s.last_error}
            for name, s in self._tasks.items()
        }

    async def shutdown(self, timeout_s: float) -> None:
        """Cancel every task and wait for them, at most `timeout_s`; name the ones that would not stop."""
        running = [s.task for s in self._tasks.values() if s.task is not None and not s.task.done()]
        for task in running:
            task.cancel()
        if not running:
            return
        done, pending = await asyncio.wait(running, timeout=timeout_s)
        for task in done:
            if not task.cancelled() and task.exception() is not None:
                logger.debug("task %s ended with %r during shutdown", task.get_name(), task.exception())
        if pending:
            logger.warning(
                "tasks did not stop within %.1f s: %s", timeout_s, sorted(t.get_name() for t in pending)
            )


# ---- metrics and context ----


class NodeMetrics:
    """The node's Prometheus metrics, in its own registry (never the global one). Roles add theirs to `registry`."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.info = Info("hivenode_node", "Identity of this node", registry=self.registry)
        self.heartbeats = Counter("hivenode_heartbeats", "Heartbeat records stored", registry=self.registry)
        self.heartbeat_failures = Counter(
            "hivenode_heartbeat_failures", "Heartbeat stores refused or timed out", registry=self.registry
        )
        self.peers_visible = Gauge(
            "hivenode_peers_visible", "Live peers seen in the run", registry=self.registry
        )
        self.task_restarts = Counter(
            "hivenode_task_restarts", "Supervised task restarts", ["task"], registry=self.registry
        )
        self.rpc_throttled = Counter(
            "hivenode_rpc_throttled",
            "Framed requests refused for load, before they were read",
            ["route", "reason"],
            registry=self.registry,
        )

        self.admission_refused = Counter(
            "hivenode_admission_refused",
            "Pushes the syncer refused for want of the run's admission cost (protocol.admission), by cause",
            ["reason"],
            registry=self.registry,
        )

    def count_throttle(self, _peer: str, route: str, admission: Any) -> None:
        """`FramedServer(on_throttle=metrics.count_throttle)`: count refusals by route and limit."""
        self.rpc_throttled.labels(route=route, reason=admission.reason).inc()


@dataclass(kw_only=True, slots=True)
class NodeContext:
    """What every role gets: settings, identity, the verified run, the DHT and its records, metrics, events,
    the task supervisor, and the status source the HTTP API serves."""

    config: NodeConfig
    identity: NodeIdentity
    signed_manifest: SignedManifest
    manifest: RunManifest
    dht: Any  # hivemind.DHT
    records: SwarmRecords
    metrics: NodeMetrics
    events: EventLog
    supervisor: TaskSupervisor
    log_context: LogContext
    device: str = "cpu"  # resolved from config.device
    role_name: str = "-"
    stage: int | None = None
    http_address: str = ""  # host:port of our status API once it listens
    status_source: Callable[[], dict[str, Any]] = field(default=lambda: {})
    tokenizer: Any = None  # node.ml.tokenizer.Tokenizer of the run's BPE, verified; None: raw bytes
    connectivity: dict[str, Any] = field(default_factory=dict)  # node.swarm.relay.Connectivity.as_dict()
    # our proof of the run's admission cost once solved (node.swarm.admission); heartbeats carry it
    admission_proof: int | None = None

    @property
    def encode(self) -> Callable[[bytes], list[int]] | None:
        """What turns corpus bytes into the run's tokens (`Corpus.with_encoder`); None: the bytes themselves."""
        return None if self.tokenizer is None else self.tokenizer.encode

    @property
    def run_id(self) -> str:
        return self.signed_manifest.run_id

    @property
    def peer_id(self) -> str:
        return self.identity.peer_id


def resolve_device(requested: str) -> str:
    """`auto` -> the best device visible to this process: `cuda`, else `mps` (Apple silicon), else `cpu`. An
    explicit device this process cannot use is a ConfigError at start, not a crash at the first tensor."""
    import torch  # hivemind imports torch anyway; keep it out of this module's import time

    if requested == "auto":
        if torch.cuda.is_available():
            return "cuda"
        return "mps" if _mps_available() else "cpu"
    if requested.startswith("cuda"):
        if not torch.cuda.is_available():
            raise ConfigError(f"--device {requested}: no CUDA device is visible to this process")
        index, count = int(requested.partition(":")[2] or 0), torch.cuda.device_count()
        if index >= count:
            raise ConfigError(
                f"--device {requested}: this process sees {count} CUDA device(s), 0..{count - 1}"
            )
    if requested == "mps" and not _mps_available():
        raise ConfigError(
            f"--device {requested}: MPS is not available (Apple silicon and a torch built with it)"
        )
    return requested


def _mps_available() -> bool:
    import torch

    mps = getattr(torch.backends, "mps", None)  # absent from some torch builds
    return bool(mps is not None and mps.is_available())


async def wait_or_stop(stop: asyncio.Event, timeout_s: float) -> bool:
    """Wait up to `timeout_s` for `stop`; True if it is set. The only way our loops pause."""
    with contextlib.suppress(asyncio.TimeoutError):
        await asyncio.wait_for(stop.wait(), timeout_s)
    return stop.is_set()


def events_path(config: NodeConfig) -> Path:
    return config.state_dir / EVENTS_FILENAME


EXIT_GRACE_S = 1.0  # how long a leaving process waits for a busy worker thread before it ends without it


def run_loop(main: Coroutine[Any, Any, int]) -> int:
    """`asyncio.run(main)`, except that the default executor is not waited for: a worker thread still busy (a model
    build or corpus load that a SIGTERM interrupted) must not hold up a node that has left the swarm; see
    `exit_process`."""
    loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    try:
        return loop.run_until_complete(main)
    finally:
        try:
            pending = asyncio.all_tasks(loop)
            for task in pending:
                task.cancel()
            loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
            loop.run_until_complete(loop.shutdown_asyncgens())
        finally:
            asyncio.set_event_loop(None)
            loop.close()  # shuts the default executor down without waiting for its threads


def exit_process(code: int, grace_s: float = EXIT_GRACE_S) -> NoReturn:
    """End the process with `code` once the worker threads are done, or after `grace_s`: the interpreter would
    otherwise wait for every executor thread to finish its task (seconds to minutes for a model build). Called
    after the node stopped, so nothing it committed is in those threads (checkpoints are written atomically)."""
    deadline = time.monotonic() + grace_s
    lingering = [t for t in threading.enumerate() if t is not threading.main_thread() and not t.daemon]
    for thread in lingering:
        thread.join(max(0.0, deadline - time.monotonic()))
    if any(t.is_alive() for t in lingering):
        names = ", ".join(t.name for t in lingering if t.is_alive())
        logging.getLogger(__name__).info("not waiting for busy worker threads (%s)", names)
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)
