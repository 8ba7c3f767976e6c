"""What model a run trains: the family, the named presets, and how `[model]` in run.toml resolves.

Pure data and validation (no torch, no transformers): the manifest signs the *resolved* table, so every
peer builds exactly the same shape whatever preset defaults a future version ships. Resolution is
idempotent (a resolved table resolves to itself), which the manifest's canonical-bytes check relies on.

    [model]
    preset = "llama-20m"   # any of PRESETS; default "llama-tiny"
    family = "qwen2"       # optional: llama | gpt2 | qwen2 (the preset's family otherwise)
    num_layers = 6         # any field below overrides the preset

`node.ml.model` turns a resolved table into transformers modules.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

FAMILIES = ("llama", "gpt2", "qwen2")
DEFAULT_PRESET = "llama-tiny"
BYTE_VOCAB = 256  # the raw-byte "tokenizer": token = byte value

# Every preset is a Llama shape (the other families reuse it with `family = ...`). Sizes are with a 32k
# vocabulary except llama-tiny and llama-20m (the byte vocabulary, or an 8k BPE, respectively).
PRESETS: dict[str, dict[str, Any]] = {
    # the demo's and the tests' model: a few seconds per hundred steps on one CPU core
    "llama-tiny": {"family": "llama", "context_len": 128, "num_layers": 4, "width": 128, "num_heads": 4},
    "llama-20m": {"family": "llama", "context_len": 512, "num_layers": 8, "width": 384, "num_heads": 6},
    "llama-124m": {"family": "llama", "context_len": 1024, "num_layers": 12, "width": 768, "num_heads": 12},
    "llama-350m": {
        "family": "llama",
        "context_len": 1024,
        "num_layers": 24,
        "width": 1024,
        "num_heads": 16,
        "mlp_width": 2816,
    },
    "llama-1b": {  # TinyLlama's shape
        "family": "llama",
        "context_len": 2048,
        "num_layers": 22,
        "width": 2048,
        "num_heads": 32,
        "num_kv_heads": 4,
        "mlp_width": 5632,
    },
}

INT_FIELDS = ("vocab_size", "context_len", "num_layers", "width", "num_heads", "num_kv_heads", "mlp_width")
FLOAT_FIELDS = ("rope_theta", "norm_eps", "dropout", "init_std")
STR_FIELDS = ("family", "preset")
MODEL_FIELDS = frozenset((*INT_FIELDS, *FLOAT_FIELDS, *STR_FIELDS))
_FLOAT_DEFAULTS = {"rope_theta": 10000.0, "norm_eps": 1e-5, "dropout": 0.0, "init_std": 0.02}


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def default_mlp_width(family: str, width: int) -> int:
    """GPT-2's 4x; Llama/Qwen2's SwiGLU 8/3x, rounded up to a multiple of 16 (same parameters as 4x GELU)."""
    if family == "gpt2":
        return 4 * width
    return 16 * math.ceil(8 * width / 3 / 16)


def resolve_model(table: Mapping[str, Any], *, vocab_size: int = BYTE_VOCAB) -> dict[str, Any]:
    """The complete model table for `table` (a run.toml `[model]`): preset defaults under explicit fields.

    `vocab_size` is the tokenizer's, used when the table names none. Raises ValueError naming the field.
    """
    unknown = sorted(set(table) - MODEL_FIELDS)
    if unknown:
        raise ValueError(f"unknown model keys {unknown} (known: {sorted(MODEL_FIELDS)})")
    preset = table.get("preset", DEFAULT_PRESET)
    if preset not in PRESETS:
        raise ValueError(f"model.preset must be one of {sorted(PRESETS)}, got {preset!r}")
    resolved: dict[str, Any] = {"preset": preset, "vocab_size": vocab_size, **_FLOAT_DEFAULTS}
    resolved.update(PRESETS[preset])
    resolved.update(table)
    for name in FLOAT_FIELDS:  # TOML writes `dropout = 0` as an int
        if _is_int(resolved[name]):
            resolved[name] = float(resolved[name])
    family = resolved["family"]
    if family not in FAMILIES:
        raise ValueError(f"model.family must be one of {FAMILIES}, got {family!r}")
    resolved.setdefault("num_kv_heads", resolved["num_heads"])
    width = resolved["width"]
    if not resolved.get("mlp_width") and _is_int(width):
        resolved["mlp_width"] = default_mlp_width(family, width)
    check_model(resolved)
    return dict(sorted(resolved.items()))


def check_model(model: Mapping[str, Any]) -> None:
    """Raise ValueError unless `model` is a complete, consistent resolved table."""
    missing = sorted(MODEL_FIELDS - set(model))
    if missing:
        raise ValueError(f"model lacks {missing}")
    unknown = sorted(set(model) - MODEL_FIELDS)
    if unknown:
        raise ValueError(f"unknown model keys {unknown}")
    for name in INT_FIELDS:
        if not _is_int(model[name]) or model[name] < 1:
            raise ValueError(f"model.{name} must be an int >= 1, got {model[name]!r}")
    for name in FLOAT_FIELDS:
        value = model[name]
        if not isinstance(value, float) or not math.isfinite(value) or value < 0:
            raise ValueError(f"model.{name} must be a float >= 0, got {value!r}")
    if model["family"] not in FAMILIES:
        raise ValueError(f"model.family must be one of {FAMILIES}, got {model['family']!r}")
    if model["preset"] not in PRESETS:
        raise ValueError(f"model.preset must be one of {sorted(PRESETS)}, got {model['preset']!r}")
    if model["vocab_size"] < 2:
        raise ValueError("model.vocab_size must be at least 2")
    if model["width"] % model["num_heads"]:
        raise ValueError("model.width must be divisible by model.num_heads")
    if model["num_heads"] % model["num_kv_heads"]:
        raise ValueError("model.num_heads must be a multiple of model.num_kv_heads")
    if model["family"] == "gpt2" and model["num_kv_heads"] != model["num_heads"]:
        raise ValueError(
            "model.family gpt2 has no grouped-query attention: num_kv_heads must equal num_heads"
        )
    if (model["width"] // model["num_heads"]) % 2:
        raise ValueError("model head dimension (width / num_heads) must be even (rotary embeddings)")
    if not 0.0 <= model["dropout"] < 1.0:
        raise ValueError("model.dropout must be in [0, 1)")
    if model["rope_theta"] <= 0 or model["norm_eps"] <= 0 or model["init_std"] <= 0:
        raise ValueError("model.rope_theta, norm_eps and init_std must be > 0")


def largest_param_elements(model: Mapping[str, Any]) -> int:
    """Elements of the model's largest single parameter tensor (the wire caps size fragments by it)."""
    width, mlp, heads, kv = model["width"], model["mlp_width"], model["num_heads"], model["num_kv_heads"]
    qkv = width * (width + 2 * width // heads * kv)
    return int(max(model["vocab_size"] * width, model["context_len"] * width, qkv, mlp * width))
