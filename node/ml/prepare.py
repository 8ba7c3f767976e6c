"""`python -m bootstrap data prepare`: text files into token shards and their index (node.ml.shards).

Inputs are .txt files (each a document), .jsonl files (one document per line, in a string field, `text` by
default) and .parquet files (a string column; needs `pyarrow`), given as files or folders (searched recursively,
in name order). Everything streams: text is read in blocks of at most `BLOCK_BYTES` cut at line ends, tokenized,
and appended to one shard buffer that is written out (named by its sha256) whenever it holds `shard_tokens`
tokens, so memory is one shard plus one block whatever the corpus size. With a BPE tokenizer each document ends
with its end-of-text token. The owner keeps `heldout_shards` shards out of training: the ones with the smallest
hashes, a choice no one can steer without changing the data.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import json
import logging
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from node.ml.shards import (
    BYTE_TOKENIZER,
    INDEX_FILENAME,
    ShardEntry,
    ShardIndex,
    dtype_for,
    shard_path,
    write_atomic,
)
from protocol.errors import DataError

logger = logging.getLogger(__name__)

BLOCK_BYTES = 2**20  # longest run of text tokenized at once
INPUT_SUFFIXES = (".txt", ".jsonl", ".parquet")
DEFAULT_SHARD_TOKENS = 2**23  # 16 MiB of uint16 tokens per shard


class Progress(Protocol):
    def update(self, n: int) -> object: ...


@dataclass(frozen=True, kw_only=True, slots=True)
class PrepareConfig:
    shard_tokens: int = DEFAULT_SHARD_TOKENS
    heldout_shards: int = 1
    text_field: str = "text"  # the jsonl field / parquet column holding each document

    def __post_init__(self) -> None:
        if self.shard_tokens < 2:
            raise ValueError(f"shard_tokens must be >= 2, got {self.shard_tokens}")
        if self.heldout_shards < 1:
            raise ValueError(f"heldout_shards must be >= 1, got {self.heldout_shards}")


def input_files(inputs: Sequence[Path]) -> list[Path]:
    """The files to read, in order: each given file, then each folder's .txt/.jsonl/.parquet files by name."""
    files: list[Path] = []
    for path in inputs:
        if path.is_dir():
            found = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix in INPUT_SUFFIXES)
            files.extend(found)
        elif path.is_file():
            if path.suffix not in INPUT_SUFFIXES:
                raise DataError(f"{path}: not a .txt, .jsonl or .parquet file")
            files.append(path)
        else:
            raise DataError(f"{path}: no such file or folder")
    if not files:
        raise DataError(f"no .txt, .jsonl or .parquet files in {', '.join(map(str, inputs))}")
    if any(p.suffix == ".parquet" for p in files) and importlib.util.find_spec("pyarrow") is None:
        raise DataError(
            "reading .parquet needs pyarrow, which is not installed: `pip install pyarrow`, or convert the "
            "files to .jsonl"
        )
    return files


def documents(path: Path, text_field: str) -> Iterator[tuple[bytes, bool]]:
    """(block of UTF-8 text, whether it ends a document) for one input file, block by block."""
    if path.suffix == ".jsonl":
        yield from _jsonl_blocks(path, text_field)
    elif path.suffix == ".parquet":  # pragma: no cover - pyarrow is optional and not installed in CI
        yield from _parquet_blocks(path, text_field)
    else:
        yield from _text_blocks(path)


def _text_blocks(path: Path) -> Iterator[tuple[bytes, bool]]:
    carry = b""
    with path.open("rb") as handle:
        while block := handle.read(BLOCK_BYTES):
            block = carry + block
            cut = block.rfind(b"\n") + 1 or len(block)  # whole lines, unless one line outgrows a block
            carry = block[cut:]
            if block[:cut]:
                yield block[:cut], False
    yield carry, True


def _jsonl_blocks(path: Path, text_field: str) -> Iterator[tuple[bytes, bool]]:
    with path.open("rb") as handle:
        for line_number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"{path}:{line_number}: not valid JSON ({e.msg})") from None
            text = record.get(text_field) if isinstance(record, dict) else None
            if not isinstance(text, str):
                raise DataError(
                    f"{path}:{line_number}: expected an object with a string {text_field!r} field"
                )
            yield from _split_text(text.encode("utf-8"))


def _split_text(data: bytes) -> Iterator[tuple[bytes, bool]]:
    for start in range(0, max(len(data), 1), BLOCK_BYTES):
        yield data[start : start + BLOCK_BYTES], start + BLOCK_BYTES >= len(data)


def _parquet_blocks(path: Path, text_field: str) -> Iterator[tuple[bytes, bool]]:  # pragma: no cover
    parquet: Any = importlib.import_module("pyarrow.parquet")
    try:
        for batch in parquet.ParquetFile(path).iter_batches(columns=[text_field], batch_size=1024):
            for text in batch.column(0).to_pylist():
                if isinstance(text, str):
                    yield from _split_text(text.encode("utf-8"))
    except (KeyError, ValueError, OSError) as e:
        raise DataError(f"{path}: cannot read column {text_field!r}: {e}") from None


class ShardWriter:
    """Tokens in, shards out: a buffer of `shard_tokens` written to `<sha256>.tokens` each time it fills."""

    def __init__(self, out: Path, dtype: str, shard_tokens: int) -> None:
        self.out = out
        self.dtype = np.dtype(dtype).newbyteorder("<")
        self.buffer = np.empty(shard_tokens, dtype=self.dtype)
        self.filled = 0
        self.shards: list[ShardEntry] = []

    def add(self, tokens: np.ndarray) -> None:
        while tokens.size:
            take = min(tokens.size, self.buffer.size - self.filled)
            self.buffer[self.filled : self.filled + take] = tokens[:take]
            self.filled += take
            tokens = tokens[take:]
            if self.filled == self.buffer.size:
                self.flush()

    def flush(self) -> None:
        if not self.filled:
            return
        blob = self.buffer[: self.filled].tobytes()
        entry = ShardEntry(name=_sha256(blob), tokens=self.filled, bytes=len(blob))
        self.filled = 0
        if any(s.name == entry.name for s in self.shards):
            logger.info("shard %s repeats an earlier one (duplicate text): skipped", entry.name[:12])
            return
        write_atomic(shard_path(self.out, entry.name), blob)
        self.shards.append(entry)


def _sha256(blob: bytes) -> str:
    return hashlib.sha256(blob).hexdigest()


Encoder = Callable[[bytes], list[int]]


@dataclass(frozen=True, kw_only=True, slots=True)
class TokenizerInfo:
    """What prepare needs of the run's tokenizer: None encoder = raw bytes."""

    encode: Encoder | None = None
    vocab_size: int = 256
    sha256: str = BYTE_TOKENIZER
    end_of_text: int | None = None


def prepare(
    inputs: Sequence[Path],
    out: Path,
    tokenizer: TokenizerInfo,
    config: PrepareConfig,
    progress: Callable[[int], Progress] | None = None,
) -> ShardIndex:
    """Tokenize `inputs` into shards under `out` and write `out/index.json`; returns the index."""
    files = input_files(inputs)
    writer = ShardWriter(out, dtype_for(tokenizer.vocab_size), config.shard_tokens)
    bar = progress(sum(p.stat().st_size for p in files)) if progress is not None else None
    for path in files:
        for block, ends in documents(path, config.text_field):
            writer.add(_tokens(block, ends, tokenizer))
            if bar is not None:
                bar.update(len(block))
    writer.flush()
    index = _index(writer, tokenizer, config)
    write_atomic(out / INDEX_FILENAME, index.to_bytes())
    logger.info(
        "prepared %d shards (%d held out) of %d tokens from %d files into %s",
        len(index.shards),
        len(index.heldout),
        sum(s.tokens for s in index.shards),
        len(files),
        out,
    )
    return index


def _tokens(block: bytes, ends: bool, tokenizer: TokenizerInfo) -> np.ndarray:
    if tokenizer.encode is None:
        return np.frombuffer(block, dtype=np.uint8)
    ids = tokenizer.encode(block) if block else []
    if ends and tokenizer.end_of_text is not None:
        ids.append(tokenizer.end_of_text)
    return np.asarray(ids, dtype=np.int64)


def _index(writer: ShardWriter, tokenizer: TokenizerInfo, config: PrepareConfig) -> ShardIndex:
    shards = tuple(writer.shards)
    if len(shards) <= config.heldout_shards:
        raise DataError(
            f"the corpus fills only {len(shards)} shard(s) of {config.shard_tokens} tokens, not enough to hold "
            f"out {config.heldout_shards}: lower --shard-tokens or add text"
        )
    heldout = tuple(sorted(s.name for s in shards)[: config.heldout_shards])
    return ShardIndex(
        dtype=str(writer.buffer.dtype.name),
        shard_tokens=config.shard_tokens,
        vocab_size=tokenizer.vocab_size,
        tokenizer=tokenizer.sha256,
        shards=shards,
        heldout=heldout,
    )
