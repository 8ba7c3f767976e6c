"""The merge with its outer gradient in a spill file (issue 17: no fragment-sized buffer in a syncer's merge): the same
values as the in-memory merge at any chunk size, within float rounding of the whole-tensor RDA it replaced, the new
version swapped in a tensor at a time after the old one is dropped, and no fragment-sized allocation in the merge
(control: the in-memory outer gradient is one)."""

from __future__ import annotations

import gc
import math
import weakref
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from node.diloco import chunked
from node.diloco.loss_probe import LossProbe
from node.diloco.merge import Contribution, MergeResult, merge_fragment
from node.diloco.screening import ContributionScreen, ScreeningConfig
from node.diloco.spill import ScaledTensors, SpillDir, SpilledTensors
from node.diloco.syncer_core import SyncerCore
from tests.unit.params_modes import IN_MEMORY_ONLY
from tests.unit.test_syncer_core import PLAN
from tests.unit.test_syncer_spill import contribute, momentum_of, synchronous

pytestmark = [pytest.mark.timeout(120), pytest.mark.usefixtures("params_mode")]
SHAPES = {"emb": (50, 6), "w": (13, 11), "b": (5,), "d": (4, 4)}


def inputs(seed: int = 0) -> tuple[dict[str, torch.Tensor], list[Contribution]]:
    """Four contributions (one of them large, to be clipped and winsorized) to a fragment of an embedding, two
    RDA tensors and one (`d`) whose deltas cancel (RDA falls back to the mean there: the reweighting in `merged`
    balances p0 + p2 against p1 + p3)."""
    gen = torch.Generator().manual_seed(seed)
    global_params = {n: torch.randn(s, generator=gen) for n, s in SHAPES.items()}
    opposite = 0.01 * torch.randn(SHAPES["d"], generator=gen)
    contributions = []
    for peer in range(4):
        scale = 0.05 if peer == 3 else 0.01
        params = {n: t - scale * torch.randn(t.shape, generator=gen) for n, t in global_params.items()}
        params["d"] = global_params["d"] - (opposite if peer % 2 else -opposite)
        contributions.append(Contribution(f"p{peer}", params, 0, 4, 256))
    return global_params, contributions


def merged(spill: SpillDir | None, trim: float = 0.3) -> MergeResult:
    global_params, contributions = inputs()
    return merge_fragment(
        global_params,
        contributions,
        embedding_names={"emb"},
        clip_factor=1.5,
        trim_fraction=trim,
        reweight=lambda w: {p: v * (0.5 if p in ("p1", "p2") else 1.0) for p, v in w.items()},
        spill=spill,
    )


def values(tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {n: tensors[n].clone() for n in tensors}


@pytest.mark.parametrize("chunk", [7, 64, 1 << 20])
def test_the_outer_gradient_in_a_file_equals_the_in_memory_one_at_any_chunk_size(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, chunk: int
) -> None:
    """7 divides no tensor here; 64 splits the embedding; 1 << 20 holds every tensor in one chunk."""
    monkeypatch.setattr(chunked, "CHUNK", chunk)
    memory, spilled = merged(None), merged(SpillDir(tmp_path / "spill"))
    assert isinstance(spilled.outer_grad, ScaledTensors) and isinstance(memory.outer_grad, dict)
    assert spilled.fallback_tensors == memory.fallback_tensors == ("d",)  # the degenerate case is covered
    assert spilled.clipped == memory.clipped and spilled.clipped  # so is clipping
    ours, theirs = values(spilled.outer_grad), values(memory.outer_grad)
    assert ours.keys() == theirs.keys() == SHAPES.keys()
    assert all(torch.equal(ours[n], t) for n, t in theirs.items())
    spilled.outer_grad.scale_all(0.25)  # the seniority cap's scale: applied as read, as mul_ applies it
    assert all(torch.equal(spilled.outer_grad[n], theirs[n].mul_(0.25)) for n in SHAPES)


def whole_tensor_rda(trim_free: MergeResult) -> dict[str, torch.Tensor]:
    """The merge as it was (no winsorizing here): each tensor's deltas whole, the direction's length a float32
    norm of the whole tensor."""
    global_params, contributions = inputs()
    total = math.fsum(trim_free.weights.values())
    out = {}
    for name, base in global_params.items():
        deltas = [
            (base - c.params[name]) * trim_free.clipped.get(c.peer_id, 1.0)
            for c in contributions
            if trim_free.weights[c.peer_id] > 0
        ]
        weights = [
            trim_free.weights[c.peer_id] / total for c in contributions if trim_free.weights[c.peer_id] > 0
        ]
        mean = sum(w * d for w, d in zip(weights, deltas, strict=True))
        if name == "emb" or name in trim_free.fallback_tensors:
            out[name] = mean
            continue
        direction = sum(w * d / float(d.norm()) for w, d in zip(weights, deltas, strict=True))
        radial = sum(w * float(d.norm()) for w, d in zip(weights, deltas, strict=True))
        out[name] = direction * (radial / float(direction.norm()))
    return out


def test_the_streamed_merge_is_the_whole_tensor_merge_within_float_rounding(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(chunked, "CHUNK", 7)
    result = merged(SpillDir(tmp_path / "spill"), trim=0.0)
    reference = whole_tensor_rda(result)
    for name, tensor in reference.items():
        torch.testing.assert_close(result.outer_grad[name], tensor, rtol=2e-5, atol=1e-7)


@pytest.mark.parametrize("chunk", [7, 1 << 20])
def test_a_core_merging_through_a_file_lands_where_the_in_memory_core_does(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, chunk: int
) -> None:
    """Four rounds per fragment with momentum, on current and older bases: the same parameters and momentum, bit
    for bit, and no outer-gradient file left behind."""
    monkeypatch.setattr(chunked, "CHUNK", chunk)
    from tests.unit.test_syncer_spill import script

    memory, spilled = synchronous(None), synchronous(tmp_path / "spill")
    script(memory)
    script(spilled)
    assert all(torch.equal(spilled.params[n], t) for n, t in memory.params.items())
    ours, theirs = momentum_of(spilled), momentum_of(memory)
    assert all(torch.equal(ours[k], t) for k, t in theirs.items())
    gc.collect()
    assert not [p for p in (tmp_path / "spill").iterdir() if p.name.startswith("outer-grad")]


@IN_MEMORY_ONLY
def test_the_new_version_is_read_in_a_tensor_at_a_time_after_the_old_one_is_dropped(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """At each read of a new tensor, the core's replaced tensor of that name is gone (nobody else held it): the
    commit never holds a tensor twice. Control: the replaced tensors are alive before the commit."""
    core = synchronous(tmp_path / "spill")
    # fragment 2: the embedding alone (a 1B llama's is a whole fragment too)
    contribute(core, "a", 2, 0, seed=1, now=1.0)
    names = PLAN.fragments[2].names
    old = {n: weakref.ref(core.params[n]) for n in names}
    alive_at_read: list[bool] = []
    read = SpilledTensors.__getitem__

    def watched(self: SpilledTensors, name: str) -> torch.Tensor:
        if self.key.startswith("outer-grad"):
            gc.collect()
            alive_at_read.append(old[name]() is not None)
        return read(self, name)

    monkeypatch.setattr(SpilledTensors, "__getitem__", watched)
    order = list(core.params)
    taken = core.take_round(2, 1, 2.0)
    assert taken is not None
    prepared = core.compute_merge(2, taken[0], expected=1, required=1, started_at=2.0)
    assert all(ref() is not None for ref in old.values())  # control: the merge itself replaced nothing
    core.commit_merge(prepared, 2.0)
    assert alive_at_read == [False] * len(names)
    assert list(core.params) == order  # replaced in place: a checkpoint writes the tensors in the same order
    assert core.versions[2] == 1 and isinstance(core.history.tensors[2][0], str)
    base = core.history.at(2, 0)
    assert base is not None and not torch.equal(base[names[0]], core.params[names[0]])


@IN_MEMORY_ONLY
def test_a_failed_read_of_the_new_version_puts_the_old_one_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A read error half way through the swap: the core's params are the replaced version again, the version number
    unchanged and the history's current version in memory (control: without the error the version moves on)."""
    core = synchronous(tmp_path / "spill")
    contribute(core, "a", 0, 0, seed=1, now=1.0)
    names = PLAN.fragments[0].names
    before = {n: core.params[n].clone() for n in names}
    read, reads = SpilledTensors.__getitem__, []

    def failing(self: SpilledTensors, name: str) -> torch.Tensor:
        if self.key.startswith("outer-grad"):
            reads.append(name)
            if len(reads) == 3:
                raise OSError("disk gone")
        return read(self, name)

    monkeypatch.setattr(SpilledTensors, "__getitem__", failing)
    taken = core.take_round(0, 1, 2.0)
    assert taken is not None and len(names) > 3
    prepared = core.compute_merge(0, taken[0], expected=1, required=1, started_at=2.0)
    with pytest.raises(OSError, match="disk gone"):
        core.commit_merge(prepared, 2.0)
    assert core.versions[0] == 0 and all(torch.equal(core.params[n], t) for n, t in before.items())
    assert all(core.history.tensors[0][0][n] is core.params[n] for n in names)
    assert not [
        p for p in (tmp_path / "spill").iterdir() if p.name.startswith("version")
    ]  # its file went too
    monkeypatch.setattr(SpilledTensors, "__getitem__", read)  # control: the same merge commits
    contribute(core, "a", 0, 0, seed=2, now=3.0)
    assert core.merge_now(0, 1, 4.0) is not None and core.versions[0] == 1
    assert not all(torch.equal(core.params[n], t) for n, t in before.items())


def largest_allocation(run: Any) -> int:
    """The largest CPU allocation any one torch op made while `run()` ran (the profiler's memory accounting)."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        run()
    return max((e.cpu_memory_usage for e in prof.events()), default=0)


def embedding_merge(core: SyncerCore) -> Iterator[None]:
    contribute(core, "a", 2, 0, seed=1, now=1.0)
    contribute(core, "b", 2, 0, seed=2, now=1.0)
    taken = core.take_round(2, 2, 2.0)
    assert taken is not None
    yield None
    core.compute_merge(2, taken[0], expected=2, required=2, started_at=2.0)


@pytest.mark.parametrize("streamed", [True, False])
def test_no_fragment_sized_allocation_in_a_merge_through_a_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, streamed: bool
) -> None:
    """The embedding fragment (4096 values, 16 KiB) merged 64 values a chunk: the largest allocation of the merge is
    chunk-sized. Control (`streamed` False: the outer gradient in memory, the path before this change): one
    allocation of the whole fragment."""
    monkeypatch.setattr(chunked, "CHUNK", 64)
    core = synchronous(tmp_path / "spill")
    if not streamed:
        import node.diloco.syncer_core as syncer_core

        whole = syncer_core.merge_fragment
        monkeypatch.setattr(syncer_core, "merge_fragment", lambda *a, **k: whole(*a, **{**k, "spill": None}))
    steps = embedding_merge(core)
    next(steps)
    fragment_bytes = 4 * sum(core.params[n].numel() for n in PLAN.fragments[2].names)
    largest = largest_allocation(lambda: next(steps, None))
    if streamed:
        assert largest <= fragment_bytes // 8
    else:
        assert largest >= fragment_bytes


def test_a_push_screened_from_a_spill_file_gets_the_in_memory_verdict(tmp_path: Path) -> None:
    """The screen reads a contribution a chunk at a time: held in a file, the same norm, cosine, verdict and probe
    score."""
    gen = torch.Generator().manual_seed(3)
    current = {n: torch.randn(s, generator=gen) for n, s in SHAPES.items()}
    params = {n: t - 0.01 * torch.randn(t.shape, generator=gen) for n, t in current.items()}
    spill = SpillDir(tmp_path / "spill")
    spill.write("push", params)
    verdicts = []
    for held in (params, spill.tensors("push")):
        screen = ContributionScreen(ScreeningConfig(min_history=1), spill=spill)
        screen.commit(0, screen.prepare_commit(0, merged(None)))  # a recent direction to measure a cosine on
        verdicts.append(screen.check(0, held, None, current, peer="p"))
    memory, spilled = verdicts
    assert spilled.tag == memory.tag and spilled.norm == memory.norm
    assert spilled.cosine == memory.cosine and memory.cosine is not None
    # the held-out loss probe applies the delta to the model: from the file, the same score
    scores = []
    for held in (params, spill.tensors("push")):
        probe = LossProbe(lambda tensors: math.fsum(float(t.double().pow(2).sum()) for t in tensors.values()))
        scores.append(probe.measure(current, (0,), current, held, lambda: 0.0, reverse=True))
    assert scores[0] is not None and scores[0] == scores[1]


def test_a_push_already_in_a_spill_file_is_accepted_and_merged_as_the_same_push_in_memory(
    tmp_path: Path,
) -> None:
    """A push handed over as a file of the core's spill (never in memory: what a route streaming its payload to disk
    would give) is checked, screened, held as it is (not copied) and merged to the same parameters and momentum as
    the in-memory push. A malformed one is refused the same way without being read whole."""
    cores = [synchronous(tmp_path / "a"), synchronous(tmp_path / "b")]
    gen = torch.Generator().manual_seed(5)
    base = cores[0].fragment_tensors(0)
    push = {n: t - 0.01 * torch.randn(t.shape, generator=gen) for n, t in base.items()}
    spill = cores[1].history.spill
    assert spill is not None
    on_disk = spill.create(spill.new_key("push"), [(n, tuple(t.shape)) for n, t in push.items()])
    for name, tensor in push.items():
        on_disk.put(name, 0, tensor.reshape(-1))
    for c, params in zip(cores, (push, on_disk), strict=True):
        c.accept(
            "a", 0, params, base_version=0, steps=4, tokens=256, sched_step=1, step_time_s=0.1,
            nonce=b"n" * 16, now=1.0,
        )  # fmt: skip
    assert cores[1].rounds[0].entries["a"].contribution.params is on_disk  # held as it is
    for c in cores:
        assert c.merge_now(0, 1, 2.0) is not None
    assert all(torch.equal(cores[1].params[n], t) for n, t in cores[0].params.items())
    ours, theirs = momentum_of(cores[1]), momentum_of(cores[0])
    assert all(torch.equal(ours[k], t) for k, t in theirs.items())
    wrong = spill.create(spill.new_key("push"), [(n, (1,)) for n in push])
    with pytest.raises(Exception, match="wrong shape"):
        cores[1].check_contribution(0, wrong)
