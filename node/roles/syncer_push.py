"""The syncer's push route with the push received into a spill file (issue 17: the syncer's peak RSS ~ the model).

A push is one fragment of the model. Held whole in the route's receive buffer, it was a fragment of resident memory
on top of the model through the whole accept (the 1B syncer's peak, docs/scale.md). So the route asks the stream
layer (`protocol.rpc.SpillRoute`) to write a push of `PUSH_SPILL_MIN_BYTES` or more into a file of the core's spill
directory as its chunks arrive. The file is checked as a frame in memory is (`protocol.frame_file.open_frame_file`:
signature, context, replay, digest and the finite values, before any tensor is read), then its tensors are read
from it a chunk at a time when used (`SpilledTensors` over the frame's layout), which the core's screen, copy check
and merge already do for a contribution it holds on disk.

The file's lifetime: until the open takes it, the stream layer removes it when the route returns or fails (a
truncated, oversize or refused frame leaves nothing). Once taken it belongs to the push's `SpilledTensors`
(owned: deleted when that mapping is dropped): the core keeps that mapping as the contribution it holds
(`syncer_core.held`), so the file goes when the contribution is merged, replaced or its round dropped, and a push
refused after the open goes with the refusal."""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from node.diloco.learner_ledger import frame_digest
from node.diloco.spill import SpilledTensors
from protocol.envelope import Context, Header, MetaValue
from protocol.frame_file import FrameFile, OpenedFile, open_frame_file

if TYPE_CHECKING:
    from node.diloco.syncer_core import SyncerCore
    from protocol.codec import TensorLimits
    from protocol.replay import ReplayGuard

# Smaller pushes stay in memory: a file costs a create and an unlink, and holding a few chunks is no memory matter.
PUSH_SPILL_MIN_BYTES = 8 << 20


@dataclass(frozen=True, slots=True)
class OpenedPush:
    """A push frame that passed every check, its tensors in memory or read from its file when used."""

    header: Header
    tensors: Mapping[str, torch.Tensor]

    @property
    def meta(self) -> Mapping[str, MetaValue]:
        return self.header.meta


def push_spill_dir(core: SyncerCore | None) -> Path | None:
    """Where a push is received to: the core's spill directory (None without one: in memory)."""
    spill = core.history.spill if core is not None else None
    return spill.directory if spill is not None else None


def open_push_file(
    frame: FrameFile,
    *,
    remote: str,
    expect: Context,
    limits: TensorLimits,
    replay: ReplayGuard,
    core: SyncerCore | None,
    codec: str,
) -> OpenedPush:
    """A push received into a file, checked (`open_frame_file`, which raises as `open_envelope` does), with its
    tensors read from the file (`file_tensors`)."""
    opened = open_frame_file(
        frame, remote_peer=remote, expect=expect, limits=limits, replay=replay, now=time.time()
    )
    return OpenedPush(opened.header, file_tensors(opened, core, codec, limits))


def file_tensors(
    opened: OpenedFile, core: SyncerCore | None, codec: str, limits: TensorLimits
) -> Mapping[str, torch.Tensor]:
    """The tensors of a checked push file, read a chunk at a time from the file, which they then own (see the
    module docstring), where the core can hold it so: every tensor float32 (what a spill file holds), an fp32 push
    (a compressed one is decoded into memory anyway) and the file in the core's spill directory. Else read into
    memory (the file is then the stream layer's to remove)."""
    spill = core.history.spill if core is not None else None
    frame = opened.frame
    in_place = (
        spill is not None
        and codec == "fp32"
        and frame.path.parent.resolve() == spill.directory.resolve()
        and all(place.dtype == "float32" for place in opened.places.values())
    )
    if not in_place:
        return opened.read_tensors(limits)
    assert spill is not None
    where = {name: (place.offset, place.shape) for name, place in opened.places.items()}
    tensors = SpilledTensors(spill, frame.path.name, owned=True, where=where)
    frame.take()  # (after the mapping that deletes it exists: no moment where nobody would)
    return tensors


def evidence_digest(frame: Any) -> str:
    """sha256 of a refused push's signed frame (the learner ledger's evidence), in memory or in its file."""
    return frame.sha256() if isinstance(frame, FrameFile) else frame_digest(frame)
