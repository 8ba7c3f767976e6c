"""Where the syncer core keeps the global parameters (the current version of every fragment): `MemoryParams`, a
tensor per name in memory, or `DiskParams`, one spill file per fragment (node.diloco.spill) read a tensor or a
chunk at a time when asked for (`[syncer] params_on_disk`, issue 17: the syncer's resident memory was the process
plus the whole model, 1.28 x the bound of model bytes + 2 fragments at llama-124m by itself; docs/scale.md).

Both are a `ParamStore`: a read-only mapping name -> tensor (a disk store's `[name]` reads a fresh copy), the
fragment's tensors (`fragment`), what the core's `VersionHistory` keeps for the current version (`entry`: the
tensors, or the key of their file), a published version taken over (`publish`), a version written in (`put`:
adoption and restore), and a frozen view for snapshots (`view`). A disk store's file is never written once made (a
new version is a new key), and what it hands out is pinned (held open), so a snapshot, a probe or a fetch still
reads the version it was given after the history deleted its key."""

from __future__ import annotations

import math
import os
from abc import abstractmethod
from collections.abc import Iterator, Mapping, Sequence
from typing import Protocol

import torch

from node.diloco import chunked
from node.diloco.fragments import FragmentPlan
from node.diloco.spill import SpillDir, SpilledTensors

# stands in for a tensor of the params while its replacement is read (`MemoryParams.swap_in`)
_DROPPED = torch.empty(0)
# what the history keeps for a version: its tensors, or the key of its file in the spill directory
Entry = dict[str, torch.Tensor] | str


class VersionHistory(Protocol):
    """What a store needs of the core's history (node.diloco.syncer_core.VersionHistory) to swap a version in."""

    tensors: dict[int, dict[int, Entry]]

    def retire(self, fragment: int, version: int, spilled: str) -> None: ...

    def at(self, fragment: int, version: int) -> Mapping[str, torch.Tensor] | None: ...

    def discard(self, entry: Entry | None) -> None: ...


def owned(tensor: torch.Tensor, *, copy: bool) -> torch.Tensor:
    """`tensor` as the core's own float32 CPU tensor: copied, or (handed over) converted only if it must be."""
    out = tensor.detach().to("cpu", torch.float32)
    return out.clone() if copy else out


class ParamStore(Mapping[str, torch.Tensor]):
    """The global parameters by name, in the plan's order (see the module docstring)."""

    on_disk = False

    def __init__(self, plan: FragmentPlan, shapes: Mapping[str, tuple[int, ...]]) -> None:
        self.plan = plan
        self.shapes = dict(shapes)

    @abstractmethod
    def fragment(self, fragment: int) -> Mapping[str, torch.Tensor]:
        """The fragment's current tensors (never written in place: a new version replaces them)."""

    @abstractmethod
    def entry(self, fragment: int) -> Entry:
        """What `VersionHistory` keeps for the fragment's current version."""

    @abstractmethod
    def publish(
        self,
        fragment: int,
        new: Mapping[str, torch.Tensor],
        history: VersionHistory,
        version: int,
        spilled: str | None,
    ) -> tuple[Entry, str | None]:
        """A merge's new version of the fragment (current `version` in `history`; `spilled`: the current one's file,
        if the merge wrote it) becomes the current one: (the history's entry for it, the file of the replaced one)."""

    @abstractmethod
    def put(self, fragment: int, tensors: Mapping[str, torch.Tensor]) -> None:
        """Take `tensors` (the fragment's, any float dtype, not kept) as its current version."""

    @abstractmethod
    def load(self, params: Mapping[str, torch.Tensor]) -> None:
        """A restore: every fragment's current version taken from `params` (a snapshot's)."""

    @abstractmethod
    def view(self) -> Mapping[str, torch.Tensor]:
        """Every parameter as it is now, unchanged by later versions (a snapshot's; not written into)."""

    def shape_of(self, name: str) -> tuple[int, ...]:
        return self.shapes[name]

    def __contains__(self, name: object) -> bool:
        return name in self.shapes  # Mapping's own reads a tensor on disk whole

    def __iter__(self) -> Iterator[str]:
        return iter(self.shapes)

    def __len__(self) -> int:
        return len(self.shapes)


class MemoryParams(ParamStore):
    """Every tensor in memory (the default)."""

    def __init__(self, plan: FragmentPlan, params: Mapping[str, torch.Tensor], *, copy: bool) -> None:
        self.tensors = {n: owned(params[n], copy=copy) for n in plan.names()}
        super().__init__(plan, {n: tuple(t.shape) for n, t in self.tensors.items()})

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.tensors[name]

    def fragment(self, fragment: int) -> dict[str, torch.Tensor]:
        return {n: self.tensors[n] for n in self.plan.fragments[fragment].names}

    def entry(self, fragment: int) -> Entry:
        return self.fragment(fragment)

    def publish(
        self,
        fragment: int,
        new: Mapping[str, torch.Tensor],
        history: VersionHistory,
        version: int,
        spilled: str | None,
    ) -> tuple[Entry, str | None]:
        if isinstance(new, SpilledTensors):
            # a merge writes its new version to a file only with a spill directory
            assert spilled is not None
            new, spilled = self.swap_in(fragment, new, history, version, spilled), None
        self.tensors.update(new)
        return dict(new), spilled

    def swap_in(
        self, fragment: int, new: SpilledTensors, history: VersionHistory, version: int, spilled: str
    ) -> dict[str, torch.Tensor]:
        """The new version read from its file, each tensor only after the one it replaces was dropped (the replaced
        version goes to its file `spilled` in the history first): the commit adds no fragment-sized buffer (issue 17;
        a snapshot or a probe still holding the old tensors keeps them alive, unchanged). A failed read puts the
        replaced version back from its file and raises."""
        names = self.plan.fragments[fragment].names
        history.retire(fragment, version, spilled)
        fresh: dict[str, torch.Tensor] = {}
        try:
            for name in names:
                # dropped in place (the history's reference went with `retire`): the dict keeps its order
                self.tensors[name] = _DROPPED
                fresh[name] = self.tensors[name] = new[name]
        except BaseException:
            old = history.at(fragment, version)
            assert old is not None
            for name in names:
                self.tensors[name] = _DROPPED
                self.tensors[name] = old[name]
            history.tensors[fragment][version] = self.fragment(fragment)
            history.discard(spilled)
            raise
        return fresh

    def put(self, fragment: int, tensors: Mapping[str, torch.Tensor]) -> None:
        for name in self.plan.fragments[fragment].names:
            self.tensors[name] = owned(tensors[name], copy=True)

    def load(self, params: Mapping[str, torch.Tensor]) -> None:
        """A restore's tensors, shared with its snapshot, not copied: neither side writes a tensor in place (a copy
        was one model more at every restore)."""
        self.tensors = {n: owned(params[n], copy=False) for n in self.plan.names()}

    def view(self) -> dict[str, torch.Tensor]:
        return dict(self.tensors)


class DiskParams(ParamStore):
    """One spill file per fragment, pinned; `[name]` reads the tensor, `chunk` a slice (node.diloco.chunked), and
    `streamed` names every tensor, so the syncer's forward passes (node.ml.streamed_forward) read them by range.
    The files' keys are the history's entries for the current versions: the history deletes them when it drops a
    version; a new version is a new file (a merge's own file taken over by a rename: no read, no write)."""

    on_disk = True

    def __init__(self, plan: FragmentPlan, params: Mapping[str, torch.Tensor], spill: SpillDir) -> None:
        # (shapes without reading: `params` may draw each tensor when read, node.ml.model.SeedParameters)
        super().__init__(plan, {n: chunked.shape(params, n) for n in plan.names()})
        self.spill = spill
        self.streamed = frozenset(self.shapes)
        self._fragment_of = {n: f.index for f in plan.fragments for n in f.names}
        self.files: list[SpilledTensors] = []
        for fragment in range(plan.num_fragments):
            self.files.append(self._written(fragment, params))

    def _written(self, fragment: int, tensors: Mapping[str, torch.Tensor]) -> SpilledTensors:
        """The fragment's tensors in a new file, a tensor in memory at a time (as float32)."""
        key = self.spill.new_key(f"params-{fragment}")
        names = self.plan.fragments[fragment].names
        self.spill.write(key, _Float32(tensors, names))
        return SpilledTensors(self.spill, key, pinned=True)

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.files[self._fragment_of[name]][name]

    def chunk(self, name: str, start: int, stop: int) -> torch.Tensor:
        return self.files[self._fragment_of[name]].chunk(name, start, stop)

    def fragment(self, fragment: int) -> SpilledTensors:
        return self.files[fragment]

    def entry(self, fragment: int) -> Entry:
        return self.files[fragment].key

    def publish(
        self,
        fragment: int,
        new: Mapping[str, torch.Tensor],
        history: VersionHistory,
        version: int,
        spilled: str | None,
    ) -> tuple[Entry, str | None]:
        current = self.files[fragment]
        if isinstance(new, SpilledTensors) and new.spill is self.spill and new.key == current.key:
            # a void round: the same file is the next version too (the history deletes a key no version holds)
            return current.key, None
        if isinstance(new, SpilledTensors) and new.spill is self.spill and new.owned:
            # the merge's own file (its outer step wrote the new parameters into it): renamed, so that its owner's
            # deletion when it is dropped misses it
            key = self.spill.new_key(f"params-{fragment}")
            os.replace(self.spill.directory / new.key, self.spill.directory / key)
            self.files[fragment] = SpilledTensors(self.spill, key, pinned=True)
        else:
            self.files[fragment] = self._written(fragment, new)
        return self.files[fragment].key, None

    def put(self, fragment: int, tensors: Mapping[str, torch.Tensor]) -> None:
        self.files[fragment] = self._written(fragment, tensors)

    def load(self, params: Mapping[str, torch.Tensor]) -> None:
        """A restore's tensors, written a fragment's file at a time, a tensor in memory at a time."""
        self.files = [self._written(f, params) for f in range(self.plan.num_fragments)]

    def view(self) -> FilesView:
        return FilesView(tuple(self.files), self.shapes)


class FilesView(Mapping[str, torch.Tensor]):
    """The parameters in the files they were in when the view was taken (pinned: readable after the store moved on
    and the history deleted their keys), read a tensor or a range at a time; `streamed` as `DiskParams`."""

    def __init__(self, files: Sequence[SpilledTensors], shapes: Mapping[str, tuple[int, ...]]) -> None:
        self.files, self.shapes = files, shapes
        self._source = {name: file for file in files for name in file}
        self.streamed = frozenset(self._source)

    def chunk(self, name: str, start: int, stop: int) -> torch.Tensor:
        return self._source[name].chunk(name, start, stop)

    def shape_of(self, name: str) -> tuple[int, ...]:
        return self.shapes[name]

    def __getitem__(self, name: str) -> torch.Tensor:
        return self._source[name][name]

    def __contains__(self, name: object) -> bool:
        return name in self._source

    def __iter__(self) -> Iterator[str]:
        return iter(self.shapes)

    def __len__(self) -> int:
        return len(self.shapes)


class _Float32(Mapping[str, torch.Tensor]):
    """`names` of `tensors` as float32 on the CPU, each converted when read (`SpillDir.write` takes one at a time)."""

    def __init__(self, tensors: Mapping[str, torch.Tensor], names: Sequence[str]) -> None:
        self.tensors, self.names = tensors, names

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.tensors[name].detach().to("cpu", torch.float32)

    def __iter__(self) -> Iterator[str]:
        return iter(self.names)

    def __len__(self) -> int:
        return len(self.names)


def new_store(
    plan: FragmentPlan,
    params: Mapping[str, torch.Tensor],
    *,
    spill: SpillDir | None,
    on_disk: bool,
    copy: bool,
) -> ParamStore:
    """The core's store: on disk when asked to (it needs the spill directory), else in memory (`copy`: unless the
    caller handed `params` over)."""
    if not on_disk:
        return MemoryParams(plan, params, copy=copy)
    if spill is None:
        raise ValueError("params on disk need a spill directory")
    return DiskParams(plan, params, spill)


def fragment_bytes(store: ParamStore, fragment: int) -> int:
    """The fragment's float32 bytes, from the shapes alone."""
    return 4 * sum(math.prod(store.shapes[n]) for n in store.plan.fragments[fragment].names)
