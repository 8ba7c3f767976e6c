"""Syncer checkpoints on disk: content-addressed, atomic, the newest N kept, a damaged newest one skipped.

The kill test runs a real writer process and SIGKILLs it while it writes; everything else is in process.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from node.diloco.outer import STATE_PREFIX
from node.ml.checkpoint import CheckpointError, CheckpointStore, SyncerSnapshot, load_checkpoint

pytestmark = pytest.mark.timeout(60)

RUN = "ab" * 20
SHAPES = {"w": (4, 8), "b": (8,)}
REPO = Path(__file__).resolve().parents[2]


def snapshot(value: float, *, merges: int = 1, shapes: dict[str, tuple[int, ...]] = SHAPES) -> SyncerSnapshot:
    params = {name: torch.full(shape, value) for name, shape in shapes.items()}
    return SyncerSnapshot(
        run_id=RUN,
        term=1,
        versions=(merges, 0),
        params=params,
        momentum={STATE_PREFIX + name: torch.zeros(shape) for name, shape in shapes.items()},
        merges=merges,
    )


def load(store: CheckpointStore) -> SyncerSnapshot:
    return store.load_latest(expected=SHAPES, num_fragments=2)


def test_saves_are_content_addressed_and_the_newest_keep_are_kept(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path, RUN, keep=2)
    with pytest.raises(FileNotFoundError):
        load(store)
    paths = [store.save(snapshot(float(i), merges=i)) for i in range(1, 5)]
    assert len(set(paths)) == 4 and all(p.name.startswith(f"syncer-{RUN[:16]}-") for p in paths)
    assert store.paths() == [paths[3], paths[2]]  # newest first; two older pruned
    assert load(store).merges == 4
    for path in store.paths():
        store.check_hash(path)  # each name is the hash of its bytes
    assert not list(tmp_path.glob("*.tmp"))


def test_a_damaged_newest_checkpoint_falls_back_to_the_one_before(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path, RUN, keep=3)
    store.save(snapshot(1.0, merges=1))
    newest = store.save(snapshot(2.0, merges=2))
    data = bytearray(newest.read_bytes())
    data[-5] ^= 0x01  # one bit of a parameter: the file still parses and every value is finite
    newest.write_bytes(bytes(data))
    # negative control: read without its name's hash, the damaged file loads as if whole
    damaged = load_checkpoint(newest, run_id=RUN, expected=SHAPES, num_fragments=2)
    assert damaged.merges == 2
    assert load(store).merges == 1  # the store sees the mismatch and takes the one before
    newest.write_bytes(bytes(data[: len(data) // 2]))  # torn in half
    assert load(store).merges == 1
    for path in store.paths():
        path.write_bytes(b"garbage")
    with pytest.raises(CheckpointError, match="no usable checkpoint"):
        load(store)


def test_the_legacy_single_file_is_still_read(tmp_path: Path) -> None:
    from node.ml.checkpoint import checkpoint_path, save_checkpoint

    save_checkpoint(checkpoint_path(tmp_path, RUN), snapshot(3.0, merges=3))
    store = CheckpointStore(tmp_path, RUN)
    assert load(store).merges == 3
    store.save(snapshot(5.0, merges=5))
    assert load(store).merges == 5


WRITER = """
import sys, torch
from pathlib import Path
from tests.unit.test_checkpoint import BIG, snapshot
from node.ml.checkpoint import CheckpointStore
store = CheckpointStore(Path(sys.argv[1]), "ab" * 20, keep=100)
i = 10
while True:
    store.save(snapshot(float(i), merges=i, shapes=BIG))
    i += 1
"""
BIG = {"w": (2048, 4096), "b": (8,)}  # 32 MiB of parameters + 32 MiB of momentum per checkpoint


def test_a_writer_killed_mid_write_leaves_the_previous_checkpoint_loadable(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path, RUN, keep=100)
    first = store.save(snapshot(1.0, merges=1, shapes=BIG))
    for _attempt in range(5):
        writer = subprocess.Popen(
            [sys.executable, "-c", WRITER, str(tmp_path)],
            cwd=REPO,
            env={**os.environ, "PYTHONPATH": str(REPO)},
        )
        try:
            deadline = time.monotonic() + 30
            while not list(tmp_path.glob("*.tmp")) and time.monotonic() < deadline:
                assert writer.poll() is None, "the writer died on its own"
                time.sleep(0.005)
            writer.send_signal(signal.SIGKILL)
        finally:
            writer.kill()
            writer.wait(10)
        if list(tmp_path.glob("*.tmp")):
            break  # killed while a checkpoint was half written
    else:
        pytest.fail("never caught the writer mid-write")
    assert all(not p.name.endswith(".tmp") for p in store.paths())  # a half-written file is never a candidate
    for path in store.paths():
        store.check_hash(path)  # every visible checkpoint is whole
    latest = store.load_latest(expected=BIG, num_fragments=2)
    assert latest.merges >= 1 and first.exists()
    assert torch.equal(latest.params["w"], torch.full(BIG["w"], float(latest.merges)))
