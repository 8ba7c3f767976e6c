"""The syncer core with its global parameters in spill files (`[syncer] params_on_disk`, node.diloco.param_store,
issue 17): a sequence of merges with a rollback, a void round, an adoption and a restore from a checkpoint ends
bit for bit where the core with its parameters in memory ends; their snapshots write the same checkpoint bytes, a
fetch answers the same payload, the probe and the evaluation score the same loss; and the disk core holds none of
the model's tensors (the negative controls: the memory core holds them, and a value changed in a file is read)."""

from __future__ import annotations

import gc
import types
from pathlib import Path

import pytest
import torch

from node.diloco.merge import NothingToMerge
from node.diloco.param_store import DiskParams, MemoryParams
from node.diloco.screening import ScreeningConfig
from node.diloco.spill import SpilledTensors
from node.diloco.syncer_core import probe_context
from node.ml.checkpoint import checkpoint_path, load_checkpoint, save_checkpoint
from node.ml.model import SeedParameters, build_model
from node.roles.syncer import SyncerCore, model_skeleton, quorum_config, skeleton_loss
from node.roles.syncer_rpc import version_answer
from protocol.identity import NodeIdentity
from protocol.manifest import DilocoSpec
from tests.unit.test_syncer_core import CFG, PLAN, core
from tests.unit.test_syncer_spill import OPTIONS, RUN_ID, contribute, script

pytestmark = pytest.mark.timeout(120)
# the screen is not what is compared here, and off it lets a push whose outer step overflows reach the rollback
SCREEN_OFF = ScreeningConfig(enabled=False)


def pair_core(spill: Path, *, on_disk: bool) -> SyncerCore:
    quorum = quorum_config(DilocoSpec(mode="elastic_sync"), max_grace_s=5.0)
    return core(quorum, now=0.0, spill_dir=spill, params_on_disk=on_disk, screening=SCREEN_OFF)


def rollback_then_void(c: SyncerCore, now: float) -> None:
    """A push whose outer step overflows float32: the merge is rolled back, then published as a void round (the
    synchronous modes' answer to a round with nothing to merge)."""
    huge = {n: torch.full_like(t, 3e38) for n, t in dict(c.fragment_tensors(0)).items()}
    c.accept(
        "evil", 0, huge, base_version=c.versions[0], steps=4, tokens=256, sched_step=1, step_time_s=0.1,
        nonce=b"e" * 16, now=now,
    )  # fmt: skip
    taken = c.take_round(0, 1, now)
    assert taken is not None
    with pytest.raises(NothingToMerge) as rolled:
        c.compute_merge(0, taken[0], expected=taken[1], required=taken[2], started_at=now)
    void = c.void_merge(
        0, taken[0], expected=taken[1], required=taken[2], started_at=now, rejected=rolled.value.rejected
    )
    c.commit_merge(void, now)
    history = c.history.tensors[0]
    if isinstance(c.params, DiskParams):  # the void version is its predecessor's file, not a copy
        assert history[c.versions[0]] == history[c.versions[0] - 1] == c.params.files[0].key


def turns(c: SyncerCore, now: float, count: int) -> float:
    """`count` rounds on every fragment, one push on the current base and one two versions back where held."""
    for turn in range(count):
        for fragment in range(PLAN.num_fragments):
            current = c.versions[fragment]
            contribute(c, "a", fragment, current, seed=int(now) + 10 * turn + fragment, now=now)
            if c.history.at(fragment, current - 2) is not None:
                contribute(c, "b", fragment, current - 2, seed=int(now) + 100 + turn, now=now)
            assert c.merge_now(fragment, 2, now + 1.0) is not None
            now += 2.0
    return now


def drive(c: SyncerCore, checkpoints: Path) -> None:
    """The sequence both cores run: merges, a rollback and a void round (whose version shares its predecessor's
    file on disk, then drops out of the history), an adoption, a checkpoint, more merges, and a restore from it."""
    script(c)
    rollback_then_void(c, 20.0)
    now = turns(c, 30.0, 3)
    adopted = {
        n: torch.full_like(t, 0.25) + i for i, (n, t) in enumerate(dict(c.fragment_tensors(1)).items())
    }
    assert c.adopt(1, c.versions[1] + 3, adopted, now)
    now = turns(c, now + 5.0, 1)
    path = checkpoint_path(checkpoints, RUN_ID)
    save_checkpoint(path, c.snapshot(RUN_ID, term=1, wall_offset=0.0))
    now = turns(c, now + 5.0, 2)
    saved = load_checkpoint(path, run_id=RUN_ID, expected=c.shapes, num_fragments=PLAN.num_fragments)
    c.restore(saved, now, wall_offset=0.0)
    turns(c, now + 5.0, 2)


def equal(a: object, b: object) -> bool:
    assert isinstance(a, dict) or hasattr(a, "items")
    left, right = dict(a.items()), dict(b.items())  # type: ignore[attr-defined]
    return left.keys() == right.keys() and all(torch.equal(left[k], right[k]) for k in left)


@pytest.fixture(scope="module")
def driven(tmp_path_factory: pytest.TempPathFactory) -> tuple[SyncerCore, SyncerCore]:
    root = tmp_path_factory.mktemp("params")
    memory, disk = pair_core(root / "memory", on_disk=False), pair_core(root / "disk", on_disk=True)
    drive(memory, root / "checkpoints-memory")
    drive(disk, root / "checkpoints-disk")
    return memory, disk


def test_a_sequence_of_merges_with_the_params_on_disk_equals_it_in_memory_bit_for_bit(
    driven: tuple[SyncerCore, SyncerCore],
) -> None:
    memory, disk = driven
    assert isinstance(memory.params, MemoryParams) and isinstance(disk.params, DiskParams)
    assert disk.versions == memory.versions and disk.merges == memory.merges
    assert equal(disk.params, memory.params)
    assert equal(disk.snapshot(RUN_ID, 1).momentum, memory.snapshot(RUN_ID, 1).momentum)
    for fragment in range(PLAN.num_fragments):
        held, theirs = disk.history.of(fragment), memory.history.of(fragment)
        assert sorted(held) == sorted(theirs)
        assert all(equal(held[v], theirs[v]) for v in held)
        # on disk the current version is its file, the history's entry its key: nothing of it in memory
        assert disk.history.tensors[fragment][disk.versions[fragment]] == disk.params.files[fragment].key
        assert isinstance(memory.history.tensors[fragment][memory.versions[fragment]], dict)


def test_the_snapshots_write_the_same_checkpoint_bytes(
    driven: tuple[SyncerCore, SyncerCore], tmp_path: Path
) -> None:
    memory, disk = driven
    for name, c in (("memory", memory), ("disk", disk)):
        save_checkpoint(tmp_path / name, c.snapshot(RUN_ID, term=3, wall_offset=100.0))
    assert (tmp_path / "disk").read_bytes() == (tmp_path / "memory").read_bytes()


def test_a_snapshot_on_disk_keeps_its_moment_through_later_merges(tmp_path: Path) -> None:
    """A checkpoint written in a thread reads the snapshot's files after merges replaced (and the history deleted)
    them: they are pinned."""
    c = pair_core(tmp_path / "spill", on_disk=True)
    script(c)
    before = {n: t.clone() for n, t in dict(c.snapshot(RUN_ID, 1).params.items()).items()}
    snapshot = c.snapshot(RUN_ID, 1)
    turns(c, 50.0, 4)  # past max_staleness: the snapshot's keys are deleted
    assert not any((tmp_path / "spill" / f.key).exists() for f in snapshot.params.files)  # type: ignore[attr-defined]
    assert equal(snapshot.params, before) and not equal(c.params, before)


def test_a_fetch_answers_the_same_payload(driven: tuple[SyncerCore, SyncerCore]) -> None:
    memory, disk = driven
    identity = NodeIdentity.generate()
    for fragment in range(PLAN.num_fragments):
        ours, theirs = (version_answer(identity, RUN_ID, "peer", c, fragment, 1) for c in (disk, memory))
        assert ours.header.tensors == theirs.header.tensors and ours.header.meta == theirs.header.meta
        assert b"".join(ours.pieces(1 << 16)) == b"".join(theirs.pieces(1 << 16))


def test_the_probe_and_the_evaluation_score_the_same_loss(driven: tuple[SyncerCore, SyncerCore]) -> None:
    memory, disk = driven
    skeleton, batches = model_skeleton(CFG), [torch.randint(0, CFG.vocab_size, (2, 17)) for _ in range(2)]
    data = [(b[:, :-1], b[:, 1:]) for b in batches]

    def loss(params: object) -> float:
        return skeleton_loss(skeleton, params, data)  # type: ignore[arg-type]

    assert loss(disk.params.view()) == loss(memory.params.view())
    context = probe_context(disk, 0, disk.versions[0] - 1)
    assert context.streamed == frozenset(disk.params) and not context.tensors  # every tensor read from a file
    assert loss(context) == loss(probe_context(memory, 0, memory.versions[0] - 1))


def tensor_bytes_reachable(root: object) -> int:
    """The bytes of the distinct tensor storages reachable from `root` through its objects (not through modules,
    classes or functions: the code's own constants are not the core's state)."""
    seen, storages, stack, total = set(), set(), [root], 0
    while stack:
        obj = stack.pop()
        if id(obj) in seen or isinstance(obj, (type, types.ModuleType, types.FunctionType)):
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            storage = obj.untyped_storage()
            if storage.data_ptr() not in storages:
                storages.add(storage.data_ptr())
                total += storage.nbytes()
            continue
        stack.extend(gc.get_referents(obj))
    return total


def test_the_disk_core_holds_no_tensor_of_the_model_and_reads_its_files(tmp_path: Path) -> None:
    """Handed the seed model, the disk core holds less than a fragment of tensors (the memory core holds the model:
    the control), and what it serves is read from its files (a value changed in one is what it reads next)."""
    model_bytes = 4 * sum(f.num_params for f in PLAN.fragments)
    smallest = 4 * min(f.num_params for f in PLAN.fragments)
    held = {}
    for on_disk in (False, True):
        handed = {n: p.detach() for n, p in build_model(CFG, seed=0).named_parameters()}
        options = {**OPTIONS, "take_params": True, "params_on_disk": on_disk}
        c = SyncerCore(PLAN, handed, spill_dir=tmp_path / f"spill-{on_disk}", **options)  # type: ignore[arg-type]
        del handed
        held[on_disk] = tensor_bytes_reachable(c)
    assert held[False] >= model_bytes and held[True] < smallest
    assert isinstance(c.params, DiskParams)
    file = c.params.fragment(0)
    name = next(iter(file))
    value = file.chunk(name, 0, 1) + 1.0
    with open(c.params.spill.directory / file.key, "r+b") as handle:
        handle.seek(file._where[name][0])
        handle.write(value.numpy().tobytes())
    assert torch.equal(c.params[name].view(-1)[:1], value)
    assert isinstance(c.fragment_tensors(0), SpilledTensors)


def test_params_on_disk_need_a_spill_directory() -> None:
    with pytest.raises(ValueError, match="spill directory"):
        core(now=0.0, params_on_disk=True)


def test_the_seed_drawn_a_tensor_at_a_time_is_the_built_model_bit_for_bit(tmp_path: Path) -> None:
    """The syncer with its params on disk writes the seed model a tensor at a time (`SeedParameters`): the same
    values as `build_model`, and a core built from it equals one built from the model. Control: another seed's
    draw differs."""
    built = dict(build_model(CFG, seed=0).named_parameters())
    drawn = SeedParameters(CFG, 0)
    assert list(drawn) == list(built) and all(torch.equal(drawn[n], t) for n, t in built.items())
    assert any(not torch.equal(SeedParameters(CFG, 1)[n], t) for n, t in built.items())
    options = {**OPTIONS, "take_params": True, "params_on_disk": True}
    c = SyncerCore(PLAN, drawn, spill_dir=tmp_path / "spill", **options)  # type: ignore[arg-type]
    assert equal(c.params, built)
