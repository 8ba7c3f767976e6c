"""A no-grad held-out loss is cut into passes of a few rows with its MLPs and logits run a few positions at a
time (node.ml.model.loss_pass_shape, mlp_by_positions, chunked_lm_loss; node.roles.syncer.skeleton_loss), so the
syncer's probe and evaluation at llama-1b's full context do not hold 8 rows x 2,048 positions x 32k logits (4 GiB
with the log-softmax; issue 17): the same loss as one whole pass, for every family and with a streamed contribution; the
largest logits and MLP temporaries built stay within the budget (negative control: an unbounded budget builds
the whole batch's)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from node.diloco.loss_probe import Applied
from node.ml.model import LOSS_PASS_BYTES, ModelConfig, PassShape, build_model, loss_pass_shape
from node.roles.syncer import model_skeleton, skeleton_loss
from protocol.model_spec import resolve_model

pytestmark = pytest.mark.timeout(120)

SHAPE = {"vocab_size": 2048, "context_len": 32, "num_layers": 2, "width": 64, "num_heads": 2}
ROWS, SEQ = 4, 32
SMALL = 64 << 10  # bytes: a budget that cuts this model's 4 x 32 batch into several passes and logit chunks


def held(seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, SHAPE["vocab_size"], (2, ROWS, SEQ + 1), generator=gen)
    return [(batch[:, :-1], batch[:, 1:]) for batch in tokens]


def model(family: str) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    cfg = ModelConfig.from_dict({**SHAPE, "family": family})
    return cfg, {n: p.detach() for n, p in build_model(cfg, seed=0).named_parameters()}


class Largest:
    """The largest output of the skeleton's LM head and of a layer's MLP up-projection (forward hooks) while
    installed: the logits and the MLP's [rows, positions, mlp_width] temporaries a pass builds at once."""

    def __init__(self, skeleton: Any) -> None:
        self.logits = self.mlp = 0
        up = skeleton.model.layers["0"].mlp.up_proj
        self.handles = [
            skeleton.lm_head.register_forward_hook(self._logits),
            up.register_forward_hook(self._mlp),
        ]

    def _logits(self, module: Any, args: Any, out: torch.Tensor) -> None:
        self.logits = max(self.logits, out.numel())

    def _mlp(self, module: Any, args: Any, out: torch.Tensor) -> None:
        self.mlp = max(self.mlp, out.numel())

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


def test_the_llama_1b_cut_keeps_a_full_context_row_and_a_few_hundred_positions() -> None:
    cfg = ModelConfig.from_dict(resolve_model({"preset": "llama-1b", "vocab_size": 32000}))
    cut = loss_pass_shape(cfg, rows=8, seq=cfg.context_len)
    assert cut.rows == 1  # one row's [2,048 x 2,048] layer tensors, six alive, are 0.09 GiB already
    # 1 M logits a chunk: as in the llama-1b probe-on run that met the goal (docs/scale.md)
    assert cut.positions == 32
    assert cut.rows * cut.positions * cfg.vocab_size * 4 * 2 <= LOSS_PASS_BYTES
    tiny = ModelConfig()
    assert loss_pass_shape(tiny, rows=8, seq=tiny.context_len) == PassShape(8, tiny.context_len)  # whole
    assert loss_pass_shape(cfg, rows=8, seq=cfg.context_len, budget_bytes=1) == PassShape(1, 1)


@pytest.mark.parametrize("family", ["llama", "qwen2", "gpt2"])
def test_the_cut_pass_gives_the_whole_pass_loss(family: str) -> None:
    cfg, params = model(family)
    cut = loss_pass_shape(cfg, ROWS, SEQ, SMALL)
    assert cut.rows < ROWS and cut.positions < SEQ, cut  # the budget really cuts both ways
    skeleton, batches = model_skeleton(cfg), held(1)
    whole = skeleton_loss(skeleton, params, batches, pass_bytes=1 << 40)
    assert skeleton_loss(skeleton, params, batches, pass_bytes=SMALL) == pytest.approx(whole, rel=1e-5)
    assert skeleton_loss(skeleton, params, batches, pass_bytes=1) == pytest.approx(whole, rel=1e-5)


def test_a_streamed_contribution_scores_the_same_cut_or_whole() -> None:
    cfg, current = model("llama")
    gen = torch.Generator().manual_seed(2)
    names = [n for n in current if "lm_head" in n or "embed" in n]
    base = {n: current[n] + 0.01 * torch.randn(current[n].shape, generator=gen) for n in names}
    params = {n: base[n] - 0.05 * torch.randn(current[n].shape, generator=gen) for n in names}
    skeleton, batches = model_skeleton(cfg), held(3)
    applied = Applied(current, base, params, sign=1.0)
    whole = skeleton_loss(skeleton, applied, batches, pass_bytes=1 << 40)
    assert skeleton_loss(skeleton, applied, batches, pass_bytes=SMALL) == pytest.approx(whole, rel=1e-5)
    assert whole != pytest.approx(
        skeleton_loss(skeleton, current, batches), rel=1e-4
    )  # the contribution counts


def test_the_largest_logits_and_mlp_temporaries_stay_within_the_budget() -> None:
    cfg, params = model("llama")
    skeleton, batches = model_skeleton(cfg), held(4)
    seen = Largest(skeleton)
    skeleton_loss(skeleton, params, batches, pass_bytes=SMALL)
    seen.remove()
    print(f"cut: largest logits {seen.logits * 4} bytes, MLP up {seen.mlp * 4} bytes, budget {SMALL}")
    assert 0 < seen.logits * 4 * 2 <= SMALL
    assert 0 < seen.mlp * 4 * 4 <= SMALL
    cut = loss_pass_shape(cfg, ROWS, SEQ, SMALL)
    assert seen.mlp == cut.rows * cut.positions * cfg.mlp_width
    assert not any("forward" in vars(m) for m in skeleton.modules())  # the MLPs' own forward again


def test_negative_control_an_unbounded_budget_builds_the_whole_batch_logits_and_mlp() -> None:
    cfg, params = model("llama")
    skeleton, batches = model_skeleton(cfg), held(4)
    seen = Largest(skeleton)
    skeleton_loss(skeleton, params, batches, pass_bytes=1 << 40)
    seen.remove()
    assert seen.logits == ROWS * SEQ * SHAPE["vocab_size"]
    assert seen.mlp == ROWS * SEQ * cfg.mlp_width
    assert seen.logits * 4 * 2 > 8 * SMALL
