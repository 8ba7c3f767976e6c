"""From a trained checkpoint to a folder anyone can use: `AutoModelForCausalLM.from_pretrained(DIR)` and
`AutoTokenizer.from_pretrained(DIR)` load it (`python -m node export`), `python -m node generate` samples.

Our parameter names are the transformers model's own (node.ml.model), so the export is the tensors as
they are plus the config transformers needs. The tokenizer is the run's BPE, or for a byte-level run a
256-token byte tokenizer whose ids are the byte values (GPT-2's byte-to-unicode table, no merges).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from node.ml.model import ModelConfig, build_model, hf_config, load_state_subset
from node.ml.tokenizer import END_OF_TEXT

logger = logging.getLogger(__name__)

PARAM_PREFIX = "param/"  # the syncer checkpoint's parameter tensors (node.ml.checkpoint)


class ExportError(ValueError):
    """The checkpoint does not hold the model the run describes (missing tensors, wrong shapes)."""


def checkpoint_params(path: Path) -> dict[str, torch.Tensor]:
    """The model tensors of a syncer checkpoint (`param/<name>`) or of a plain safetensors state dict."""
    tensors = load_file(str(path))
    params = {k[len(PARAM_PREFIX) :]: v for k, v in tensors.items() if k.startswith(PARAM_PREFIX)}
    return params or tensors


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character table (what the ByteLevel pre-tokenizer emits)."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    table = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def byte_tokenizer_json() -> str:
    """A tokenizer.json whose ids are raw byte values (what a run without a BPE trains on)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {char: byte for byte, char in _bytes_to_unicode().items()}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    text: str = tokenizer.to_str()
    return text


def export_hf(
    cfg: ModelConfig, params: dict[str, torch.Tensor], out: Path, tokenizer_blob: bytes | None
) -> None:
    """Write config.json, model.safetensors and the tokenizer files to `out`."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    model = build_model(cfg, seed=0)
    try:
        load_state_subset(model, params)
    except (KeyError, ValueError) as e:
        raise ExportError(f"checkpoint does not fit the run's model: {e}") from None
    out.mkdir(parents=True, exist_ok=True)
    config = hf_config(cfg)
    config.architectures = [_architecture(cfg.family)]
    config.save_pretrained(out)
    state = {name: t.detach().contiguous() for name, t in model.state_dict().items()}
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    text = tokenizer_blob.decode() if tokenizer_blob is not None else byte_tokenizer_json()
    special: dict[str, Any] = {}
    if tokenizer_blob is not None:
        special = {"eos_token": END_OF_TEXT, "bos_token": END_OF_TEXT, "unk_token": END_OF_TEXT}
    fast = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(text), **special)
    fast.model_max_length = cfg.context_len
    fast.save_pretrained(out)
    logger.info("exported %s (%d tensors) to %s", cfg.preset, len(state), out)


def _architecture(family: str) -> str:
    return {"llama": "LlamaForCausalLM", "gpt2": "GPT2LMHeadModel", "qwen2": "Qwen2ForCausalLM"}[family]


def generate(directory: Path, prompt: str, *, max_new_tokens: int, temperature: float, seed: int) -> str:
    """A sample from an exported folder, loaded the way anyone would load it."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # the weight-loading bar; our callers print one line
    tokenizer = AutoTokenizer.from_pretrained(directory)
    model: Any = AutoModelForCausalLM.from_pretrained(directory)
    model.eval()
    inputs = tokenizer(prompt, return_tensors="pt")
    room = model.config.max_position_embeddings - inputs["input_ids"].shape[1]
    torch.manual_seed(seed)
    with torch.no_grad():
        output = model.generate(
            input_ids=inputs["input_ids"],
            attention_mask=inputs["attention_mask"],
            max_new_tokens=max(1, min(max_new_tokens, room)),
            do_sample=temperature > 0,
            temperature=temperature if temperature > 0 else None,
            top_k=None,
            top_p=None,
            pad_token_id=tokenizer.eos_token_id if tokenizer.eos_token_id is not None else 0,
        )
    return str(tokenizer.decode(output[0], skip_special_tokens=True))
