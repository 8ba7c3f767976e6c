"""The loss probe's contribution applied alone is computed a block at a time inside the forward pass
(node.ml.streamed_forward, node.diloco.loss_probe.Applied), never held whole (issue 17, docs/scale.md): the same
loss as with the applied tensors built whole, for every family; the tensors alive during the pass stay a small part
of the fragment (negative control: built whole, the fragment is alive at once); a streamed tensor read outside its
module's own forward fails instead of scoring the current values; the skeleton is left as it was."""

from __future__ import annotations

import gc
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from node.diloco.loss_probe import Applied
from node.diloco.spill import SpillDir, SpilledTensors
from node.diloco.syncer_core import ProbeContext
from node.ml.model import ModelConfig, build_model
from node.ml.streamed_forward import streaming
from node.roles.syncer import model_skeleton, skeleton_loss

pytestmark = pytest.mark.timeout(120)

SHAPE = {"vocab_size": 2048, "context_len": 16, "num_layers": 2, "width": 64, "num_heads": 2}
BLOCK = 1024  # values per block: many blocks per tensor


def held(seed: int, rows: int = 2, seq: int = 8) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, SHAPE["vocab_size"], (2, rows, seq + 1), generator=gen)
    return [(row[:, :-1], row[:, 1:]) for row in tokens]


def setup(family: str, fragment: Any) -> tuple[ModelConfig, dict[str, torch.Tensor], dict, dict]:
    cfg = ModelConfig.from_dict({**SHAPE, "family": family})
    current = {n: p.detach() for n, p in build_model(cfg, seed=0).named_parameters()}
    names = [n for n in current if fragment(n)]
    gen = torch.Generator().manual_seed(1)
    base = {n: current[n] + 0.01 * torch.randn(current[n].shape, generator=gen) for n in names}
    params = {n: base[n] - 0.05 * torch.randn(current[n].shape, generator=gen) for n in names}
    return cfg, current, base, params


def whole(applied: Applied) -> dict[str, torch.Tensor]:
    """The applied tensors built whole (what the probe did before)."""
    return {name: applied[name] for name in applied}


def small_loss(skeleton: Any, params: Mapping[str, torch.Tensor], batches: Any) -> float:
    with torch.no_grad():
        from torch.func import functional_call

        from node.ml.data import evaluate
        from node.ml.streamed_forward import streamed_names

        streamed = streamed_names(params)
        tensors = {n: params[n] for n in params if n not in streamed}
        with streaming(skeleton, params, block_values=BLOCK):
            return evaluate(lambda x, y: functional_call(skeleton, tensors, (x, y)), batches)


@pytest.mark.parametrize("family", ["llama", "qwen2", "gpt2"])
@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_streamed_scores_as_the_applied_tensors_built_whole(family: str, sign: float) -> None:
    # every tensor of the model streamed: embeddings (rows looked up), linears, norms, GPT-2's Conv1D
    cfg, current, base, params = setup(family, lambda n: True)
    applied = Applied(current, base, params, sign=sign)
    skeleton, batches = model_skeleton(cfg), held(3)
    expected = skeleton_loss(skeleton, whole(applied), batches)
    assert small_loss(skeleton, applied, batches) == pytest.approx(expected, rel=1e-5)
    assert skeleton_loss(skeleton, applied, batches) == pytest.approx(expected, rel=1e-5)  # default block
    assert expected != pytest.approx(skeleton_loss(skeleton, current, batches), rel=1e-4)  # the delta counts
    assert all(p.is_meta for p in skeleton.parameters())
    assert not any("forward" in vars(m) for m in skeleton.modules())  # patches undone
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in skeleton.modules())


class LiveBytes(Applied):
    """`Applied` that, at every range read, adds up the tensors alive in the process that were not alive when it was
    made (the largest sum seen: what the pass holds beyond the model at that moment)."""

    peak = 0

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # tensors other tests left alive (caches, garbage not yet collected) are not this pass's: run after other
        # tests, they once made the streamed pass look 218 KB heavy
        gc.collect()
        self._before = {storage.data_ptr() for storage, _ in self._storages()}

    def chunk(self, name: str, start: int, stop: int) -> torch.Tensor:
        self.peak = max(self.peak, self._live())
        return super().chunk(name, start, stop)

    def _live(self) -> int:
        # the inputs held in memory were alive before the pass, so `_before` holds them
        seen = {
            storage.data_ptr(): nbytes
            for storage, nbytes in self._storages()
            if storage.data_ptr() not in self._before
        }
        return sum(seen.values())

    @staticmethod
    def _storages() -> list[tuple[Any, int]]:
        with warnings.catch_warnings():  # isinstance on some modules' lazy attributes warns of deprecations
            warnings.simplefilter("ignore")
            tensors = [obj for obj in gc.get_objects() if isinstance(obj, torch.Tensor)]
        return [
            (t.untyped_storage(), t.untyped_storage().nbytes())
            for t in tensors
            if not t.is_meta and t.device.type == "cpu"
        ]


def test_the_pass_holds_a_block_not_the_fragment() -> None:
    # the fragment: the embedding and layer 0 (a llama-1b fragment is a vocabulary-sized tensor or a few layers)
    cfg, current, base, params = setup("llama", lambda n: "embed" in n or ".layers.0." in n)
    fragment = sum(t.numel() * 4 for t in params.values())
    skeleton, batches = model_skeleton(cfg), held(5, rows=1, seq=4)
    streamed = LiveBytes(current, base, params, sign=1.0)
    small_loss(skeleton, streamed, batches)
    print(f"streamed: {streamed.peak} bytes alive at most, fragment {fragment}")
    assert 0 < streamed.peak < 0.25 * fragment, (streamed.peak, fragment)


def test_negative_control_built_whole_the_fragment_is_alive_at_once() -> None:
    cfg, current, base, params = setup("llama", lambda n: "embed" in n or ".layers.0." in n)
    fragment = sum(t.numel() * 4 for t in params.values())
    skeleton, batches = model_skeleton(cfg), held(5, rows=1, seq=4)
    built = LiveBytes(current, base, params, sign=1.0)
    small_loss(skeleton, whole(built), batches)  # the old way: every applied tensor first
    print(f"built whole: {built.peak} bytes alive at most, fragment {fragment}")
    assert built.peak > 0.75 * fragment, (built.peak, fragment)


class Peeking(nn.Module):
    """A parent that reads its child's weight outside the child's own forward."""

    def __init__(self) -> None:
        super().__init__()
        self.child = nn.Linear(4, 4, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.child.weight.t()


def test_a_streamed_tensor_read_outside_its_module_fails_instead_of_scoring_the_current_one() -> None:
    from torch.func import functional_call

    with torch.device("meta"):
        model = Peeking()
    current = {"child.weight": torch.randn(4, 4)}
    applied = Applied(current, current, {"child.weight": torch.zeros(4, 4)}, sign=1.0)
    x = torch.randn(2, 4)
    with pytest.raises(RuntimeError, match="outside its module"), streaming(model, applied):
        functional_call(model, {}, (x,)).sum().item()
    # negative control: given whole (not streamed), the same module computes
    out = functional_call(model, whole(applied), (x,))
    assert torch.allclose(out, x @ applied["child.weight"].t())


def test_a_streamed_name_missing_from_the_model_is_refused() -> None:
    cfg = ModelConfig.from_dict(SHAPE)
    current = {"not.a.param": torch.zeros(2, 2)}
    applied = Applied(current, current, current, sign=1.0)
    with pytest.raises(KeyError), streaming(model_skeleton(cfg), applied):
        pass


def test_a_base_context_in_spill_files_is_streamed_not_read_whole(tmp_path: Path) -> None:
    # the loss screen scores in the base context (node.diloco.syncer_core.probe_context); its older versions live in
    # the syncer's spill files, and the forward reads them by range like the applied contribution
    cfg, current, base, params = setup("llama", lambda n: ".layers.1." in n)
    older = {
        n: t + 0.02 for n, t in current.items() if "embed" in n or ".layers.0." in n
    }  # other fragments, then
    spill = SpillDir(tmp_path / "spill")
    spill.write("v1", older)
    context = ProbeContext(
        {n: t for n, t in current.items() if n not in older},
        (1, 0),
        (SpilledTensors(spill, "v1", pinned=True),),
    )
    assert context.streamed == frozenset(older)
    skeleton, batches = model_skeleton(cfg), held(7, rows=1, seq=4)
    expected = skeleton_loss(skeleton, whole(Applied({**current, **older}, base, params, sign=1.0)), batches)
    assert skeleton_loss(skeleton, Applied(context, base, params, sign=1.0), batches) == pytest.approx(
        expected, rel=1e-5
    )
    assert skeleton_loss(skeleton, context, batches) == pytest.approx(
        skeleton_loss(skeleton, context.read(), batches), rel=1e-5
    )
    # what the pass holds: a block, not the spilled fragments (control: read whole first, they are alive at once)
    spilled_bytes = sum(t.numel() * 4 for t in older.values())
    streamed = LiveBytes(context, base, params, sign=1.0)
    small_loss(skeleton, streamed, batches)
    read_first = LiveBytes(context, base, params, sign=1.0)
    small_loss(skeleton, whole(read_first), batches)  # every tensor read whole before the pass (as before)
    assert streamed.peak < 0.25 * spilled_bytes, (streamed.peak, spilled_bytes)
    assert read_first.peak >= spilled_bytes, (read_first.peak, spilled_bytes)
