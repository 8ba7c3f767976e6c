"""Export: a syncer-format checkpoint -> a folder `from_pretrained` loads, computing what our model computes;
`python -m node generate` samples from it. Byte-level and BPE runs."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from node.__main__ import main
from node.ml.export import PARAM_PREFIX, ExportError, checkpoint_params, export_hf
from node.ml.model import ModelConfig, build_model
from node.ml.tokenizer import Tokenizer, train_bpe

RUN = "[model]\ncontext_len = 32\nnum_layers = 2\nwidth = 32\nnum_heads = 4\n"


def _checkpoint(path: Path, cfg: ModelConfig) -> torch.nn.Module:
    model = build_model(cfg, seed=5)
    with torch.no_grad():  # "trained": not the seed values an export could get by rebuilding
        for param in model.parameters():
            param.add_(0.05 * torch.randn(param.shape, generator=torch.Generator().manual_seed(2)))
    save_file({PARAM_PREFIX + k: v.contiguous() for k, v in model.state_dict().items()}, str(path))
    return model


@pytest.mark.parametrize("bpe", [False, True])
def test_export_loads_with_from_pretrained_and_generates(
    bpe: bool, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    run = tmp_path / "run.toml"
    run.write_text(RUN)
    args = ["export", "--checkpoint", str(tmp_path / "ckpt.safetensors"), "--out", str(tmp_path / "hf")]
    args += ["--run", str(run)]
    vocab = 256
    if bpe:
        blob = train_bpe(iter(["def f(x):\n    return x\n"] * 50), 280, show_progress=False)
        (tmp_path / "tokenizer.json").write_bytes(blob)
        args += ["--tokenizer", str(tmp_path / "tokenizer.json")]
        vocab = Tokenizer(blob).vocab_size
    cfg = ModelConfig(context_len=32, num_layers=2, width=32, num_heads=4, vocab_size=vocab)
    ours = _checkpoint(tmp_path / "ckpt.safetensors", cfg)
    assert main(args) == 0

    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "hf")
    ids = tokenizer("def hello(x):", return_tensors="pt")["input_ids"]
    if not bpe:
        assert ids[0].tolist() == list(b"def hello(x):")  # byte runs: ids are the bytes
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=ids).logits, ours(ids))
    capsys.readouterr()
    assert main(["generate", str(tmp_path / "hf"), "--prompt", "def ", "--max-new-tokens", "8"]) == 0
    printed = capsys.readouterr().out
    assert printed.startswith("def ") and len(printed.strip()) > len("def")


def test_export_refuses_a_checkpoint_of_another_shape(tmp_path: Path) -> None:
    _checkpoint(
        tmp_path / "ckpt.safetensors", ModelConfig(context_len=32, num_layers=2, width=32, num_heads=4)
    )
    params = checkpoint_params(tmp_path / "ckpt.safetensors")
    with pytest.raises(ExportError, match="does not fit"):
        export_hf(
            ModelConfig(context_len=32, num_layers=3, width=32, num_heads=4), params, tmp_path / "x", None
        )
    assert main(["export", "--checkpoint", str(tmp_path / "missing"), "--out", str(tmp_path / "y")]) == 1
