"""Training data: loading a corpus as bytes, the held-out split, per-peer shards, and batches.

With no `--data` the corpus is the Python standard library's own source, which every machine has (peers on
different Python versions read slightly different files; `Corpus.fingerprint()` tells them apart). A
corpus is a tuple of pieces (documents cut to at most `piece_bytes`), sorted by name. The held-out split
takes whole documents by name hash; shards bin-pack the training pieces by size, so the split, the shards
and every batch are functions of the corpus and a seed alone.
"""

from __future__ import annotations

import hashlib
import heapq
import importlib.util
import json
import logging
import math
import os
import sysconfig
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Protocol

import torch
from torch import nn

logger = logging.getLogger(__name__)

Batch = tuple[torch.Tensor, torch.Tensor]

# Directories of the standard library that are not representative source (tests, vendored packages,
# codec tables, build config) or are installed packages rather than the library.
_STDLIB_SKIP_DIRS = frozenset(
    {
        "site-packages",
        "dist-packages",
        "test",
        "tests",
        "idle_test",
        "__pycache__",
        "encodings",
        "ensurepip",
        "lib-dynload",
        "turtledemo",
    }
)
_MIN_PIECE_BYTES = 256
_PIECES_PER_SMALL_CORPUS = 32  # small corpora are cut finer so the split and the shards have units to share
_MIN_DOCS_FOR_DOCUMENT_SPLIT = 16


@dataclass(frozen=True, kw_only=True, slots=True)
class DataConfig:
    """How a corpus is read and split; every peer of a run must use the same values."""

    builtin_max_bytes: int = 6 * 2**20  # bytes of standard-library source read (keeps startup well under 1 s)
    max_bytes: int = 256 * 2**20  # bytes read from `--data` sources; the rest is ignored (logged)
    validation_fraction: float = 0.03  # share of bytes held out, taken as whole documents where possible
    piece_bytes: int = 64 * 2**10  # longest unit of splitting and sharding; longer documents are cut

    def __post_init__(self) -> None:
        for name in ("builtin_max_bytes", "max_bytes", "piece_bytes"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < _MIN_PIECE_BYTES:
                raise ValueError(f"DataConfig.{name} must be an int >= {_MIN_PIECE_BYTES}, got {value!r}")
        if not 0.0 < self.validation_fraction < 0.5:
            raise ValueError(
                f"DataConfig.validation_fraction must be in (0, 0.5), got {self.validation_fraction}"
            )


@dataclass(frozen=True, slots=True)
class Piece:
    """A named run of bytes; `document` names the source document it was cut from."""

    name: str
    document: str
    data: bytes


def _hash_int(label: str) -> int:
    return int.from_bytes(hashlib.sha256(label.encode()).digest()[:8], "big")


def shard_for(key: str, num_shards: int) -> int:
    """A stable shard index for a key such as a peer id (different keys may share a shard)."""
    if num_shards < 1:
        raise ValueError(f"num_shards must be >= 1, got {num_shards}")
    return _hash_int(f"shard/{key}") % num_shards


@dataclass(frozen=True, slots=True)
class Corpus:
    """Training and held-out pieces of one data source, each tuple sorted by name."""

    source: str
    train: tuple[Piece, ...]
    validation: tuple[Piece, ...]
    # bytes -> token ids (the run's BPE, node.ml.tokenizer); None: the tokens are the bytes themselves
    encode: Callable[[bytes], list[int]] | None = None

    def with_encoder(self, encode: Callable[[bytes], list[int]] | None) -> Corpus:
        return Corpus(self.source, self.train, self.validation, encode)

    @property
    def train_bytes(self) -> int:
        return sum(len(p.data) for p in self.train)

    @property
    def validation_bytes(self) -> int:
        return sum(len(p.data) for p in self.validation)

    def fingerprint(self) -> str:
        """sha256 over names and bytes of both splits: equal fingerprints mean peers read the same data."""
        digest = hashlib.sha256()
        for split, pieces in (("train", self.train), ("validation", self.validation)):
            for piece in pieces:
                digest.update(f"{split}\0{piece.name}\0{len(piece.data)}\0".encode())
                digest.update(piece.data)
        return digest.hexdigest()

    def shard(self, index: int, num_shards: int) -> tuple[Piece, ...]:
        """Training pieces of shard `index` of `num_shards`: disjoint, covering, near-equal in bytes."""
        if num_shards < 1:
            raise ValueError(f"num_shards must be >= 1, got {num_shards}")
        if not 0 <= index < num_shards:
            raise ValueError(f"shard index {index} out of range for {num_shards} shards")
        return _bin_pack(self.train, num_shards)[index]

    def train_stream(self, shard_index: int = 0, num_shards: int = 1) -> TokenStream:
        pieces = self.shard(shard_index, num_shards)
        if not pieces:
            raise ValueError(
                f"shard {shard_index} of {num_shards} is empty: the corpus has only {len(self.train)} "
                "training pieces"
            )
        return TokenStream.from_pieces(pieces, self.encode)

    def validation_stream(self) -> TokenStream:
        return TokenStream.from_pieces(self.validation, self.encode)


def _bin_pack(pieces: Sequence[Piece], num_shards: int) -> list[tuple[Piece, ...]]:
    # Largest first onto the lightest shard (ties by hash, then lowest index): balanced and deterministic.
    order = sorted(pieces, key=lambda p: (-len(p.data), _hash_int(f"pack/{p.name}"), p.name))
    loads = [(0, i) for i in range(num_shards)]
    bins: list[list[Piece]] = [[] for _ in range(num_shards)]
    for piece in order:
        load, index = heapq.heappop(loads)
        bins[index].append(piece)
        heapq.heappush(loads, (load + len(piece.data), index))
    return [tuple(sorted(b, key=lambda p: p.name)) for b in bins]


class TokenStream:
    """Pieces concatenated into one tensor of tokens: uint8 bytes, or int32 ids of the run's tokenizer."""

    def __init__(self, tokens: torch.Tensor) -> None:
        if tokens.dtype not in (torch.uint8, torch.int32) or tokens.dim() != 1:
            raise ValueError(
                f"tokens must be a 1-D uint8/int32 tensor, got {tokens.dtype} {tuple(tokens.shape)}"
            )
        self.tokens = tokens

    @classmethod
    def from_pieces(
        cls, pieces: Sequence[Piece], encode: Callable[[bytes], list[int]] | None = None
    ) -> TokenStream:
        if encode is not None:
            ids = [token for piece in pieces for token in encode(piece.data)]
            return cls(torch.tensor(ids, dtype=torch.int32))
        joined = bytearray(b"".join(p.data for p in pieces))
        if not joined:
            return cls(torch.empty(0, dtype=torch.uint8))
        return cls(torch.frombuffer(joined, dtype=torch.uint8))

    def __len__(self) -> int:
        return int(self.tokens.numel())

    def windows(self, starts: torch.Tensor, context_len: int) -> Batch:
        """(inputs, targets) int64 [len(starts), context_len]; targets are inputs shifted by one."""
        index = starts[:, None] + torch.arange(context_len + 1)
        window = self.tokens[index].long()
        return window[:, :-1], window[:, 1:]

    def num_starts(self, context_len: int) -> int:
        """How many windows of `context_len + 1` tokens start in the stream."""
        return max(0, len(self) - context_len)

    def check_fits(self, context_len: int) -> None:
        if len(self) < context_len + 1:
            raise ValueError(f"stream of {len(self)} tokens is shorter than one window of {context_len + 1}")


class TokenSource(Protocol):
    """What batches are cut from: a `TokenStream` in memory or a `node.ml.shards.ShardStream` of memmaps."""

    def __len__(self) -> int: ...
    def num_starts(self, context_len: int) -> int: ...
    def check_fits(self, context_len: int) -> None: ...
    def windows(self, starts: torch.Tensor, context_len: int) -> Batch: ...


class BatchSampler:
    """Random windows of a stream, drawn from the caller's generator: (inputs, targets) int64 [B, T]."""

    def __init__(
        self, stream: TokenSource, *, batch_size: int, context_len: int, generator: torch.Generator
    ) -> None:
        if batch_size < 1 or context_len < 1:
            raise ValueError(f"batch_size and context_len must be >= 1, got {batch_size}, {context_len}")
        stream.check_fits(context_len)
        self.stream = stream
        self.batch_size = batch_size
        self.context_len = context_len
        self.generator = generator

    def next_batch(self) -> Batch:
        stream = self.stream  # read once: a learner may swap in another stream between batches
        high = stream.num_starts(self.context_len)  # exclusive: the last window ends at the last token
        starts = torch.randint(0, high, (self.batch_size,), generator=self.generator)
        return stream.windows(starts, self.context_len)

    def __iter__(self) -> Iterator[Batch]:
        return self

    def __next__(self) -> Batch:
        return self.next_batch()


def validation_batches(
    source: Corpus | TokenSource, *, batch_size: int, context_len: int, num_batches: int
) -> list[Batch]:
    """A fixed list of held-out batches: windows evenly spaced over the whole validation stream."""
    stream = source.validation_stream() if isinstance(source, Corpus) else source
    if batch_size < 1 or num_batches < 1:
        raise ValueError(f"batch_size and num_batches must be >= 1, got {batch_size}, {num_batches}")
    stream.check_fits(context_len)
    last_start = stream.num_starts(context_len) - 1
    starts = torch.linspace(0, last_start, batch_size * num_batches).round().long()
    return [stream.windows(chunk, context_len) for chunk in starts.split(batch_size)]


LossFn = Callable[[torch.Tensor, torch.Tensor], "torch.Tensor | tuple[torch.Tensor, torch.Tensor]"]


@torch.no_grad()
def evaluate(model: nn.Module | LossFn, batches: Sequence[Batch]) -> float:
    """Mean loss over `batches`; `model(inputs, targets)` returns a loss or (logits, loss). Eval mode inside."""
    if not batches:
        raise ValueError("evaluate needs at least one batch")
    was_training = isinstance(model, nn.Module) and model.training
    if isinstance(model, nn.Module):
        model.eval()
    try:
        device = _device_of(model)
        total = 0.0
        for inputs, targets in batches:
            out = model(inputs.to(device), targets.to(device))
            loss = out[1] if isinstance(out, tuple) else out
            total += float(loss)
        return total / len(batches)
    finally:
        if was_training:
            assert isinstance(model, nn.Module)
            model.train()


def _device_of(model: object) -> torch.device:
    if isinstance(model, nn.Module):
        for param in model.parameters():
            return param.device
    return torch.device("cpu")


# ---------------------------------------------------------------- loading


def load_corpus(spec: str | None = None, config: DataConfig | None = None) -> Corpus:
    """Read a corpus: None = the standard library's source; else a text file, a directory of .txt/.jsonl
    files, a .jsonl file (a "text" field per line), or a Hugging Face dataset name (needs `datasets`)."""
    config = config or DataConfig()
    if spec is None:
        source = f"stdlib:{sysconfig.get_paths()['stdlib']}"
        documents = _stdlib_documents(config.builtin_max_bytes)
    else:
        source = spec
        documents = _spec_documents(spec, config.max_bytes)
    corpus = _split(source, documents, config)
    logger.info(
        "corpus %s: %d train bytes in %d pieces, %d held-out bytes in %d pieces",
        source,
        corpus.train_bytes,
        len(corpus.train),
        corpus.validation_bytes,
        len(corpus.validation),
    )
    return corpus


def _stdlib_documents(max_bytes: int) -> list[tuple[str, bytes]]:
    root = Path(sysconfig.get_paths()["stdlib"])
    candidates: list[tuple[str, Path, int]] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(
            d for d in dirnames if d not in _STDLIB_SKIP_DIRS and not d.startswith("config-")
        )
        for filename in filenames:
            if not filename.endswith(".py") or filename.startswith(("test_", "_sysconfigdata")):
                continue
            path = Path(dirpath) / filename
            name = "stdlib/" + PurePosixPath(path.relative_to(root).as_posix()).as_posix()
            candidates.append((name, path, path.stat().st_size))
    # Under the cap, keep a hash-chosen spread of modules rather than the alphabetically first ones.
    candidates.sort(key=lambda c: (_hash_int(f"stdlib/{c[0]}"), c[0]))
    chosen: list[tuple[str, Path]] = []
    total = 0
    for name, path, size in candidates:
        if size > 0 and total + size <= max_bytes:
            chosen.append((name, path))
            total += size
    if not chosen:
        raise ValueError(f"no standard-library source found under {root}")
    return sorted((name, path.read_bytes()) for name, path in chosen)


def _spec_documents(spec: str, max_bytes: int) -> list[tuple[str, bytes]]:
    if not spec.strip():
        raise ValueError("--data is an empty string; leave it out to use the built-in corpus")
    path = Path(spec).expanduser()
    if path.is_dir():
        return _directory_documents(path, max_bytes)
    if path.is_file():
        return _file_documents(path, path.name, max_bytes)
    if _looks_like_path(spec) or importlib.util.find_spec("datasets") is None:
        raise FileNotFoundError(
            f"--data {spec!r}: no such file or directory (a Hugging Face dataset name needs the `datasets` "
            "package, which is not installed)"
        )
    return _hf_documents(spec, max_bytes)


def _looks_like_path(spec: str) -> bool:
    return spec.startswith((".", "/", "~")) or Path(spec).suffix in {".txt", ".jsonl", ".json", ".md"}


def _directory_documents(root: Path, max_bytes: int) -> list[tuple[str, bytes]]:
    files = sorted(
        (p for p in root.rglob("*") if p.is_file() and p.suffix in {".txt", ".jsonl"}),
        key=lambda p: p.relative_to(root).as_posix(),
    )
    if not files:
        raise ValueError(f"--data {str(root)!r}: directory holds no .txt or .jsonl files")
    documents: list[tuple[str, bytes]] = []
    budget = max_bytes
    for path in files:
        if budget <= 0:
            logger.info("--data %s: byte cap %d reached, ignoring the remaining files", root, max_bytes)
            break
        found = _file_documents(path, path.relative_to(root).as_posix(), budget)
        documents.extend(found)
        budget -= sum(len(data) for _, data in found)
    return documents


def _file_documents(path: Path, name: str, max_bytes: int) -> list[tuple[str, bytes]]:
    if path.suffix == ".jsonl":
        return _jsonl_documents(path, name, max_bytes)
    with path.open("rb") as handle:
        data = handle.read(max_bytes)
        if handle.read(1):
            logger.info("--data %s: read only the first %d bytes", path, max_bytes)
    return [(name, data)] if data else []


def _jsonl_documents(path: Path, name: str, max_bytes: int) -> list[tuple[str, bytes]]:
    documents: list[tuple[str, bytes]] = []
    total = 0
    with path.open("rb") as handle:
        for line_number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}:{line_number}: not valid JSON ({exc.msg})") from exc
            if not isinstance(record, dict) or not isinstance(record.get("text"), str):
                raise ValueError(f'{path}:{line_number}: expected an object with a string "text" field')
            data = record["text"].encode("utf-8")[: max_bytes - total]
            if data:
                documents.append((f"{name}:{line_number:08d}", data))
                total += len(data)
            if total >= max_bytes:
                logger.info("--data %s: byte cap %d reached at line %d", path, max_bytes, line_number)
                break
    return documents


def _hf_documents(name: str, max_bytes: int) -> list[tuple[str, bytes]]:  # pragma: no cover - optional dep
    import datasets  # type: ignore[import-not-found]

    dataset = datasets.load_dataset(name, split="train", streaming=True)
    documents: list[tuple[str, bytes]] = []
    total = 0
    for index, record in enumerate(dataset):
        text = record.get("text") if isinstance(record, dict) else None
        if not isinstance(text, str):
            raise ValueError(f'Hugging Face dataset {name!r}: record {index} has no string "text" field')
        data = text.encode("utf-8")[: max_bytes - total]
        documents.append((f"{name}:{index:010d}", data))
        total += len(data)
        if total >= max_bytes:
            break
    return documents


def _split(source: str, documents: list[tuple[str, bytes]], config: DataConfig) -> Corpus:
    total = sum(len(data) for _, data in documents)
    if total == 0:
        raise ValueError(f"corpus {source!r} is empty")
    pieces = _cut(documents, _piece_size(total, config.piece_bytes))
    # Hold out whole documents, so no file is half train, half validation; a corpus of a few big
    # documents (one text file) has to be split by piece instead.
    by_document = len(documents) >= _MIN_DOCS_FOR_DOCUMENT_SPLIT
    groups: dict[str, list[Piece]] = {}
    for piece in pieces:
        groups.setdefault(piece.document if by_document else piece.name, []).append(piece)
    held_out = _choose_held_out(groups, config.validation_fraction * total)
    validation = tuple(sorted((p for k in held_out for p in groups[k]), key=lambda p: p.name))
    held_names = {p.name for p in validation}
    train = tuple(p for p in pieces if p.name not in held_names)
    if not train:
        raise ValueError(f"corpus {source!r} is too small to hold out validation data ({total} bytes)")
    return Corpus(source=source, train=train, validation=validation)


def _piece_size(total: int, piece_bytes: int) -> int:
    return min(piece_bytes, max(_MIN_PIECE_BYTES, math.ceil(total / _PIECES_PER_SMALL_CORPUS)))


def _cut(documents: list[tuple[str, bytes]], size: int) -> list[Piece]:
    pieces: list[Piece] = []
    for name, data in sorted(documents):
        if len(data) <= size:
            pieces.append(Piece(name=name, document=name, data=data))
            continue
        for index, start in enumerate(range(0, len(data), size)):
            pieces.append(Piece(name=f"{name}#{index:06d}", document=name, data=data[start : start + size]))
    return sorted(pieces, key=lambda p: p.name)


def _choose_held_out(groups: dict[str, list[Piece]], target_bytes: float) -> list[str]:
    order = sorted(groups, key=lambda k: (_hash_int(f"validation/{k}"), k))
    chosen: list[str] = []
    held = 0
    for key in order:
        size = sum(len(p.data) for p in groups[key])
        if held + size <= target_bytes:
            chosen.append(key)
            held += size
    return chosen or order[:1]
