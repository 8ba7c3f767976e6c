"""The syncer core with its older versions and outer momentum on disk (node.diloco.spill, issue 17): the same merges,
refusals, checkpoints and restores as the core that keeps everything in memory, with only the current version of each
fragment in memory."""

from __future__ import annotations

import gc
import json
import struct
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from node.diloco.outer import STATE_PREFIX
from node.diloco.spill import SpillDir
from node.diloco.syncer_core import SyncerCore
from node.ml.checkpoint import (
    TensorFile,
    checkpoint_path,
    load_checkpoint,
    save_checkpoint,
    write_safetensors,
)
from node.ml.model import build_model, embedding_param_names
from node.roles.syncer import Refusal, quorum_config
from protocol.manifest import DilocoSpec
from tests.unit.params_modes import IN_MEMORY_ONLY
from tests.unit.test_syncer_core import CFG, PLAN, core, params_with_delta

pytestmark = [pytest.mark.timeout(60), pytest.mark.usefixtures("params_mode")]
RUN_ID = "ab" * 20
OPTIONS = {
    "quorum": quorum_config(DilocoSpec(mode="elastic_sync"), max_grace_s=5.0),
    "embedding_names": embedding_param_names(CFG),
    "outer_lr": 0.7,
    "outer_momentum": 0.9,
    "clip_factor": 3.0,
    "max_staleness": 2,
    "max_steps_per_s": 10.0,
    "tokens_per_step": 64,
    "now": 0.0,
}


def synchronous(spill: Path | None) -> SyncerCore:
    """elastic_sync takes contributions on older bases: merges read the versions they were built on."""
    return core(quorum_config(DilocoSpec(mode="elastic_sync"), max_grace_s=5.0), now=0.0, spill_dir=spill)


def contribute(c: SyncerCore, peer: str, fragment: int, base: int, seed: int, now: float) -> None:
    gen = torch.Generator().manual_seed(seed)
    base_tensors = c.history.at(fragment, base)
    assert base_tensors is not None
    params = {n: t - 0.01 * torch.randn(t.shape, generator=gen) for n, t in base_tensors.items()}
    c.accept(
        peer, fragment, params, base_version=base, steps=4, tokens=4 * 64, sched_step=1, step_time_s=0.1,
        nonce=bytes([seed]) * 16, now=now,
    )  # fmt: skip


def script(c: SyncerCore) -> None:
    """Rounds on both fragments, contributions on the current and on older bases (the synchronous modes merge
    those against their own base, read back from disk when spilled)."""
    now = 10.0
    for turn in range(4):
        for fragment in range(PLAN.num_fragments):
            current = c.versions[fragment]
            contribute(c, "a", fragment, current, seed=10 * turn + fragment, now=now)
            if current >= 2:
                contribute(c, "b", fragment, current - 2, seed=100 + 10 * turn + fragment, now=now)
            assert c.merge_now(fragment, 2, now + 1.0) is not None
            now += 2.0


def momentum_of(c: SyncerCore) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in c.snapshot(RUN_ID, term=1).momentum.items()}


@IN_MEMORY_ONLY
def test_a_spilled_core_merges_exactly_as_the_in_memory_one_and_holds_only_the_current_version(
    tmp_path: Path,
) -> None:
    memory, spilled = synchronous(None), synchronous(tmp_path / "spill")
    script(memory)
    script(spilled)
    assert spilled.versions == memory.versions == [4] * PLAN.num_fragments
    assert all(torch.equal(spilled.params[n], t) for n, t in memory.params.items())
    ours, theirs = momentum_of(spilled), momentum_of(memory)
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], t) for k, t in theirs.items())
    # in memory: the current version of each fragment (the params themselves), and no momentum
    for fragment, versions in spilled.history.tensors.items():
        assert sorted(versions) == [2, 3, 4]
        assert all(isinstance(versions[v], str) for v in (2, 3))
        assert all(versions[4][n] is spilled.params[n] for n in PLAN.fragments[fragment].names)
    assert not spilled.outer.state_dict()
    # negative control: the in-memory core holds the older versions as tensors
    assert all(isinstance(memory.history.tensors[0][v], dict) for v in (2, 3))
    # on disk: the two older versions, one momentum generation and the screen's recent direction per fragment
    files = [p.name.split("-")[0] for p in (tmp_path / "spill").iterdir()]
    assert sorted(set(files)) == ["direction", "momentum", "version"]
    assert [files.count(kind) for kind in ("direction", "momentum", "version")] == [
        PLAN.num_fragments,
        PLAN.num_fragments,
        2 * PLAN.num_fragments,
    ]
    assert not spilled.screen._direction or all(
        isinstance(d, str) for d in spilled.screen._direction.values()
    )


def test_a_copy_of_a_spilled_version_is_refused_as_a_free_rider(tmp_path: Path) -> None:
    c = synchronous(tmp_path / "spill")
    script(c)
    old = c.history.at(0, 3)
    assert isinstance(c.history.tensors[0][3], str) and old is not None
    with pytest.raises(Refusal) as refused:
        c.accept(
            "c", 0, dict(old), base_version=4, steps=4, tokens=256, sched_step=1, step_time_s=0.1,
            nonce=b"f" * 16, now=100.0,
        )  # fmt: skip
    assert refused.value.reason == "free-rider"
    # control: its own work on the current version is taken
    c.accept(
        "c", 0, params_with_delta(c, 0, 7), base_version=4, steps=4, tokens=256, sched_step=1, step_time_s=0.1,
        nonce=b"g" * 16, now=100.0,
    )  # fmt: skip


@IN_MEMORY_ONLY
def test_a_checkpoint_of_a_spilled_core_resumes_momentum_and_merges_as_the_in_memory_one(
    tmp_path: Path,
) -> None:
    memory, spilled = synchronous(None), synchronous(tmp_path / "spill")
    script(memory)
    script(spilled)
    paths = []
    for name, c in (("memory", memory), ("spilled", spilled)):
        paths.append(checkpoint_path(tmp_path / name, RUN_ID))
        save_checkpoint(paths[-1], c.snapshot(RUN_ID, term=2))
    loaded = [
        load_checkpoint(p, run_id=RUN_ID, expected=memory.shapes, num_fragments=PLAN.num_fragments)
        for p in paths
    ]
    assert loaded[0].momentum.keys() == loaded[1].momentum.keys() and loaded[1].momentum
    assert all(torch.equal(loaded[1].momentum[k], t) for k, t in loaded[0].momentum.items())
    restored = [synchronous(None), synchronous(tmp_path / "restored")]
    for c, snapshot in zip(restored, loaded, strict=True):
        c.restore(snapshot, 200.0)
        for fragment in range(PLAN.num_fragments):  # the momentum carries into the next outer step
            contribute(c, "a", fragment, c.versions[fragment], seed=50 + fragment, now=201.0)
            assert c.merge_now(fragment, 1, 202.0) is not None
    assert all(torch.equal(restored[1].params[n], t) for n, t in restored[0].params.items())
    ours, theirs = momentum_of(restored[1]), momentum_of(restored[0])
    assert all(torch.equal(ours[k], t) for k, t in theirs.items())
    # negative control: without the restored momentum the same round lands elsewhere
    fresh = synchronous(None)
    fresh.restore(loaded[0], 200.0)
    fresh.outer.load_state_dict({})
    contribute(fresh, "a", 0, fresh.versions[0], seed=50, now=201.0)
    fresh.merge_now(0, 1, 202.0)
    assert any(not torch.equal(fresh.params[n], restored[0].params[n]) for n in PLAN.fragments[0].names)


def test_a_snapshot_keeps_its_momentum_files_through_later_merges_until_dropped(tmp_path: Path) -> None:
    c = synchronous(tmp_path / "spill")
    script(c)
    snapshot = c.snapshot(RUN_ID, term=1)
    taken = {k: v.clone() for k, v in snapshot.momentum.items()}
    for step, fragment in enumerate((0, 0, 1)):
        contribute(c, "a", fragment, c.versions[fragment], seed=70 + step, now=300.0 + 10 * step)
        assert c.merge_now(fragment, 1, 301.0 + 10 * step) is not None
    assert any(not torch.equal(momentum_of(c)[k], t) for k, t in taken.items())  # the momentum moved on
    path = checkpoint_path(tmp_path / "ckpt", RUN_ID)
    save_checkpoint(path, snapshot)
    loaded = load_checkpoint(path, run_id=RUN_ID, expected=c.shapes, num_fragments=PLAN.num_fragments)
    assert all(torch.equal(loaded.momentum[k], t) for k, t in taken.items())
    momentum_files = lambda: [p for p in (tmp_path / "spill").iterdir() if p.name.startswith("momentum")]  # noqa: E731
    assert len(momentum_files()) > PLAN.num_fragments  # the snapshot's generations are kept
    del snapshot
    gc.collect()
    contribute(c, "a", 1, c.versions[1], seed=90, now=350.0)
    assert c.merge_now(1, 1, 351.0) is not None
    assert len(momentum_files()) == PLAN.num_fragments  # and pruned once no snapshot names them


def test_the_streamed_safetensors_file_reads_back_with_safetensors(tmp_path: Path) -> None:
    tensors = {"b": torch.randn(3, 5), "a": torch.randn(7), "s": torch.tensor(2.5), "e": torch.zeros(0, 4)}
    path = tmp_path / "x.safetensors"
    with open(path, "wb") as handle:
        write_safetensors(
            handle, [(k, tuple(t.shape)) for k, t in tensors.items()], tensors.values(), {"k": "v"}
        )
    loaded = load_file(str(path))
    assert loaded.keys() == tensors.keys() and all(torch.equal(loaded[k], t) for k, t in tensors.items())
    with open(tmp_path / "y", "wb") as handle, pytest.raises(ValueError):  # a tensor that is not its entry
        write_safetensors(handle, [("a", (7,))], [torch.randn(6)], {})


def test_a_spill_file_round_trips_and_a_reader_never_sees_a_half_written_one(tmp_path: Path) -> None:
    spill = SpillDir(tmp_path / "s")
    tensors = {"x": torch.randn(4, 4), "y": torch.randn(3)}
    spill.write("k", tensors)
    assert all(torch.equal(spill.read("k")[n], t) for n, t in tensors.items())
    assert sorted(p.name for p in (tmp_path / "s").iterdir()) == ["k"]  # no temporary left
    with pytest.raises(ValueError):
        spill.write("bf16", {"x": torch.ones(2, dtype=torch.bfloat16)})
    assert not (tmp_path / "s" / "bf16").exists()
    assert SpillDir(tmp_path / "s") and not list((tmp_path / "s").iterdir())  # reopened: emptied
    assert STATE_PREFIX  # (the momentum views key by it)


@IN_MEMORY_ONLY
def test_handed_over_params_are_not_copied() -> None:
    """The node's syncer hands its seed model over (`take_params`): one model at its start, not two."""
    taken, copied = core(take_params=True), core()
    model = build_model(CFG, seed=0)
    handed = dict(model.named_parameters())
    c = SyncerCore(PLAN, handed, **{**OPTIONS, "take_params": True})  # type: ignore[arg-type]
    assert all(c.params[n].data_ptr() == handed[n].data_ptr() for n in c.params)
    # control: without it the core copies
    d = SyncerCore(PLAN, handed, **OPTIONS)  # type: ignore[arg-type]
    assert all(d.params[n].data_ptr() != handed[n].data_ptr() for n in d.params)
    assert all(torch.equal(taken.params[n], copied.params[n]) for n in copied.params)


def test_a_checkpoint_written_by_safetensors_itself_still_loads_its_momentum_lazily(tmp_path: Path) -> None:
    """Checkpoints written before the streamed writer (safetensors' save_file) load through the plain-read loader;
    the momentum is read when used, not at load."""
    c = synchronous(None)
    script(c)
    snapshot = c.snapshot(RUN_ID, term=1)
    tensors = {"param/" + n: t for n, t in snapshot.params.items()} | dict(snapshot.momentum)
    path = checkpoint_path(tmp_path, RUN_ID)
    save_checkpoint(tmp_path / "streamed", snapshot)
    data = (tmp_path / "streamed").read_bytes()
    metadata = json.loads(data[8 : 8 + struct.unpack("<Q", data[:8])[0]])
    save_file(tensors, str(path), metadata=metadata["__metadata__"])
    loaded = load_checkpoint(path, run_id=RUN_ID, expected=c.shapes, num_fragments=PLAN.num_fragments)
    assert isinstance(loaded.momentum, TensorFile) and loaded.momentum.keys() == snapshot.momentum.keys()
    assert all(torch.equal(loaded.momentum[k], t) for k, t in snapshot.momentum.items())
    restored = synchronous(tmp_path / "spill")
    restored.restore(loaded, 5.0)
    assert all(torch.equal(momentum_of(restored)[k], t) for k, t in snapshot.momentum.items())


@IN_MEMORY_ONLY
def test_a_held_contribution_is_a_file_of_its_own_read_in_chunks_and_deleted_once_merged(
    tmp_path: Path,
) -> None:
    """With a spill directory, a round's accepted contributions are files (not K fragments in memory), deleted when
    the round is merged or the contribution replaced."""
    c = synchronous(tmp_path / "spill")

    def contributions() -> list[str]:
        return sorted(p.name for p in (tmp_path / "spill").iterdir() if p.name.startswith("contribution"))

    contribute(c, "a", 0, 0, seed=1, now=1.0)
    contribute(c, "b", 0, 0, seed=2, now=1.0)
    held = c.rounds[0].entries["a"].contribution.params
    assert not isinstance(held, dict) and len(contributions()) == 2
    name = PLAN.fragments[0].names[0]
    assert torch.equal(
        torch.cat([held.chunk(name, 0, 3), held.chunk(name, 3, 10**9)]), held[name].reshape(-1)
    )  # type: ignore[attr-defined]
    del held
    contribute(c, "a", 0, 0, seed=3, now=1.5)  # replaces a's first one: its file goes
    gc.collect()
    assert len(contributions()) == 2
    assert c.merge_now(0, 2, 2.0) is not None
    gc.collect()
    assert contributions() == []
    # control: the in-memory core holds them as they came
    memory = synchronous(None)
    contribute(memory, "a", 0, 0, seed=1, now=1.0)
    assert isinstance(memory.rounds[0].entries["a"].contribution.params, dict)


@pytest.mark.parametrize("chunk", [7, 1000])
def test_merges_a_few_values_a_chunk_land_where_whole_tensors_do(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, chunk: int
) -> None:
    """The merge, the screen, the momentum step and the checkpoint work a chunk at a time (node.diloco.chunked): with
    tiny chunks (every tensor split, at boundaries inside it) the spilled core lands where the in-memory one does at
    one chunk per tensor, up to float rounding (float64 norms summed per chunk)."""
    reference = synchronous(None)
    script(reference)
    monkeypatch.setattr("node.diloco.chunked.CHUNK", chunk)
    spilled = synchronous(tmp_path / "spill")
    script(spilled)
    assert spilled.versions == reference.versions
    for n, t in reference.params.items():
        torch.testing.assert_close(spilled.params[n], t, rtol=1e-5, atol=1e-6)
    ours, theirs = momentum_of(spilled), momentum_of(reference)
    assert ours.keys() == theirs.keys()
    for k, t in theirs.items():
        torch.testing.assert_close(ours[k], t, rtol=1e-5, atol=1e-6)
    path = checkpoint_path(tmp_path / "ckpt", RUN_ID)  # the momentum written in chunks reads back whole
    save_checkpoint(path, spilled.snapshot(RUN_ID, term=1))
    loaded = load_checkpoint(path, run_id=RUN_ID, expected=spilled.shapes, num_fragments=PLAN.num_fragments)
    assert all(torch.equal(loaded.momentum[k], t) for k, t in ours.items())
