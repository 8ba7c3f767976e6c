"""Fragment-sized state the syncer keeps on disk instead of in memory (issue 17: resident memory ~ the model).

`SpillDir` holds sets of float32 tensors, one file each: written whole under a temporary name and renamed (a reader
never sees half of one), read back with explicit reads into fresh tensors. No mmap: mapped pages a process touched
count in its RSS; what sits in the page cache after a read or a write does not, and the kernel drops it under
pressure. The files are a working store, not durable state: the checkpoint (node.ml.checkpoint) holds what a restart
resumes from, so the directory is emptied when a store opens it and nothing is fsynced.

`SpilledMomentum` keeps the outer Nesterov momentum of each fragment in a file of its own, a new file (generation) per
outer step: a checkpoint snapshot names the generations it was taken at (`MomentumView`) and the files stay until no
live view names them, so a checkpoint written in a thread while merges go on still writes the momentum of its
moment, one fragment in memory at a time."""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import itertools
import json
import math
import os
import shutil
import struct
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path

import torch

from node.diloco import chunked
from node.diloco.outer import STATE_PREFIX, checked_buffers

_HEADER = struct.Struct("<Q")


class SpillDir:
    """Named files of float32 tensors in one directory, emptied when opened (see the module docstring)."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        if directory.exists():
            shutil.rmtree(directory)  # a previous process's files: nothing resumes from them
        directory.mkdir(parents=True)
        self._serial = itertools.count()

    def new_key(self, prefix: str) -> str:
        """A file name never used before in this directory (a key is written once and never rewritten)."""
        return f"{prefix}-{next(self._serial)}"

    def write(self, key: str, tensors: Mapping[str, torch.Tensor]) -> None:
        """Write `tensors` (float32, any device) under `key`: a temporary file renamed onto its name."""
        layout = [[name, list(t.shape)] for name, t in tensors.items()]
        header = json.dumps(layout).encode()
        tmp = self.directory / f".{key}.tmp"
        with open(tmp, "wb") as handle:
            handle.write(_HEADER.pack(len(header)) + header)
            for name, tensor in tensors.items():
                if tensor.dtype != torch.float32:
                    raise ValueError(f"{name}: spilled tensors are float32, not {tensor.dtype}")
                data = tensor.detach().to("cpu").contiguous().reshape(-1)
                handle.write(data.numpy().data.cast("B"))
        os.replace(tmp, self.directory / key)

    def write_stream(
        self, key: str, layout: Sequence[tuple[str, tuple[int, ...]]], chunks: Iterable[torch.Tensor]
    ) -> None:
        """Write tensors of `layout` (name, shape) under `key` from `chunks`, their float32 values in order (each
        tensor flattened, the tensors one after the other), a chunk in memory at a time; ValueError if the chunks
        do not add up to the layout (nothing written)."""
        header = json.dumps([[name, list(shape)] for name, shape in layout]).encode()
        expected = sum(math.prod(shape) for _, shape in layout)
        tmp, written = self.directory / f".{key}.tmp", 0
        try:
            with open(tmp, "wb") as handle:
                handle.write(_HEADER.pack(len(header)) + header)
                for chunk in chunks:
                    if chunk.dtype != torch.float32:
                        raise ValueError(f"spilled tensors are float32, not {chunk.dtype}")
                    data = chunk.detach().to("cpu").contiguous().reshape(-1)
                    handle.write(data.numpy().data.cast("B"))
                    written += data.numel()
            if written != expected:
                raise ValueError(f"{key}: {written} values written for a layout of {expected}")
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        os.replace(tmp, self.directory / key)

    def create(self, key: str, layout: Sequence[tuple[str, tuple[int, ...]]]) -> SpilledTensors:
        """A new file under `key` for tensors of `layout` (name, shape), made at its size (zeros) and filled a chunk at
        a time anywhere (`SpilledTensors.put`) while it is read: the merge's outer gradient, computed a chunk at a
        time, then overwritten by the outer step with the new parameters (issue 17: no fragment-sized buffer in a
        merge). Owned: deleted once the returned mapping is unreferenced. The key is new: nobody reads it half made."""
        header = json.dumps([[name, list(shape)] for name, shape in layout]).encode()
        total = _HEADER.size + len(header) + 4 * sum(math.prod(shape) for _, shape in layout)
        with open(self.directory / key, "wb") as handle:
            handle.write(_HEADER.pack(len(header)) + header)
            handle.truncate(total)
        return SpilledTensors(self, key, owned=True)

    def tensors(self, key: str, *, owned: bool = False) -> SpilledTensors:
        """The tensors under `key`, read a tensor or a chunk at a time when asked for; `owned`: the file is
        deleted once the returned mapping is no longer referenced (a contribution held on disk)."""
        return SpilledTensors(self, key, owned=owned)

    def read(self, key: str) -> dict[str, torch.Tensor]:
        """The tensors written under `key`, read into new tensors (FileNotFoundError if there is none)."""
        with open(self.directory / key, "rb") as handle:
            (size,) = _HEADER.unpack(handle.read(_HEADER.size))
            layout = json.loads(handle.read(size))
            out: dict[str, torch.Tensor] = {}
            for name, shape in layout:
                tensor = torch.empty(shape, dtype=torch.float32)
                view = tensor.reshape(-1).numpy().data.cast("B")
                if handle.readinto(view) != view.nbytes:
                    raise OSError(f"{self.directory / key}: truncated at {name}")
                out[name] = tensor
        return out

    def delete(self, key: str) -> None:
        (self.directory / key).unlink(missing_ok=True)


class SpilledTensors(Mapping[str, torch.Tensor]):
    """A file of `SpillDir` as name -> tensor, nothing held: `[name]` reads that tensor, `chunk` a slice of its
    flattened values (node.diloco.chunked). With `owned`, the file goes when this mapping is garbage."""

    def __init__(
        self,
        spill: SpillDir,
        key: str,
        *,
        owned: bool = False,
        where: Mapping[str, tuple[int, tuple[int, ...]]] | None = None,
        pinned: bool = False,
    ) -> None:
        self.spill, self.key = spill, key
        path = spill.directory / key
        # `pinned`: the file is opened now and read through that descriptor, so it stays readable if its key is
        # deleted meanwhile (a version the history drops while the loss probe's thread still reads it as a base)
        self._fd: int | None = None
        if pinned:
            self._fd = fd = os.open(path, os.O_RDONLY)
            weakref.finalize(self, os.close, fd)
        self._where: dict[str, tuple[int, tuple[int, ...]]] = {}
        if where is not None:  # a file of another layout (a received push frame): name -> (offset, shape)
            self._where.update(where)
        else:
            with open(path, "rb") as handle:
                (size,) = _HEADER.unpack(handle.read(_HEADER.size))
                layout = json.loads(handle.read(size))
            offset = _HEADER.size + size
            for name, shape in layout:
                self._where[name] = (offset, tuple(shape))
                offset += 4 * math.prod(shape)
        self.owned = owned
        if owned:
            weakref.finalize(self, path.unlink, missing_ok=True)

    def shape_of(self, name: str) -> tuple[int, ...]:
        return self._where[name][1]

    def put(self, name: str, start: int, values: torch.Tensor) -> None:
        """Overwrite values [start, start + numel) of tensor `name`, flattened, with `values` (float32): a file of
        `SpillDir.create` being filled (a file others may be reading is never written: keys are written once)."""
        offset, shape = self._where[name]
        if values.dtype != torch.float32 or start < 0 or start + values.numel() > math.prod(shape):
            raise ValueError(f"{name}: {values.numel()} {values.dtype} values do not fit at {start}")
        data = values.detach().to("cpu").contiguous().reshape(-1).numpy().data.cast("B")
        with open(self.spill.directory / self.key, "r+b") as handle:
            handle.seek(offset + 4 * start)
            handle.write(data)

    def chunk(self, name: str, start: int, stop: int) -> torch.Tensor:
        """Values [start, stop) of tensor `name`, flattened, read into a new tensor."""
        offset, shape = self._where[name]
        stop = min(stop, math.prod(shape))
        out = torch.empty(max(0, stop - start), dtype=torch.float32)
        view = out.numpy().data.cast("B")
        if self._fd is not None:
            if view.nbytes and os.preadv(self._fd, [view], offset + 4 * start) != view.nbytes:
                raise OSError(f"{self.spill.directory / self.key}: truncated at {name}")
            return out
        with open(self.spill.directory / self.key, "rb") as handle:
            handle.seek(offset + 4 * start)
            if view.nbytes and handle.readinto(view) != view.nbytes:
                raise OSError(f"{self.spill.directory / self.key}: truncated at {name}")
        return out

    def __getitem__(self, name: str) -> torch.Tensor:
        shape = self._where[name][1]
        return self.chunk(name, 0, math.prod(shape)).reshape(shape)

    def __contains__(self, name: object) -> bool:
        return name in self._where  # Mapping's own reads the tensor whole

    def __iter__(self) -> Iterator[str]:
        return iter(self._where)

    def __len__(self) -> int:
        return len(self._where)


class ScaledTensors(Mapping[str, torch.Tensor]):
    """The tensors of a spill file, each multiplied by its factors in order as it is read (`chunk`, `[name]`): the
    merge's RDA factor and the seniority cap's scale, applied as the in-memory path applies them to its tensors
    (`mul_` after `mul_`: the same float32 values), without rewriting the file."""

    def __init__(self, file: SpilledTensors) -> None:
        self.file = file
        self.factors: dict[str, list[float]] = {name: [] for name in file}

    def scale(self, name: str, factor: float) -> None:
        self.factors[name].append(factor)

    def scale_all(self, factor: float) -> None:
        for name in self.factors:
            self.scale(name, factor)

    def shape_of(self, name: str) -> tuple[int, ...]:
        return self.file.shape_of(name)

    def chunk(self, name: str, start: int, stop: int) -> torch.Tensor:
        values = self.file.chunk(name, start, stop)
        for factor in self.factors[name]:
            values.mul_(factor)
        return values

    def __getitem__(self, name: str) -> torch.Tensor:
        shape = self.shape_of(name)
        return self.chunk(name, 0, math.prod(shape)).reshape(shape)

    def __contains__(self, name: object) -> bool:
        return name in self.factors  # Mapping's own reads the tensor whole

    def __iter__(self) -> Iterator[str]:
        return iter(self.factors)

    def __len__(self) -> int:
        return len(self.factors)


class SpilledMomentum:
    """The outer momentum buffers of each fragment in a file per generation (see the module docstring); generation
    None: the fragment has no buffers yet (never stepped)."""

    def __init__(self, spill: SpillDir, fragments: Sequence[Sequence[str]]) -> None:
        self.spill = spill
        self.fragment_of = {name: f for f, names in enumerate(fragments) for name in names}
        self.files: list[str | None] = [None] * len(fragments)
        self.shapes: list[dict[str, tuple[int, ...]]] = [{} for _ in fragments]
        # the live views by serial (a Mapping is unhashable, and its == would read every file)
        self._views: weakref.WeakValueDictionary[int, MomentumView] = weakref.WeakValueDictionary()
        self._serial = itertools.count()
        self._stale: set[str] = set()  # replaced files a live view may still read

    def load(self, fragment: int) -> dict[str, torch.Tensor]:
        """The fragment's buffers (name -> tensor, fresh copies), {} before its first step."""
        key = self.files[fragment]
        return {} if key is None else self.spill.read(key)

    def store(self, fragment: int, buffers: Mapping[str, torch.Tensor]) -> None:
        """The fragment's new buffers (all of them: they replace the previous generation's)."""
        key = self.spill.new_key(f"momentum-{fragment}")
        self.spill.write(key, buffers)
        old, self.files[fragment] = self.files[fragment], key
        self.shapes[fragment] = {name: tuple(t.shape) for name, t in buffers.items()}
        if old is not None:
            self._stale.add(old)
        self._prune()

    def current(self, fragment: int) -> SpilledTensors | None:
        """The fragment's buffers as they are, read a chunk at a time when used (None before its first step)."""
        key = self.files[fragment]
        return None if key is None else self.spill.tensors(key)

    def store_stream(
        self, fragment: int, layout: Sequence[tuple[str, tuple[int, ...]]], chunks: Iterable[torch.Tensor]
    ) -> None:
        """`store` from chunks (`SpillDir.write_stream`): nothing changes if `chunks` raises."""
        key = self.spill.new_key(f"momentum-{fragment}")
        self.spill.write_stream(key, layout, chunks)
        old, self.files[fragment] = self.files[fragment], key
        self.shapes[fragment] = dict(layout)
        if old is not None:
            self._stale.add(old)
        self._prune()

    def restore(self, state: Mapping[str, torch.Tensor]) -> None:
        """A restore: `state` (keyed as `OuterNesterov.state_dict` keys it, maybe read lazily: a checkpoint's)
        becomes the whole momentum, read, checked and written one fragment at a time. ValueError (as
        `OuterNesterov.load_state_dict`) on a foreign key, a dtype or a non-finite value; keys are checked before
        anything changes, values as each fragment is read."""
        groups: list[list[str]] = [[] for _ in self.files]
        for key in state:
            fragment = (
                self.fragment_of.get(key[len(STATE_PREFIX) :]) if key.startswith(STATE_PREFIX) else None
            )
            if fragment is None:
                raise ValueError(f"unexpected key in outer optimiser state: {key!r}")
            groups[fragment].append(key)
        for fragment, keys in enumerate(groups):
            if keys:
                self.store(fragment, checked_buffers({k: state[k] for k in keys}, copy=False))
            elif (old := self.files[fragment]) is not None:
                self.files[fragment], self.shapes[fragment] = None, {}
                self._stale.add(old)
        self._prune()

    def view(self) -> MomentumView:
        """The momentum as it is now, read lazily (a checkpoint snapshot's `momentum`)."""
        view = MomentumView(self.spill, tuple(self.files), [dict(s) for s in self.shapes])
        self._views[next(self._serial)] = view
        return view

    def _prune(self) -> None:
        held = {key for view in list(self._views.values()) for key in view.files if key is not None}
        for key in self._stale - held:
            self.spill.delete(key)
        self._stale &= held


class MomentumView(Mapping[str, torch.Tensor]):
    """The momentum at one moment, keyed as `OuterNesterov.state_dict` keys it (STATE_PREFIX + name), in fragment
    order; a read loads the tensor's whole fragment and keeps that one fragment (iterating it in order reads each
    file once). Its files are kept while the view lives."""

    def __init__(
        self, spill: SpillDir, files: tuple[str | None, ...], shapes: list[dict[str, tuple[int, ...]]]
    ) -> None:
        self.spill, self.files, self.shapes = spill, files, shapes
        self._where = {STATE_PREFIX + n: f for f, group in enumerate(shapes) for n in group}
        self._cached: tuple[int, dict[str, torch.Tensor]] | None = None

    def __getitem__(self, key: str) -> torch.Tensor:
        fragment = self._where[key]
        if self._cached is None or self._cached[0] != fragment:
            self._cached = None  # the previous fragment goes before the next one is read
            file = self.files[fragment]
            assert file is not None
            self._cached = (fragment, self.spill.read(file))
        return self._cached[1][key[len(STATE_PREFIX) :]]

    def __iter__(self) -> Iterator[str]:
        return iter(self._where)

    def __len__(self) -> int:
        return len(self._where)

    def shape(self, key: str) -> tuple[int, ...]:
        return self.shapes[self._where[key]][key[len(STATE_PREFIX) :]]

    def pieces(self, key: str) -> tuple[tuple[int, ...], Iterator[torch.Tensor]]:
        """(shape, its values in chunks, read from its file a chunk at a time as they are consumed): a
        checkpoint writes a buffer without holding it (node.ml.checkpoint `Pieces`)."""
        fragment, name = self._where[key], key[len(STATE_PREFIX) :]
        file = self.files[fragment]
        assert file is not None
        shape = self.shapes[fragment][name]

        def chunks() -> Iterator[torch.Tensor]:
            tensors = self.spill.tensors(file)
            for start, stop in chunked.ranges(math.prod(shape)):
                yield tensors.chunk(name, start, stop)

        return shape, chunks()


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    name = ctypes.util.find_library("c")
    try:
        return ctypes.CDLL(name).malloc_trim if name else None
    except (OSError, AttributeError):  # not glibc: nothing to trim
        return None


# glibc's mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
RELEASE_AT_BYTES = 1 << 20  # blocks from 1 MiB up are given back to the kernel when freed


@functools.cache
def _mallopt() -> Callable[[int, int], int] | None:
    name = ctypes.util.find_library("c")
    try:
        return ctypes.CDLL(name).mallopt if name else None
    except (OSError, AttributeError):  # not glibc
        return None


def release_large_blocks_when_freed(
    mmap_bytes: int = RELEASE_AT_BYTES, trim_bytes: int = RELEASE_AT_BYTES
) -> bool:
    """Make glibc give blocks of `threshold_bytes` or more back to the kernel as they are freed, in every thread
    (fixed mmap and trim thresholds); False where it could not (not glibc). Why: `release_freed_memory` does not
    reach a worker thread's heap. The loss probe's forward passes run off the event loop (`asyncio.to_thread`),
    where glibc serves them from that thread's own arena, and `malloc_trim` trims only the main arena's top: the
    pass's ~30 MiB of 4 MiB blocks and logits stayed resident there after every score, under the next merge (llama-1b
    at P = 16: ratio 1.011-1.012 with the probe on, 0.999 off; docs/scale.md). Fixed thresholds also stop glibc
    raising them as blocks are freed (its dynamic thresholds: the mmap one up to 32 MiB, the trim one to twice
    that), which kept such blocks in a heap; a block over the mmap threshold is its own mapping, unmapped when
    freed. Process-wide; the cost is a mapping and its page faults per large block (the merge's and probe's chunks
    are 4 MiB: ~1 ms each)."""
    mallopt = _mallopt()
    if mallopt is None:
        return False
    return bool(mallopt(_M_MMAP_THRESHOLD, mmap_bytes)) and bool(mallopt(_M_TRIM_THRESHOLD, trim_bytes))


def release_freed_memory() -> None:
    """Give the pages the allocator holds free back to the kernel (glibc's `malloc_trim`; elsewhere nothing). A
    merge's fragment-sized temporaries come from glibc's heap once its dynamic mmap threshold has risen (to the
    largest block freed, up to 32 MiB), and freed there they stayed in the syncer's RSS: 0.45 GiB of a llama-124m
    syncer core's 1.44 GiB after its round (docs/scale.md). Called after a merge, once its round is dropped."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)
