"""The causal LM every role trains (transformers Llama, GPT-2 or Qwen2), and how it is cut into stages.

The decoder layers, embeddings, norms and rotary tables are `transformers`' own modules, built from a
config (never downloaded); only the glue that runs them is ours, because a pipeline stage holds a
contiguous span of layers: stage 0 also holds the embeddings, the last stage the final norm, the LM head
and the loss. Every stage computes its own position ids (0..T-1), rotary cos/sin and causal mask from the
activations' shape, exactly as the unsplit transformers model does, so the cut changes nothing
(tests/unit/test_model.py compares loss and gradients against `AutoModelForCausalLM`).

Parameter names are the transformers model's own (``model.layers.3.self_attn.q_proj.weight``,
``transformer.h.0.attn.c_attn.weight``, ``lm_head.weight``), so a stage's state dict is a slice of the
full model's and a checkpoint loads with `from_pretrained` as it is (`node.ml.export`). Initial values are
drawn per tensor from (seed, name), so the union of all stages built from one seed *is* the full model
built from that seed: the DiLoCo syncer can treat stage fragments and learner fragments alike.

Tied embeddings are untied (`tie_word_embeddings=False` for every family, GPT-2 included): the embedding
lives on stage 0 and the head on the last stage, and keeping one tensor in sync across two peers would
need a gradient exchange every step. The LM head is a separate tensor, initialised like the embedding.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import math
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import asdict, dataclass, fields
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from protocol.model_spec import check_model, default_mlp_width, resolve_model

logger = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True, slots=True)
class ModelConfig:
    """Shape of the model; the run manifest carries it as a plain dict (protocol.model_spec resolves it)."""

    family: str = "llama"  # llama | gpt2 | qwen2
    preset: str = "llama-tiny"  # the preset the fields were resolved from (informational once resolved)
    vocab_size: int = 256  # tokens; 256 = raw bytes
    context_len: int = 128  # tokens per sequence (max_position_embeddings)
    num_layers: int = 4  # decoder layers
    width: int = 128  # residual stream width (hidden_size)
    num_heads: int = 4  # attention heads; width must divide evenly
    num_kv_heads: int = 0  # key/value heads (grouped-query attention); 0 = num_heads
    mlp_width: int = 0  # MLP hidden units (intermediate_size); 0 = the family's default for the width
    rope_theta: float = 10000.0  # rotary base (llama, qwen2)
    norm_eps: float = 1e-5  # RMSNorm / LayerNorm epsilon
    dropout: float = 0.0  # probability: attention, residual and embedding dropout
    init_std: float = 0.02  # normal init of every matrix (GPT-2's residual projections scaled by depth)

    def __post_init__(self) -> None:
        if self.num_kv_heads == 0:
            object.__setattr__(self, "num_kv_heads", self.num_heads)
        if self.mlp_width == 0 and isinstance(self.width, int):
            object.__setattr__(self, "mlp_width", default_mlp_width(self.family, self.width))
        for name in ("rope_theta", "norm_eps", "dropout", "init_std"):
            value = getattr(self, name)
            if isinstance(value, int) and not isinstance(value, bool):
                object.__setattr__(self, name, float(value))
        check_model(asdict(self))

    @property
    def head_dim(self) -> int:
        return self.width // self.num_heads

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ModelConfig:
        """From a manifest's model table (a preset plus overrides, or an already resolved table)."""
        known = {f.name for f in fields(cls)}
        unknown = set(data) - known
        if unknown:
            raise ValueError(f"unknown ModelConfig keys: {sorted(unknown)}")
        return cls(**resolve_model(data))


_IMPORT_LOCK = threading.Lock()
_HF: dict[str, Any] = {}


def _hf() -> dict[str, Any]:
    """The transformers classes we use, imported once under a lock: transformers' lazy top-level module is
    not safe to import from two threads at once (a node preloads it in a thread, `preload`)."""
    with _IMPORT_LOCK:
        if not _HF:
            from transformers import GPT2Config, LlamaConfig, Qwen2Config
            from transformers.masking_utils import create_causal_mask
            from transformers.models.gpt2.modeling_gpt2 import GPT2Block
            from transformers.models.llama.modeling_llama import (
                LlamaDecoderLayer,
                LlamaRMSNorm,
                LlamaRotaryEmbedding,
            )
            from transformers.models.qwen2.modeling_qwen2 import (
                Qwen2DecoderLayer,
                Qwen2RMSNorm,
                Qwen2RotaryEmbedding,
            )

            _HF.update(
                {
                    "config": {"gpt2": GPT2Config, "llama": LlamaConfig, "qwen2": Qwen2Config},
                    "layer": {"gpt2": GPT2Block, "llama": LlamaDecoderLayer, "qwen2": Qwen2DecoderLayer},
                    "rotary": {"llama": LlamaRotaryEmbedding, "qwen2": Qwen2RotaryEmbedding},
                    "norm": {"llama": LlamaRMSNorm, "qwen2": Qwen2RMSNorm},
                    "create_causal_mask": create_causal_mask,
                }
            )
        return _HF


def hf_config(cfg: ModelConfig) -> Any:
    """The transformers config for `cfg` (sdpa attention, untied head, no special token ids)."""
    config_class = _hf()["config"][cfg.family]
    common: dict[str, Any] = {
        "vocab_size": cfg.vocab_size,
        "tie_word_embeddings": False,
        "attn_implementation": "sdpa",
        "bos_token_id": None,
        "eos_token_id": None,
        "pad_token_id": None,
    }
    if cfg.family == "gpt2":
        return config_class(
            n_positions=cfg.context_len,
            n_embd=cfg.width,
            n_layer=cfg.num_layers,
            n_head=cfg.num_heads,
            n_inner=cfg.mlp_width,
            resid_pdrop=cfg.dropout,
            embd_pdrop=cfg.dropout,
            attn_pdrop=cfg.dropout,
            layer_norm_epsilon=cfg.norm_eps,
            initializer_range=cfg.init_std,
            **common,
        )
    return config_class(
        hidden_size=cfg.width,
        intermediate_size=cfg.mlp_width,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads,
        max_position_embeddings=cfg.context_len,
        rms_norm_eps=cfg.norm_eps,
        rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_theta},
        attention_dropout=cfg.dropout,
        initializer_range=cfg.init_std,
        use_cache=False,
        **common,
    )


def preload() -> None:
    """Import the transformers modules every family needs (~2.5 s of CPU): a node calls this in a thread
    while it joins the DHT, so building its model later does not add the import to its start-up."""
    _hf()


def _layer_class(family: str) -> Callable[..., nn.Module]:
    layer: Callable[..., nn.Module] = _hf()["layer"][family]
    return layer


def _rotary(family: str, config: Any) -> nn.Module:
    rotary: nn.Module = _hf()["rotary"][family](config)
    return rotary


def _final_norm(cfg: ModelConfig) -> nn.Module:
    if cfg.family == "gpt2":
        return nn.LayerNorm(cfg.width, eps=cfg.norm_eps)
    norm: nn.Module = _hf()["norm"][cfg.family](cfg.width, eps=cfg.norm_eps)
    return norm


class _LayerSpan(nn.Module):
    """Layers [start, stop) plus, at the ends, the embeddings or the head; named as in transformers.

    Llama/Qwen2: ``model.embed_tokens``, ``model.layers.{i}``, ``model.norm``, ``lm_head``.
    GPT-2: ``transformer.wte``, ``transformer.wpe``, ``transformer.h.{i}``, ``transformer.ln_f``, ``lm_head``.
    """

    def __init__(self, cfg: ModelConfig, span: tuple[int, int], *, is_first: bool, is_last: bool) -> None:
        super().__init__()
        start, stop = span
        _check_span(cfg, span, is_first=is_first, is_last=is_last)
        self.cfg = cfg
        self.span = (start, stop)
        self.is_first = is_first
        self.is_last = is_last
        self.hf_config = hf_config(cfg)
        layer_class = _layer_class(cfg.family)
        # String keys keep the full model's layer indices in parameter names.
        layers = nn.ModuleDict({str(i): layer_class(self.hf_config, layer_idx=i) for i in range(start, stop)})
        body = nn.Module()
        self._body_name = "transformer" if cfg.family == "gpt2" else "model"
        self.add_module(self._body_name, body)
        if cfg.family == "gpt2":
            if is_first:
                body.wte = nn.Embedding(cfg.vocab_size, cfg.width)
                body.wpe = nn.Embedding(cfg.context_len, cfg.width)
                body.drop = nn.Dropout(cfg.dropout)
            body.h = layers
            if is_last:
                body.ln_f = _final_norm(cfg)
        else:
            if is_first:
                body.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.width)
            body.layers = layers
            body.rotary_emb = _rotary(cfg.family, self.hf_config)
            if is_last:
                body.norm = _final_norm(cfg)
        if is_last:
            self.lm_head = nn.Linear(cfg.width, cfg.vocab_size, bias=False)

    @property
    def body(self) -> nn.Module:
        module: nn.Module = getattr(self, self._body_name)
        return module

    @property
    def _layers(self) -> nn.ModuleDict:
        layers = self.body.h if self.cfg.family == "gpt2" else self.body.layers
        assert isinstance(layers, nn.ModuleDict)
        return layers

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        if tokens.dim() != 2:
            raise ValueError(f"tokens must be [batch, seq], got shape {tuple(tokens.shape)}")
        seq = tokens.shape[1]
        if seq > self.cfg.context_len:
            raise ValueError(f"sequence length {seq} exceeds context_len {self.cfg.context_len}")
        body = self.body
        if self.cfg.family == "gpt2":
            positions = torch.arange(seq, device=tokens.device)
            return body.drop(body.wte(tokens) + body.wpe(positions))  # type: ignore[operator]
        return body.embed_tokens(tokens)  # type: ignore[operator]

    def run_layers(self, h: torch.Tensor) -> torch.Tensor:
        """The span's layers, with the position ids, rotary tables and causal mask the unsplit model uses."""
        create_causal_mask = _hf()["create_causal_mask"]
        position_ids = torch.arange(h.shape[1], device=h.device).unsqueeze(0)
        mask = create_causal_mask(
            config=self.hf_config,
            inputs_embeds=h,
            attention_mask=None,
            past_key_values=None,
            position_ids=position_ids,
        )
        if self.cfg.family == "gpt2":
            for layer in self._layers.values():
                h = _tensor(layer(h, None, mask, position_ids=position_ids))
            return h
        rotary = self.body.rotary_emb(h, position_ids=position_ids)  # type: ignore[operator]
        for layer in self._layers.values():
            h = _tensor(layer(h, attention_mask=mask, position_ids=position_ids, position_embeddings=rotary))
        return h

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        norm = self.body.ln_f if self.cfg.family == "gpt2" else self.body.norm
        return self.lm_head(norm(h))  # type: ignore[operator]

    def reset_buffers(self) -> None:
        """Recompute the rotary tables (non-persistent buffers: not in any state dict, garbage after to_empty)."""
        if self.cfg.family != "gpt2":
            self.body.rotary_emb = _rotary(self.cfg.family, self.hf_config)


def _check_span(cfg: ModelConfig, span: tuple[int, int], *, is_first: bool, is_last: bool) -> None:
    start, stop = span
    if not 0 <= start <= stop <= cfg.num_layers:
        raise ValueError(f"span {span} is not within 0..{cfg.num_layers}")
    if start == stop:
        raise ValueError(f"a stage needs at least one layer, got span {span}")
    if is_first and start != 0:
        raise ValueError(f"the first stage must start at layer 0, got span {span}")
    if is_last and stop != cfg.num_layers:
        raise ValueError(f"the last stage must end at layer {cfg.num_layers}, got span {span}")


def _tensor(out: Any) -> torch.Tensor:
    """A decoder layer's hidden states (some transformers layers return a tuple)."""
    return out[0] if isinstance(out, tuple) else out


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy in nats per token (per byte for the byte vocabulary)."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))


# What an evaluation pass (`loss_pass_shape`) may hold in its largest activations. A llama-1b row at full context is
# 0.25 GiB of float32 logits (32k vocabulary x 2,048 positions), cross-entropy's log-softmax as much again and the
# MLP's [2,048 x 5,632] tensors 0.13 GiB: the syncer's 8-row held-out batches were 4 GiB beyond its model (issue 17's
# budget: the model + 2 fragments). 8 MiB gives the chunk of the llama-1b probe-on run that met that goal (32
# positions of a 32k head; docs/scale.md); the price is speed (smaller matmuls, a streamed head read once per chunk)
LOSS_PASS_BYTES = 8 << 20
# a row's [seq, width] tensors alive at once in a layer: residual, norm, q, k, v, attention out
_ROW_LIVE = 6
# float32 values alive per position, in units of max(mlp_width, vocab / 2): an MLP's gate, up, activation and
# product, or the logits and their log-softmax
_POSITION_LIVE = 4


@dataclass(frozen=True, slots=True)
class PassShape:
    """How a no-grad loss over [rows, seq] tokens is cut: `rows` sequences per forward pass, the position-wise
    parts (each layer's MLP, the logits) run `positions` positions at a time (`seq` or more: whole)."""

    rows: int
    positions: int


def loss_pass_shape(cfg: ModelConfig, rows: int, seq: int, budget_bytes: int = LOSS_PASS_BYTES) -> PassShape:
    """The largest cut (at least one row and one position) whose activations stay near `budget_bytes`: the rows fit
    a layer's [seq, width] tensors, then the positions the MLP's and the logits'. A small model: one pass, whole."""
    per_row = seq * cfg.width * 4 * _ROW_LIVE
    rows_per_pass = max(1, min(rows, budget_bytes // max(1, per_row)))
    per_position = rows_per_pass * max(cfg.mlp_width, cfg.vocab_size // 2) * 4 * _POSITION_LIVE
    return PassShape(rows_per_pass, max(1, min(seq, budget_bytes // max(1, per_position))))


@contextlib.contextmanager
def mlp_by_positions(layers: Iterable[nn.Module], positions: int) -> Iterator[None]:
    """Every layer's MLP run `positions` positions at a time while inside: it is position-wise, so the values are
    the same, and its [rows, seq, mlp_width] temporaries are built a slice at a time (no-grad evaluation)."""
    patched: list[Any] = []
    for layer in layers:
        mlp: Any = layer.mlp
        whole = mlp.forward

        def forward(x: torch.Tensor, *args: Any, _whole: Any = whole, **kwargs: Any) -> torch.Tensor:
            if x.shape[1] <= positions:
                return _whole(x, *args, **kwargs)
            parts = [
                _whole(x[:, s : s + positions], *args, **kwargs) for s in range(0, x.shape[1], positions)
            ]
            return torch.cat(parts, dim=1)

        mlp.forward = forward
        patched.append(mlp)
    try:
        yield
    finally:
        for mlp in patched:
            del mlp.forward  # the class's forward again


def chunked_lm_loss(
    logits_of: Callable[[torch.Tensor], torch.Tensor], h: torch.Tensor, targets: torch.Tensor, positions: int
) -> torch.Tensor:
    """`lm_loss` of `logits_of(h)`, the logits built for `positions` positions at a time (no-grad evaluation)."""
    total = torch.zeros((), dtype=torch.float32, device=h.device)
    for start in range(0, h.shape[1], positions):
        logits = logits_of(h[:, start : start + positions])
        part = targets[:, start : start + positions].reshape(-1)
        total += F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), part, reduction="sum")
    return total / targets.numel()


class CausalLM(_LayerSpan):
    """The whole model: what learners hold."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__(cfg, (0, cfg.num_layers), is_first=True, is_last=True)

    def forward(
        self, tokens: torch.Tensor, targets: torch.Tensor | None = None, *, loss_positions: int = 0
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """int64 tokens [B, T] -> logits [B, T, vocab], or (logits, loss) when targets [B, T] are given; with
        targets and `loss_positions` > 0, the loss alone, the MLPs and logits run that many positions at a time."""
        if targets is not None and loss_positions > 0:
            with mlp_by_positions(self._layers.values(), loss_positions):
                h = self.run_layers(self.embed(tokens))
            return chunked_lm_loss(self.logits, h, targets, loss_positions)
        logits = self.logits(self.run_layers(self.embed(tokens)))
        if targets is None:
            return logits
        return logits, lm_loss(logits, targets)


class StageModule(_LayerSpan):
    """One pipeline stage: a contiguous span of layers, with the embeddings on the first, the head on the last.

    forward by position in the pipeline:
      first:  int64 tokens [B, T] -> activations [B, T, width]
      middle: activations -> activations
      last:   activations (+ targets [B, T]) -> scalar loss (logits when targets is None)
    A single stage that is both first and last behaves like the first feeding the last.
    """

    def forward(self, x: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        h = self._through_layers(x)
        if not self.is_last:
            return h
        logits = self.logits(h)
        return logits if targets is None else lm_loss(logits, targets)

    def forward_with_logits(
        self, x: torch.Tensor, targets: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Last stage only: (logits, loss), for callers that also want predictions."""
        if not self.is_last:
            raise ValueError("forward_with_logits is only defined on the last stage")
        logits = self.logits(self._through_layers(x))
        return logits, lm_loss(logits, targets)

    def _through_layers(self, x: torch.Tensor) -> torch.Tensor:
        return self.run_layers(self.embed(x) if self.is_first else x)


def stage_spans(num_layers: int, num_stages: int) -> list[tuple[int, int]]:
    """Cut num_layers layers into num_stages contiguous, non-empty spans whose sizes differ by at most one.

    Extra layers go to middle stages first, then the first stage, then the last: the end stages also
    carry the embedding lookup and the head plus loss.
    """
    if num_stages < 1:
        raise ValueError(f"num_stages must be >= 1, got {num_stages}")
    if num_layers < num_stages:
        raise ValueError(f"cannot cut {num_layers} layers into {num_stages} non-empty stages")
    base, extra = divmod(num_layers, num_stages)
    sizes = [base] * num_stages
    order = list(range(1, num_stages - 1)) + [0] + ([num_stages - 1] if num_stages > 1 else [])
    for index in order[:extra]:
        sizes[index] += 1
    spans: list[tuple[int, int]] = []
    start = 0
    for size in sizes:
        spans.append((start, start + size))
        start += size
    return spans


def embedding_param_names(cfg: ModelConfig) -> set[str]:
    """The token (and GPT-2's position) embedding tensors: the DiLoCo merge averages these instead of RDA."""
    if cfg.family == "gpt2":
        return {"transformer.wte.weight", "transformer.wpe.weight"}
    return {"model.embed_tokens.weight"}


def _tensor_seed(seed: int, name: str) -> int:
    digest = hashlib.sha256(f"hivenode-init/{seed}/{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


def _init_std(name: str, cfg: ModelConfig) -> float:
    # GPT-2 scales its residual output projections by depth so the residual stream does not grow.
    if cfg.family == "gpt2" and name.endswith("c_proj.weight"):
        return cfg.init_std / math.sqrt(2 * cfg.num_layers)
    return cfg.init_std


@torch.no_grad()
def init_parameters(module: _LayerSpan, seed: int) -> None:
    """Deterministic init: each matrix drawn from its own generator keyed by (seed, parameter name); norm
    gains 1, biases 0. Keying by name (not by draw order) is what makes a stage's values equal the full
    model's."""
    for name, param in module.named_parameters():
        if param.dim() >= 2 and not (param.dtype == torch.float32 and param.is_contiguous()):
            values = torch.empty(param.shape, dtype=torch.float32)
            _fill_initial(name, values, module.cfg, seed)
            param.copy_(values)
        else:
            # drawn in place, the same values: a float32 draw copied over was the largest tensor once more at
            # every build (a llama-1b embedding: 0.25 GiB of a syncer's start, issue 17)
            _fill_initial(name, param, module.cfg, seed)


@torch.no_grad()
def _fill_initial(name: str, out: torch.Tensor, cfg: ModelConfig, seed: int) -> None:
    """`init_parameters`' rule for one tensor, written into `out`."""
    if out.dim() >= 2:
        generator = torch.Generator(device="cpu").manual_seed(_tensor_seed(seed, name))
        out.normal_(0.0, _init_std(name, cfg), generator=generator)
    elif name.endswith(".bias"):
        out.zero_()
    elif name.endswith(".weight"):
        out.fill_(1.0)
    else:
        raise AssertionError(f"no init rule for {name}")


class SeedParameters(Mapping[str, torch.Tensor]):
    """The seed model's parameters by name (those of `build_model(cfg, seed)`, from the same per-name generators),
    each drawn when read and none held: a syncer that keeps its parameters on disk writes them a tensor at a time
    (`[syncer] params_on_disk`) instead of building the whole model first (issue 17)."""

    def __init__(self, cfg: ModelConfig, seed: int) -> None:
        with torch.device("meta"):
            skeleton = CausalLM(cfg)
        self.cfg, self.seed = cfg, seed
        self.shapes = {name: tuple(p.shape) for name, p in skeleton.named_parameters()}

    def shape_of(self, name: str) -> tuple[int, ...]:
        return self.shapes[name]

    def __getitem__(self, name: str) -> torch.Tensor:
        out = torch.empty(self.shapes[name], dtype=torch.float32)
        _fill_initial(name, out, self.cfg, self.seed)
        return out

    def __contains__(self, name: object) -> bool:
        return name in self.shapes

    def __iter__(self) -> Iterator[str]:
        return iter(self.shapes)

    def __len__(self) -> int:
        return len(self.shapes)


def _materialize(module: _LayerSpan, seed: int) -> None:
    module.to_empty(device="cpu")
    module.reset_buffers()
    init_parameters(module, seed)


def build_model(cfg: ModelConfig, seed: int) -> CausalLM:
    # Built on the meta device: torch's default init would draw from (and advance) the global RNG.
    with torch.device("meta"):
        model = CausalLM(cfg)
    _materialize(model, seed)
    return model


def build_stage(cfg: ModelConfig, seed: int, stage_index: int, num_stages: int) -> StageModule:
    spans = stage_spans(cfg.num_layers, num_stages)
    if not 0 <= stage_index < num_stages:
        raise ValueError(f"stage_index {stage_index} out of range for {num_stages} stages")
    with torch.device("meta"):
        stage = StageModule(
            cfg, spans[stage_index], is_first=stage_index == 0, is_last=stage_index == num_stages - 1
        )
    _materialize(stage, seed)
    return stage


def stage_state_subset(module: nn.Module, state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The entries of a full-model (or any superset) state dict that `module` holds, by its own names."""
    own = module.state_dict()
    missing = sorted(set(own) - set(state))
    if missing:
        raise KeyError(f"state dict lacks {len(missing)} tensors this module holds, e.g. {missing[:3]}")
    for name, tensor in own.items():
        if tuple(state[name].shape) != tuple(tensor.shape):
            raise ValueError(f"{name}: shape {tuple(state[name].shape)} != expected {tuple(tensor.shape)}")
    return {name: state[name] for name in own}


def load_state_subset(module: nn.Module, state: Mapping[str, torch.Tensor]) -> None:
    """Copy into `module` the tensors it holds from a full-model (or superset) state dict."""
    module.load_state_dict(stage_state_subset(module, state), strict=True)


def count_parameters(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())
