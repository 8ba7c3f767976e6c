"""Shared fixtures for loopback integration tests: a child-process reaper and an event loop running in a thread.

- `reap_children` (autouse) kills every process a test started and left running (p2pd daemons included, and
  orphaned grandchildren: the session is their subreaper), SIGTERM then SIGKILL, and warns with their command
  lines: a leak is a bug in the test or the code. Processes that module/session fixtures started before the test
  are left to those fixtures.
- `loop_thread` (module scope) runs one asyncio loop in a named thread, so module-scoped peers (a hivemind P2P is
  bound to the loop that created it) can be shared by several sync tests: `loop_thread.run(coro, timeout_s=...)`.
"""

from __future__ import annotations

import asyncio
import os
import threading
import warnings
from collections.abc import Coroutine, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest

from tools.proctree import cmdline, comm, descendants, reap, set_subreaper, terminate, wait_gone

T = TypeVar("T")
TERM_GRACE_S = 3.0
EXIT_GRACE_S = 1.0  # a process already shutting down when the test returns is given this long to finish alone
# Helpers that outlive their creator by design and exit on their own: torch's shared-memory manager stays while any
# process holds shared tensors (and killing one this process uses would break torch sharing in later tests).
# /proc/<pid>/comm holds at most 15 characters, so names are compared cut to that length.
IGNORED_PROCESS_NAMES = frozenset({"torch_shm_manager"[:15]})


@pytest.fixture(scope="session")
def _subreaper() -> bool:
    """Make this process the reaper of orphaned descendants (Linux prctl), so a grandchild whose parent died (a p2pd
    of a killed node) is re-parented here and still found by the scan, instead of escaping to init."""
    return set_subreaper()


@pytest.fixture(autouse=True)
def reap_children(_subreaper: bool) -> Iterator[None]:
    if not Path("/proc/self/stat").exists():  # not Linux: nothing to scan
        yield
        return
    before = set(descendants(os.getpid()))
    yield
    killed: list[int] = []
    for _ in range(3):  # killing a parent may orphan children the first scan could not see yet
        leaked = [
            p
            for p in descendants(os.getpid())
            if p not in before and p not in killed and comm(p) not in IGNORED_PROCESS_NAMES
        ]
        leaked = wait_gone(leaked, EXIT_GRACE_S)
        if not leaked:
            break
        names = "; ".join(f"{p}: {cmdline(p, 120)}" for p in leaked)
        terminate(leaked, TERM_GRACE_S)
        killed.extend(leaked)
        warnings.warn(f"test left {len(leaked)} process(es) running, killed: {names}", stacklevel=1)
    reap(killed)  # a leaked process is nobody's to wait for any more


class LoopThread:
    """An asyncio loop in a daemon thread; `run` submits a coroutine from sync code and waits with a bound."""

    def __init__(self, name: str = "test-loop") -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self._thread.start()

    def run(self, coro: Coroutine[Any, Any, T], timeout_s: float = 30.0) -> T:
        future = asyncio.run_coroutine_threadsafe(coro, self.loop)
        try:
            return future.result(timeout_s)
        except TimeoutError:
            future.cancel()
            raise

    def close(self, timeout_s: float = 10.0) -> None:
        async def cancel_all() -> None:
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in tasks:
                task.cancel()
            if tasks:
                await asyncio.wait(tasks, timeout=timeout_s)

        if self.loop.is_running():
            asyncio.run_coroutine_threadsafe(cancel_all(), self.loop).result(timeout_s + 1)
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(timeout_s)
        self.loop.close()


@pytest.fixture(scope="module")
def loop_thread() -> Iterator[LoopThread]:
    runner = LoopThread()
    try:
        yield runner
    finally:
        runner.close()
