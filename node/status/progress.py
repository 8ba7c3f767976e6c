"""A join's progress, pure: which phase it is in, how training goes, and what to do when it fails.

Phases, in order: connecting (the DHT daemon and the bootstraps, the reach check, a relay) -> manifest (finding,
verifying and pinning the run) -> tokenizer/data (the run's tokenizer and data shards) -> state load (the model,
the global version from the syncer) -> training (steps/s, tokens, loss, merges applied). `JoinProgress` is fed
by the run sequence (`enter`) and by the node's own /api/status document (`observe`); the clock is passed in.
`node.status.progress_view` shows it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

PHASES = ("connecting", "manifest", "tokenizer/data", "state load", "training")
FAILED = "failed"
_RATE_WEIGHT = 0.3  # weight of the newest steps/s sample: smooth, yet within a few seconds of a change

# (substring of the error, what to do next): the first match wins; the messages are the node's own JoinErrors
_HINTS: tuple[tuple[str, str], ...] = (
    (
        "no entry point answered",
        "check that the bootstrap is running and that --join is its current address (peer id included); "
        "`python -m node status <bootstrap URL>` shows its addresses",
    ),
    (
        "found no",
        "--join must name a hivenode bootstrap (python -m bootstrap) or a peer connected to one",
    ),
    (
        "pinned to owner",
        "the run changed owner: if you trust the new owner, `python -m node trust forget RUN_ID` and join again",
    ),
    (
        "is not an authorized",
        "ask the run's owner to authorize your key (the peer id above), or join with --role auto",
    ),
    (
        "identity",
        "another node uses this state directory: stop it, or give this one its own --state-dir",
    ),
    (
        "tokenizer",
        "the bootstrap's tokenizer could not be fetched or did not match the manifest: check its HTTP address",
    ),
    (
        "refused",
        "the swarm refused this node: see the reason above; `python -m node status <bootstrap URL> "
        "--state-dir <your state dir>` explains credit and bans",
    ),
    ("timed out", "the swarm answered too slowly: check your connection and try again"),
)
DEFAULT_HINT = "run again with --log-level DEBUG and read the log above; the error names the step that failed"


def next_hint(message: str) -> str:
    """What a volunteer should do after `message` (an error the node reported)."""
    lowered = message.lower()
    return next((hint for needle, hint in _HINTS if needle in lowered), DEFAULT_HINT)


@dataclass(frozen=True, slots=True)
class ProgressSnapshot:
    phase: str  # one of PHASES, or FAILED
    step_index: int  # 1-based position in PHASES (the phase reached when it failed)
    detail: str  # what the phase is doing now ("reach check", "role learner", ...)
    elapsed_s: float  # since the join began
    connectivity: str = ""  # direct / relay / client
    role: str = ""
    inner_step: int | None = None
    steps_per_s: float | None = None
    tokens: int | None = None
    loss: float | None = None
    merges: int | None = None  # versions applied, summed over fragments
    error: str = ""
    next: str = ""  # what to do about `error`


def merges_applied(status: Mapping[str, Any]) -> int | None:
    """The versions a node applied, summed over fragments: a learner's `versions`, a stage's `diloco.versions`."""
    diloco = status.get("diloco")
    versions = status.get("versions") or (diloco.get("versions") if isinstance(diloco, Mapping) else None)
    if not isinstance(versions, Mapping):
        return None
    return sum(int(v) for v in versions.values() if isinstance(v, int | float))


class JoinProgress:
    """The state of one join, from its first dial to training."""

    def __init__(self, clock: Callable[[], float]) -> None:
        self.clock = clock
        self.started_at = clock()
        self.phase = PHASES[0]
        self.step_index = 1
        self.detail = ""
        self.error = ""
        self._status: dict[str, Any] = {}
        self._rate: float | None = None
        self._last: tuple[float, int] | None = None  # (time, inner step) of the previous observation
        self.changes = 0  # bumped on every phase change (the plain view logs one line per change)
        self.listeners: list[Callable[[], None]] = []  # called after each change (a view redraws at once)

    def enter(self, phase: str, detail: str = "") -> None:
        """Move to `phase` (never back: a late `enter` of an earlier phase only updates nothing)."""
        if phase not in PHASES:
            raise ValueError(f"unknown phase {phase!r}")
        index = PHASES.index(phase) + 1
        if self.phase == FAILED or index < self.step_index:
            return
        changed = index > self.step_index or detail != self.detail
        self.phase, self.step_index, self.detail = phase, index, detail
        if changed:
            self._changed()

    def _changed(self) -> None:
        self.changes += 1
        for listener in self.listeners:
            listener()

    def observe(self, status: Mapping[str, Any]) -> None:
        """Take the node's /api/status document: the role's state decides state load vs training; the step
        counter gives steps/s."""
        self._status = dict(status)
        state = str(status.get("state", ""))
        if state in ("training", "serving", "syncing", "verifying"):
            self.enter("training", f"role {status.get('role', '?')}")
        elif state == "joining":
            self.enter("state load", f"role {status.get('role', '?')}")
        step = status.get("inner_step")
        if isinstance(step, int):
            now = self.clock()
            if self._last is not None and now > self._last[0] and step >= self._last[1]:
                sample = (step - self._last[1]) / (now - self._last[0])
                self._rate = (
                    sample if self._rate is None else (1 - _RATE_WEIGHT) * self._rate + _RATE_WEIGHT * sample
                )
            self._last = (now, step)

    def fail(self, message: str) -> None:
        if self.phase == FAILED:
            return
        self.phase, self.error = FAILED, message
        self._changed()

    def snapshot(self) -> ProgressSnapshot:
        status = self._status
        connectivity = status.get("connectivity")
        loss = status.get("loss")
        return ProgressSnapshot(
            phase=self.phase,
            step_index=self.step_index,
            detail=self.detail,
            elapsed_s=self.clock() - self.started_at,
            connectivity=str(connectivity.get("mode", "")) if isinstance(connectivity, Mapping) else "",
            role=str(status.get("role") or ""),
            inner_step=status.get("inner_step") if isinstance(status.get("inner_step"), int) else None,
            steps_per_s=self._rate,
            tokens=status.get("tokens") if isinstance(status.get("tokens"), int) else None,
            loss=float(loss) if isinstance(loss, int | float) else None,
            merges=merges_applied(status),
            error=self.error,
            next=next_hint(self.error) if self.error else "",
        )


def render_line(snap: ProgressSnapshot) -> str:
    """One line for the console: `[3/5 tokenizer/data] ...` or the training figures, or the error and `next:`."""
    if snap.phase == FAILED:
        return f"join failed at {PHASES[snap.step_index - 1]}: {snap.error} | next: {snap.next}"
    head = f"[{snap.step_index}/{len(PHASES)} {snap.phase}]"
    parts = [head + (f" {snap.detail}" if snap.detail else "")]
    if snap.phase == "training":
        if snap.inner_step is not None:
            rate = f" ({snap.steps_per_s:.2f} steps/s)" if snap.steps_per_s is not None else ""
            parts.append(f"step {snap.inner_step}{rate}")
        if snap.tokens is not None:
            parts.append(f"{_count(snap.tokens)} tokens")
        if snap.loss is not None:
            parts.append(f"loss {snap.loss:.3f}")
        if snap.merges is not None:
            parts.append(f"{snap.merges} merges applied")
    if snap.connectivity:
        parts.append(snap.connectivity)
    parts.append(f"{snap.elapsed_s:.0f} s")
    return " | ".join(parts)


def _count(n: int) -> str:
    for unit, size in (("M", 1_000_000), ("k", 1_000)):
        if n >= size:
            return f"{n / size:.1f}{unit}"
    return str(n)
