"""`python -m node demo`: a whole swarm on loopback, as real processes, with a live view and a report at the end.

    python -m node demo [--learners N] [--stages S --replicas R --verifiers V] [--chaos] [--attack KIND]
                        [--duration SECONDS] [--out DIR] [--seed N] [--http-port P]

What it does, in order:

1. creates the trusted keys first (syncer, verifiers: `NodeIdentity.load_or_create`) and one key per node, so
   every process has a known peer id; writes a `run.toml` that authorizes the syncer(s) and verifiers and sizes the
   model for a 2-core laptop (2 layers x 64 wide, context 64, byte-level, the built-in corpus);
2. starts `python -m bootstrap --run run.toml` and waits for its multiaddr and dashboard URL (printed);
3. starts the syncer (and, with `--chaos`, a standby syncer), the learners, the pipeline stage replicas and the
   verifiers as `python -m node --join <maddr> --role ...`, each a process group of its own (its DHT process and
   p2pd come with it), with one torch thread each;
4. watches the swarm through the bootstrap's `/api/swarm` (and the active syncer's `/api/status`) with
   `node.status.swarm_view.SwarmHistory`, and shows it live (rich) or, without a terminal, as a log line every 10 s;
5. with `--chaos`, runs `tools.chaos` schedules (learner kills and restarts, stalls, a syncer kill with failover);
   with `--attack KIND`, one stage replica runs the named attack (`HIVENODE_UNSAFE_ATTACK`, the stage's explicit
   unsafe option; `verification.attacks` names the kinds); its stage has at least 3 replicas, the fewest with
   which a verifier may ban one (it never leaves a stage fewer than 2 working replicas, and a spot check needs a
   third replica to decide two against one), and the report says whether and when it was banned;
6. at `--duration` (seconds of training after the swarm is up) or on Ctrl-C: stops every process (SIGTERM, then
   SIGKILL of whatever is left and what it forked; the demo is the subreaper of everything it started, so nothing
   escapes), checks that no process is left, evaluates the syncer's final checkpoint on held-out data, and writes
   `report.json`, the text report and the plots (`tools.report`) into `--out` (default `runs/<timestamp>`).

"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import json
import logging
import math
import os
import queue
import re
import resource
import shlex
import signal
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import aiohttp

from node.config import LOOPBACK_LISTEN
from node.status.swarm_view import (
    NOTES_FILENAME,
    SwarmHistory,
    ViewConfig,
    goodput_text,
    short,
    summary_line,
    throughput_text,
)
from protocol.errors import ConfigError, HivenodeError
from protocol.identity import NodeIdentity
from tools.proctree import ProcInfo, cmdline, descendants, proc_table, reap, set_subreaper, terminate
from tools.report import ReportInputs, build_report, render_text, write_plots, write_report

logger = logging.getLogger(__name__)

if TYPE_CHECKING:
    from tools.chaos import ProcessGroup

EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2
REPO_ROOT = Path(__file__).resolve().parents[1]
DEMO_MODEL = {"vocab_size": 256, "context_len": 64, "num_layers": 2, "width": 64, "num_heads": 4}
EVAL_BATCHES, EVAL_BATCH_SIZE = 4, 8  # held-out batches the syncer and the demo evaluate the global model on
MIN_CHAOS_DURATION_S = 40.0
REVIVE_AFTER_S = 6.0  # a node down this long that chaos does not account for is started again
ATTACK_START_AFTER = 80  # honest steps of the attacker before it attacks (the monitors warm up first)
# The verifier's ledger never bans a stage below 2 working replicas (verification.ledger.LedgerConfig:
# min_active_replicas_per_stage, max_banned_fraction_per_stage 0.5), and a spot check convicts only two against
# one: with 2 replicas the liar could never be banned.
ATTACK_MIN_REPLICAS = 3
_DASHBOARD = re.compile(r"^dashboard: (http://\S+?)/?$", re.M)
_MADDR = re.compile(r"^(/ip4/\S+/p2p/\S+)$", re.M)
_STATUS = re.compile(r"^status: (http://\S+)$", re.M)


# ---- configuration ----


@dataclass(frozen=True, kw_only=True, slots=True)
class DemoConfig:
    """One demo swarm: what runs, for how long, and where its files go."""

    out_dir: Path  # report, plots, logs, state of every process
    learners: int = 2  # full-model DiLoCo learners
    stages: int = 0  # pipeline stages (0: no pipeline)
    replicas: int = 1  # replicas per stage
    verifiers: int = 1  # verifiers driving the pipeline (only with stages)
    chaos: bool = False  # kill/restart/stall nodes on a seeded schedule
    attack: str | None = None  # one malicious stage replica runs this attack
    duration_s: float | None = None  # seconds of training after the swarm is up; None = until Ctrl-C
    seed: int = 0  # run seed (model init, data order) and chaos seed
    http_port: int = 0  # dashboard port (0 = any free port)
    heartbeat_period_s: float = 2.0  # the default; shorter makes records flap on a busy 2-core box
    batch_size: int = 16  # sequences per inner step
    sync_every_steps: int = 24  # H
    num_fragments: int = 2  # P, per stage
    min_sync_interval_s: float = 3.0
    eval_every_merges: int = 10  # the syncer evaluates the global model this often
    refresh_s: float = 1.0  # how often the demo reads the swarm
    start_timeout_s: float = 120.0  # bounds the start of each process (a cold torch import on a busy box)
    stop_timeout_s: float = 24.0  # bounds the graceful stop of all processes (four tiers)
    chaos_window_s: float = 120.0  # chaos schedules are drawn per window (the whole run with --duration)
    live: bool = False  # rich live view (needs a terminal); else a log line every `log_every_s`
    log_every_s: float = 10.0

    def __post_init__(self) -> None:
        if self.learners < 0 or self.stages < 0 or self.replicas < 1 or self.verifiers < 0:
            raise ValueError("need learners >= 0, stages >= 0, replicas >= 1, verifiers >= 0")
        if self.learners == 0 and self.stages == 0:
            raise ValueError("nothing to train: give --learners N and/or --stages S")
        if self.stages and self.verifiers < 1:
            raise ValueError("a pipeline needs at least one verifier to drive it")
        if self.attack is not None and (self.stages < 1 or self.replicas < ATTACK_MIN_REPLICAS):
            raise ValueError(
                f"--attack needs a pipeline with at least {ATTACK_MIN_REPLICAS} replicas per stage "
                f"(got --stages {self.stages} --replicas {self.replicas}): a verifier never bans a stage "
                f"below 2 working replicas and needs a third replica to decide a spot check, so with fewer "
                f"the liar could never be banned; use --replicas {ATTACK_MIN_REPLICAS} (the default with --attack)"
            )
        if self.duration_s is not None and self.duration_s <= 0:
            raise ValueError("--duration must be positive")
        if self.chaos and self.duration_s is not None and self.duration_s < MIN_CHAOS_DURATION_S:
            raise ValueError(
                f"--chaos needs --duration of at least {MIN_CHAOS_DURATION_S:g} s (its faults take time)"
            )
        for name in (
            "heartbeat_period_s",
            "refresh_s",
            "start_timeout_s",
            "stop_timeout_s",
            "chaos_window_s",
        ):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive")
        if not 0 <= self.http_port <= 65535:
            raise ValueError("--http-port must be in [0, 65535]")

    @property
    def syncers(self) -> int:
        # a standby lets chaos kill the active syncer and watch the failover
        return 2 if self.chaos else 1

    @property
    def num_layers(self) -> int:
        return max(DEMO_MODEL["num_layers"], self.stages)

    @property
    def attacker(self) -> str | None:
        """The name of the lying stage replica (see plan_nodes), None without --attack."""
        return f"stage0r{self.replicas}" if self.attack is not None else None

    @property
    def planned_workers(self) -> int:
        """Peers whose tokens the swarm view counts: learners and stage-0 replicas."""
        return self.learners + (self.replicas if self.stages else 0)


@dataclass(frozen=True, kw_only=True, slots=True)
class NodeSpec:
    """One node process of the demo."""

    name: str
    role: str
    stage: int | None = None
    attack: str | None = None
    options: dict[str, dict[str, Any]] = field(default_factory=dict)  # node.toml tables

    @property
    def trusted(self) -> bool:
        return self.role in ("syncer", "verifier")


def plan_nodes(config: DemoConfig) -> list[NodeSpec]:
    """The demo's node processes (the bootstrap apart), in start order."""
    syncer_options = {
        "syncer": {
            "eval_every_merges": config.eval_every_merges,
            "eval_batches": EVAL_BATCHES,
            "eval_batch_size": EVAL_BATCH_SIZE,
            "checkpoint_every_merges": 8,
            "checkpoint_dir": str(config.out_dir / "state" / "syncer-checkpoints"),
        }
    }
    learner_options = {"learner": {"torch_threads": 1, "eval_every_steps": 0}}
    nodes = [
        NodeSpec(name=f"syncer{i + 1}", role="syncer", options=syncer_options) for i in range(config.syncers)
    ]
    nodes += [
        NodeSpec(name=f"learner{i + 1}", role="learner", options=learner_options)
        for i in range(config.learners)
    ]
    for stage in range(config.stages):
        for replica in range(config.replicas):
            # the last replica of stage 0 lies, when asked to: its activations cross a checked boundary on every
            # microbatch, and the other replicas of its stage stay honest to compare with and route to
            lies = config.attack is not None and stage == 0 and replica == config.replicas - 1
            nodes.append(
                NodeSpec(
                    name=f"stage{stage}r{replica + 1}",
                    role="stage",
                    stage=stage,
                    attack=config.attack if lies else None,
                )
            )
    if config.stages:
        nodes += [NodeSpec(name=f"verifier{i + 1}", role="verifier") for i in range(config.verifiers)]
    return nodes


def run_toml(config: DemoConfig, syncers: Sequence[str], verifiers: Sequence[str]) -> str:
    """The demo's run.toml: tiny model, quick syncs, the demo's trusted keys authorized."""
    model = {**DEMO_MODEL, "num_layers": config.num_layers}
    lines = [
        'name = "demo"',
        f"seed = {config.seed}",
        f"num_stages = {max(config.stages, 1)}",
        f"heartbeat_period_s = {float(config.heartbeat_period_s)}",
        f"authorized_syncers = {json.dumps(sorted(syncers))}",
        f"authorized_verifiers = {json.dumps(sorted(verifiers))}",
        "",
        "[model]",
        *(f"{key} = {value}" for key, value in model.items()),
        "",
        "[inner]",
        "lr = 0.001",
        f"batch_size = {config.batch_size}",
        "",
        "[diloco]",
        f"sync_every_steps = {config.sync_every_steps}",
        f"num_fragments = {config.num_fragments}",
        f"min_sync_interval_s = {float(config.min_sync_interval_s)}",
        "",
        "[admission]",  # a proof-of-work as in a public run, cheap: each demo learner solves in milliseconds
        'mode = "pow"',
        "pow_bits = 12",
    ]
    return "\n".join(lines) + "\n"


def node_toml(spec: NodeSpec) -> str:
    lines: list[str] = []
    for table, values in spec.options.items():
        lines.append(f"[{table}]")
        lines += [f"{key} = {json.dumps(value)}" for key, value in values.items()]
    return "\n".join(lines) + "\n"


def attack_prefix(kind: str) -> list[str]:
    """The command prefix that makes a stage replica attack (`env HIVENODE_UNSAFE_ATTACK=<spec>`: the stage's
    explicit, loudly named unsafe option); ConfigError if this version has none or the attack is unknown. A bare
    KIND starts attacking after `ATTACK_START_AFTER` honest steps, so the verifiers' monitors warm up on honest
    traffic first; a full spec (`KIND:key=value,...`, see verification.attacks.parse_attack) is used as given."""
    try:
        from verification.attacks import UNSAFE_ATTACK_ENV, parse_attack
    except ImportError:
        raise ConfigError(
            "--attack needs the stage's unsafe attack option, which this version does not have yet"
        ) from None
    spec = kind if ":" in kind else f"{kind}:start_after={ATTACK_START_AFTER}"
    try:
        parse_attack(spec)
    except ValueError as e:
        raise ConfigError(f"--attack {kind}: {e}") from None
    return ["env", f"{UNSAFE_ATTACK_ENV}={spec}"]


# ---- processes ----


class ProcessWatch:
    """Counts the processes the demo started (directly or not), their CPU time, and reaps orphaned zombies."""

    def __init__(self, own_children: Callable[[], set[int]]) -> None:
        self.own_children = own_children  # pids a Popen owns now (it reaps them itself)
        self.seen: set[int] = set()
        self.peak_alive = 0
        self._ticks: dict[int, int] = {}
        self._hz = os.sysconf("SC_CLK_TCK")

    def sample(self) -> int:
        table = proc_table()
        alive = descendants(os.getpid(), table)
        self.seen.update(alive)
        self.peak_alive = max(self.peak_alive, len(alive))
        for pid in alive:
            self._ticks[pid] = max(self._ticks.get(pid, 0), table[pid].cpu_ticks)
        self.reap(table)
        return len(alive)

    def reap(self, table: dict[int, ProcInfo] | None = None) -> None:
        table = table if table is not None else proc_table()
        me, own = os.getpid(), self.own_children()
        reap(pid for pid, info in table.items() if info.ppid == me and info.state == "Z" and pid not in own)

    @property
    def cpu_s(self) -> float:
        return sum(self._ticks.values()) / self._hz


def kill_leftovers(grace_s: float = 3.0, timeout_s: float = 5.0) -> list[str]:
    """Give what is still below us `grace_s` to exit on its own (a DHT process or torch's shared-memory manager
    winds down after its parent), then SIGTERM, then SIGKILL it; return what had to be killed (pid and command)."""
    deadline = time.monotonic() + grace_s
    while descendants(os.getpid()) and time.monotonic() < deadline:
        time.sleep(0.1)
    left = descendants(os.getpid())
    described = [f"{pid} {cmdline(pid)}" for pid in left]
    terminate(left, timeout_s)
    reap(left)
    return described


def join_command(maddr: str, executable: str = sys.executable) -> str:
    """The command a volunteer runs to join this swarm, as it works from a fresh shell: the `hivenode` console
    script beside our interpreter (by absolute path, no venv to activate), else that interpreter with `-m node`."""
    python = Path(executable).absolute()  # not resolved: a venv's python is a symlink to the system one
    script = python.parent / "hivenode"
    prefix = [str(script)] if script.is_file() and os.access(script, os.X_OK) else [str(python), "-m", "node"]
    return shlex.join([*prefix, "--join", maddr])


def announce_fault(
    phase: str, injected: Any, *, since: float, notes: Path, peer: str | None
) -> dict[str, Any]:
    """Say a fault's start or end (`tools.chaos.announcement`) on the console, `[seconds since the swarm was up]`
    first, and on the dashboard: a line in the bootstrap's notes file, which it adds to its events. Returns the
    note (an event: `t`, `kind` fault or recovery, `text`, `target`, `phase`, `peer`)."""
    from tools.chaos import announcement

    now = time.time()
    said = announcement(phase, injected)
    print(f"[{now - since:5.0f} s] {said['text']}", flush=True)
    kind = "fault" if said["phase"] == "start" else "recovery"
    note: dict[str, Any] = {"t": now, "kind": kind, "text": said["text"], "phase": said["phase"]}
    note.update(target=injected.target, peer=peer)
    try:
        with notes.open("a") as out:
            out.write(json.dumps(note) + "\n")
    except OSError as e:
        logger.warning("cannot add the fault to the dashboard's events: %s", e)
    return note


def events_path_of(state_dir: Path) -> Path:
    from node.context import EVENTS_FILENAME

    return state_dir / EVENTS_FILENAME


# ---- the demo ----


@dataclass(slots=True)
class Started:
    spec: NodeSpec
    argv: list[str]
    peer_id: str
    state_dir: Path


class MergeTapes:
    """The merge lines of the syncers' events.jsonl, read incrementally; the most recent ones are kept."""

    def __init__(self, state_dirs: list[Path], keep: int = 512) -> None:
        self.paths = [events_path_of(d) for d in state_dirs]
        self.recent: collections.deque[dict[str, Any]] = collections.deque(maxlen=keep)
        self._offsets: dict[Path, int] = {}

    def read(self) -> list[dict[str, Any]]:
        """New complete lines of every tape, then the recent merges (oldest first)."""
        for path in self.paths:
            offset = self._offsets.get(path, 0)
            try:
                with path.open("rb") as f:
                    f.seek(offset)
                    chunk = f.read()
            except OSError:
                continue
            complete = chunk[: chunk.rfind(b"\n") + 1]
            self._offsets[path] = offset + len(complete)
            for line in complete.splitlines():
                with contextlib.suppress(ValueError):
                    event = json.loads(line)
                    if isinstance(event, dict) and event.get("event") == "merge":
                        self.recent.append(event)
        return list(self.recent)


def seed_model_loss(num_layers: int, seed: int) -> float:
    """Held-out loss of version 0 (the seed model), on the batches the syncer evaluates on."""
    import torch

    from node.ml.data import evaluate, load_corpus, validation_batches
    from node.ml.model import ModelConfig, build_model

    torch.set_num_threads(1)
    cfg = ModelConfig.from_dict({**DEMO_MODEL, "num_layers": num_layers})
    batches = validation_batches(
        load_corpus(None),
        batch_size=EVAL_BATCH_SIZE,
        context_len=cfg.context_len,
        num_batches=EVAL_BATCHES,
    )
    return evaluate(build_model(cfg, seed), batches)


def checkpoint_loss(run_file: Path, state: Path, run_id: str) -> float | None:
    """Held-out loss of the syncer's last checkpoint (written when it stopped), or None if there is none."""
    import torch

    from node.diloco.sync_client import run_fragment_plan
    from node.ml.checkpoint import CheckpointError, CheckpointStore
    from node.ml.data import evaluate, load_corpus, validation_batches
    from node.ml.model import ModelConfig, build_model
    from protocol.manifest import load_run_toml

    manifest = load_run_toml(run_file)
    cfg = ModelConfig.from_dict(manifest.model)
    model = build_model(cfg, manifest.seed)
    expected = {n: tuple(p.shape) for n, p in model.named_parameters()}
    store = CheckpointStore(state / "syncer-checkpoints", run_id)
    try:
        snapshot = store.load_latest(
            expected=expected,
            num_fragments=run_fragment_plan(manifest).num_fragments,
        )
    except (FileNotFoundError, CheckpointError) as e:
        logger.warning("no final checkpoint to evaluate: %s", e)
        return None
    torch.set_num_threads(1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(snapshot.params[name])
    batches = validation_batches(
        load_corpus(None),
        batch_size=EVAL_BATCH_SIZE,
        context_len=cfg.context_len,
        num_batches=EVAL_BATCHES,
    )
    return evaluate(model, batches)


def export_sample(run_file: Path, state: Path, run_id: str, out: Path) -> str | None:
    """Export the syncer's final checkpoint as a transformers folder (`out`) and sample 48 tokens after
    "def " from it, loaded with from_pretrained (docs/models.md); None (logged) if anything is missing."""
    from node.ml.checkpoint import CheckpointStore
    from node.ml.export import ExportError, checkpoint_params, export_hf, generate
    from node.ml.model import ModelConfig
    from protocol.manifest import load_run_toml

    # the newest of the content-addressed checkpoints (the legacy single-file name is only ever the oldest)
    paths = CheckpointStore(state / "syncer-checkpoints", run_id).paths()
    if not paths:
        logger.warning(
            "no export or sample: the syncer wrote no checkpoint in %s", state / "syncer-checkpoints"
        )
        return None
    path = paths[0]
    try:
        manifest = load_run_toml(run_file)
        export_hf(ModelConfig.from_dict(manifest.model), checkpoint_params(path), out, None)
        return generate(out, "def ", max_new_tokens=48, temperature=0.8, seed=0)
    except (OSError, ValueError, ExportError) as e:
        logger.warning("no export or sample: %s", e)
        return None


def terminate_gently(group: ProcessGroup, names: list[str], timeout_s: float) -> None:
    """SIGTERM (after a SIGCONT: a stalled process cannot handle SIGTERM) and wait up to `timeout_s` for them."""
    running = [n for n in names if n in group.names() and group.alive(n)]
    for name in running:
        with contextlib.suppress(ProcessLookupError):
            group.signal(name, signal.SIGCONT)
            group.signal(name, signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    while any(group.alive(n) for n in running) and time.monotonic() < deadline:
        time.sleep(0.1)


class DemoSwarm:
    """One demo run: `prepare()`, `start()`, `run(stop)`, then `shutdown()` and `finish()` in a finally."""

    def __init__(self, config: DemoConfig) -> None:
        from tools.chaos import ProcessGroup

        self.config = config
        self.out = config.out_dir
        self.logs = self.out / "logs"
        self.state = self.out / "state"
        env = dict(os.environ)
        env.update(
            PYTHONUNBUFFERED="1",
            OMP_NUM_THREADS="1",
            MKL_NUM_THREADS="1",
            HIVENODE_STATE_DIR=str(self.state),
            PYTHONPATH=os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")])),
        )
        self.group = ProcessGroup(self.logs, env=env, cwd=REPO_ROOT, active_syncer=self.active_syncer)
        self.history = SwarmHistory(ViewConfig(sample_period_s=config.refresh_s, max_samples=100_000))
        self.nodes: dict[str, Started] = {}
        self.names_by_peer: dict[str, str] = {}
        self.dashboard = ""
        self.maddr = ""
        self.run_file = self.out / "run.toml"
        self.started_at = time.time()  # the report's time zero: when the swarm is up
        self.ended_at: float | None = None
        self.faults: list[dict[str, Any]] = []
        self.chaos_events: queue.SimpleQueue[tuple[str, Any, dict[str, Any]]] = queue.SimpleQueue()
        self.last_doc: dict[str, Any] = {}
        self.watch = ProcessWatch(self._popen_pids)
        self.left_behind: list[str] = []
        self._chaos_runner: Any = None
        self._start_eval: asyncio.Future[float] | None = None
        self._events_logged = 0
        self._chaos_down: set[str] = set()  # killed by chaos, its restart still due
        self._down_since: dict[str, float] = {}
        self.unplanned_exits: list[dict[str, Any]] = []
        self.tapes = MergeTapes([])  # the syncers' event tapes, once `prepare` has named them

    def _popen_pids(self) -> set[int]:
        return {self.group.pid(name) for name in self.group.names()}

    # ---- setup ----

    def prepare(self) -> None:
        """Keys (trusted ones first: the run authorizes them), run.toml and node.toml files."""
        if self.config.attack is not None:
            attack_prefix(self.config.attack)  # fail now, before anything is written or started
        for path in (self.logs, self.state):
            path.mkdir(parents=True, exist_ok=True)
        specs = plan_nodes(self.config)
        for spec in specs:
            state_dir = self.state / spec.name
            identity = NodeIdentity.load_or_create(state_dir / "identity.key")
            argv = [sys.executable, "-m", "node", "--join", "MADDR", "--role", spec.role]
            argv += ["--state-dir", str(state_dir), "--identity", str(identity.path), "--log-level", "INFO"]
            argv += ["--http", "127.0.0.1:0", "--listen", LOOPBACK_LISTEN]  # the demo stays on this machine
            if spec.stage is not None:
                argv += ["--stage", str(spec.stage)]
            if spec.options:
                (state_dir / "node.toml").write_text(node_toml(spec))
                argv += ["--config", str(state_dir / "node.toml")]
            if spec.attack is not None:
                argv = attack_prefix(spec.attack) + argv  # `env` execs python: the same process
            self.nodes[spec.name] = Started(
                spec=spec, argv=argv, peer_id=identity.peer_id, state_dir=state_dir
            )
            self.names_by_peer[identity.peer_id] = spec.name
        syncers = [n.peer_id for n in self.nodes.values() if n.spec.role == "syncer"]
        verifiers = [n.peer_id for n in self.nodes.values() if n.spec.role == "verifier"]
        self.run_file.write_text(run_toml(self.config, syncers, verifiers))
        self.tapes = MergeTapes([n.state_dir for n in self.nodes.values() if n.spec.role == "syncer"])

    async def start(self, stop: asyncio.Event) -> None:
        """Bootstrap first, then every node at once; returns when all of them serve their status API."""
        self._start_eval = asyncio.ensure_future(
            asyncio.to_thread(seed_model_loss, self.config.num_layers, self.config.seed)
        )
        argv = [sys.executable, "-m", "bootstrap", "--run", str(self.run_file), "--state-dir"]
        argv += [str(self.state / "bootstrap"), "--http", f"127.0.0.1:{self.config.http_port}"]
        argv += ["--no-syncer", "--no-verifier"]  # the demo runs its own, and kills them on its schedule
        argv += ["--listen", LOOPBACK_LISTEN]
        self.group.start("bootstrap", argv)
        text = await self._wait_log("bootstrap", [_DASHBOARD, _MADDR], stop)
        self.dashboard = _DASHBOARD.search(text).group(1) + "/"  # type: ignore[union-attr]
        self.maddr = _MADDR.search(text).group(1)  # type: ignore[union-attr]
        print(f"dashboard: {self.dashboard}", flush=True)
        print(f"join this swarm: {join_command(self.maddr)}", flush=True)
        for started in self.nodes.values():
            started.argv[started.argv.index("MADDR")] = self.maddr
            self.group.start(started.spec.name, started.argv)
        await asyncio.gather(*(self._wait_log(name, [_STATUS], stop) for name in self.nodes))
        self.started_at = time.time()
        self.history.note(self.started_at, "demo", f"swarm up: {len(self.nodes) + 1} nodes")
        seed_loss = await self._start_eval
        self.history.add_eval(self.started_at, seed_loss, label="seed model (version 0)")

    async def _wait_log(self, name: str, patterns: list[re.Pattern[str]], stop: asyncio.Event) -> str:
        deadline = time.monotonic() + self.config.start_timeout_s
        while True:
            text = self.group.log(name)
            if all(p.search(text) for p in patterns):
                return text
            if not self.group.alive(name):
                tail = "\n".join(text.strip().splitlines()[-5:])
                raise HivenodeError(f"{name} exited while starting; its log ends with:\n{tail}")
            if time.monotonic() > deadline:
                raise HivenodeError(f"{name} did not start within {self.config.start_timeout_s:g} s")
            if stop.is_set():
                raise HivenodeError(f"stopped while {name} was starting")
            await asyncio.sleep(0.2)

    # ---- running ----

    def active_syncer(self) -> str:
        """Name of the syncer process holding the lease (for `tools.chaos`'s kill_syncer)."""
        records = [s for s in self.last_doc.get("syncer") or [] if s.get("state") == "active"]
        if not records:
            raise ValueError("no active syncer in the last look at the swarm")
        best = max(records, key=lambda s: (s.get("term", 0), s.get("lease_until", 0.0)))
        return self.names_by_peer[best["peer_id"]]

    async def run(self, stop: asyncio.Event) -> None:
        """Observe (and shake) the swarm until `stop` or the duration."""
        tasks = [asyncio.ensure_future(self._observe(stop))]
        if self.config.chaos:
            tasks.append(asyncio.ensure_future(self._chaos(stop)))
        deadline = self.started_at + self.config.duration_s if self.config.duration_s else math.inf
        try:
            view = LiveView(self) if self.config.live else None
            with view if view is not None else contextlib.nullcontext():
                next_log = time.monotonic() + self.config.log_every_s
                while not stop.is_set() and time.time() < deadline:
                    with contextlib.suppress(asyncio.TimeoutError):
                        await asyncio.wait_for(stop.wait(), min(0.5, max(deadline - time.time(), 0.01)))
                    if view is not None:
                        view.update()
                    elif time.monotonic() >= next_log:
                        next_log += self.config.log_every_s
                        print(self.progress_line(), flush=True)
                    for task in tasks:
                        if task.done() and task.exception() is not None:
                            raise task.exception()  # type: ignore[misc]
        finally:
            stop.set()
            if self._chaos_runner is not None:
                self._chaos_runner.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            self.ended_at = time.time()

    async def _observe(self, stop: asyncio.Event) -> None:
        timeout = aiohttp.ClientTimeout(total=5.0)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            while not stop.is_set():
                await self.observe_once(session)
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(stop.wait(), self.config.refresh_s)

    async def observe_once(self, session: aiohttp.ClientSession) -> None:
        self._drain_chaos_events()
        self._restart_the_fallen(time.time())
        self.watch.sample()
        try:
            async with session.get(self.dashboard + "api/swarm") as response:
                doc = await response.json() if response.status == 200 else None
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as e:
            logger.debug("swarm document: %s", e)
            return
        if not isinstance(doc, dict):
            return
        status = await self._syncer_status(session, doc) or {}
        # the syncers' event tapes carry every merge's quorum, grace waited, weights and tokens
        doc["syncer_status"] = {**status, "recent_merges": self.tapes.read()}
        self.last_doc = doc
        self.history.observe(doc, float(doc.get("time") or time.time()))
        self._log_events()

    def _log_events(self) -> None:
        """Append new events (the swarm's and the chaos actions) to <out>/swarm-events.jsonl."""
        events = self.history.events_after(self._events_logged)
        if events:
            self._events_logged = events[-1]["seq"]
            with (self.out / "swarm-events.jsonl").open("a") as log:
                log.writelines(json.dumps(e, default=str) + "\n" for e in events)

    async def _syncer_status(
        self, session: aiohttp.ClientSession, doc: dict[str, Any]
    ) -> dict[str, Any] | None:
        active = [s for s in doc.get("syncer") or [] if s.get("state") == "active" and s.get("http")]
        if not active:
            return None
        best = max(active, key=lambda s: (s.get("term", 0), s.get("lease_until", 0.0)))
        try:
            async with session.get(f"http://{best['http']}/api/status") as response:
                return await response.json() if response.status == 200 else None
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError):
            return None

    async def _chaos(self, stop: asyncio.Event) -> None:
        from tools.chaos import ChaosConfig, ChaosRunner, plan_faults

        targets = [n for n, s in self.nodes.items() if s.spec.role in ("learner", "stage")]
        window = self.config.duration_s or self.config.chaos_window_s
        rounds = 0
        while not stop.is_set():
            faults_per_kind = max(1, round(window / 90))
            config = ChaosConfig(
                seed=self.config.seed * 1000 + rounds,
                duration_s=window,
                learner_kills=faults_per_kind,
                stragglers=faults_per_kind,
                syncer_kills=1 if window >= 60 else 0,
                restart_delay_s=4.0,
                stop_s=6.0,
                margin_s=min(10.0, window / 5),
                min_gap_s=8.0,
            )
            try:
                plan = plan_faults(config, targets)
            except ValueError as e:  # a window too short for its faults: say so, do not take the demo down
                self.history.note(time.time(), "chaos", f"no chaos schedule: {e}")
                return
            runner = ChaosRunner(plan, self.group, on_event=self._announce_fault)
            self._chaos_runner = runner
            self.history.note(
                time.time(), "chaos", f"chaos schedule {rounds + 1}: {len(plan)} faults in {window:g} s"
            )
            await asyncio.to_thread(runner.run)
            rounds += 1
            if self.config.duration_s:
                return

    def _announce_fault(self, phase: str, injected: Any) -> None:
        """On the chaos thread, as a fault starts or ends (see `announce_fault`); the swarm view and the report
        take it from the queue."""
        started = self.nodes.get(injected.target)
        notes = self.state / "bootstrap" / NOTES_FILENAME
        peer = started.peer_id if started is not None else None
        note = announce_fault(phase, injected, since=self.started_at, notes=notes, peer=peer)
        self.chaos_events.put((phase, injected, note))

    def _drain_chaos_events(self) -> None:
        while True:
            try:
                kind, injected, note = self.chaos_events.get_nowait()
            except queue.Empty:
                return
            now = note["t"]
            target = injected.target
            started = self.nodes.get(target)
            peer = started.peer_id if started is not None else None
            role = started.spec.role if started is not None else "?"
            action = {"kill": "kill", "stop": "stall", "kill_syncer": "kill"}[injected.fault.kind]
            if kind == "inject":
                if action == "kill" and not injected.error:
                    self._chaos_down.add(target)
                self.history.note(now, note["kind"], note["text"], peer=peer, target=target)
                if not injected.error:
                    self.faults.append(
                        {
                            "t": now,
                            "action": action,
                            "kind": injected.fault.kind,
                            "target": target,
                            "peer": peer,
                            "role": role,
                        }
                    )
            else:
                self._chaos_down.discard(target)
                self.history.note(now, note["kind"], note["text"], peer=peer, target=target)

    def _restart_the_fallen(self, now: float) -> None:
        """A node that exited on its own (not killed by chaos, or failing to come back after its chaos restart) is
        started again once it has been down `REVIVE_AFTER_S`, as its volunteer would; each such exit is reported."""
        for name, started in self.nodes.items():
            if name in self._chaos_down or self.group.alive(name):
                self._down_since.pop(name, None)
                continue
            since = self._down_since.setdefault(name, now)
            if now - since < REVIVE_AFTER_S:
                continue
            last_line = (self.group.log(name).strip().splitlines() or [""])[-1][:200]
            self.unplanned_exits.append(
                {"t": now, "node": name, "peer": started.peer_id, "last_line": last_line}
            )
            self.history.note(
                now, "exit", f"{name} exited on its own ({last_line}); restarting it", peer=started.peer_id
            )
            logger.warning("%s exited on its own (%s); restarting it", name, last_line)
            with contextlib.suppress(ValueError):
                self.group.restart(name)
            self._down_since.pop(name, None)

    # ---- views ----

    def progress_line(self) -> str:
        elapsed = time.time() - self.started_at
        evals = self.history.eval_points
        held = f"held-out {evals[0]['loss']:.3f} -> {evals[-1]['loss']:.3f}" if evals else "held-out -"
        return f"[{elapsed:5.0f} s] {held}; {summary_line(self.history)}"

    # ---- the end ----

    async def shutdown(self) -> None:
        """Workers first (SIGTERM; they announce leaving), then the syncers (final checkpoint), then the bootstrap;
        then SIGKILL whatever is left anywhere below us."""
        if self._chaos_runner is not None:
            self._chaos_runner.cancel()
        workers = [n for n, s in self.nodes.items() if s.spec.role != "syncer"]
        syncers = [n for n, s in self.nodes.items() if s.spec.role == "syncer"]
        try:
            active = [self.active_syncer()]
        except (ValueError, KeyError):
            active = []
        standbys = [n for n in syncers if n not in active]
        # standbys before the active syncer: it writes the final checkpoint, and none may take over from it
        per_tier = self.config.stop_timeout_s / 4
        for names in (workers, standbys, active, ["bootstrap"]):
            await asyncio.to_thread(terminate_gently, self.group, names, per_tier)
        await asyncio.to_thread(self.group.terminate_all, 2.0)
        self.left_behind = await asyncio.to_thread(kill_leftovers)
        if self.left_behind:
            logger.warning(
                "%d process(es) were left and had to be killed: %s", len(self.left_behind), self.left_behind
            )
        self.watch.reap()

    async def finish(self) -> dict[str, Any]:
        """Final held-out loss, report.json, the plots; returns the report."""
        ended_at = self.ended_at or time.time()
        run_id = self.last_doc.get("run_id")
        final = (
            await asyncio.to_thread(checkpoint_loss, self.run_file, self.state, run_id) if run_id else None
        )
        sample = None
        if final is not None and run_id:
            self.history.add_eval(ended_at, final, label="final checkpoint")
            sample = await asyncio.to_thread(
                export_sample, self.run_file, self.state, run_id, self.out / "model"
            )
        history = self.history.history_json()
        cpu_wall = max(ended_at - self.started_at, 1e-9)
        own = resource.getrusage(resource.RUSAGE_SELF)
        report = build_report(
            ReportInputs(
                run=self._run_summary(),
                started_at=self.started_at,
                ended_at=ended_at,
                history=history,
                events=self.history.events_json(),
                faults=self.faults,
                planned_workers=self.config.planned_workers,
                processes={
                    "unplanned_exits": self.unplanned_exits,
                    "started": len(self.watch.seen),
                    "peak_alive": self.watch.peak_alive,
                    "left_behind": len(self.left_behind),
                },
                cpu={
                    "cores": os.cpu_count(),
                    "cpu_s": round(self.watch.cpu_s + own.ru_utime + own.ru_stime, 1),
                    "wall_s": round(cpu_wall, 1),
                },
            )
        )
        if self.config.attacker is not None:
            report["attack"] = attack_outcome(
                self.config, self._run_summary()["nodes"], report.get("bans") or []
            )
        report["sample"] = sample  # the exported model's continuation of "def " (None: no checkpoint)
        paths = await asyncio.to_thread(write_plots, report, history, self.out, self.started_at)
        report["plots"] = [p.name for p in paths]
        write_report(self.out, report)
        (self.out / "history.json").write_text(json.dumps(history) + "\n")
        self._log_events()
        return report

    def _run_summary(self) -> dict[str, Any]:
        c = self.config
        return {
            "run_id": self.last_doc.get("run_id"),
            "learners": c.learners,
            "stages": c.stages,
            "replicas": c.replicas,
            "verifiers": c.verifiers if c.stages else 0,
            "syncers": c.syncers,
            "chaos": c.chaos,
            "attack": c.attack,
            "seed": c.seed,
            "duration_s": c.duration_s,
            "model": {**DEMO_MODEL, "num_layers": c.num_layers},
            "nodes": {
                name: {"role": s.spec.role, "stage": s.spec.stage, "peer_id": s.peer_id}
                for name, s in self.nodes.items()
            },
            "dashboard": self.dashboard,
            "out_dir": str(self.out),
        }


# ---- the live terminal view ----


class LiveView:
    """A rich live view: loss, tokens/s, versions, quorum, peers and bans, refreshed in place."""

    def __init__(self, swarm: DemoSwarm) -> None:
        from rich.console import Console
        from rich.live import Live

        self.swarm = swarm
        self.live = Live(console=Console(), refresh_per_second=2, transient=False)

    def __enter__(self) -> LiveView:
        self.live.__enter__()
        self.update()
        return self

    def __exit__(self, *exc: object) -> None:
        self.live.__exit__(*exc)  # type: ignore[arg-type]

    def update(self) -> None:
        self.live.update(render_live(self.swarm))


def render_live(swarm: DemoSwarm) -> Any:
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    history, doc = swarm.history, swarm.last_doc
    elapsed = time.time() - swarm.started_at
    header = Text.assemble(
        ("hivenode demo ", "bold"),
        f"{elapsed:5.0f} s  ",
        ("dashboard ", "dim"),
        (swarm.dashboard, "underline cyan"),
    )
    last = history.samples[-1] if history.samples else {}
    evals = list(history.eval_points)
    merges = list(history.merges)
    quorums = [m["quorum"] for m in merges[-20:] if isinstance(m.get("quorum"), int)]
    versions = [s.get("versions") for s in doc.get("syncer") or [] if s.get("state") == "active"]
    merged = sum(m["count"] for m in merges)
    stats = Table.grid(padding=(0, 2))
    stats.add_row(
        f"held-out {evals[0]['loss']:.3f} -> {evals[-1]['loss']:.3f}" if evals else "held-out -",
        f"train {last['loss']:.3f}" if last.get("loss") is not None else "train -",
        goodput_text(last.get("goodput"), history.goodput_source),
        throughput_text(last.get("throughput")),
    )
    stats.add_row(
        f"versions {' '.join(map(str, versions[0])) if versions else '-'}",
        f"merges {merged}" + (f" (quorum {sum(quorums) / len(quorums):.1f})" if quorums else ""),
        f"peers {len(doc.get('peers') or [])}",
        f"bans {len(history.bans)}, faults {len(swarm.faults)}",
    )
    table = Table(expand=False, show_edge=False, pad_edge=False)
    for column in ("node", "peer", "role", "health", "step", "tok/s", "loss"):
        table.add_column(column, justify="right" if column in ("step", "tok/s", "loss") else "left")
    view = history.swarm_map(doc)
    cells = [c for row in view["stages"] for c in row]
    cells += view["learners"] + view["verifiers"] + view["syncers"] + view["bootstraps"]
    colours = {"alive": "green", "straggling": "yellow", "missing": "dim", "banned": "red", "idle": "dim"}
    for cell in cells:
        name = swarm.names_by_peer.get(cell["peer_id"], "bootstrap" if cell["role"] == "bootstrap" else "?")
        role = cell["role"] + (f" {cell['stage']}" if cell["stage"] is not None else "")
        loss = f"{cell['loss']:.3f}" if cell["loss"] is not None else "-"
        table.add_row(
            name,
            short(cell["peer_id"]),
            role,
            Text(cell["health"], style=colours.get(cell["health"], "")),
            str(cell["inner_step"] or 0),
            f"{cell['throughput'] or 0:,.0f}",
            loss,
        )
    events = Text("\n".join(f"  {e['kind']:10} {e['text']}" for e in history.events_json(6)), style="dim")
    return Group(header, stats, table, events)


# ---- the command line ----


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m node demo", description="Run a whole swarm on this machine."
    )
    add = parser.add_argument
    add(
        "--learners",
        type=int,
        default=None,
        metavar="N",
        help="full-model learners (default 2; 0 with a pipeline)",
    )
    add("--stages", type=int, default=0, metavar="S", help="pipeline stages (default: no pipeline)")
    add(
        "--replicas",
        type=int,
        default=None,
        metavar="R",
        help=f"replicas per stage (default 1, {ATTACK_MIN_REPLICAS} with --attack)",
    )
    add("--verifiers", type=int, default=1, metavar="V", help="verifiers driving the pipeline (default 1)")
    add("--chaos", action="store_true", help="kill, restart and stall nodes on a seeded schedule")
    add(
        "--attack",
        metavar="KIND",
        help=f"one stage replica attacks (implies a 2-stage, {ATTACK_MIN_REPLICAS}-replica pipeline)",
    )
    add(
        "--duration",
        type=float,
        metavar="SECONDS",
        help="train this long, then report and exit (default: Ctrl-C)",
    )
    add("--out", type=Path, metavar="DIR", help="report, plots, logs and state (default: runs/<timestamp>)")
    add("--seed", type=int, default=0, metavar="N")
    add("--http-port", type=int, default=0, metavar="P", help="dashboard port (default: any free port)")
    add("--no-live", action="store_true", help="log a progress line every 10 s instead of the live view")
    add("--log-level", choices=("DEBUG", "INFO", "WARNING", "ERROR"), default="WARNING")
    return parser


def config_from_args(args: argparse.Namespace, now: float) -> DemoConfig:
    stages = args.stages or (2 if args.attack else 0)
    replicas = args.replicas if args.replicas is not None else (ATTACK_MIN_REPLICAS if args.attack else 1)
    learners = args.learners if args.learners is not None else (0 if stages else 2)
    out = args.out or Path("runs") / time.strftime("%Y%m%d-%H%M%S", time.localtime(now))
    try:
        return DemoConfig(
            out_dir=out.resolve(),
            learners=learners,
            stages=stages,
            replicas=replicas,
            verifiers=args.verifiers,
            chaos=args.chaos,
            attack=args.attack,
            duration_s=args.duration,
            seed=args.seed,
            http_port=args.http_port,
            live=sys.stdout.isatty() and not args.no_live,
        )
    except ValueError as e:
        raise ConfigError(str(e)) from None


async def run_demo(config: DemoConfig) -> dict[str, Any] | None:
    """The whole demo; returns the report (None if stopped before the swarm was up). Every process it started
    is gone when this returns or raises."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, stop.set)
    set_subreaper()
    swarm = DemoSwarm(config)
    swarm.prepare()
    print(f"hivenode demo: {describe(config)}; files in {config.out_dir}", flush=True)
    try:
        try:
            await swarm.start(stop)
        except HivenodeError:
            if stop.is_set():
                return None  # Ctrl-C before the swarm was up: nothing to report
            raise
        print(
            f"swarm up ({len(swarm.nodes) + 1} nodes); "
            + ("Ctrl-C to stop" if not config.duration_s else f"running {config.duration_s:g} s"),
            flush=True,
        )
        await swarm.run(stop)
    finally:
        print("stopping the swarm ...", flush=True)
        await swarm.shutdown()
    return await swarm.finish()


def attack_outcome(
    config: DemoConfig, nodes: dict[str, dict[str, Any]], bans: Sequence[dict[str, Any]]
) -> dict[str, Any]:
    """Whether the lying replica was banned (the report's `attack` entry): its name and peer id, the attack,
    and from the report's bans whether a ban of it took effect, when it was first seen and why."""
    name = config.attacker
    peer = (nodes.get(name or "") or {}).get("peer_id")
    mine = [b for b in bans if peer is not None and b.get("offender") == peer]
    honest = sorted({str(b.get("offender")) for b in bans if b.get("offender") != peer})
    return {
        "node": name,
        "peer_id": peer,
        "kind": config.attack,
        "banned": any(b.get("in_effect") for b in mine),
        "ban_seen": bool(mine),
        "first_seen_s": min(
            (b["first_seen_s"] for b in mine if b.get("first_seen_s") is not None), default=None
        ),
        "reasons": [r for b in mine for r in b.get("reasons") or []][:3],
        "honest_banned": honest,
    }


def attack_line(outcome: dict[str, Any]) -> str:
    """One line for the terminal: was the liar banned?"""
    who = (
        f"{outcome['node']} ({short(str(outcome['peer_id']))})" if outcome.get("peer_id") else outcome["node"]
    )
    if outcome["banned"]:
        when = outcome.get("first_seen_s")
        verdict = "BANNED" + (f" {when:.0f} s into the run" if when is not None else "")
    elif outcome["ban_seen"]:
        verdict = "ban published but not (yet) in effect"
    else:
        verdict = (
            f"NOT banned (it attacks after {ATTACK_START_AFTER} honest steps of its own; a short run may end "
            "before it attacks or before the verifier has the evidence)"
        )
    extra = f"; honest replicas banned: {len(outcome['honest_banned'])}" if outcome["honest_banned"] else ""
    return f"attack {outcome['kind']} by {who}: {verdict}{extra}"


def describe(config: DemoConfig) -> str:
    parts = [f"{config.learners} learner(s)"] if config.learners else []
    if config.stages:
        parts.append(
            f"{config.stages} stage(s) x {config.replicas} replica(s), {config.verifiers} verifier(s)"
        )
    parts.append(f"{config.syncers} syncer(s)")
    if config.chaos:
        parts.append("chaos")
    if config.attack:
        parts.append(f"attack {config.attack} by {config.attacker}")
    return ", ".join(parts)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(list(argv) if argv is not None else None)
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        config = config_from_args(args, time.time())
        report = asyncio.run(run_demo(config))
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except HivenodeError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_FAILED
    if report is None:
        print("stopped before the swarm was up; no report", flush=True)
        return EXIT_OK
    print(render_text(report), flush=True)
    if report.get("attack"):
        print(attack_line(report["attack"]), flush=True)
    if report.get("sample") is not None:
        print(f"exported to {config.out_dir / 'model'}; it writes: {report['sample']!r}", flush=True)
    print(
        f"report: {config.out_dir / 'report.json'}; plots: {', '.join(report.get('plots', []))}", flush=True
    )
    if report["processes"].get("left_behind"):
        print(
            f"warning: {report['processes']['left_behind']} process(es) had to be killed at the end",
            file=sys.stderr,
        )
    return EXIT_OK
