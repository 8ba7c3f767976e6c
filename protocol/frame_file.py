"""A request frame received into a file as its chunks arrive, and how such a frame is opened (issue 17).

A route that takes fragment-sized frames (the syncer's push) may ask the stream layer (`protocol.rpc.SpillRoute`) to
write a large request to a file of a directory it names instead of growing a buffer: the receiver then holds a
chunk at a time, whatever the frame's size, and the frame waits in the page cache, which the kernel may drop and
which is not the process's RSS. The wire format is the same; only where the receiver puts the bytes differs.

`FileSink` is that file while it fills: every chunk is written where `rpc.Reassembler` would have put it in memory
(the head of a frame sent head last goes in front), and the payload is hashed chunk by chunk as it arrives
(`envelope.FrameDigester`, fed the chunk itself). Anything that stops the transfer (a chunk over the declared total,
a truncated stream, a timeout, a refusal for load) removes the file (`discard`).

`open_frame_file` checks a received file exactly as `envelope.open_envelope` checks a frame in memory and in the
same order (size cap, header, signer, signature, context, replay, byte counts: `envelope.check_head`; then the
digest, then the finite-value policy read a piece at a time): no tensor is built and nothing of the payload is
handed on before all of that passed. It returns where each tensor lies in the file; the caller reads it from
there (`node.roles.syncer_push` maps the file as the syncer's spill files are read, a chunk at a time)."""

from __future__ import annotations

import hashlib
import os
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import blake3
import torch

from protocol import codec
from protocol.codec import TensorLimits
from protocol.envelope import (
    DIGEST_SIZE,
    MAX_HEADER_BYTES,
    Expectation,
    FrameDigester,
    Header,
    check_head,
    max_frame_bytes,
    split_frame,
)
from protocol.errors import DigestMismatch, FrameTooLarge, TensorPolicyError
from protocol.identity import SIGNATURE_SIZE
from protocol.replay import ReplayGuard

FILE_PREFIX = ".frame-"  # never a `node.diloco.spill.SpillDir` key (those are `<prefix>-<serial>`)
READ_PIECE_BYTES = 4 << 20  # what a check reads of the file at a time: the most it holds of the payload
_LENGTH_BYTES = 4  # the frame's u32 header length, which the digester reads to find the payload


class FileSink:
    """A frame being received into a new file of `directory` (see the module docstring). `head_bytes` > 0: the
    frame's first `head_bytes` bytes arrive last, and the payload is written after their place."""

    def __init__(self, directory: Path, total_bytes: int, head_bytes: int = 0) -> None:
        fd, name = tempfile.mkstemp(dir=directory, prefix=FILE_PREFIX)
        self.fd: int | None = fd
        self.path = Path(name)
        self.total_bytes = total_bytes
        self._end = head_bytes  # where the next in-order byte goes
        self.prefix = bytearray()  # the frame's first bytes (its header length), for the digester
        self.digester: FrameDigester | None = None

    def __len__(self) -> int:
        """Bytes placed so far (with the head's place, when the head comes last), as a buffer would hold."""
        return self._end

    def extend(self, data: memoryview) -> None:
        """The next in-order bytes."""
        if len(self.prefix) < _LENGTH_BYTES and self._end < _LENGTH_BYTES:
            self.prefix += data[: _LENGTH_BYTES - self._end]
        self._write(self._end, data)
        self._end += len(data)

    def place(self, offset: int, data: memoryview) -> None:
        """Bytes of the head (sent last) at their place in front (the digester was given the payload's offset)."""
        self._write(offset, data)

    def _write(self, offset: int, data: memoryview) -> None:
        assert self.fd is not None
        while data:  # a regular file takes it whole; the loop covers a short write
            written = os.pwrite(self.fd, data, offset)
            data, offset = data[written:], offset + written

    def finish(self) -> FrameFile:
        """The whole frame arrived (the caller checked its size): the file, closed."""
        self._close()
        return FrameFile(self.path, self.total_bytes, self.digester)

    def discard(self) -> None:
        """The transfer failed: the file goes."""
        self._close()
        self.path.unlink(missing_ok=True)

    def _close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


class FrameFile:
    """A whole frame received into a file, with the payload digest computed as it arrived.

    The stream layer removes the file once the route's handler returned (`remove`) unless the handler took it over
    (`take`): a handler that keeps its tensors on disk past the request (the syncer's push, held until its round
    merges) owns the file from then on."""

    def __init__(self, path: Path, size: int, digester: FrameDigester | None = None) -> None:
        self.path, self.size, self.digester = path, size, digester
        self.taken = False

    def __len__(self) -> int:
        return self.size

    def read(self, offset: int, length: int) -> bytes:
        with open(self.path, "rb") as handle:
            return os.pread(handle.fileno(), length, offset)

    def pieces(self, start: int = 0, stop: int | None = None) -> Iterator[bytes]:
        """The bytes [start, stop) in pieces of `READ_PIECE_BYTES`, one in memory at a time."""
        stop = self.size if stop is None else stop
        with open(self.path, "rb") as handle:
            for offset in range(start, stop, READ_PIECE_BYTES):
                piece = os.pread(handle.fileno(), min(READ_PIECE_BYTES, stop - offset), offset)
                if not piece:
                    raise OSError(f"{self.path}: ends at {offset} of {stop}")
                yield piece

    def sha256(self) -> str:
        """sha256 (hex, first 16 bytes) of the frame, as `node.diloco.learner_ledger.frame_digest` of it in memory."""
        digest = hashlib.sha256()
        for piece in self.pieces():
            digest.update(piece)
        return digest.hexdigest()[:32]

    def take(self) -> Path:
        """The caller owns the file from now on (the stream layer leaves it)."""
        self.taken = True
        return self.path

    def remove(self) -> None:
        """Remove the file unless a handler took it."""
        if not self.taken:
            self.path.unlink(missing_ok=True)


@dataclass(frozen=True, slots=True)
class TensorPlace:
    """Where one tensor of an opened frame file lies: its bytes are [offset, offset + nbytes) of the file."""

    dtype: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int


@dataclass(frozen=True, slots=True)
class OpenedFile:
    """A frame file that passed every check: its header, and where each tensor lies in the file (by name)."""

    header: Header
    places: dict[str, TensorPlace]
    frame: FrameFile

    def read_tensors(self, limits: TensorLimits) -> dict[str, torch.Tensor]:
        """Every tensor read into memory (one private copy each): for frames too small or of dtypes a caller does
        not read from the file."""
        return {
            name: codec.build_tensor(p.dtype, p.shape, self.frame.read(p.offset, p.nbytes), limits)
            for name, p in self.places.items()
        }


def open_frame_file(
    frame: FrameFile,
    *,
    remote_peer: str,
    expect: Expectation,
    limits: TensorLimits,
    replay: ReplayGuard,
    now: float,
    current_step: int | None = None,
) -> OpenedFile:
    """`open_envelope` of a frame in a file: the same checks in the same order, raising the same typed errors; the
    payload is read a piece at a time for the digest (unless the stream layer made it on the way) and the finite
    values, and no tensor is built. The frame is recorded in `replay` once it passed."""
    if frame.size > max_frame_bytes(limits):
        raise FrameTooLarge(f"frame of {frame.size} bytes > cap {max_frame_bytes(limits)}")
    head = frame.read(0, min(frame.size, _LENGTH_BYTES + MAX_HEADER_BYTES + SIGNATURE_SIZE))
    header_bytes, signature, _ = split_frame(memoryview(head))
    start = _LENGTH_BYTES + len(header_bytes) + SIGNATURE_SIZE
    header, frame_id, sizes = check_head(
        header_bytes,
        bytes(signature),
        frame.size - start,
        remote_peer=remote_peer,
        expect=expect,
        limits=limits,
        replay=replay,
        now=now,
        current_step=current_step,
    )
    if _file_digest(frame, start) != header.digest:
        raise DigestMismatch("payload bytes do not match the signed digest")
    places, offset = {}, start
    for spec, size in zip(header.tensors, sizes, strict=True):
        places[spec.name] = TensorPlace(spec.dtype, spec.shape, offset, size)
        offset += size
    if limits.nonfinite == "reject":
        for place in places.values():
            _check_finite(frame, place)
    replay.record(frame_id, now=now)
    return OpenedFile(header, places, frame)


def _file_digest(frame: FrameFile, payload_start: int) -> bytes:
    """The digest the stream layer made as the frame arrived, else one pass over the file's payload now."""
    if frame.digester is not None:
        streamed = frame.digester.digest(payload_start, frame.size)
        if streamed is not None:
            return streamed
    hasher = blake3.blake3(max_threads=blake3.blake3.AUTO)
    for piece in frame.pieces(payload_start):
        hasher.update(piece)
    return bytes(hasher.digest(DIGEST_SIZE))


def _check_finite(frame: FrameFile, place: TensorPlace) -> None:
    """The finite-value policy of `codec.build_tensor`, a piece of the file at a time."""
    if place.dtype not in codec.FLOAT_DTYPES or not place.nbytes:
        return
    dtype = codec.WIRE_DTYPES[place.dtype]
    for piece in frame.pieces(place.offset, place.offset + place.nbytes):  # pieces hold whole values
        if not codec.all_finite(torch.frombuffer(bytearray(piece), dtype=dtype)):
            raise TensorPolicyError("tensor holds NaN or Inf", reason="non-finite values")
