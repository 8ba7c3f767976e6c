"""The byte-level GPT every role trains, and how it is cut into pipeline stages.

A small decoder-only transformer (pre-LayerNorm, causal SDPA attention, GELU MLP, learned positions,
untied head). A pipeline stage holds a contiguous span of blocks; stage 0 also holds the embeddings and
the last stage the final LayerNorm and head. Parameter names are the same in a stage and in the full
model, and initial values are drawn per tensor from (seed, name), so the union of all stages built from
one seed *is* the full model built from that seed: the DiLoCo syncer can treat stage fragments and
learner fragments alike.
"""

from __future__ import annotations

import hashlib
import logging
import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

logger = logging.getLogger(__name__)

TOKEN_EMBEDDING = "tok_emb.weight"
POSITION_EMBEDDING = "pos_emb.weight"


@dataclass(frozen=True, kw_only=True, slots=True)
class ModelConfig:
    """Shape of the model; the run manifest carries it as a plain dict."""

    vocab_size: int = 256  # tokens; 256 = raw bytes
    context_len: int = 128  # tokens per sequence (position embedding rows)
    num_layers: int = 4  # transformer blocks
    width: int = 128  # residual stream width (d_model)
    num_heads: int = 4  # attention heads; width must divide evenly
    mlp_ratio: int = 4  # MLP hidden width = mlp_ratio * width
    dropout: float = 0.0  # probability, attention and residual dropout

    def __post_init__(self) -> None:
        for name in ("vocab_size", "context_len", "num_layers", "width", "num_heads", "mlp_ratio"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"ModelConfig.{name} must be a positive int, got {value!r}")
        if self.vocab_size < 2:
            raise ValueError(f"ModelConfig.vocab_size must be at least 2, got {self.vocab_size}")
        if self.width % self.num_heads != 0:
            raise ValueError(
                f"ModelConfig.width ({self.width}) must be divisible by num_heads ({self.num_heads})"
            )
        if not isinstance(self.dropout, (int, float)) or not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"ModelConfig.dropout must be in [0, 1), got {self.dropout!r}")

    @property
    def head_dim(self) -> int:
        return self.width // self.num_heads

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ModelConfig:
        known = {f.name for f in fields(cls)}
        unknown = set(data) - known
        if unknown:
            raise ValueError(f"unknown ModelConfig keys: {sorted(unknown)}")
        return cls(**dict(data))


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.num_heads = cfg.num_heads
        self.dropout = cfg.dropout
        self.qkv = nn.Linear(cfg.width, 3 * cfg.width)
        self.proj = nn.Linear(cfg.width, cfg.width)
        self.proj.residual_out = True  # type: ignore[assignment]  # scaled init, see _init_std
        self.resid_drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, width = x.shape
        qkv = self.qkv(x).view(batch, seq, 3, self.num_heads, width // self.num_heads)
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)  # each [B, heads, T, head_dim]
        y = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0
        )
        y = y.transpose(1, 2).reshape(batch, seq, width)
        return self.resid_drop(self.proj(y))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(cfg.width, cfg.mlp_ratio * cfg.width)
        self.proj = nn.Linear(cfg.mlp_ratio * cfg.width, cfg.width)
        self.proj.residual_out = True  # type: ignore[assignment]
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.proj(F.gelu(self.fc(x))))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.width)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.width)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class _LayerSpan(nn.Module):
    """Blocks [start, stop) plus, at the ends, the embeddings or the head; shared by GPT and stages."""

    def __init__(self, cfg: ModelConfig, span: tuple[int, int], *, is_first: bool, is_last: bool) -> None:
        super().__init__()
        start, stop = span
        if not 0 <= start <= stop <= cfg.num_layers:
            raise ValueError(f"span {span} is not within 0..{cfg.num_layers}")
        if start == stop:
            raise ValueError(f"a stage needs at least one block, got span {span}")
        if is_first and start != 0:
            raise ValueError(f"the first stage must start at block 0, got span {span}")
        if is_last and stop != cfg.num_layers:
            raise ValueError(f"the last stage must end at block {cfg.num_layers}, got span {span}")
        self.cfg = cfg
        self.span = (start, stop)
        self.is_first = is_first
        self.is_last = is_last
        if is_first:
            self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.width)
            self.pos_emb = nn.Embedding(cfg.context_len, cfg.width)
            self.emb_drop = nn.Dropout(cfg.dropout)
        # String keys keep the full model's block indices in parameter names ("blocks.2.attn.qkv.weight").
        self.blocks = nn.ModuleDict({str(i): Block(cfg) for i in range(start, stop)})
        if is_last:
            self.ln_f = nn.LayerNorm(cfg.width)
            self.head = nn.Linear(cfg.width, cfg.vocab_size, bias=False)

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        if tokens.dim() != 2:
            raise ValueError(f"tokens must be [batch, seq], got shape {tuple(tokens.shape)}")
        seq = tokens.shape[1]
        if seq > self.cfg.context_len:
            raise ValueError(f"sequence length {seq} exceeds context_len {self.cfg.context_len}")
        positions = torch.arange(seq, device=tokens.device)
        return self.emb_drop(self.tok_emb(tokens) + self.pos_emb(positions))

    def run_blocks(self, h: torch.Tensor) -> torch.Tensor:
        for block in self.blocks.values():
            h = block(h)
        return h

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        return self.head(self.ln_f(h))


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy in nats per token (per byte for the byte vocabulary)."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


class GPT(_LayerSpan):
    """The whole model: what learners hold."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__(cfg, (0, cfg.num_layers), is_first=True, is_last=True)

    def forward(
        self, tokens: torch.Tensor, targets: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """int64 tokens [B, T] -> logits [B, T, vocab], or (logits, loss) when targets [B, T] are given."""
        logits = self.logits(self.run_blocks(self.embed(tokens)))
        if targets is None:
            return logits
        return logits, lm_loss(logits, targets)


class StageModule(_LayerSpan):
    """One pipeline stage: a contiguous span of blocks, with the embeddings on the first, the head on the last.

    forward by position in the pipeline:
      first:  int64 tokens [B, T] -> activations [B, T, width]
      middle: activations -> activations
      last:   activations (+ targets [B, T]) -> scalar loss (logits when targets is None)
    A single stage that is both first and last behaves like the first feeding the last.
    """

    def forward(self, x: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        h = self._through_blocks(x)
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
        logits = self.logits(self._through_blocks(x))
        return logits, lm_loss(logits, targets)

    def _through_blocks(self, x: torch.Tensor) -> torch.Tensor:
        return self.run_blocks(self.embed(x) if self.is_first else x)


def stage_spans(num_layers: int, num_stages: int) -> list[tuple[int, int]]:
    """Cut num_layers blocks into num_stages contiguous, non-empty spans whose sizes differ by at most one.

    Extra blocks go to middle stages first, then the first stage, then the last: the end stages also
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
    """The token and position embedding tensors (the DiLoCo merge averages these instead of RDA)."""
    del cfg  # same names for every shape; the argument keeps call sites explicit about which model
    return {TOKEN_EMBEDDING, POSITION_EMBEDDING}


def _tensor_seed(seed: int, name: str) -> int:
    digest = hashlib.sha256(f"hivenode-init/{seed}/{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


def _init_std(module: nn.Module, cfg: ModelConfig) -> float:
    # GPT-2: residual output projections are scaled down by depth so the residual stream does not grow.
    if getattr(module, "residual_out", False):
        return 0.02 / math.sqrt(2 * cfg.num_layers)
    return 0.02


@torch.no_grad()
def init_parameters(module: _LayerSpan, seed: int) -> None:
    """Deterministic init: each tensor drawn from its own generator keyed by (seed, parameter name).

    Keying by name (not by draw order) is what makes a stage's values equal the full model's.
    """
    for module_name, sub in module.named_modules():
        for param_name, param in sub.named_parameters(recurse=False):
            full_name = f"{module_name}.{param_name}" if module_name else param_name
            if isinstance(sub, nn.LayerNorm):
                param.fill_(1.0 if param_name == "weight" else 0.0)
            elif param_name == "bias":
                param.zero_()
            elif isinstance(sub, (nn.Linear, nn.Embedding)):
                generator = torch.Generator(device="cpu").manual_seed(_tensor_seed(seed, full_name))
                values = torch.empty(param.shape, dtype=torch.float32)
                values.normal_(0.0, _init_std(sub, module.cfg), generator=generator)
                param.copy_(values)
            else:
                raise AssertionError(f"no init rule for {full_name} in {type(sub).__name__}")


def _materialize(module: _LayerSpan, seed: int) -> None:
    module.to_empty(device="cpu")
    init_parameters(module, seed)


def build_model(cfg: ModelConfig, seed: int) -> GPT:
    # Built on the meta device: torch's default init would draw from (and advance) the global RNG.
    with torch.device("meta"):
        model = GPT(cfg)
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
