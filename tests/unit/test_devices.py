"""`--device` (#16 item 3): how it resolves, and that every role that runs a model computes on it while what
leaves the role stays CPU fp32.

There is no GPU here. Real compute runs on the CPU; where a test needs "another device" it uses the meta
device for placement only (no data), or a spy on the two crossing points (`to_device`, `to_wire`) in pure-logic
tests; the CUDA bf16 path is exercised by substituting CPU bf16 autocast for CUDA's (the same dtype rules).
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from functools import partial
from types import SimpleNamespace
from typing import Any

import pytest
import torch

import node.roles.stage as stage_module
from node.config import NodeConfig
from node.context import resolve_device
from node.ml.device import autocast
from node.roles.stage import StageConfig, StageCore, build_core
from node.roles.syncer import build_probe, model_skeleton, skeleton_loss
from protocol.errors import ConfigError
from protocol.manifest import InnerOptimizerSpec, RunManifest, WireSpec
from protocol.pipeline import TensorPolicyError

pytestmark = pytest.mark.timeout(60)

MODEL = {"vocab_size": 256, "context_len": 16, "num_layers": 2, "width": 32, "num_heads": 2}
RUN_ID = "0" * 40


def run(batch_size: int = 2) -> RunManifest:
    return RunManifest(
        model=MODEL,
        num_stages=2,
        inner=InnerOptimizerSpec(lr=1e-2, batch_size=batch_size, weight_decay=0.01),
        wire=WireSpec(max_batch=4),
    )


@pytest.fixture(autouse=True)
def one_torch_thread() -> Iterator[None]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def tokens(seed: int) -> torch.Tensor:
    return torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(seed))


# ------------------------------------------------------------------------------------------ resolve_device


def machine(monkeypatch: pytest.MonkeyPatch, *, cuda: int = 0, mps: bool = False) -> None:
    """Pretend this process sees `cuda` CUDA devices and (or not) MPS."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: cuda)
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: mps)


@pytest.mark.parametrize(
    ("cuda", "mps", "expected"),
    [(1, True, "cuda"), (2, False, "cuda"), (0, True, "mps"), (0, False, "cpu")],
)
def test_auto_picks_cuda_then_mps_then_cpu(
    monkeypatch: pytest.MonkeyPatch, cuda: int, mps: bool, expected: str
) -> None:
    machine(monkeypatch, cuda=cuda, mps=mps)
    assert resolve_device("auto") == expected


@pytest.mark.parametrize(
    ("requested", "cuda", "mps", "message"),
    [
        ("cuda", 0, True, "no CUDA device is visible"),
        ("cuda:0", 0, False, "no CUDA device is visible"),
        ("cuda:1", 1, False, "sees 1 CUDA device"),
        ("mps", 2, False, "MPS is not available"),
    ],
)
def test_an_explicit_device_this_process_lacks_is_a_config_error(
    monkeypatch: pytest.MonkeyPatch, requested: str, cuda: int, mps: bool, message: str
) -> None:
    machine(monkeypatch, cuda=cuda, mps=mps)
    with pytest.raises(ConfigError, match=message):
        resolve_device(requested)


@pytest.mark.parametrize(
    ("requested", "cuda", "mps"),
    [("cpu", 0, False), ("cpu", 2, True), ("cuda:1", 2, False), ("mps", 0, True)],
)
def test_an_explicit_device_that_is_there_is_kept(
    monkeypatch: pytest.MonkeyPatch, requested: str, cuda: int, mps: bool
) -> None:
    machine(monkeypatch, cuda=cuda, mps=mps)
    assert resolve_device(requested) == requested


def test_the_config_accepts_every_device_kind_and_nothing_else(tmp_path: Any) -> None:
    for device in ("auto", "cpu", "cuda", "cuda:3", "mps"):
        assert NodeConfig(join=("x",), state_dir=tmp_path, device=device).device == device
    for device in ("tpu", "cuda:", "cuda:x", "MPS", "mps:0", ""):
        with pytest.raises(ValueError, match="device must be"):
            NodeConfig(join=("x",), state_dir=tmp_path, device=device)


def test_autocast_is_bf16_on_cuda_only() -> None:
    for device in ("cpu", "mps", torch.device("cpu")):
        assert isinstance(autocast(device), contextlib.nullcontext)
    for device in ("cuda", "cuda:1"):
        with warnings.catch_warnings():  # torch warns when CUDA is missing (here): the object is what counts
            warnings.simplefilter("ignore")
            cast = autocast(device)  # not entered
        assert isinstance(cast, torch.autocast) and cast.fast_dtype == torch.bfloat16


# ------------------------------------------------------------------------------------------ the stage role


def test_a_stage_core_puts_its_module_and_optimizer_on_its_device() -> None:
    core = build_core(run(), RUN_ID, 0, StageConfig(), device="meta")  # placement only: meta holds no data
    assert core.device == torch.device("meta")
    assert {p.device.type for p in core.module.parameters()} == {"meta"}
    assert {b.device.type for b in core.module.buffers()} <= {"meta"}
    assert all(p.dtype == torch.float32 for p in core.params.values())  # fp32 master weights
    optimized = [p for group in core.optimizer.param_groups for p in group["params"]]
    assert {id(p) for p in optimized} == {id(p) for p in core.params.values()}  # the moved ones, not copies


class Crossings:
    """Spies on the stage's two crossing points: what was moved to the device, what was handed back."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.moved: list[tuple[torch.device, tuple[int, ...]]] = []
        self.returned: list[torch.Tensor] = []
        real_to_device, real_to_wire = stage_module.to_device, stage_module.to_wire
        monkeypatch.setattr(stage_module, "to_device", partial(self._to_device, real_to_device))
        monkeypatch.setattr(stage_module, "to_wire", partial(self._to_wire, real_to_wire))

    def _to_device(self, real: Any, tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
        self.moved.append((device, tuple(tensor.shape)))
        return real(tensor, device)  # type: ignore[no-any-return]

    def _to_wire(self, real: Any, tensor: torch.Tensor) -> torch.Tensor:
        out = real(tensor)
        self.returned.append(out)
        return out  # type: ignore[no-any-return]

    def answered(self, tensor: torch.Tensor) -> bool:
        return any(tensor is out for out in self.returned) and tensor.device.type == "cpu"


def test_every_stage_entry_moves_its_inputs_to_the_device_and_answers_through_the_wire_crossing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    spy = Crossings(monkeypatch)
    first, last = (build_core(run(batch_size=4), RUN_ID, s, StageConfig()) for s in (0, 1))
    x, targets = tokens(0), tokens(1)
    act = first.forward("v", 1, x)
    assert spy.answered(act) and (first.device, (2, 16)) in spy.moved
    assert spy.answered(first.forward_eval(x))
    loss, grad = last.forward_loss("v", 1, act, targets)
    assert grad is not None and spy.answered(grad) and (last.device, (2, 16, 32)) in spy.moved
    assert spy.answered(last.forward_eval(act, targets))
    assert spy.answered(last.input_gradient(act, None, targets))
    spy.moved.clear()
    assert first.backward("v", 1, grad) is None  # stage 0: no input gradient
    assert spy.moved == [(first.device, (2, 16, 32))]  # the incoming gradient, moved before its use
    assert first.backward("v", 1, grad) is None  # answered from the ledger: nothing moved again
    assert len(spy.moved) == 1 and last.forward_loss("v", 1, act, targets)[1] is grad  # cached: the wire's


def test_a_stage_core_on_the_cpu_answers_cpu_fp32_and_refuses_a_non_fp32_gradient_before_any_move() -> None:
    first, last = (build_core(run(), RUN_ID, s, StageConfig(), device="cpu") for s in (0, 1))
    act = first.forward("v", 1, tokens(0))
    loss, grad = last.forward_loss("v", 1, act, tokens(1))
    assert (act.device.type, act.dtype) == ("cpu", torch.float32)
    assert grad is not None and (grad.device.type, grad.dtype) == ("cpu", torch.float32)
    assert loss == loss and not grad.requires_grad and not act.requires_grad
    with pytest.raises(TensorPolicyError, match="does not match"):
        first.backward("v", 1, grad.to(torch.bfloat16))  # the wire's dtype rule holds whatever the device


def bf16_like_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    """The CUDA path without CUDA: the same bf16 autocast, on the CPU."""
    monkeypatch.setattr(stage_module, "autocast", lambda _device: torch.autocast("cpu", dtype=torch.bfloat16))


def test_the_bf16_path_keeps_fp32_master_weights_optimizer_state_and_wire_tensors(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    fp32_act = build_core(run(), RUN_ID, 0, StageConfig()).forward("v", 1, tokens(0))
    bf16_like_cuda(monkeypatch)
    first, last = (build_core(run(), RUN_ID, s, StageConfig()) for s in (0, 1))
    before = {n: p.detach().clone() for n, p in first.params.items()}
    act = first.forward("v", 1, tokens(0))
    assert act.dtype == torch.float32  # computed in bf16, cast in the graph: the backward takes fp32
    assert not torch.equal(act, fp32_act)  # autocast did run in bf16 ...
    assert torch.linalg.vector_norm(act - fp32_act) < 0.05 * torch.linalg.vector_norm(fp32_act)  # ... close
    loss, grad = last.forward_loss("v", 1, act, tokens(1))
    assert grad is not None and grad.dtype == torch.float32 and loss == loss
    assert first.backward("v", 1, grad) is None
    assert first.inner_step == 1 and last.inner_step == 1  # batch_size 2 = one microbatch: both stepped
    for core in (first, last):
        assert all(p.dtype == torch.float32 for p in core.params.values())
        states = [s for state in core.optimizer.state.values() for s in state.values() if s.dim() > 0]
        assert states and all(s.dtype == torch.float32 for s in states)
    assert any(not torch.equal(before[n], p) for n, p in first.params.items())  # the step moved them
    recomputed = last.input_gradient(act, None, tokens(1))  # a spot check's recompute: wire tensor too
    assert (recomputed.device.type, recomputed.dtype) == ("cpu", torch.float32)


def test_the_stage_role_builds_its_cores_on_the_node_device(monkeypatch: pytest.MonkeyPatch) -> None:
    built: list[str] = []

    class Built(Exception):
        pass

    def spy(*_args: object, device: str, **_kwargs: object) -> StageCore:
        built.append(device)
        raise Built

    monkeypatch.setattr(stage_module, "build_core", spy)
    manifest = run()
    ctx = SimpleNamespace(
        stage=0, config=SimpleNamespace(), manifest=manifest, run_id=RUN_ID, device="cuda:1"
    )
    with pytest.raises(Built):
        stage_module.StageRole(ctx)  # type: ignore[arg-type]
    assert built == ["cuda:1"]


# ------------------------------------------------------------------------------------------ the syncer


def test_the_skeleton_keeps_its_buffers_on_the_device_and_its_parameters_nowhere() -> None:
    from node.ml.model import ModelConfig

    skeleton = model_skeleton(ModelConfig.from_dict(MODEL), "meta")  # stand-in for an accelerator
    buffers = list(skeleton.buffers())
    assert buffers and {b.device.type for b in buffers} == {"meta"}  # the rotary tables, moved
    assert {p.device.type for p in skeleton.parameters()} == {"meta"}  # no memory: they come in per call


def test_skeleton_loss_computes_on_the_device_from_the_cpu_master_copy(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from node.ml.model import ModelConfig, build_model

    cfg = ModelConfig.from_dict(MODEL)
    master = {n: p.detach() for n, p in build_model(cfg, seed=0).named_parameters()}
    seen: list[set[str]] = []

    def spy(_model: Any, tensors: dict[str, torch.Tensor], args: tuple[torch.Tensor, ...]) -> torch.Tensor:
        seen.append({t.device.type for t in [*tensors.values(), *args]})
        return torch.tensor(1.5)

    monkeypatch.setattr(torch.func, "functional_call", spy)
    batches = [(tokens(2), tokens(3))]
    assert skeleton_loss(model_skeleton(cfg, "meta"), master, batches, device="meta") == 1.5
    assert seen == [{"meta"}]  # every parameter and both inputs on the device
    assert {t.device.type for t in master.values()} == {"cpu"}  # the master copy did not move


def test_the_probe_is_built_on_the_node_device() -> None:
    from node.diloco.screening import ScreeningConfig

    stream = SimpleNamespace(
        check_fits=lambda _len: None,
        num_starts=lambda _len: 100,
        windows=lambda row, length: (torch.zeros(len(row), length), torch.zeros(len(row), length)),
    )
    ctx = SimpleNamespace(manifest=run(), device="meta", config=SimpleNamespace(data=None))
    probe = build_probe(ctx, ScreeningConfig(), held=stream)  # type: ignore[arg-type]
    assert probe.loss.keywords["device"] == "meta"  # type: ignore[attr-defined]
    skeleton = probe.loss.args[0]  # type: ignore[attr-defined]
    assert {b.device.type for b in skeleton.buffers()} == {"meta"}


@pytest.mark.parametrize(("setting", "expected"), [(0, None), (8, 8), (10_000, None)])
def test_the_probe_scores_sequences_of_at_most_loss_sequence_tokens(
    setting: int, expected: int | None
) -> None:
    """A score compares the loss before and after on the same windows: it needs no full context, and at a real
    model's 2,048 a pass costs minutes and a fifth of a GiB. None: the model's context (0, or a setting above it)."""
    from node.diloco.screening import ScreeningConfig
    from node.ml.model import ModelConfig

    cfg = ModelConfig.from_dict(MODEL)
    asked: list[int] = []

    def windows(row: torch.Tensor, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        asked.append(length)
        return torch.zeros(len(row), length), torch.zeros(len(row), length)

    stream = SimpleNamespace(check_fits=asked.append, num_starts=lambda _len: 100, windows=windows)
    ctx = SimpleNamespace(manifest=run(), device="meta", config=SimpleNamespace(data=None))
    probe = build_probe(ctx, ScreeningConfig(loss_sequence_tokens=setting), held=stream)  # type: ignore[arg-type]
    want = cfg.context_len if expected is None else expected
    assert set(asked) == {want}
    assert {tuple(inputs.shape) for inputs, _ in probe.loss.keywords["batches"]} == {(8, want)}  # type: ignore[attr-defined]


def test_a_negative_loss_sequence_length_is_refused() -> None:
    from node.diloco.screening import ScreeningConfig

    with pytest.raises(ValueError, match="loss_sequence_tokens"):
        ScreeningConfig(loss_sequence_tokens=-1)
