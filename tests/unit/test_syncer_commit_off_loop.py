"""A merge's commit reads its new version from the spill directory (a fragment: 0.25-1 GiB at llama-1b). The syncer
role runs that read in a worker thread (`node.roles.syncer.commit`), so the event loop keeps answering, and its routes wait
on `core_free` (`syncer_rpc.core_now`) so that none reads a fragment half swapped. Controls: the commit on the
loop (the old placement) stalls it for the whole read; a reader that does not wait sees the swap half done."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from node.diloco import param_store
from node.diloco.spill import SpilledTensors
from node.diloco.syncer_core import PreparedMerge, SyncerCore
from node.roles.syncer import commit
from node.roles.syncer_rpc import core_now
from tests.unit.params_modes import IN_MEMORY_ONLY
from tests.unit.test_syncer_core import PLAN
from tests.unit.test_syncer_spill import contribute, synchronous

pytestmark = [pytest.mark.timeout(60), pytest.mark.usefixtures("params_mode")]
READ_S = 0.4  # one tensor read from the spill file, slowed down: a fragment of a 1B model read from disk
FRAGMENT = 2  # the embedding alone


def prepared_merge(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[SyncerCore, PreparedMerge]:
    core = synchronous(tmp_path / "spill")
    contribute(core, "a", FRAGMENT, 0, seed=1, now=1.0)
    taken = core.take_round(FRAGMENT, 1, 2.0)
    assert taken is not None
    prepared = core.compute_merge(FRAGMENT, taken[0], expected=1, required=1, started_at=2.0)
    assert isinstance(prepared.new_params, SpilledTensors)  # the new version is a file: the commit reads it
    read = SpilledTensors.__getitem__

    def slow(self: SpilledTensors, name: str) -> torch.Tensor:
        if self.key.startswith("outer-grad"):
            time.sleep(READ_S)
        return read(self, name)

    monkeypatch.setattr(SpilledTensors, "__getitem__", slow)
    return core, prepared


async def lag_while(work: Any) -> float:
    """The loop's worst lateness on a 10 ms tick while `work` runs."""
    worst, done = 0.0, asyncio.Event()

    async def tick() -> None:
        nonlocal worst
        while not done.is_set():
            start = time.perf_counter()
            await asyncio.sleep(0.01)
            worst = max(worst, time.perf_counter() - start - 0.01)

    ticker = asyncio.create_task(tick())
    await asyncio.sleep(0.02)
    try:
        await work
    finally:
        done.set()
        await ticker
    return worst


def seen(core: SyncerCore) -> tuple[int, bool]:
    """The fragment's version and whether any of its tensors is the swap's placeholder (a half-swapped fragment)."""
    names = PLAN.fragments[FRAGMENT].names
    return core.versions[FRAGMENT], any(core.params[n] is param_store._DROPPED for n in names)


@IN_MEMORY_ONLY
def test_the_commit_reads_the_new_version_off_the_loop_and_routes_see_it_whole(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    core, prepared = prepared_merge(tmp_path, monkeypatch)
    role = SimpleNamespace(core=core, core_free=asyncio.Event())
    role.core_free.set()
    views: dict[str, tuple[int, bool]] = {}

    async def gated() -> None:
        views["gated"] = seen(await core_now(role))  # type: ignore[arg-type]

    async def naive() -> None:  # control: reads the core without waiting for the commit
        views["naive"] = seen(core)

    async def run() -> float:
        committing = asyncio.create_task(commit(role.core_free, core, prepared))
        await asyncio.sleep(READ_S / 2)  # the worker thread is in the read
        readers = [asyncio.create_task(gated()), asyncio.create_task(naive())]
        lag = await lag_while(committing)
        await asyncio.gather(*readers)
        return lag

    lag = asyncio.run(run())
    assert lag < READ_S / 2, lag  # the loop kept ticking through the read
    assert views["gated"] == (1, False)  # the published version, whole
    assert views["naive"] == (0, True)  # control: without the gate, half a swap under the old version number
    assert core.versions[FRAGMENT] == 1 and role.core_free.is_set()


@IN_MEMORY_ONLY
def test_control_the_commit_on_the_loop_stalls_it_for_the_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    core, prepared = prepared_merge(tmp_path, monkeypatch)

    async def on_loop() -> None:
        core.commit_merge(prepared, 3.0)  # the placement before: the read ran on the event loop

    lag = asyncio.run(lag_while(on_loop()))
    assert lag >= READ_S * 0.9, lag
    assert core.versions[FRAGMENT] == 1


@IN_MEMORY_ONLY
def test_a_failed_read_off_the_loop_reopens_the_core_with_the_old_version(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    core, prepared = prepared_merge(tmp_path, monkeypatch)
    before = {n: core.params[n].clone() for n in PLAN.fragments[FRAGMENT].names}

    read = SpilledTensors.__getitem__

    def failing(self: SpilledTensors, name: str) -> torch.Tensor:
        if self.key.startswith("outer-grad"):
            raise OSError("disk gone")
        return read(self, name)  # the replaced version, read back from its file

    monkeypatch.setattr(SpilledTensors, "__getitem__", failing)
    role = SimpleNamespace(core_free=asyncio.Event())
    with pytest.raises(OSError):
        asyncio.run(commit(role.core_free, core, prepared))
    assert role.core_free.is_set() and core.versions[FRAGMENT] == 0
    assert all(torch.equal(core.params[n], t) for n, t in before.items())
