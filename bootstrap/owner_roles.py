"""The owner's trusted roles, run by the bootstrap: without a syncer nothing is merged, so a default swarm needs one.

`python -m bootstrap` with no flags runs a syncer (and a verifier when the run has pipeline stages) as child
processes, `python -m node --join <our maddr> --role syncer|verifier --state-dir <state_dir>/roles/<role>`.
Each child's key is `<state_dir>/roles/<role>/identity.key`, created by the bootstrap before it signs the manifest,
so the manifest authorizes it; the keys persist, so a restarted bootstrap signs the same manifest (the same run
id). The children are processes, not tasks (the layering test keeps training roles out of the bootstrap's
process): their torch and DHT never share the bootstrap's event loop, and a crash of one is a restart, not the
bootstrap's end. Each child's stdout and stderr go to `<state_dir>/roles/<role>/node.log`.

Lifetime: a child that exits while the bootstrap runs is restarted after a backoff (`Backoff`: doubling from
`base_s` to `max_s`, back to `base_s` once a child ran `reset_after_s`); on stop each gets SIGTERM (the node's
graceful leave) and SIGKILL after `stop_timeout_s`. On Linux a child also gets SIGTERM if the bootstrap dies
without stopping it (PR_SET_PDEATHSIG), so a SIGKILLed bootstrap leaves no orphan syncer behind.

`--no-syncer` / `--no-verifier` leave a role to the owner (`--authorize-syncer ID`, `--authorize-verifier ID`);
an external authorized syncer next to ours is a standby (the syncer lease decides, docs/diloco.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import logging
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from node.config import BootstrapConfig
from protocol.identity import NodeIdentity
from protocol.manifest import RunManifest

logger = logging.getLogger(__name__)

ROLES_DIRNAME = "roles"
LOG_FILENAME = "node.log"
PR_SET_PDEATHSIG = 1


@dataclass(frozen=True, slots=True)
class OwnerRole:
    """One role the bootstrap runs: its name, its state dir (its key is `identity.key` there) and peer id."""

    role: str  # syncer | verifier
    state_dir: Path
    peer_id: str

    @property
    def log_path(self) -> Path:
        return self.state_dir / LOG_FILENAME


def planned_roles(config: BootstrapConfig, manifest: RunManifest) -> tuple[str, ...]:
    """Which roles the bootstrap runs for this run: a syncer unless told not to; a verifier when the run has
    pipeline stages (a verifier drives them) unless told not to."""
    roles: list[str] = []
    if config.run_syncer:
        roles.append("syncer")
    if config.run_verifier and manifest.num_stages > 1:
        roles.append("verifier")
    return tuple(roles)


def prepare_roles(config: BootstrapConfig, manifest: RunManifest) -> tuple[OwnerRole, ...]:
    """The planned roles with their keys, created on first use under `<state_dir>/roles/<role>/`."""
    prepared = []
    for role in planned_roles(config, manifest):
        state_dir = config.state_dir / ROLES_DIRNAME / role
        identity = NodeIdentity.load_or_create(state_dir / "identity.key")
        prepared.append(OwnerRole(role, state_dir, identity.peer_id))
    return tuple(prepared)


@dataclass(slots=True)
class Backoff:
    """Delay before restarting a child that exited: doubles per quick exit, resets after a long enough run."""

    base_s: float = 2.0
    max_s: float = 60.0
    reset_after_s: float = 120.0  # a child that ran this long before it exited counts as healthy
    _next_s: float = field(default=0.0, init=False)

    def __post_init__(self) -> None:
        if not 0 < self.base_s <= self.max_s or self.reset_after_s <= 0:
            raise ValueError(f"invalid Backoff {self}")
        self._next_s = self.base_s

    def after_exit(self, ran_s: float) -> float:
        """The wait before the next start, for a child that ran `ran_s` seconds."""
        if ran_s >= self.reset_after_s:
            self._next_s = self.base_s
        delay = self._next_s
        self._next_s = min(self._next_s * 2, self.max_s)
        return delay


def child_argv(role: OwnerRole, join: str, config_path: Path | None) -> list[str]:
    argv = [sys.executable, "-m", "node", "--join", join, "--role", role.role]
    argv += ["--state-dir", str(role.state_dir)]
    if config_path is not None:
        argv += ["--config", str(config_path)]
    return argv


def local_join_maddr(maddrs: tuple[str, ...]) -> str:
    """The multiaddr our children dial: a loopback one when we listen on one (they run on this machine)."""
    loopback = [m for m in maddrs if m.startswith(("/ip4/127.", "/ip6/::1/"))]
    return (loopback or list(maddrs))[0]


def _die_with_parent() -> None:  # pragma: no cover - runs in the forked child before exec
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


class OwnerRoles:
    """Runs each `OwnerRole` as a child process joined to `join`: `run(stop)` until stop, then ends them."""

    def __init__(
        self,
        roles: tuple[OwnerRole, ...],
        join: str,
        *,
        config_path: Path | None = None,
        stop_timeout_s: float = 20.0,
        backoff: Backoff | None = None,
    ) -> None:
        self.roles = roles
        self.join = join
        self.config_path = config_path
        self.stop_timeout_s = stop_timeout_s
        self._backoff = backoff
        self._children: dict[str, asyncio.subprocess.Process] = {}
        self.starts: dict[str, int] = {r.role: 0 for r in roles}
        self.last_exit: dict[str, int | None] = {r.role: None for r in roles}

    def status(self) -> list[dict[str, Any]]:
        """For the bootstrap's /api/status: each role, its peer id, pid, starts and last exit code."""
        return [
            {
                "role": r.role,
                "peer_id": r.peer_id,
                "pid": child.pid if (child := self._children.get(r.role)) else None,
                "starts": self.starts[r.role],
                "last_exit": self.last_exit[r.role],
                "log": str(r.log_path),
            }
            for r in self.roles
        ]

    async def run(self, stop: asyncio.Event) -> None:
        if not self.roles:
            return
        keepers = [asyncio.ensure_future(self._keep(role, stop)) for role in self.roles]
        try:
            await stop.wait()
        finally:
            for keeper in keepers:  # no restart from here on; then each child gets its graceful stop
                keeper.cancel()
            await asyncio.gather(*keepers, return_exceptions=True)
            await asyncio.gather(*(self._end(role.role) for role in self.roles), return_exceptions=True)

    async def _keep(self, role: OwnerRole, stop: asyncio.Event) -> None:
        """Start `role`, and start it again after a backoff whenever it exits before stop."""
        backoff = self._backoff or Backoff()
        while not stop.is_set():
            started = time.monotonic()
            try:
                child = await self._spawn(role)
            except OSError as e:  # no such interpreter, no file descriptors left: try again later
                logger.warning("cannot start the owner's %s: %s", role.role, e)
                code, pid = -1, 0
            else:
                code, pid = await child.wait(), child.pid
            self.last_exit[role.role] = code
            if stop.is_set():
                return
            delay = backoff.after_exit(time.monotonic() - started)
            logger.warning(
                "the owner's %s (pid %d) exited with %d; restarting in %.0f s (log: %s)",
                role.role,
                pid,
                code,
                delay,
                role.log_path,
            )
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(stop.wait(), delay)

    async def _spawn(self, role: OwnerRole) -> asyncio.subprocess.Process:
        role.state_dir.mkdir(parents=True, exist_ok=True)
        with role.log_path.open("ab") as log:
            child = await asyncio.create_subprocess_exec(
                *child_argv(role, self.join, self.config_path),
                stdin=asyncio.subprocess.DEVNULL,
                stdout=log,
                stderr=asyncio.subprocess.STDOUT,
                preexec_fn=_die_with_parent if sys.platform == "linux" else None,
            )
        self._children[role.role] = child
        self.starts[role.role] += 1
        logger.info(
            "started the owner's %s %s (pid %d, log %s)", role.role, role.peer_id, child.pid, role.log_path
        )
        return child

    async def _end(self, name: str) -> None:
        """SIGTERM the child, SIGKILL it after `stop_timeout_s`."""
        child = self._children.get(name)
        if child is None or child.returncode is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            child.send_signal(signal.SIGTERM)
        try:
            await asyncio.wait_for(child.wait(), self.stop_timeout_s)
        except asyncio.TimeoutError:
            logger.warning("the owner's %s did not stop in %.0f s: killing it", name, self.stop_timeout_s)
            with contextlib.suppress(ProcessLookupError):
                child.kill()
            await child.wait()
        self.last_exit[name] = child.returncode
