"""Prepared data: prepare into shards, the index, the memmap reader, shard verification, the assignment."""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pytest
import torch

from node.ml.assignment import ShardAssignment, assign, epoch_of, moved
from node.ml.data import BatchSampler, validation_batches
from node.ml.prepare import PrepareConfig, TokenizerInfo, input_files, prepare
from node.ml.shards import (
    INDEX_FILENAME,
    ShardStream,
    dtype_for,
    parse_index,
    shard_path,
    verify_shard,
)
from protocol.errors import DataError, ShardMismatch

TEXT = "".join(f"line {i}: the quick brown fox jumps over the lazy dog\n" for i in range(400))


def _write_inputs(root: Path) -> Path:
    folder = root / "in"
    (folder / "sub").mkdir(parents=True)
    (folder / "a.txt").write_text(TEXT)
    lines = [json.dumps({"body": f"document {i} " * 20}) for i in range(50)]
    (folder / "sub" / "b.jsonl").write_text("\n".join(lines) + "\n")
    (folder / "ignored.md").write_text("not an input")
    return folder


def _config(**overrides: int) -> PrepareConfig:
    return PrepareConfig(**{"shard_tokens": 4096, **overrides}, text_field="body")  # type: ignore[arg-type]


def _bytes_of(folder: Path) -> bytes:
    docs = [json.loads(line)["body"] for line in (folder / "sub" / "b.jsonl").read_text().splitlines()]
    return TEXT.encode() + "".join(docs).encode()


def test_prepare_writes_fixed_size_shards_named_by_hash_and_an_index(tmp_path: Path) -> None:
    folder = _write_inputs(tmp_path)
    config = PrepareConfig(shard_tokens=4096, heldout_shards=2, text_field="body")
    index = prepare([folder], tmp_path / "out", TokenizerInfo(), config)
    assert index.dtype == "uint16" and index.vocab_size == 256 and index.tokenizer == "bytes"
    assert [s.tokens for s in index.shards[:-1]] == [4096] * (len(index.shards) - 1)
    assert 0 < index.shards[-1].tokens <= 4096
    # the shards, concatenated in index order, are exactly the input bytes (txt first, then the jsonl texts)
    joined = b"".join(
        np.fromfile(shard_path(tmp_path / "out", s.name), dtype="<u2").astype(np.uint8).tobytes()
        for s in index.shards
    )
    assert joined == _bytes_of(folder)
    for shard in index.shards:
        verify_shard(shard_path(tmp_path / "out", shard.name), shard)  # raises on a mismatch
    blob = (tmp_path / "out" / INDEX_FILENAME).read_bytes()
    assert parse_index(blob, index.sha256()) == index
    assert len(index.heldout) == 2 and len(index.train) == len(index.shards) - 2
    # deterministic: the same inputs give the same index hash
    again = prepare([folder], tmp_path / "again", TokenizerInfo(), config)
    assert again.sha256() == index.sha256()


def test_prepare_with_a_bpe_tokenizer_separates_documents(tmp_path: Path) -> None:
    folder = _write_inputs(tmp_path)
    tokenizer = TokenizerInfo(
        encode=lambda data: [b % 200 + 300 for b in data], vocab_size=70_000, sha256="ab" * 32, end_of_text=7
    )
    index = prepare(
        [folder], tmp_path / "out", tokenizer, PrepareConfig(shard_tokens=8192, text_field="body")
    )
    assert index.dtype == "uint32" and index.tokenizer == "ab" * 32
    tokens = np.concatenate([np.fromfile(shard_path(tmp_path / "out", s.name), "<u4") for s in index.shards])
    assert int((tokens == 7).sum()) == 1 + 50  # one end-of-text per document: the txt file, each jsonl line
    assert tokens.max() < 70_000


def test_prepare_refuses_bad_inputs_with_typed_errors(tmp_path: Path) -> None:
    (tmp_path / "x.parquet").write_bytes(b"PAR1")
    with pytest.raises(DataError, match="pyarrow"):
        input_files([tmp_path / "x.parquet"])
    with pytest.raises(DataError, match="no such file"):
        input_files([tmp_path / "missing.txt"])
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine"}\n{"text": 3}\n')
    with pytest.raises(DataError, match=r"bad.jsonl:2"):
        prepare([bad], tmp_path / "out", TokenizerInfo(), PrepareConfig(shard_tokens=4))
    small = tmp_path / "small.txt"
    small.write_text("tiny")
    with pytest.raises(DataError, match="lower --shard-tokens"):
        prepare([small], tmp_path / "out2", TokenizerInfo(), _config())


def test_index_parse_refuses_tampering_and_malformed_documents(tmp_path: Path) -> None:
    index = prepare([_write_inputs(tmp_path)], tmp_path / "out", TokenizerInfo(), _config())
    blob = index.to_bytes()
    with pytest.raises(ShardMismatch):
        parse_index(blob.replace(b'"heldout"', b'"heldout" '), index.sha256())
    document = json.loads(blob)
    document["shards"][0]["tokens"] += 1
    with pytest.raises(DataError, match="malformed"):
        parse_index(json.dumps(document).encode())
    with pytest.raises(DataError, match="malformed"):
        parse_index(b"[1, 2]")
    assert dtype_for(256) == "uint16" and dtype_for(65536) == "uint16" and dtype_for(65537) == "uint32"


def test_verify_shard_refuses_a_corrupt_file_and_the_control_reads_it(tmp_path: Path) -> None:
    out = tmp_path / "out"
    index = prepare([_write_inputs(tmp_path)], out, TokenizerInfo(), _config())
    entry = index.train[0]
    path = shard_path(out, entry.name)
    data = bytearray(path.read_bytes())
    data[10] ^= 0x01  # one flipped bit, same size
    path.write_bytes(bytes(data))
    with pytest.raises(ShardMismatch, match="hashes to"):
        verify_shard(path, entry)
    # negative control: without the check the reader would train on the corrupted token
    stream = ShardStream([path], index.dtype)
    inputs, _ = stream.windows(torch.tensor([0]), 16)
    assert int(inputs[0, 5]) == data[10] | (data[11] << 8)
    path.write_bytes(bytes(data[:-2]))  # truncated
    with pytest.raises(ShardMismatch, match="bytes"):
        verify_shard(path, entry)


def test_shard_stream_windows_stay_inside_shards_and_sampling_is_bounded(tmp_path: Path) -> None:
    paths = []
    for i, length in enumerate((100, 5, 50)):  # the 5-token shard holds no window of 9 and is skipped
        path = tmp_path / f"s{i}.tokens"
        np.arange(1000 * i, 1000 * i + length, dtype="<u2").tofile(path)
        paths.append(path)
    stream = ShardStream(paths, "uint16")
    assert len(stream) == 155 and stream.num_starts(8) == (100 - 8) + (50 - 8)
    inputs, targets = stream.windows(torch.tensor([0, 91, 92, 133]), 8)
    assert inputs[:, 0].tolist() == [0, 91, 2000, 2041]
    assert torch.equal(inputs[:, 1:], targets[:, :-1])
    assert (targets[:, -1] - inputs[:, 0]).tolist() == [8, 8, 8, 8]  # never crosses a shard boundary
    sampler = BatchSampler(stream, batch_size=32, context_len=8, generator=torch.Generator().manual_seed(0))
    for _ in range(20):
        x, y = sampler.next_batch()
        assert torch.equal(x[:, 1:], y[:, :-1]) and ((y[:, -1] - x[:, 0]) == 8).all()
    held = validation_batches(stream, batch_size=4, context_len=8, num_batches=2)
    assert len(held) == 2 and held[0][0].shape == (4, 8)


LEARNERS = [f"12D3KooW{c * 8}" for c in "ABCDEFG"]
SHARDS = [f"{i:064x}" for i in range(40)]


def test_assignment_is_disjoint_covering_balanced_and_deterministic() -> None:
    table = ShardAssignment.compute(SHARDS, LEARNERS[:5], epoch=3)
    sets = [set(table.shards_for(p)) for p in LEARNERS[:5]]
    assert sum(len(s) for s in sets) == len(SHARDS) and set().union(*sets) == set(SHARDS)
    assert max(len(s) for s in sets) == 8 == min(len(s) for s in sets)
    shuffled = random.Random(1).sample(LEARNERS[:5], 5)
    assert ShardAssignment.compute(SHARDS, shuffled, epoch=3) == table  # order of the live list is irrelevant
    assert assign(LEARNERS[0], SHARDS, LEARNERS[1:5], 3) == table.shards_for(LEARNERS[0])
    assert ShardAssignment.compute(SHARDS, LEARNERS[:5], epoch=4) != table  # a new epoch reshuffles


def test_assignment_rebalances_on_churn_moving_few_shards() -> None:
    before = ShardAssignment.compute(SHARDS, LEARNERS[:5], epoch=0)
    after = ShardAssignment.compute(SHARDS, LEARNERS[:4], epoch=0)  # one learner left
    assert set().union(*(set(after.shards_for(p)) for p in LEARNERS[:4])) == set(SHARDS)
    lost = len(before.shards_for(LEARNERS[4]))
    assert moved(before, after) <= lost + 4  # mostly the leaver's shards move
    joined = ShardAssignment.compute(SHARDS, LEARNERS[:6], epoch=0)  # one joined
    assert moved(before, joined) <= len(joined.shards_for(LEARNERS[5])) + 6
    fresh = ShardAssignment.compute(SHARDS, LEARNERS[:4], epoch=1)
    assert moved(before, fresh) > moved(before, after)  # the stability is real, not an artefact of the test


def test_assignment_with_fewer_shards_than_learners_gives_everyone_one() -> None:
    table = ShardAssignment.compute(SHARDS[:3], LEARNERS, epoch=0)
    assert all(len(table.shards_for(p)) == 1 for p in LEARNERS)
    with pytest.raises(ValueError):
        ShardAssignment.compute([], LEARNERS, epoch=0)
    with pytest.raises(KeyError):
        table.shards_for("someone-else")


def test_the_epoch_advances_once_the_learners_trained_the_training_tokens() -> None:
    # 4 learners x 1,000 tokens a round: 10,000 training tokens take 3 rounds (2.5, rounded up)
    epoch = [epoch_of(r, train_tokens=10_000, learners=4, tokens_per_round=1_000) for r in range(8)]
    assert epoch == [0, 0, 0, 1, 1, 1, 2, 2]
    assert epoch_of(3, train_tokens=10_000, learners=2, tokens_per_round=1_000) == 0  # fewer learners: longer
    assert epoch_of(-1, train_tokens=10, learners=1, tokens_per_round=1) == 0
    with pytest.raises(ValueError):
        epoch_of(1, train_tokens=10, learners=0, tokens_per_round=1)
    # every learner holding the same versions computes the same table: disjoint within the epoch, new at the next
    tables = [ShardAssignment.compute(SHARDS, LEARNERS[:4], epoch=e) for e in sorted(set(epoch))]
    assert len({t.table[LEARNERS[0]] for t in tables}) == len(tables)


def test_a_local_mirror_is_read_in_place_and_a_corrupt_mirror_shard_is_not_used(tmp_path: Path) -> None:
    import asyncio

    from node.swarm.shard_fetch import ShardSource, ensure_shards, obtain_index

    mirror = tmp_path / "out"
    index = prepare([_write_inputs(tmp_path)], mirror, TokenizerInfo(), _config())
    source = ShardSource(cache=tmp_path / "cache", bases=(), mirror=mirror)  # no bootstrap to ask
    assert asyncio.run(obtain_index(index.sha256(), source)) == index
    names = [s.name for s in index.train[:2]]
    assert asyncio.run(ensure_shards(index, names, source)) == [shard_path(mirror, n) for n in names]
    path = shard_path(mirror, names[0])
    data = bytearray(path.read_bytes())
    data[0] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(DataError, match="could not obtain shard"):
        asyncio.run(ensure_shards(index, names[:1], source))
    assert path.exists()  # the mirror is the owner's copy: refused, never deleted
    with pytest.raises(DataError, match="could not obtain the run's shard index"):
        asyncio.run(obtain_index("f" * 64, source))
