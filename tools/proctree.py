"""The process tree below us, read from /proc: for the demo, the chaos driver and the test harness.

Whoever starts node processes must also end them, grandchildren included (each node's hivemind DHT child
and its p2pd daemon): `set_subreaper` makes orphans of our children ours, `descendants` finds them, and
`terminate` ends them, SIGTERM first and SIGKILL after a grace period. Linux only; elsewhere the tree reads
as empty.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys
import time
from collections.abc import Iterable
from pathlib import Path
from typing import NamedTuple

PR_SET_CHILD_SUBREAPER = 36


class ProcInfo(NamedTuple):
    ppid: int
    state: str  # one letter, as in /proc/<pid>/stat ("Z" for a zombie)
    cpu_ticks: int  # user + system time, in clock ticks


def proc_table() -> dict[int, ProcInfo]:
    """pid -> (ppid, state, cpu ticks) for every process we can read."""
    table = {}
    with contextlib.suppress(OSError):
        entries = list(Path("/proc").iterdir())
        for entry in entries:
            if not entry.name.isdigit():
                continue
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            # The command name (field 2) may hold spaces and parentheses: split after its last ')'.
            fields = stat[stat.rindex(")") + 2 :].split()
            table[int(entry.name)] = ProcInfo(int(fields[1]), fields[0], int(fields[11]) + int(fields[12]))
    return table


def cpu_seconds(pid: int | str) -> float:
    """User + system CPU seconds of process `pid` ("self": this one), all its threads; 0 where unreadable."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return 0.0
    fields = stat[stat.rindex(")") + 2 :].split()  # after the command name, as in `proc_table`
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def status_bytes(field: str, pid: int | str = "self") -> int:
    """A `/proc/<pid>/status` figure in bytes (VmRSS, VmHWM, ...); 0 if unknown."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        pass
    return 0


def descendants(root: int, table: dict[int, ProcInfo] | None = None) -> list[int]:
    """Live (non-zombie) descendants of `root`, parents before children."""
    table = table if table is not None else proc_table()
    children: dict[int, list[int]] = {}
    for pid, info in table.items():
        if info.state != "Z":
            children.setdefault(info.ppid, []).append(pid)
    out, frontier = [], [root]
    while frontier:
        frontier = [c for p in frontier for c in children.get(p, [])]
        out += frontier
    return out


def is_alive(pid: int) -> bool:
    """Running or stopped, not a zombie and not gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2] != "Z"


def cmdline(pid: int, limit: int = 160) -> str:
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return "?"
    return raw.replace(b"\0", b" ").decode(errors="replace").strip()[:limit]


def comm(pid: int) -> str:
    """The kernel's short name of the process (at most 15 characters)."""
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return "?"


def set_subreaper() -> bool:
    """Orphans of our children (a DHT process or p2pd whose node was killed) are re-parented to us, so that we
    can find and reap them instead of losing them to init."""
    if not sys.platform.startswith("linux"):
        return False
    with contextlib.suppress(OSError, AttributeError):
        return ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
    return False


def wait_gone(pids: Iterable[int], timeout_s: float) -> list[int]:
    """Wait up to `timeout_s` for the pids to exit; return those still alive."""
    deadline = time.monotonic() + timeout_s
    while (alive := [p for p in pids if is_alive(p)]) and time.monotonic() < deadline:
        time.sleep(0.05)
    return alive


def reap(pids: Iterable[int]) -> None:
    """Collect the exit status of those that are our zombie children (others are left to their owners)."""
    for pid in pids:
        with contextlib.suppress(ChildProcessError, OSError):
            os.waitpid(pid, os.WNOHANG)


def terminate(pids: list[int], grace_s: float) -> list[int]:
    """SIGCONT + SIGTERM the pids (children first: `pids` in parents-first order), SIGKILL those still alive
    after `grace_s`; return the ones that had to be killed. Zombies count as gone."""
    for pid in reversed(pids):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)  # a stopped process would not act on SIGTERM
            os.kill(pid, signal.SIGTERM)
    killed = wait_gone(pids, grace_s)
    for pid in killed:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    return killed
