"""The byte-level GPT and its pipeline cut: names, init, and gradients through the cut."""

from __future__ import annotations

import pytest
import torch

from node.ml.data import load_corpus
from node.ml.model import (
    GPT,
    ModelConfig,
    StageModule,
    build_model,
    build_stage,
    count_parameters,
    embedding_param_names,
    load_state_subset,
    stage_spans,
)
from tools.train_local import train_local

SMALL = ModelConfig(context_len=16, num_layers=4, width=32, num_heads=4)


def _batch(cfg: ModelConfig, seed: int, batch: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    window = torch.randint(0, cfg.vocab_size, (batch, cfg.context_len + 1), generator=gen)
    return window[:, :-1], window[:, 1:]


def test_reference_config_has_about_0_9m_parameters() -> None:
    cfg = ModelConfig()
    assert (cfg.num_layers, cfg.width, cfg.context_len, cfg.vocab_size) == (4, 128, 128, 256)
    assert 850_000 <= count_parameters(build_model(cfg, seed=0)) <= 950_000


@pytest.mark.parametrize(
    "bad",
    [
        {"width": 130, "num_heads": 4},
        {"num_layers": 0},
        {"vocab_size": 1},
        {"dropout": 1.0},
        {"dropout": -0.1},
        {"context_len": 2.5},
        {"mlp_ratio": True},
    ],
)
def test_config_rejects_invalid_values(bad: dict[str, object]) -> None:
    with pytest.raises(ValueError):
        ModelConfig(**bad)  # type: ignore[arg-type]


def test_config_dict_round_trip_and_unknown_keys() -> None:
    cfg = ModelConfig(num_layers=6, width=64, num_heads=2, dropout=0.1)
    data = cfg.to_dict()
    assert all(isinstance(v, (int, float)) for v in data.values())
    assert ModelConfig.from_dict(data) == cfg
    with pytest.raises(ValueError, match="unknown"):
        ModelConfig.from_dict({**data, "n_embd": 3})


def test_same_seed_same_init_and_global_rng_untouched() -> None:
    rng_before = torch.get_rng_state()
    a = build_model(SMALL, seed=7).state_dict()
    b = build_model(SMALL, seed=7).state_dict()
    c = build_model(SMALL, seed=8).state_dict()
    assert torch.equal(rng_before, torch.get_rng_state())
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["blocks.1.mlp.fc.weight"], c["blocks.1.mlp.fc.weight"])
    # Distinct tensors of one model are not copies of each other's draws.
    assert not torch.equal(a["blocks.0.attn.qkv.weight"], a["blocks.1.attn.qkv.weight"])


def test_forward_shapes_and_loss_at_init_is_near_uniform() -> None:
    model = build_model(SMALL, seed=0)
    inputs, targets = _batch(SMALL, seed=1)
    logits = model(inputs)
    assert logits.shape == (3, SMALL.context_len, SMALL.vocab_size)
    _, loss = model(inputs, targets)
    assert abs(loss.item() - torch.log(torch.tensor(256.0)).item()) < 0.1
    with pytest.raises(ValueError, match="context_len"):
        model(torch.zeros(1, SMALL.context_len + 1, dtype=torch.long))


@pytest.mark.parametrize(
    ("num_layers", "num_stages"), [(4, 1), (4, 2), (4, 3), (4, 4), (5, 3), (7, 3), (12, 5)]
)
def test_stage_spans_contiguous_balanced_covering(num_layers: int, num_stages: int) -> None:
    spans = stage_spans(num_layers, num_stages)
    assert len(spans) == num_stages
    assert spans[0][0] == 0 and spans[-1][1] == num_layers
    assert all(prev[1] == nxt[0] for prev, nxt in zip(spans, spans[1:], strict=False))
    sizes = [stop - start for start, stop in spans]
    assert min(sizes) >= 1 and max(sizes) - min(sizes) <= 1


def test_stage_spans_rejects_impossible_cuts() -> None:
    with pytest.raises(ValueError):
        stage_spans(3, 4)
    with pytest.raises(ValueError):
        stage_spans(3, 0)


@pytest.mark.parametrize("num_stages", [2, 3, 4])
def test_stages_partition_the_full_models_names_and_initial_values(num_stages: int) -> None:
    full = build_model(SMALL, seed=3).state_dict()
    stages = [build_stage(SMALL, 3, i, num_stages) for i in range(num_stages)]
    seen: set[str] = set()
    for stage in stages:
        own = stage.state_dict()
        assert not seen & set(own), "stages must not share tensors"
        seen |= set(own)
        for name, tensor in own.items():
            assert torch.equal(tensor, full[name]), name
    assert seen == set(full)
    assert embedding_param_names(SMALL) <= set(stages[0].state_dict())
    assert {"ln_f.weight", "head.weight"} <= set(stages[-1].state_dict())
    assert "blocks.2.attn.qkv.weight" in full


def test_stage_module_rejects_inconsistent_spans() -> None:
    with pytest.raises(ValueError):
        StageModule(SMALL, (1, 2), is_first=True, is_last=False)
    with pytest.raises(ValueError):
        StageModule(SMALL, (2, 3), is_first=False, is_last=True)
    with pytest.raises(ValueError):
        StageModule(SMALL, (2, 2), is_first=False, is_last=False)
    with pytest.raises(ValueError):
        build_stage(SMALL, 0, stage_index=3, num_stages=3)


def _pipeline_step(stages: list[StageModule], inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Forward then backward by hand, exactly as over the network: each hop sees detached tensors."""
    outputs: list[torch.Tensor] = []
    received: list[torch.Tensor] = []
    activation: torch.Tensor = inputs
    for stage in stages[:-1]:
        out = stage(activation)
        outputs.append(out)
        activation = out.detach().requires_grad_(True)
        received.append(activation)
    loss = stages[-1](activation, targets)
    loss.backward()
    grad = received[-1].grad
    for index in range(len(outputs) - 1, -1, -1):
        assert grad is not None
        torch.autograd.backward(outputs[index], grad)
        grad = received[index - 1].grad if index > 0 else None
    return loss.detach()


@pytest.mark.parametrize("num_stages", [2, 3])
def test_gradients_through_the_cut_equal_the_uncut_model(num_stages: int) -> None:
    full = build_model(SMALL, seed=11)
    stages = [build_stage(SMALL, 11, i, num_stages) for i in range(num_stages)]
    inputs, targets = _batch(SMALL, seed=5)

    _, full_loss = full(inputs, targets)
    full_loss.backward()
    pipe_loss = _pipeline_step(stages, inputs, targets)

    torch.testing.assert_close(pipe_loss, full_loss.detach(), rtol=0, atol=1e-6)
    full_grads = {name: p.grad for name, p in full.named_parameters()}
    checked = 0
    for stage in stages:
        for name, param in stage.named_parameters():
            assert param.grad is not None, name
            torch.testing.assert_close(param.grad, full_grads[name], rtol=1e-5, atol=1e-7, msg=name)
            checked += 1
    assert checked == len(full_grads)


def test_load_state_subset_makes_a_stage_compute_like_the_trained_model() -> None:
    trained = build_model(SMALL, seed=0)
    with torch.no_grad():
        for param in trained.parameters():
            param.add_(0.01 * torch.randn(param.shape, generator=torch.Generator().manual_seed(1)))
    stages = [build_stage(SMALL, 99, i, 2) for i in range(2)]
    for stage in stages:
        load_state_subset(stage, trained.state_dict())
    inputs, targets = _batch(SMALL, seed=2)
    with torch.no_grad():
        logits, loss = trained(inputs, targets)
        stage_logits, stage_loss = stages[1].forward_with_logits(stages[0](inputs), targets)
    torch.testing.assert_close(stage_logits, logits)
    torch.testing.assert_close(stage_loss, loss)

    partial = {k: v for k, v in trained.state_dict().items() if not k.startswith("blocks.3.")}
    with pytest.raises(KeyError, match="lacks"):
        load_state_subset(stages[1], partial)
    wrong = build_model(ModelConfig(context_len=16, num_layers=4, width=64, num_heads=4), 0).state_dict()
    with pytest.raises(ValueError, match="shape"):
        load_state_subset(stages[0], wrong)


def test_gpt_is_a_single_stage_holding_everything() -> None:
    model = build_model(SMALL, seed=4)
    single = build_stage(SMALL, 4, 0, 1)
    assert isinstance(model, GPT)
    assert model.state_dict().keys() == single.state_dict().keys()
    inputs, targets = _batch(SMALL, seed=6)
    with torch.no_grad():
        _, loss = model(inputs, targets)
        torch.testing.assert_close(single(inputs, targets), loss)


def test_train_local_reduces_held_out_loss() -> None:
    cfg = ModelConfig(context_len=32, num_layers=1, width=32, num_heads=2)
    corpus = load_corpus(None)
    losses = train_local(
        cfg, corpus, steps=40, batch_size=8, lr=3e-3, seed=0, eval_every=20, num_val_batches=4
    )
    assert len(losses) == 2
    assert losses[-1] < torch.log(torch.tensor(256.0)).item() - 1.0
    again = train_local(
        cfg, corpus, steps=40, batch_size=8, lr=3e-3, seed=0, eval_every=20, num_val_batches=4
    )
    assert losses == pytest.approx(again, rel=1e-5)
