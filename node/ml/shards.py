"""Prepared training data: fixed-size token shards named by their sha256, an index naming them, a memmap reader.

`python -m bootstrap data prepare` (node.ml.prepare) writes a directory of shards: each shard is raw little-endian
token ids (uint16 when the vocabulary has fewer than 65536 tokens, else uint32) in a file `<sha256>.tokens`, and
`index.json` lists them in corpus order with the tokenizer they were cut with and the shards the owner keeps out
for evaluation (`heldout`). The index's own sha256 goes in the signed manifest (`data = {source = "shards",
index_sha256 = ...}`), so the run's identity, and every checkpoint, names the exact tokens trained on; a peer
checks every shard's bytes against its name before reading it (`verify_shard`).

`ShardStream` reads shards through numpy memmaps: a window is sliced out of the page cache when sampled, so a
learner's memory does not grow with the dataset (nothing is read into Python lists).
"""

from __future__ import annotations

import hashlib
import json
import logging
import mmap
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from protocol.errors import DataError, ShardMismatch

logger = logging.getLogger(__name__)

INDEX_FORMAT = "hivenode-shards-v1"
INDEX_FILENAME = "index.json"
SHARD_SUFFIX = ".tokens"
BYTE_TOKENIZER = "bytes"  # the index's `tokenizer` when the tokens are raw bytes (vocabulary 256)
MAX_INDEX_BYTES = 16 * 2**20  # ~100k shards; a larger index is refused unread
_HASH_CHUNK_BYTES = 4 * 2**20
_HEX = frozenset("0123456789abcdef")


def dtype_for(vocab_size: int) -> str:
    """The narrowest token dtype for a vocabulary: uint16 below 65536 tokens, else uint32."""
    if vocab_size < 1:
        raise ValueError(f"vocab_size must be >= 1, got {vocab_size}")
    return "uint16" if vocab_size <= 2**16 else "uint32"


def is_sha256_hex(value: object) -> bool:
    return isinstance(value, str) and len(value) == 64 and set(value) <= _HEX


@dataclass(frozen=True, slots=True)
class ShardEntry:
    """One shard: its sha256 (hex, also its file name and URL), its token count and its size in bytes."""

    name: str
    tokens: int
    bytes: int

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "tokens": self.tokens, "bytes": self.bytes}


@dataclass(frozen=True, slots=True)
class ShardIndex:
    """What `index.json` says: the token dtype, the shards in corpus order, and which of them are held out."""

    dtype: str
    shard_tokens: int  # tokens per shard (the last one may hold fewer)
    vocab_size: int
    tokenizer: str  # sha256 of the tokenizer.json the tokens were cut with, or BYTE_TOKENIZER
    shards: tuple[ShardEntry, ...]
    heldout: tuple[str, ...]  # names of shards never assigned for training

    @property
    def itemsize(self) -> int:
        return int(np.dtype(self.dtype).itemsize)

    @property
    def train(self) -> tuple[ShardEntry, ...]:
        held = set(self.heldout)
        return tuple(s for s in self.shards if s.name not in held)

    @property
    def held_out(self) -> tuple[ShardEntry, ...]:
        held = set(self.heldout)
        return tuple(s for s in self.shards if s.name in held)

    def entry(self, name: str) -> ShardEntry:
        for shard in self.shards:
            if shard.name == name:
                return shard
        raise KeyError(name)

    def to_bytes(self) -> bytes:
        """The canonical JSON (sorted keys, no spaces): these exact bytes hash to the manifest's index_sha256."""
        document = {
            "format": INDEX_FORMAT,
            "dtype": self.dtype,
            "shard_tokens": self.shard_tokens,
            "vocab_size": self.vocab_size,
            "tokenizer": self.tokenizer,
            "shards": [s.to_json() for s in self.shards],
            "heldout": list(self.heldout),
        }
        return json.dumps(document, sort_keys=True, separators=(",", ":")).encode()

    def sha256(self) -> str:
        return hashlib.sha256(self.to_bytes()).hexdigest()


def parse_index(blob: bytes, expected_sha256: str | None = None) -> ShardIndex:
    """The index in `blob`; DataError when it is malformed or (given `expected_sha256`) not the run's."""
    if len(blob) > MAX_INDEX_BYTES:
        raise DataError(f"shard index of {len(blob)} bytes exceeds {MAX_INDEX_BYTES}")
    actual = hashlib.sha256(blob).hexdigest()
    if expected_sha256 is not None and actual != expected_sha256:
        logger.error("shard index refused: sha256 %s, the run names %s", actual[:16], expected_sha256[:16])
        raise ShardMismatch(f"shard index sha256 {actual} is not the run's {expected_sha256}")
    try:
        document = json.loads(blob)
        index = _index_from_json(document)
    except (ValueError, TypeError, KeyError) as e:
        raise DataError(f"shard index is malformed: {type(e).__name__}: {e}") from None
    return index


def _index_from_json(document: Any) -> ShardIndex:
    if not isinstance(document, dict) or document.get("format") != INDEX_FORMAT:
        raise ValueError(f"not a {INDEX_FORMAT} document")
    shards = tuple(
        ShardEntry(name=str(s["name"]), tokens=int(s["tokens"]), bytes=int(s["bytes"]))
        for s in document["shards"]
    )
    index = ShardIndex(
        dtype=str(document["dtype"]),
        shard_tokens=int(document["shard_tokens"]),
        vocab_size=int(document["vocab_size"]),
        tokenizer=str(document["tokenizer"]),
        shards=shards,
        heldout=tuple(str(n) for n in document["heldout"]),
    )
    _check_index(index)
    return index


def _check_index(index: ShardIndex) -> None:
    if index.dtype != dtype_for(index.vocab_size):
        raise ValueError(f"dtype {index.dtype} does not fit a vocabulary of {index.vocab_size}")
    if index.shard_tokens < 1 or not index.shards:
        raise ValueError("an index needs shard_tokens >= 1 and at least one shard")
    names = [s.name for s in index.shards]
    if len(set(names)) != len(names):
        raise ValueError("shard names repeat")
    for shard in index.shards:
        if not is_sha256_hex(shard.name):
            raise ValueError(f"shard name {shard.name!r} is not a sha256 hex digest")
        if not 0 < shard.tokens <= index.shard_tokens or shard.bytes != shard.tokens * index.itemsize:
            raise ValueError(f"shard {shard.name[:12]}: {shard.tokens} tokens in {shard.bytes} bytes")
    if not set(index.heldout) <= set(names) or len(index.heldout) >= len(names):
        raise ValueError("heldout must name some (not all) of the shards")
    if index.tokenizer != BYTE_TOKENIZER and not is_sha256_hex(index.tokenizer):
        raise ValueError(f"tokenizer must be {BYTE_TOKENIZER!r} or a sha256, got {index.tokenizer!r}")


def shard_path(directory: Path, name: str) -> Path:
    return directory / f"{name}{SHARD_SUFFIX}"


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        while chunk := handle.read(_HASH_CHUNK_BYTES):
            digest.update(chunk)
    return digest.hexdigest()


def verify_shard(path: Path, entry: ShardEntry) -> None:
    """Raise ShardMismatch (and log it) unless the file at `path` is exactly the shard `entry` names."""
    size = path.stat().st_size
    if size != entry.bytes:
        logger.error("shard %s refused: %d bytes, the index says %d", entry.name[:12], size, entry.bytes)
        raise ShardMismatch(f"shard {entry.name} at {path} has {size} bytes, the index says {entry.bytes}")
    actual = file_sha256(path)
    if actual != entry.name:
        logger.error("shard %s refused: its bytes hash to %s", entry.name[:12], actual[:12])
        raise ShardMismatch(f"shard at {path} hashes to {actual}, not its name {entry.name}")


def write_atomic(path: Path, blob: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(path.name + ".tmp")
    with temporary.open("wb") as handle:
        handle.write(blob)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(temporary, path)


def _map_tokens(path: Path, dtype: np.dtype[Any]) -> np.ndarray:
    """A read-only memmap of one shard, advised random access (windows are sampled at random offsets, so
    read-ahead is wasted I/O). Its pages are page cache: they count in RSS as file pages once touched, but
    the kernel reclaims them under pressure; the process's own (anonymous) memory does not grow."""
    with path.open("rb") as handle:
        if path.stat().st_size == 0:
            return np.zeros(0, dtype=dtype)
        mapped = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ)  # outlives the descriptor
    if hasattr(mapped, "madvise") and hasattr(mmap, "MADV_RANDOM"):
        mapped.madvise(mmap.MADV_RANDOM)
    return np.frombuffer(mapped, dtype=dtype)


class ShardStream:
    """Token windows sampled across shards read through memmaps (the TokenStream interface: `num_starts`,
    `windows`, `check_fits`). Start `i` is a global window index: shards shorter than one window are skipped,
    and no window crosses a shard boundary."""

    def __init__(self, paths: Sequence[Path], dtype: str) -> None:
        if not paths:
            raise ValueError("a shard stream needs at least one shard")
        self.paths = tuple(paths)
        self._arrays = [_map_tokens(p, np.dtype(dtype).newbyteorder("<")) for p in paths]
        self._context_len: int | None = None
        self._offsets = np.zeros(1, dtype=np.int64)  # cumulative window starts per shard, for one context_len

    def __len__(self) -> int:
        return sum(int(a.shape[0]) for a in self._arrays)

    def _layout(self, context_len: int) -> np.ndarray:
        if self._context_len != context_len:
            starts = [max(0, int(a.shape[0]) - context_len) for a in self._arrays]
            self._offsets = np.concatenate([[0], np.cumsum(starts)]).astype(np.int64)
            self._context_len = context_len
        return self._offsets

    def num_starts(self, context_len: int) -> int:
        return int(self._layout(context_len)[-1])

    def check_fits(self, context_len: int) -> None:
        if self.num_starts(context_len) < 1:
            raise ValueError(f"no shard of this stream holds one window of {context_len + 1} tokens")

    def windows(self, starts: torch.Tensor, context_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, targets) int64 [len(starts), context_len], each window copied out of its shard's memmap."""
        offsets = self._layout(context_len)
        flat = starts.numpy().astype(np.int64)
        which = np.searchsorted(offsets, flat, side="right") - 1
        rows = np.empty((len(flat), context_len + 1), dtype=np.int64)
        for row, (shard, start) in enumerate(zip(which.tolist(), flat.tolist(), strict=True)):
            local = start - int(offsets[shard])
            rows[row] = self._arrays[shard][local : local + context_len + 1]
        window = torch.from_numpy(rows)
        return window[:, :-1], window[:, 1:]
