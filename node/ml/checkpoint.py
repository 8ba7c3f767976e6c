"""The syncer's durable state: global fragments, outer momentum and fragment versions in one safetensors file.

Layout: tensors `param/<name>` (the global parameters, float32) and `outer_momentum/<name>` (the Nesterov
buffers, as `OuterNesterov.state_dict` names them), plus string metadata: `format`, `run_id`, `term`,
`versions` (JSON list, one per fragment of the run plan), `merges`, `tokens_merged`, `merged` (the ledger) and
`published_wall` (JSON list: when each fragment's version was published, wall clock) and `seniority` (JSON, see
node.diloco.seniority: how many merges each identity was in; malformed, it is logged and read as none, so the
parameters still resume). Nothing is unpickled.

`CheckpointStore` keeps a run's checkpoints in one directory, content-addressed
(`syncer-<run16>-<blake3 of the file, 16 hex>.safetensors`): each is written to a temporary name, fsynced,
renamed and the directory fsynced, so a reader (a standby syncer sharing the directory, or this syncer after a
crash) never sees half of one; the newest `keep` are kept; a file whose bytes no longer match its name (a torn
copy, a bad disk) is skipped for the one before it.
"""

from __future__ import annotations

import contextlib
import copy
import json
import logging
import math
import os
import re
import struct
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import blake3
import torch

from node.diloco.outer import STATE_PREFIX
from node.diloco.seniority import SavedSeniority, SeniorityStateError, seniority_from_json, seniority_to_json

logger = logging.getLogger(__name__)

FORMAT = "hivenode-syncer-v1"
PARAM_PREFIX = "param/"


@dataclass(frozen=True, kw_only=True, slots=True)
class SyncerSnapshot:
    """Everything a syncer needs to resume: what it serves and how its outer optimiser moves next."""

    run_id: str
    term: int
    versions: tuple[int, ...]
    # tensors, or read lazily when on disk (node.diloco.param_store `FilesView`, with `shape_of`)
    params: Mapping[str, torch.Tensor]
    # keys as OuterNesterov.state_dict gives them (STATE_PREFIX + name); read lazily when on disk (node.diloco.spill)
    momentum: Mapping[str, torch.Tensor]
    merges: int = 0
    tokens_merged: int = 0
    # (peer, fragment, base version, steps, tokens) already merged: see SyncerCore.merged_ledger
    merged: tuple[tuple[str, int, int, int, int], ...] = ()
    # per fragment, when its current version was published (wall clock, 0 if unknown): a successor caps the
    # counters of work built on it by the time since then, not since it restored
    published_wall: tuple[float, ...] = ()
    # (peer, rounds, last merged on the wall clock), the most recently merged first: Seniority.export
    seniority: SavedSeniority = ()


class CheckpointError(ValueError):
    """A checkpoint file is unreadable, of another run, or does not match the expected tensors."""


def checkpoint_path(directory: Path, run_id: str) -> Path:
    """The single-file name used before checkpoints were content-addressed (still read, as the oldest)."""
    return directory / f"syncer-{run_id[:16]}.safetensors"


_HASH_HEX = 16
_TMP_STALE_S = 3600.0  # a temporary file this old belongs to a writer that died


class CheckpointStore:
    """A run's syncer checkpoints in one directory: content-addressed, atomic, the newest `keep` kept."""

    def __init__(self, directory: Path, run_id: str, *, keep: int = 3) -> None:
        if keep < 1:
            raise ValueError("keep must be >= 1")
        self.directory, self.run_id, self.keep = directory, run_id, keep
        self._name = re.compile(rf"syncer-{re.escape(run_id[:16])}-([0-9a-f]{{{_HASH_HEX}}})\.safetensors")

    def save(self, snapshot: SyncerSnapshot) -> Path:
        """Write `snapshot` (temp file, fsync, rename to its content name, fsync the directory); prune."""
        self.directory.mkdir(parents=True, exist_ok=True)
        tmp = self.directory / f".syncer-{self.run_id[:16]}.{os.getpid()}.{time.monotonic_ns()}.tmp"
        try:
            save_checkpoint(tmp, snapshot, final=False)
            path = self.directory / f"syncer-{self.run_id[:16]}-{_file_hash(tmp)}.safetensors"
            os.replace(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)
        os.utime(path)  # the same content saved again is the newest again
        _fsync_dir(self.directory)
        self._prune()
        return path

    def paths(self) -> list[Path]:
        """Checkpoint files of this run, newest first (the legacy single file last)."""
        if not self.directory.is_dir():
            return []
        found = [p for p in self.directory.iterdir() if self._name.fullmatch(p.name)]
        found.sort(key=lambda p: p.stat().st_mtime_ns, reverse=True)
        legacy = checkpoint_path(self.directory, self.run_id)
        return found + ([legacy] if legacy.exists() else [])

    def load_latest(self, *, expected: Mapping[str, tuple[int, ...]], num_fragments: int) -> SyncerSnapshot:
        """The newest checkpoint that is whole and fits; FileNotFoundError if there is none at all,
        CheckpointError if every one is damaged (each is logged)."""
        paths = self.paths()
        if not paths:
            raise FileNotFoundError(self.directory)
        errors = []
        for path in paths:
            try:
                self.check_hash(path)
                return load_checkpoint(
                    path, run_id=self.run_id, expected=expected, num_fragments=num_fragments
                )
            except (CheckpointError, FileNotFoundError) as e:  # pruned by another writer meanwhile: older one
                logger.warning("skipping checkpoint %s: %s", path.name, e)
                errors.append(str(e))
        raise CheckpointError(f"no usable checkpoint in {self.directory}: {'; '.join(errors)[:500]}")

    def check_hash(self, path: Path) -> None:
        match = self._name.fullmatch(path.name)
        if match is not None and _file_hash(path) != match.group(1):
            raise CheckpointError(f"{path}: content does not match its name (torn or damaged)")

    def _prune(self) -> None:
        for old in self.paths()[self.keep :]:
            old.unlink(missing_ok=True)
        now = time.time()
        for tmp in self.directory.glob(f".syncer-{self.run_id[:16]}.*.tmp"):
            with contextlib.suppress(FileNotFoundError):  # another writer's sweep
                if now - tmp.stat().st_mtime > _TMP_STALE_S:
                    tmp.unlink()


def _file_hash(path: Path) -> str:
    digest = blake3.blake3()
    with open(path, "rb") as handle:
        while chunk := handle.read(8 << 20):
            digest.update(chunk)
    return digest.hexdigest()[:_HASH_HEX]


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save_checkpoint(path: Path, snapshot: SyncerSnapshot, *, final: bool = True) -> None:
    """Write `snapshot` to `path`, fsynced; with `final`, atomically (a temp file renamed onto `path`)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    for key in snapshot.momentum:
        if not key.startswith(STATE_PREFIX):
            raise ValueError(f"momentum key {key!r} lacks the {STATE_PREFIX!r} prefix")
    metadata = {
        "format": FORMAT,
        "run_id": snapshot.run_id,
        "term": str(snapshot.term),
        "versions": json.dumps(list(snapshot.versions)),
        "merges": str(snapshot.merges),
        "tokens_merged": str(snapshot.tokens_merged),
        "merged": json.dumps([list(entry) for entry in snapshot.merged]),
        "published_wall": json.dumps([float(t) for t in snapshot.published_wall]),
        "seniority": seniority_to_json(snapshot.seniority),
    }
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp") if final else path
    with open(tmp, "wb") as handle:
        write_safetensors(handle, _layout(snapshot), _tensors(snapshot), metadata)
        handle.flush()
        os.fsync(handle.fileno())
    if final:
        os.replace(tmp, path)


def _layout(snapshot: SyncerSnapshot) -> list[tuple[str, tuple[int, ...]]]:
    """(key, shape) of every tensor the checkpoint holds, in the order they are written: the momentum's shapes
    are its parameters' (checked on load), so a momentum read from disk (node.diloco.spill) is read only once,
    while it is written."""
    params = snapshot.params
    shape_of = getattr(params, "shape_of", None) or (lambda name: tuple(params[name].shape))
    layout = [(PARAM_PREFIX + name, tuple(shape_of(name))) for name in params]
    for key in snapshot.momentum:
        name = key[len(STATE_PREFIX) :]
        shape = shape_of(name) if name in params else tuple(snapshot.momentum[key].shape)
        layout.append((key, tuple(shape)))
    return layout


@dataclass(frozen=True, slots=True)
class Pieces:
    """A tensor for `write_safetensors` given as its flattened values in chunks (a momentum buffer read from the
    spill a chunk at a time: a llama-1b embedding's buffer is a whole fragment, issue 17)."""

    shape: tuple[int, ...]
    chunks: Iterable[torch.Tensor]


def _tensors(snapshot: SyncerSnapshot) -> Iterator[torch.Tensor | Pieces]:
    """The tensors of `_layout`, in its order, one at a time; a momentum that can give a buffer in chunks
    (node.diloco.spill `MomentumView.pieces`) gives them so."""
    yield from snapshot.params.values()
    pieces = getattr(snapshot.momentum, "pieces", None)
    for key in snapshot.momentum:
        yield Pieces(*pieces(key)) if pieces is not None else snapshot.momentum[key]


def write_safetensors(
    handle: BinaryIO,
    layout: Sequence[tuple[str, tuple[int, ...]]],
    tensors: Iterable[torch.Tensor | Pieces],
    metadata: Mapping[str, str],
) -> None:
    """A safetensors file of float32 tensors written one at a time (`safetensors.torch.save_file` wants them all at
    once, and a syncer whose momentum is on disk would read the whole of it into memory): the header from
    `layout`, then each tensor's bytes as `tensors` yields it (ValueError if one does not fit its entry)."""
    header: dict[str, object] = {"__metadata__": dict(metadata)}
    offset = 0
    for key, shape in layout:
        size = 4 * math.prod(shape)
        header[key] = {"dtype": "F32", "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)  # the data starts 8-byte aligned, as safetensors writes it
    handle.write(struct.pack("<Q", len(encoded)) + encoded)
    written = 0
    for (key, shape), tensor in zip(layout, tensors, strict=True):
        if tuple(tensor.shape) != tuple(shape):
            raise ValueError(f"{key}: shape {tuple(tensor.shape)} != {tuple(shape)} of the layout")
        size = 0
        for part in tensor.chunks if isinstance(tensor, Pieces) else (tensor,):
            data = part.detach().to("cpu", torch.float32).contiguous().reshape(-1)
            size += handle.write(data.numpy().data.cast("B"))
        if size != 4 * math.prod(shape):
            raise ValueError(f"{key}: {size} bytes written for shape {tuple(shape)}")
        written += size
    if written != offset:
        raise ValueError(f"wrote {written} tensor bytes, the header says {offset}")


def load_checkpoint(
    path: Path, *, run_id: str, expected: Mapping[str, tuple[int, ...]], num_fragments: int
) -> SyncerSnapshot:
    """Read and check a checkpoint: same run, exactly the `expected` parameter names and shapes, finite
    values, one version per fragment. Raises CheckpointError (FileNotFoundError if there is none)."""
    if not path.exists():
        raise FileNotFoundError(path)
    try:
        tensors = TensorFile(path)
        metadata = tensors.metadata
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{path}: unreadable checkpoint ({e})") from None
    if metadata.get("format") != FORMAT or metadata.get("run_id") != run_id:
        raise CheckpointError(f"{path}: not a checkpoint of run {run_id[:12]}")
    try:
        merged = tuple(ledger_from_json(metadata.get("merged", "[]")))
        versions = json.loads(metadata["versions"])
        term, merges, tokens = int(metadata["term"]), int(metadata["merges"]), int(metadata["tokens_merged"])
    except (KeyError, ValueError) as e:
        raise CheckpointError(f"{path}: bad metadata ({e})") from None
    if not (
        isinstance(versions, list)
        and len(versions) == num_fragments
        and all(type(v) is int and v >= 0 for v in versions)
    ):
        raise CheckpointError(f"{path}: versions do not fit {num_fragments} fragments")
    published = _published_wall(metadata.get("published_wall"), num_fragments)
    names = {k[len(PARAM_PREFIX) :]: k for k in tensors if k.startswith(PARAM_PREFIX)}
    if set(names) != set(expected):
        raise CheckpointError(f"{path}: parameter names differ from the run's model")
    for key in tensors:
        name = key[len(STATE_PREFIX) :] if key.startswith(STATE_PREFIX) else key[len(PARAM_PREFIX) :]
        if name not in expected or tensors.shape(key) != tuple(expected[name]):
            raise CheckpointError(
                f"{path}: {key} has shape {tensors.shape(key)}, the model {expected.get(name)}"
            )
    try:  # the parameters read now; the momentum read again, one tensor at a time, by whoever restores it
        params = {name: tensors.checked(key) for name, key in names.items()}
        momentum = tensors.subset([k for k in tensors if k.startswith(STATE_PREFIX)])
        for key in momentum:
            momentum.checked(key)
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{path}: {e}") from None
    return SyncerSnapshot(
        run_id=run_id,
        term=term,
        versions=tuple(versions),
        params=params,
        momentum=momentum,
        merges=merges,
        tokens_merged=tokens,
        merged=merged,
        published_wall=published,
        seniority=saved_seniority(metadata.get("seniority"), str(path)),
    )


class TensorFile(Mapping[str, torch.Tensor]):
    """The float32 tensors of a safetensors file, each read when asked for with plain reads into a new tensor (not
    `safetensors.torch.load_file`, which reads the whole file at once through an mmap: a restore held the
    checkpoint's parameters and momentum together). The file stays open while this lives (a pruned checkpoint is
    still read whole). ValueError on a malformed header or a dtype other than F32 (all checkpoints are)."""

    metadata: dict[str, str]
    _entries: dict[str, tuple[tuple[int, ...], int]]  # key -> (shape, offset in the file)

    def __init__(self, path: Path) -> None:
        self.path, self._handle = path, open(path, "rb")  # noqa: SIM115 - closed with this object
        (size,) = struct.unpack("<Q", self._handle.read(8))
        header = json.loads(self._handle.read(size)) if 0 < size <= 100 << 20 else None
        if not isinstance(header, dict):
            raise ValueError("no safetensors header")
        self.metadata = header.pop("__metadata__", None) or {}
        start, end = 8 + size, os.fstat(self._handle.fileno()).st_size
        self._entries = {}
        for key, entry in header.items():
            shape, (begin, stop) = tuple(int(d) for d in entry["shape"]), entry["data_offsets"]
            if entry["dtype"] != "F32" or stop - begin != 4 * math.prod(shape) or start + stop > end:
                raise ValueError(f"{key}: not a whole float32 tensor of the file")
            self._entries[key] = (shape, start + begin)

    def __getitem__(self, key: str) -> torch.Tensor:
        shape, offset = self._entries[key]
        tensor = torch.empty(shape, dtype=torch.float32)
        view, done = tensor.reshape(-1).numpy().data.cast("B"), 0
        while done < view.nbytes:  # preadv: a subset shares the file, not a position; one call reads < 2 GiB
            got = os.preadv(self._handle.fileno(), [view[done:]], offset + done)
            if got <= 0:
                raise OSError(f"{key}: truncated")
            done += got
        return tensor

    def __contains__(self, key: object) -> bool:
        return key in self._entries  # Mapping's own reads the tensor whole

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def shape(self, key: str) -> tuple[int, ...]:
        return self._entries[key][0]

    def checked(self, key: str) -> torch.Tensor:
        """The tensor, ValueError if it holds a non-finite value."""
        tensor = self[key]
        if not bool(torch.isfinite(tensor).all()):
            raise ValueError(f"{key} holds non-finite values")
        return tensor

    def subset(self, keys: Sequence[str]) -> TensorFile:
        """These keys alone, read from the same open file."""
        part = copy.copy(self)
        part._entries = {k: self._entries[k] for k in keys}
        return part


def saved_seniority(text: str | None, source: str) -> SavedSeniority:
    """Optional metadata (older checkpoints lack it); malformed, it is logged and read as none: the learners are
    young again, as in a fresh run, but the parameters still resume."""
    try:
        return seniority_from_json(text) if text else ()
    except SeniorityStateError as e:
        logger.warning("%s: ignoring its seniority state: %s", source, e)
        return ()


def _published_wall(text: str | None, num_fragments: int) -> tuple[float, ...]:
    """Optional metadata (older checkpoints lack it): unknown or malformed reads as no publication times."""
    try:
        values = json.loads(text) if text else []
    except ValueError:
        return ()
    ok = (
        isinstance(values, list)
        and len(values) == num_fragments
        and all(type(v) in (int, float) and math.isfinite(v) and v >= 0 for v in values)
    )
    return tuple(float(v) for v in values) if ok else ()


def ledger_from_json(text: str) -> list[tuple[str, int, int, int, int]]:
    """Parse a merged-counters ledger; ValueError on anything but a list of [peer, fragment, base, steps, tokens]."""
    data = json.loads(text)
    if not isinstance(data, list):
        raise ValueError("ledger is not a list")
    out = []
    for item in data:
        ok = isinstance(item, list) and len(item) == 5 and isinstance(item[0], str) and len(item[0]) <= 128
        if not ok or not all(type(v) is int and v >= 0 for v in item[1:]):
            raise ValueError("bad ledger entry")
        out.append((item[0], item[1], item[2], item[3], item[4]))
    return out
