"""Corpus loading, the held-out split, per-peer shards, and batches."""

from __future__ import annotations

import importlib.util
import json
import time
from pathlib import Path

import pytest
import torch

from node.ml.data import (
    BatchSampler,
    Corpus,
    DataConfig,
    TokenStream,
    evaluate,
    load_corpus,
    shard_for,
    validation_batches,
)
from node.ml.model import ModelConfig, build_model


@pytest.fixture(scope="module")
def stdlib() -> Corpus:
    return load_corpus(None)


def test_builtin_corpus_is_stdlib_source_within_the_cap_and_fast() -> None:
    started = time.perf_counter()
    corpus = load_corpus(None)
    elapsed = time.perf_counter() - started
    total = corpus.train_bytes + corpus.validation_bytes
    assert 1_000_000 < total <= DataConfig().builtin_max_bytes
    assert elapsed < 2.0, f"loading the built-in corpus took {elapsed:.2f} s"
    names = [p.name for p in corpus.train + corpus.validation]
    assert all(n.startswith("stdlib/") and ".py" in n for n in names)
    assert not any("site-packages" in n or "/test/" in n for n in names)
    assert any(n.startswith("stdlib/json/") or n == "stdlib/os.py" or "asyncio" in n for n in names)


def test_builtin_corpus_is_deterministic(stdlib: Corpus) -> None:
    again = load_corpus(None)
    assert again.fingerprint() == stdlib.fingerprint()
    assert [p.name for p in again.train] == [p.name for p in stdlib.train]
    assert [p.name for p in stdlib.train] == sorted(p.name for p in stdlib.train)


def test_validation_is_a_small_disjoint_set_of_whole_documents(stdlib: Corpus) -> None:
    fraction = stdlib.validation_bytes / (stdlib.train_bytes + stdlib.validation_bytes)
    assert 0.02 <= fraction <= 0.05
    train_docs = {p.document for p in stdlib.train}
    held_docs = {p.document for p in stdlib.validation}
    assert held_docs and not train_docs & held_docs
    assert not {p.name for p in stdlib.train} & {p.name for p in stdlib.validation}


@pytest.mark.parametrize("num_shards", [1, 2, 3, 4, 7])
def test_shards_are_disjoint_covering_and_balanced(stdlib: Corpus, num_shards: int) -> None:
    shards = [stdlib.shard(i, num_shards) for i in range(num_shards)]
    names = [p.name for shard in shards for p in shard]
    assert len(names) == len(set(names)) == len(stdlib.train)
    sizes = [sum(len(p.data) for p in shard) for shard in shards]
    biggest_piece = max(len(p.data) for p in stdlib.train)
    assert max(sizes) - min(sizes) <= biggest_piece
    assert shards == [stdlib.shard(i, num_shards) for i in range(num_shards)]


def test_shard_arguments_are_checked(stdlib: Corpus) -> None:
    with pytest.raises(ValueError):
        stdlib.shard(4, 4)
    with pytest.raises(ValueError):
        stdlib.shard(0, 0)


def test_shard_for_is_stable_and_in_range() -> None:
    keys = [f"12D3KooWpeer{i}" for i in range(200)]
    first = [shard_for(k, 4) for k in keys]
    assert first == [shard_for(k, 4) for k in keys]
    assert set(first) == {0, 1, 2, 3}
    with pytest.raises(ValueError):
        shard_for("x", 0)


def test_batch_sampler_is_seeded_and_shifts_targets(stdlib: Corpus) -> None:
    stream = stdlib.train_stream(1, 4)

    def batches(seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        sampler = BatchSampler(
            stream, batch_size=4, context_len=32, generator=torch.Generator().manual_seed(seed)
        )
        return [next(sampler) for _ in range(3)]

    a, b, c = batches(0), batches(0), batches(1)
    assert all(torch.equal(x1, x2) and torch.equal(y1, y2) for (x1, y1), (x2, y2) in zip(a, b, strict=True))
    assert not torch.equal(a[0][0], c[0][0])
    inputs, targets = a[0]
    assert inputs.shape == targets.shape == (4, 32)
    assert inputs.dtype == targets.dtype == torch.int64
    assert torch.equal(inputs[:, 1:], targets[:, :-1])
    assert int(inputs.max()) < 256 and int(inputs.min()) >= 0


def test_shard_streams_hold_only_their_shards_bytes(stdlib: Corpus) -> None:
    shard = stdlib.shard(2, 3)
    stream = stdlib.train_stream(2, 3)
    assert bytes(stream.tokens.tolist()) == b"".join(p.data for p in shard)


def test_validation_batches_are_fixed_and_come_from_held_out_bytes(stdlib: Corpus) -> None:
    first = validation_batches(stdlib, batch_size=4, context_len=64, num_batches=3)
    second = validation_batches(stdlib, batch_size=4, context_len=64, num_batches=3)
    assert len(first) == 3
    assert all(
        torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(first, second, strict=True)
    )
    held_out = b"".join(p.data for p in stdlib.validation)
    for inputs, targets in first:
        for row in range(inputs.shape[0]):
            window = bytes(inputs[row].tolist()) + bytes(targets[row, -1:].tolist())
            assert window in held_out


def test_evaluate_model_and_callable_and_restores_mode(stdlib: Corpus) -> None:
    cfg = ModelConfig(context_len=32, num_layers=1, width=32, num_heads=2)
    model = build_model(cfg, seed=0)
    model.train()
    batches = validation_batches(stdlib, batch_size=2, context_len=32, num_batches=2)
    loss = evaluate(model, batches)
    assert model.training
    assert abs(loss - torch.log(torch.tensor(256.0)).item()) < 0.2
    assert evaluate(lambda x, y: model(x, y)[1], batches) == pytest.approx(loss)
    with pytest.raises(ValueError):
        evaluate(model, [])


def test_text_file_corpus(tmp_path: Path) -> None:
    path = tmp_path / "book.txt"
    path.write_text("the quick brown fox jumps over the lazy dog. " * 400)
    corpus = load_corpus(str(path))
    total = corpus.train_bytes + corpus.validation_bytes
    assert total == path.stat().st_size
    assert corpus.validation and len(corpus.train) > len(corpus.validation)
    assert not {p.name for p in corpus.train} & {p.name for p in corpus.validation}
    assert load_corpus(str(path)).fingerprint() == corpus.fingerprint()


def test_directory_of_txt_and_jsonl(tmp_path: Path) -> None:
    (tmp_path / "sub").mkdir()
    for i in range(10):
        (tmp_path / f"doc{i}.txt").write_text(f"plain text document number {i}\n" * 40)
    records = [{"text": f"json line {i} " * 30, "meta": i} for i in range(12)]
    (tmp_path / "sub" / "lines.jsonl").write_text("\n".join(json.dumps(r) for r in records) + "\n\n")
    (tmp_path / "ignored.bin").write_bytes(b"\x00" * 5000)
    corpus = load_corpus(str(tmp_path))
    documents = {p.document for p in corpus.train + corpus.validation}
    assert "doc3.txt" in documents
    assert sum(d.startswith("sub/lines.jsonl:") for d in documents) == 12
    assert not any("ignored" in d for d in documents)
    everything = b"".join(p.data for p in corpus.train + corpus.validation)
    assert b"json line 5 " in everything and b'"meta"' not in everything
    assert not {p.document for p in corpus.train} & {p.document for p in corpus.validation}


def test_jsonl_file_and_byte_cap(tmp_path: Path) -> None:
    path = tmp_path / "data.jsonl"
    path.write_text("".join(json.dumps({"text": "x" * 100}) + "\n" for _ in range(100)))
    corpus = load_corpus(str(path), DataConfig(max_bytes=2_000))
    assert corpus.train_bytes + corpus.validation_bytes == 2_000


@pytest.mark.parametrize(
    ("content", "message"),
    [('{"text": "ok"}\nnot json\n', r"data\.jsonl:2"), ('{"body": "no text"}\n', '"text" field')],
)
def test_bad_jsonl_is_a_value_error_with_line(tmp_path: Path, content: str, message: str) -> None:
    path = tmp_path / "data.jsonl"
    path.write_text(content)
    with pytest.raises(ValueError, match=message):
        load_corpus(str(path))


def test_missing_empty_and_tiny_inputs_are_typed_errors(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="no such file"):
        load_corpus(str(tmp_path / "nope.txt"))
    (tmp_path / "empty.txt").write_bytes(b"")
    with pytest.raises(ValueError, match="empty"):
        load_corpus(str(tmp_path / "empty.txt"))
    (tmp_path / "emptydir").mkdir()
    with pytest.raises(ValueError, match="no .txt or .jsonl"):
        load_corpus(str(tmp_path / "emptydir"))
    (tmp_path / "tiny.txt").write_bytes(b"abc")
    with pytest.raises(ValueError, match="too small"):
        load_corpus(str(tmp_path / "tiny.txt"))
    with pytest.raises(ValueError, match="empty string"):
        load_corpus("  ")


@pytest.mark.skipif(importlib.util.find_spec("datasets") is not None, reason="datasets is installed")
def test_dataset_name_without_datasets_package_is_a_clear_error() -> None:
    with pytest.raises(FileNotFoundError, match="datasets"):
        load_corpus("someone/some-dataset")


def test_short_streams_and_bad_config_are_rejected() -> None:
    short = TokenStream(torch.zeros(10, dtype=torch.uint8))
    with pytest.raises(ValueError, match="shorter"):
        BatchSampler(short, batch_size=2, context_len=10, generator=torch.Generator())
    with pytest.raises(ValueError):
        DataConfig(validation_fraction=0.0)
    with pytest.raises(ValueError):
        DataConfig(piece_bytes=10)


def test_empty_shard_is_a_clear_error(tmp_path: Path) -> None:
    path = tmp_path / "small.txt"
    path.write_bytes(bytes(range(256)) * 40)  # 10 KiB -> about 32 pieces
    corpus = load_corpus(str(path))
    num_shards = len(corpus.train) + 1
    with pytest.raises(ValueError, match="empty"):
        corpus.train_stream(num_shards - 1, num_shards)
