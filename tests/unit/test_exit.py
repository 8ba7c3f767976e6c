"""A node that was told to stop ends even while a worker thread is busy (a model build or a corpus load that a
SIGTERM interrupted): `run_loop` does not wait for the default executor and `exit_process` gives busy threads a
short grace. The control runs the same program under `asyncio.run`, which waits for the thread."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time

import pytest

pytestmark = pytest.mark.timeout(60)

BUSY_S = 5.0
PROGRAM = textwrap.dedent(
    """
    import asyncio, sys, time
    from node.context import exit_process, run_loop

    async def main() -> int:
        asyncio.get_running_loop().run_in_executor(None, time.sleep, {busy_s})
        await asyncio.sleep(0.2)
        print(time.time(), flush=True)  # the node has stopped here
        return 3

    if sys.argv[1] == "ours":
        exit_process(run_loop(main()), grace_s=0.5)
    sys.exit(asyncio.run(main()))
    """
).format(busy_s=BUSY_S)


def _stopped_to_exit_s(how: str) -> tuple[int, float]:
    proc = subprocess.run(
        [sys.executable, "-c", PROGRAM, how], capture_output=True, text=True, timeout=30, check=False
    )
    ended = time.time()
    return proc.returncode, ended - float(proc.stdout.split()[-1])


def test_a_busy_worker_thread_does_not_hold_up_the_exit() -> None:
    code, seconds = _stopped_to_exit_s("ours")
    assert code == 3
    assert seconds < BUSY_S - 1.5, seconds


def test_control_asyncio_run_waits_for_the_busy_thread() -> None:
    code, seconds = _stopped_to_exit_s("asyncio")
    assert code == 3
    assert seconds >= BUSY_S - 1.0, seconds
