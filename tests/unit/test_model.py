"""The transformers causal LMs and their pipeline cut: names, init, and loss/gradients through the cut,
against the unsplit `AutoModelForCausalLM` of each family."""

from __future__ import annotations

import pytest
import torch

from node.ml.data import load_corpus
from node.ml.model import (
    CausalLM,
    ModelConfig,
    StageModule,
    build_model,
    build_stage,
    count_parameters,
    embedding_param_names,
    hf_config,
    load_state_subset,
    stage_spans,
)
from protocol.model_spec import PRESETS, resolve_model
from tools.train_local import train_local

SMALL = ModelConfig(context_len=16, num_layers=4, width=32, num_heads=4)
FAMILIES = {
    "llama": ModelConfig(family="llama", context_len=16, num_layers=4, width=32, num_heads=4, num_kv_heads=2),
    "gpt2": ModelConfig(family="gpt2", context_len=16, num_layers=4, width=32, num_heads=4),
    "qwen2": ModelConfig(family="qwen2", context_len=16, num_layers=4, width=32, num_heads=4, num_kv_heads=2),
}


def _batch(cfg: ModelConfig, seed: int, batch: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    window = torch.randint(0, cfg.vocab_size, (batch, cfg.context_len + 1), generator=gen)
    return window[:, :-1], window[:, 1:]


def test_reference_config_is_llama_tiny_with_about_0_9m_parameters() -> None:
    cfg = ModelConfig()
    assert (cfg.family, cfg.num_layers, cfg.width, cfg.context_len, cfg.vocab_size) == (
        "llama",
        4,
        128,
        128,
        256,
    )
    assert cfg == ModelConfig.from_dict(resolve_model({}))
    assert 850_000 <= count_parameters(build_model(cfg, seed=0)) <= 950_000


@pytest.mark.parametrize(
    ("preset", "low", "high"),
    [
        ("llama-20m", 15e6, 25e6),
        ("llama-124m", 110e6, 140e6),
        ("llama-350m", 330e6, 390e6),
        ("llama-1b", 0.9e9, 1.2e9),
    ],
)
def test_presets_have_their_advertised_size(preset: str, low: float, high: float) -> None:
    """Counted on the meta device (nothing allocated), at the vocabulary the preset is meant for."""
    vocab = 8192 if preset == "llama-20m" else 32000
    cfg = ModelConfig.from_dict({"preset": preset, "vocab_size": vocab})
    assert cfg.family == PRESETS[preset]["family"]
    with torch.device("meta"):
        count = count_parameters(CausalLM(cfg))
    assert low <= count <= high, count


def test_preset_fields_are_overridable_and_resolution_is_idempotent() -> None:
    table = resolve_model({"preset": "llama-20m", "family": "qwen2", "num_layers": 2, "dropout": 0})
    assert (table["family"], table["num_layers"], table["width"], table["dropout"]) == ("qwen2", 2, 384, 0.0)
    assert resolve_model(table) == table
    with pytest.raises(ValueError, match="preset"):
        resolve_model({"preset": "llama-7b"})
    with pytest.raises(ValueError, match="family"):
        resolve_model({"family": "mamba"})
    with pytest.raises(ValueError, match="unknown"):
        resolve_model({"n_embd": 3})
    with pytest.raises(ValueError, match="num_kv_heads"):
        resolve_model({"family": "gpt2", "num_kv_heads": 2})


@pytest.mark.parametrize(
    "bad",
    [
        {"width": 130, "num_heads": 4},
        {"num_layers": 0},
        {"vocab_size": 1},
        {"dropout": 1.0},
        {"dropout": -0.1},
        {"context_len": 2.5},
        {"num_kv_heads": 3},
        {"family": "rwkv"},
    ],
)
def test_config_rejects_invalid_values(bad: dict[str, object]) -> None:
    with pytest.raises(ValueError):
        ModelConfig(**bad)  # type: ignore[arg-type]


def test_config_dict_round_trip_and_unknown_keys() -> None:
    cfg = ModelConfig(num_layers=6, width=64, num_heads=2, dropout=0.1)
    data = cfg.to_dict()
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
    assert not torch.equal(a["model.layers.1.mlp.up_proj.weight"], c["model.layers.1.mlp.up_proj.weight"])
    # Distinct tensors of one model are not copies of each other's draws.
    assert not torch.equal(
        a["model.layers.0.self_attn.q_proj.weight"], a["model.layers.1.self_attn.q_proj.weight"]
    )
    assert not torch.equal(a["model.embed_tokens.weight"], a["lm_head.weight"]), "the head is untied"


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


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("num_stages", [2, 3, 4])
def test_stages_partition_the_full_models_names_and_initial_values(num_stages: int, family: str) -> None:
    cfg = FAMILIES[family]
    full = build_model(cfg, seed=3).state_dict()
    stages = [build_stage(cfg, 3, i, num_stages) for i in range(num_stages)]
    seen: set[str] = set()
    for stage in stages:
        own = stage.state_dict()
        assert not seen & set(own), "stages must not share tensors"
        seen |= set(own)
        for name, tensor in own.items():
            assert torch.equal(tensor, full[name]), name
    assert seen == set(full)
    assert embedding_param_names(cfg) <= set(stages[0].state_dict())
    norm = "transformer.ln_f.weight" if family == "gpt2" else "model.norm.weight"
    assert {norm, "lm_head.weight"} <= set(stages[-1].state_dict())


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_names_are_the_transformers_models_own(family: str) -> None:
    """A checkpoint of ours loads into `AutoModelForCausalLM` with no key missing or left over."""
    from transformers import AutoModelForCausalLM

    cfg = FAMILIES[family]
    reference = AutoModelForCausalLM.from_config(hf_config(cfg))
    result = reference.load_state_dict(build_model(cfg, seed=1).state_dict(), strict=True)
    assert not result.missing_keys and not result.unexpected_keys


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


def _reference(cfg: ModelConfig, seed: int) -> torch.nn.Module:
    """The unsplit transformers model holding the same values as build_model(cfg, seed)."""
    from transformers import AutoModelForCausalLM

    reference = AutoModelForCausalLM.from_config(hf_config(cfg))
    reference.load_state_dict(build_model(cfg, seed).state_dict(), strict=True)
    return reference


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("num_stages", [2, 3])
def test_loss_and_gradients_through_the_cut_equal_the_unsplit_transformers_model(
    num_stages: int, family: str
) -> None:
    """Rotary positions, causal masks and position embeddings are right across every cut: the stages give
    the loss transformers computes itself (labels shifted inside) and the same gradient on every tensor."""
    cfg = FAMILIES[family]
    full = _reference(cfg, seed=11)
    stages = [build_stage(cfg, 11, i, num_stages) for i in range(num_stages)]
    window = torch.randint(
        0, cfg.vocab_size, (3, cfg.context_len), generator=torch.Generator().manual_seed(5)
    )
    inputs, targets = window[:, :-1], window[:, 1:]

    full_loss = full(input_ids=window, labels=window).loss
    full_loss.backward()
    pipe_loss = _pipeline_step(stages, inputs, targets)

    torch.testing.assert_close(pipe_loss, full_loss.detach(), rtol=0, atol=1e-5)
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

    partial = {k: v for k, v in trained.state_dict().items() if not k.startswith("model.layers.3.")}
    with pytest.raises(KeyError, match="lacks"):
        load_state_subset(stages[1], partial)
    wrong = build_model(ModelConfig(context_len=16, num_layers=4, width=64, num_heads=4), 0).state_dict()
    with pytest.raises(ValueError, match="shape"):
        load_state_subset(stages[0], wrong)


def test_causal_lm_is_a_single_stage_holding_everything() -> None:
    model = build_model(SMALL, seed=4)
    single = build_stage(SMALL, 4, 0, 1)
    assert isinstance(model, CausalLM)
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


def test_preloading_in_a_thread_while_another_builds_the_model_is_safe() -> None:
    """A fresh interpreter (transformers not yet imported): the node's preload thread and the role building
    its model at once. Without the import lock a stage raised ImportError in an integration run (transformers'
    lazy module is not thread-safe); the race is not reproducible on demand, so this guards the fix only."""
    import subprocess
    import sys

    code = (
        "import threading\n"
        "from node.ml.model import ModelConfig, build_model, preload\n"
        "errors = []\n"
        "def run(fn):\n"
        "    try: fn()\n"
        "    except Exception as e: errors.append(repr(e))\n"
        "cfg = ModelConfig(context_len=8, num_layers=1, width=16, num_heads=2)\n"
        "ts = [threading.Thread(target=run, args=(f,)) for f in (preload, lambda: build_model(cfg, 0))]\n"
        "[t.start() for t in ts]; [t.join() for t in ts]\n"
        "print(errors)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=110, check=True
    )
    assert out.stdout.strip() == "[]", out.stdout + out.stderr
