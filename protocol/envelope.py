"""Signed envelopes: the header every tensor crossing the network carries, how it is sealed, and how it is opened.

Frame layout (all integers big-endian)::

    [u32 header length][header: msgpack array][64-byte Ed25519 signature][payload: tensor bytes, in header order]

The header is a msgpack array with a fixed field order (see `_encode_header`). It binds the protocol version, run,
kind, sender, receiver, stage, direction, microbatch, step (or version), timestamp, a random nonce, the list of
(name, dtype, shape) of the tensors, a BLAKE3-256 digest of the payload bytes, and a small metadata map. The signature
covers `SIGNATURE_DOMAIN + header`, so a signature made for anything else (a DHT record, a manifest) never verifies
as an envelope. BLAKE3 rather than SHA-256 or BLAKE2b: on one core here it hashes about 6 GB/s against 0.7-1.6
(SHA-256) and 0.6 GB/s (BLAKE2b), and it is already installed with hivemind (py-multihash depends on it).

Where the digest is computed: `seal` copies the payload into the frame piece by piece and hashes each piece right
after copying it; on receipt, the framed stream (`protocol.rpc`) hashes the payload chunk by chunk as it arrives
(`FrameDigester`, carried by the `ReceivedFrame` it fills), so neither end makes a separate pass over the payload.
`seal_streaming` goes further on the sending side: it copies and hashes nothing up front. The stream layer sends the
payload first, straight from the tensors, hashes each piece while the daemon moves it, and sends the head (length,
header with the digest, signature) last; the receiver puts the head back in front, so the frame it opens is laid out
and checked exactly as above (`StreamingFrame`).
The streamed digest is only used, never trusted beyond the bytes it saw: `open_envelope` compares it with the signed
one at the same point of its order as a digest of its own, and digests any other frame itself.

`open_envelope` checks, in exactly this order, and raises a typed `ProtocolError` at the first failure:
size cap -> header decodes -> signer equals the Noise-authenticated remote peer -> signature -> context (run, kind,
stage, direction, receiver) -> replay window, seen-set and clock skew -> byte count equals dtype x shape -> digest ->
only then are tensors built (one private copy each, with the finite-value policy).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import ctypes
import dataclasses
import enum
import math
import secrets
import struct
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import blake3
import msgpack
import torch

from protocol import codec
from protocol.codec import TensorLimits
from protocol.errors import (
    BadSignature,
    DigestMismatch,
    FrameTooLarge,
    MalformedFrame,
    SignerMismatch,
    SizeMismatch,
    TensorPolicyError,
    WrongContext,
)
from protocol.identity import SIGNATURE_SIZE, NodeIdentity, verify_signature
from protocol.replay import FrameId, ReplayGuard

PROTOCOL_VERSION = 1
SIGNATURE_DOMAIN = b"hivenode/envelope/v1\x00"
DIGEST_SIZE = 32
NONCE_SIZE = 16
MAX_HEADER_BYTES = 256 * 1024  # room for a fragment's list of a few thousand (name, dtype, shape)
MAX_ID_CHARS = 128  # run ids and peer ids
MAX_NAME_CHARS = 256  # tensor names
MAX_META_ENTRIES = 64
MAX_META_KEY_CHARS = 64
MAX_META_STR_CHARS = 4096
MAX_META_LIST_LEN = 1024
MAX_U63 = (1 << 63) - 1
BACKGROUND_HASH_BYTES = 256 << 10  # stream pieces from this size are hashed on the hashing thread
PARALLEL_DIGEST_BYTES = 1 << 20  # measured: threads lose at 256 KiB (44 vs 35 us), win from 1 MiB
SEAL_PIECE_BYTES = 1 << 20  # seal copies and hashes the payload in pieces that stay in a core's 2 MiB L2
NO_STAGE = -1  # frames that do not belong to a pipeline stage
MAX_STAGE = (1 << 16) - 1

_LENGTH = struct.Struct(">I")
_NUM_HEADER_FIELDS = 14
_OVERHEAD_BYTES = _LENGTH.size + SIGNATURE_SIZE
# a received payload viewed in place starts at this alignment: the largest wire dtype's (`_tensor_views`)
_PAYLOAD_ALIGN = max(dtype.itemsize for dtype in codec.WIRE_DTYPES.values())

MetaScalar = None | bool | int | float | str
MetaValue = MetaScalar | list[MetaScalar]


class Kind(str, enum.Enum):
    """What a frame carries; the receiver's expectation names exactly one."""

    ACTIVATION = "activation"
    GRADIENT = "gradient"
    TOKENS = "tokens"  # input ids and targets a verifier sends into the pipeline
    LOSS = "loss"
    FRAGMENT = "fragment"  # a learner's DiLoCo fragment contribution
    VERSION = "version"  # a syncer's merged fragment version
    RECEIPT = "receipt"
    BAN = "ban"
    CONTROL = "control"  # metadata-only requests and answers


class Direction(str, enum.Enum):
    FORWARD = "forward"
    BACKWARD = "backward"
    NONE = "none"


@dataclass(frozen=True, slots=True)
class TensorSpec:
    name: str
    dtype: str
    shape: tuple[int, ...]


@dataclass(frozen=True, kw_only=True, slots=True)
class Context:
    """Where a frame belongs; the sender seals with one and the receiver opens against the one it expects."""

    run_id: str
    kind: Kind
    receiver: str
    stage: int = NO_STAGE
    direction: Direction = Direction.NONE

    def __post_init__(self) -> None:
        if not isinstance(self.kind, Kind) or not isinstance(self.direction, Direction):
            raise ValueError("kind and direction must be Kind and Direction members")
        if not NO_STAGE <= self.stage <= MAX_STAGE:
            raise ValueError(f"stage must be in [{NO_STAGE}, {MAX_STAGE}], got {self.stage}")
        if not (0 < len(self.run_id) <= MAX_ID_CHARS and 0 < len(self.receiver) <= MAX_ID_CHARS):
            raise ValueError("run_id and receiver must be non-empty and short")


Expectation = Context  # what a receiver demands of a frame is exactly the context a sender seals with


@dataclass(frozen=True, kw_only=True, slots=True)
class Header:
    """The signed part of a frame. `meta` is a read-only map of small scalars (do not mutate it)."""

    version: int
    run_id: str
    kind: Kind
    sender: str
    receiver: str
    stage: int
    direction: Direction
    microbatch: int
    step: int
    timestamp: float
    nonce: bytes
    tensors: tuple[TensorSpec, ...]
    digest: bytes
    meta: Mapping[str, MetaValue] = field(default_factory=dict)

    def frame_id(self) -> FrameId:
        return FrameId(
            sender=self.sender,
            kind=self.kind.value,
            stage=self.stage,
            direction=self.direction.value,
            microbatch=self.microbatch,
            step=self.step,
            nonce=self.nonce,
            timestamp=self.timestamp,
        )


@dataclass(frozen=True, slots=True)
class Opened:
    """A frame that passed every check: its header and its tensors by name (a single tensor is named "")."""

    header: Header
    tensors: dict[str, torch.Tensor]

    @property
    def meta(self) -> Mapping[str, MetaValue]:
        return self.header.meta


def max_frame_bytes(limits: TensorLimits) -> int:
    """The largest frame a receiver with `limits` can accept: use it as the stream cap of that handler."""
    return _OVERHEAD_BYTES + MAX_HEADER_BYTES + limits.max_bytes


# ---------------------------------------------------------------------------------------------------- sealing


def seal(
    identity: NodeIdentity,
    context: Context,
    *,
    microbatch: int,
    step: int,
    now: float,
    tensor: torch.Tensor | None = None,
    tensors: Mapping[str, torch.Tensor] | None = None,
    meta: Mapping[str, MetaValue] | None = None,
    nonce: bytes | None = None,
) -> bytearray:
    """Sign one frame from `identity` to `context.receiver`.

    Pass one `tensor`, or several named `tensors` (a fragment), or neither (a metadata-only frame). `now` is the
    sender's wall clock in seconds (it becomes the timestamp the receiver checks for skew).

    The payload is copied into the frame once, and each piece is hashed right after it is copied, while it is still
    in cache: a separate digest pass over the tensor would read it from memory a second time (measured at 16 MiB,
    load 3.6: hash then copy 8.1 ms, copy and hash piecewise 5.0 ms, the copy alone 3.8 ms). The header is signed once,
    after the last piece.

    Raises:
        ValueError: bad arguments or metadata.
        TensorPolicyError: a tensor with a dtype or shape that never travels.
    """
    return seal_streaming(
        identity,
        context,
        microbatch=microbatch,
        step=step,
        now=now,
        tensor=tensor,
        tensors=tensors,
        meta=meta,
        nonce=nonce,
    ).to_bytes()


def _seal_frame(identity: NodeIdentity, header: Header, views: list[memoryview]) -> tuple[bytearray, bytes]:
    """The frame and its payload digest."""
    header_len = len(_encode_header(header))
    if header_len > MAX_HEADER_BYTES:
        raise ValueError(f"header of {header_len} bytes > {MAX_HEADER_BYTES}")
    payload_start = _OVERHEAD_BYTES + header_len
    frame = bytearray(payload_start + sum(len(v) for v in views))
    hasher = _new_hasher(len(frame) - payload_start)
    with memoryview(frame) as out:
        offset = payload_start
        for view in views:
            for start in range(0, len(view), SEAL_PIECE_BYTES):
                piece = view[start : start + SEAL_PIECE_BYTES]
                end = offset + len(piece)
                out[offset:end] = piece
                hasher.update(out[offset:end])
                offset = end
        digest = bytes(hasher.digest(DIGEST_SIZE))
        header_bytes = _encode_header(dataclasses.replace(header, digest=digest))
        if len(header_bytes) != header_len:  # msgpack sizes a 32-byte bin the same whatever its value
            raise AssertionError("header length changed with its digest")
        _LENGTH.pack_into(out, 0, header_len)
        out[_LENGTH.size : _LENGTH.size + header_len] = header_bytes
        out[_LENGTH.size + header_len : payload_start] = identity.sign(SIGNATURE_DOMAIN + header_bytes)
    return frame, digest


def seal_streaming(
    identity: NodeIdentity,
    context: Context,
    *,
    microbatch: int,
    step: int,
    now: float,
    tensor: torch.Tensor | None = None,
    tensors: Mapping[str, torch.Tensor] | None = None,
    meta: Mapping[str, MetaValue] | None = None,
    nonce: bytes | None = None,
) -> StreamingFrame:
    """`seal`, but the payload is hashed while the stream layer sends it and the header is signed after it.

    Takes the arguments of `seal` and raises what it raises. Nothing is copied or hashed here: the frame holds
    views of the tensors (do not change them until it is sent) and is signed once per transmission, see
    `StreamingFrame`.
    """
    if tensor is not None and tensors is not None:
        raise ValueError("pass either tensor or tensors, not both")
    named = {"": tensor} if tensor is not None else dict(tensors or {})
    specs, views = [], []
    for name, value in named.items():
        dtype, shape = codec.tensor_spec(value)
        specs.append(TensorSpec(name, dtype, shape))
        views.append(codec.tensor_bytes(value))
    header = Header(
        version=PROTOCOL_VERSION,
        run_id=context.run_id,
        kind=context.kind,
        sender=identity.peer_id,
        receiver=context.receiver,
        stage=context.stage,
        direction=context.direction,
        microbatch=microbatch,
        step=step,
        timestamp=float(now),
        nonce=secrets.token_bytes(NONCE_SIZE) if nonce is None else nonce,
        tensors=tuple(specs),
        digest=bytes(DIGEST_SIZE),
        meta=dict(meta or {}),
    )
    _validate_header(header)
    return StreamingFrame(identity, header, views)


class _BackgroundHasher:
    """A BLAKE3 hasher whose big updates run on the process's hashing thread, in the order they were given.

    BLAKE3 releases the GIL while it hashes, so the event loop goes on moving the next chunk while the thread hashes
    the last one: on a machine with a core to spare the digest costs the transfer almost nothing. Pieces under
    `BACKGROUND_HASH_BYTES` are hashed at once (handing them over would cost more than hashing them). The caller
    must not change a piece's bytes until `digest` returns (the stream layer never does: sent or received bytes are
    not written again).
    """

    __slots__ = ("_hasher", "_last")

    def __init__(self, hasher: Any) -> None:
        self._hasher = hasher
        self._last: concurrent.futures.Future[None] | None = None

    def update(self, piece: memoryview) -> None:
        if len(piece) < BACKGROUND_HASH_BYTES and self._last is None:
            self._hasher.update(piece)
        else:  # once one piece went to the thread, every later one must follow it there
            self._last = _hashing_thread().submit(self._hasher.update, piece)

    async def settled(self) -> None:
        """Wait, without blocking the event loop, until every piece given so far is hashed."""
        if self._last is not None:
            await asyncio.wrap_future(self._last)

    def digest(self, length: int = DIGEST_SIZE) -> bytes:
        if self._last is not None:
            self._last.result()
        return bytes(self._hasher.digest(length))


_HASHING: list[concurrent.futures.ThreadPoolExecutor] = []


def _hashing_thread() -> concurrent.futures.ThreadPoolExecutor:
    """One worker for the whole process, made on first use: updates of one digest must run in order."""
    if not _HASHING:
        _HASHING.append(concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="blake3"))
    return _HASHING[0]


class PayloadHasher:
    """The payload digest of one transmission of a `StreamingFrame`, fed piece by piece in payload order."""

    __slots__ = ("hashed_bytes", "_hasher")

    def __init__(self, num_bytes: int) -> None:
        self.hashed_bytes = 0
        self._hasher = _BackgroundHasher(_new_hasher(num_bytes))

    def update(self, piece: memoryview) -> None:
        self._hasher.update(piece)
        self.hashed_bytes += len(piece)

    async def settled(self) -> None:
        await self._hasher.settled()

    def digest(self) -> bytes:
        return self._hasher.digest(DIGEST_SIZE)


class StreamingFrame:
    """A frame whose payload digest is made while the payload is sent: the frame layout is `seal`'s, the order on
    the wire is not.

    The stream layer (`rpc.write_message`) sends the payload first, straight from the tensors' memory, and hashes
    each piece right after handing it to the socket, while the daemon moves it; after the last piece it asks for
    the head (`[u32 header length][header with the digest][signature]`), which is signed then and sent last. The
    receiver puts the head back in front (`rpc.Reassembler`), so `open_envelope` reads the usual frame and runs its
    checks in their usual order, digest included: a tampered piece is refused before any tensor is built.
    `to_bytes` gives the same frame laid out in one buffer (for transports that need bytes).
    """

    __slots__ = ("identity", "header", "head_bytes", "payload_bytes", "sent_digest", "_views", "_header_len")

    def __init__(self, identity: NodeIdentity, header: Header, views: list[memoryview]) -> None:
        self._header_len = len(_encode_header(header))  # the digest placeholder has the digest's size
        if self._header_len > MAX_HEADER_BYTES:
            raise ValueError(f"header of {self._header_len} bytes > {MAX_HEADER_BYTES}")
        self.identity = identity
        self.header = header
        self.head_bytes = _OVERHEAD_BYTES + self._header_len
        self.payload_bytes = sum(len(v) for v in views)
        # the payload digest its last head or `to_bytes` signed: what a stage's answer names as its input digest
        self.sent_digest: bytes | None = None
        self._views = views

    def __len__(self) -> int:
        return self.head_bytes + self.payload_bytes

    def pieces(self, max_bytes: int) -> list[memoryview]:
        """The payload in order, cut into pieces of at most `max_bytes` (no piece spans two tensors)."""
        return [v[s : s + max_bytes] for v in self._views for s in range(0, len(v), max_bytes)]

    def new_hasher(self) -> PayloadHasher:
        """A digest for one transmission: feed it every piece of `pieces`, in order, then ask for `head`."""
        return PayloadHasher(self.payload_bytes)

    def head(self, hasher: PayloadHasher) -> bytes:
        """The frame's head, signed over the header that carries `hasher`'s digest of the whole payload."""
        if hasher.hashed_bytes != self.payload_bytes:
            raise ValueError(f"{hasher.hashed_bytes} of {self.payload_bytes} payload bytes were hashed")
        self.sent_digest = hasher.digest()
        header_bytes = _encode_header(dataclasses.replace(self.header, digest=self.sent_digest))
        if len(header_bytes) != self._header_len:
            raise AssertionError("header length changed with its digest")
        signature = self.identity.sign(SIGNATURE_DOMAIN + header_bytes)
        return _LENGTH.pack(self._header_len) + header_bytes + signature

    def to_bytes(self) -> bytearray:
        """The whole frame in one buffer, as `seal` lays it out (copy and hash fused)."""
        frame, self.sent_digest = _seal_frame(self.identity, self.header, self._views)
        return frame


def payload_digest(parts: list[memoryview] | list[bytes]) -> bytes:
    """BLAKE3-256 over the concatenated parts in one pass; multithreaded from 1 MiB (up to 2x faster on 2 idle
    cores). Frames that arrived on a framed stream (`ReceivedFrame`) were already digested on the way."""
    hasher = _new_hasher(sum(len(p) for p in parts), parallel=True)  # one cold pass: blake3's pool helps
    for part in parts:
        hasher.update(part)
    return hasher.digest(DIGEST_SIZE)


class FrameDigester:
    """The payload digest of one frame, computed while the frame's bytes arrive (fed by `rpc.Reassembler`).

    A frame's payload starts after `[u32 header length][header][signature]`, so the digester reads the header
    length from the first four bytes (or is given the payload's offset, when the head comes last) and from then on
    hashes every newly arrived byte past that offset. Chunks from `BACKGROUND_HASH_BYTES` are hashed on the
    process's hashing thread while the loop reads the next one, smaller ones at once (no copy, no pass after the
    last chunk); `open_envelope` compares the digest at the same point of its check order as a digest of its own.
    A header length over the cap, or one that runs past the frame, disables it; `open_envelope` then rejects the
    frame for that reason.
    """

    __slots__ = ("frame_bytes", "payload_start", "_hasher", "_hashed")

    def __init__(self, frame_bytes: int, *, payload_start: int | None = None) -> None:
        self.frame_bytes = frame_bytes
        self.payload_start: int | None = None  # known once four bytes have arrived, or given
        self._hasher: _BackgroundHasher | None = None
        self._hashed = 0  # frame offset up to which the payload is hashed
        if payload_start is not None:  # the head comes last (a `StreamingFrame`): the payload arrives first
            self._start_at(payload_start)

    def _start_at(self, start: int) -> None:
        self.payload_start = start
        if start - _OVERHEAD_BYTES > MAX_HEADER_BYTES or start > self.frame_bytes:
            return  # not a frame open_envelope accepts; it says why
        self._hasher = _BackgroundHasher(_new_hasher(self.frame_bytes - start))
        self._hashed = start

    def advance(self, frame: memoryview, filled: int, piece: bytes | memoryview | None = None) -> None:
        """`frame[:filled]` has arrived (and will not change): hash the payload bytes among it not hashed yet.

        With a given `payload_start` (the head comes last), `frame[payload_start:filled]` has arrived. `piece`, if
        given, holds the bytes that just arrived (they end at `filled`) in memory of its own: the hasher, which may
        still be reading when this returns, then holds views of `piece`, never of `frame`, so the buffer under
        `frame` may grow (and move) as the next chunk lands (`rpc.Reassembler` grows it chunk by chunk)."""
        if self.payload_start is None:
            if filled < _LENGTH.size:
                return
            (header_len,) = _LENGTH.unpack_from(frame)
            self._start_at(_OVERHEAD_BYTES + header_len)
        if self._hasher is not None and filled > self._hashed:
            new = filled - self._hashed
            if piece is None:
                self._hasher.update(frame[self._hashed : filled])
            elif new <= len(
                piece
            ):  # always, for chunks fed in order: the payload starts past the first 4 bytes
                self._hasher.update(memoryview(piece)[len(piece) - new :])
            else:
                self._hasher.update(memoryview(bytes(frame[self._hashed : filled])))
            self._hashed = filled

    def digest(self, payload_start: int, frame_bytes: int) -> bytes | None:
        """The payload digest, if the whole frame was hashed with exactly this layout; else None."""
        complete = self._hasher is not None and self._hashed == self.frame_bytes == frame_bytes
        if not complete or payload_start != self.payload_start:
            return None
        assert self._hasher is not None
        return self._hasher.digest(DIGEST_SIZE)


class ReceivedFrame(bytearray):
    """A frame's bytes as the stream layer received them, with the payload digest it computed on the way.

    The digest vouches for the bytes as they arrived. Code that edits a received frame in place before opening it
    must edit a copy (`bytearray(frame)` is a plain bytearray, digested again by `open_envelope`); item assignment
    and deletion drop the digest as a guard.
    """

    digester: FrameDigester | None = None

    def __setitem__(self, index, value) -> None:  # type: ignore[no-untyped-def]
        self.digester = None
        super().__setitem__(index, value)

    def __delitem__(self, index) -> None:  # type: ignore[no-untyped-def]
        self.digester = None
        super().__delitem__(index)


def _new_hasher(num_bytes: int, *, parallel: bool = False) -> blake3.blake3:
    """One thread unless `parallel`: the streamed and sealed digests hash pieces that are hot in cache, where one
    thread keeps up (measured at 16 MiB: 5.1 ms copy + hash on one thread, 5.0 ms with blake3's pool), and a
    pool's threads on 2 shared cores make the cost depend on who else holds them."""
    threads = blake3.blake3.AUTO if parallel and num_bytes >= PARALLEL_DIGEST_BYTES else 1
    return blake3.blake3(max_threads=threads)


def encode_frame(
    identity: NodeIdentity, header: Header, payload_parts: list[memoryview] | list[bytes]
) -> bytes:
    """Sign `header` and lay out the frame. Low level: `seal` builds a consistent header; tests forge odd ones."""
    header_bytes = _encode_header(header)
    if len(header_bytes) > MAX_HEADER_BYTES:
        raise ValueError(f"header of {len(header_bytes)} bytes > {MAX_HEADER_BYTES}")
    signature = identity.sign(SIGNATURE_DOMAIN + header_bytes)
    return b"".join([_LENGTH.pack(len(header_bytes)), header_bytes, signature, *payload_parts])


def _encode_header(h: Header) -> bytes:
    return msgpack.packb(
        [
            h.version,
            h.run_id,
            h.kind.value,
            h.sender,
            h.receiver,
            h.stage,
            h.direction.value,
            h.microbatch,
            h.step,
            h.timestamp,
            h.nonce,
            [[t.name, t.dtype, list(t.shape)] for t in h.tensors],
            h.digest,
            dict(sorted(h.meta.items())),
        ],
        use_bin_type=True,
    )


def _validate_header(h: Header) -> None:
    """Sender-side sanity (the receiver re-checks everything in `_decode_header`)."""
    if not (0 <= h.microbatch <= MAX_U63 and 0 <= h.step <= MAX_U63):
        raise ValueError("microbatch and step must be in [0, 2**63)")
    if not math.isfinite(h.timestamp):
        raise ValueError("timestamp must be finite")
    if len(h.nonce) != NONCE_SIZE:
        raise ValueError(f"nonce must have {NONCE_SIZE} bytes")
    names = [t.name for t in h.tensors]
    if len(set(names)) != len(names) or any(len(n) > MAX_NAME_CHARS for n in names):
        raise ValueError("tensor names must be unique and short")
    try:
        _check_meta(h.meta)
    except MalformedFrame as e:
        raise ValueError(str(e)) from None


# ---------------------------------------------------------------------------------------------------- opening


def open_envelope(
    frame: bytes | bytearray | memoryview,
    *,
    remote_peer: str,
    expect: Expectation,
    limits: TensorLimits,
    replay: ReplayGuard,
    now: float,
    current_step: int | None = None,
    views: bool = False,
) -> Opened:
    """Check a frame received from `remote_peer` (the Noise-authenticated caller) and build its tensors.

    `current_step`, when the receiver knows it (a syncer's version), bounds the frame's step; see `ReplayGuard`.
    `views`: a bytearray frame's tensors are views over it, not copies (`_tensor_views`; the frame is moved in
    place and must not be read as the signed frame afterwards unless a check refused it).

    Raises:
        FrameTooLarge, MalformedFrame, SignerMismatch, BadSignature, WrongContext, ClockSkew, StaleFrame,
        ReplayedFrame, TensorPolicyError, SizeMismatch, DigestMismatch: in the order of the checks.
    """
    view = memoryview(frame)
    if len(view) > max_frame_bytes(limits):
        raise FrameTooLarge(f"frame of {len(view)} bytes > cap {max_frame_bytes(limits)}")
    header_bytes, signature, payload = split_frame(view)
    header, frame_id, sizes = check_head(
        header_bytes,
        bytes(signature),
        len(payload),
        remote_peer=remote_peer,
        expect=expect,
        limits=limits,
        replay=replay,
        now=now,
        current_step=current_step,
    )
    if _digest_of(frame, payload) != header.digest:
        raise DigestMismatch("payload bytes do not match the signed digest")
    if views and isinstance(frame, bytearray):
        tensors = _tensor_views(frame, len(view) - len(payload), header, sizes, limits)
    else:
        tensors, offset = {}, 0
        for spec, size in zip(header.tensors, sizes, strict=True):
            tensors[spec.name] = codec.build_tensor(
                spec.dtype, spec.shape, payload[offset : offset + size], limits
            )
            offset += size
    replay.record(frame_id, now=now)
    return Opened(header, tensors)


def check_head(
    header_bytes: bytes,
    signature: bytes,
    payload_bytes: int,
    *,
    remote_peer: str,
    expect: Expectation,
    limits: TensorLimits,
    replay: ReplayGuard,
    now: float,
    current_step: int | None = None,
) -> tuple[Header, FrameId, list[int]]:
    """The checks of `open_envelope` from the header to the byte count, in its order (the digest and the tensors
    come after): the header, its per-tensor byte sizes, and the frame id to record once the frame is accepted.
    Shared with a frame received into a file (`protocol.frame_file`), which holds no payload in memory."""
    header = _decode_header(header_bytes, limits)
    if header.sender != remote_peer:
        raise SignerMismatch(f"frame signed by {header.sender[:16]}... arrived from {remote_peer[:16]}...")
    if not verify_signature(header.sender, SIGNATURE_DOMAIN + header_bytes, signature):
        raise BadSignature(f"signature of {header.sender[:16]}... does not verify")
    _check_context(header, expect)
    frame_id = header.frame_id()
    replay.check(frame_id, now=now, current_step=current_step)
    return header, frame_id, _check_sizes(header, payload_bytes, limits)


def _tensor_views(
    frame: bytearray, start: int, header: Header, sizes: list[int], limits: TensorLimits
) -> dict[str, torch.Tensor]:
    """The verified payload's tensors as views over `frame` itself, not copies (`open_envelope(views=True)`): the
    frame is then the only copy of a syncer's push (docs/scale.md, issue 17). The payload starts anywhere (after a
    header of any length): it is first moved down to an aligned address, in place, over the signature's last bytes
    (read already). A tensor the policy refuses puts the frame back as it came, so that the evidence digest of a
    refused frame is the signed frame's; one whose offset still misses its dtype's alignment is copied."""
    base = ctypes.addressof(ctypes.c_char.from_buffer(frame))
    length = len(frame) - start
    shift = (base + start) % _PAYLOAD_ALIGN
    saved = bytes(frame[start - shift : start])
    ctypes.memmove(base + start - shift, base + start, length)
    if isinstance(frame, ReceivedFrame):
        frame.digester = None  # moved: no longer the frame its stream digest vouches for
    payload = memoryview(frame)[start - shift : start - shift + length]
    tensors, offset = {}, 0
    try:
        for spec, size in zip(header.tensors, sizes, strict=True):
            aligned = offset % codec.WIRE_DTYPES[spec.dtype].itemsize == 0
            tensors[spec.name] = codec.build_tensor(
                spec.dtype, spec.shape, payload[offset : offset + size], limits, copy=not aligned
            )
            offset += size
    except BaseException:
        tensors.clear()
        ctypes.memmove(base + start, base + start - shift, length)
        frame[start - shift : start] = saved
        raise
    return tensors


def open_frame(
    frame: bytes | bytearray | memoryview,
    *,
    remote_peer: str,
    expect: Expectation,
    limits: TensorLimits,
    replay: ReplayGuard,
    now: float,
    current_step: int | None = None,
) -> tuple[Header, torch.Tensor]:
    """`open_envelope` for the common case of exactly one tensor (named ""); anything else is a WrongContext."""
    opened = open_envelope(
        frame,
        remote_peer=remote_peer,
        expect=expect,
        limits=limits,
        replay=replay,
        now=now,
        current_step=current_step,
    )
    if list(opened.tensors) != [""]:
        raise WrongContext(f"expected one unnamed tensor, got {sorted(opened.tensors)[:4]}")
    return opened.header, opened.tensors[""]


def _digest_of(frame: bytes | bytearray | memoryview, payload: memoryview) -> bytes:
    """The digest the stream layer computed while `frame` arrived, else one pass over `payload` now."""
    digester = frame.digester if isinstance(frame, ReceivedFrame) else None
    if digester is not None:
        streamed = digester.digest(len(frame) - len(payload), len(frame))
        if streamed is not None:
            return streamed
    return payload_digest([payload])


def split_frame(view: memoryview) -> tuple[bytes, memoryview, memoryview]:
    if len(view) < _OVERHEAD_BYTES:
        raise MalformedFrame(f"frame of {len(view)} bytes is shorter than its fixed parts")
    (header_len,) = _LENGTH.unpack_from(view)
    if header_len > MAX_HEADER_BYTES:
        raise FrameTooLarge(f"header of {header_len} bytes > {MAX_HEADER_BYTES}")
    sig_start = _LENGTH.size + header_len
    payload_start = sig_start + SIGNATURE_SIZE
    if payload_start > len(view):
        raise MalformedFrame(f"header length {header_len} runs past the end of a {len(view)}-byte frame")
    return bytes(view[_LENGTH.size : sig_start]), view[sig_start:payload_start], view[payload_start:]


def _refuse_ext(code: int, data: bytes) -> object:
    raise MalformedFrame(f"msgpack extension type {code} is not allowed")


def _decode_header(raw: bytes, limits: TensorLimits) -> Header:
    (
        version,
        run_id,
        kind,
        sender,
        receiver,
        stage,
        direction,
        microbatch,
        step,
        timestamp,
        nonce,
        specs,
        digest,
        meta,
    ) = _unpack_header_fields(raw, limits)
    _check_scalar_fields(version, run_id, kind, sender, receiver, stage, direction, microbatch, step)
    _require(type(timestamp) is float and math.isfinite(timestamp), "timestamp must be a finite float")
    _require(type(nonce) is bytes and len(nonce) == NONCE_SIZE, "bad nonce")
    _require(type(digest) is bytes and len(digest) == DIGEST_SIZE, "bad digest")
    return Header(
        version=version,
        run_id=run_id,
        kind=_KINDS[kind],
        sender=sender,
        receiver=receiver,
        stage=stage,
        direction=_DIRECTIONS[direction],
        microbatch=microbatch,
        step=step,
        timestamp=timestamp,
        nonce=nonce,
        tensors=_decode_specs(specs, limits),
        digest=digest,
        meta=_check_meta(meta),
    )


def _unpack_header_fields(raw: bytes, limits: TensorLimits) -> list[Any]:
    """msgpack with every length bounded before allocation, no ext types; the list of header fields."""
    try:
        fields = msgpack.unpackb(
            raw,
            raw=False,
            use_list=True,
            strict_map_key=True,
            ext_hook=_refuse_ext,
            max_str_len=MAX_META_STR_CHARS * 4,  # UTF-8 bytes
            max_bin_len=max(NONCE_SIZE, DIGEST_SIZE),
            max_array_len=max(_NUM_HEADER_FIELDS, limits.max_tensors, MAX_META_LIST_LEN),
            max_map_len=MAX_META_ENTRIES,
            max_ext_len=0,
        )
    except MalformedFrame:
        raise
    # msgpack raises ValueError, TypeError, OverflowError or its own errors: all of them mean "garbage".
    except Exception as e:
        raise MalformedFrame(f"header is not valid msgpack: {type(e).__name__}") from None
    if type(fields) is not list or len(fields) != _NUM_HEADER_FIELDS:
        raise MalformedFrame("header is not a list of the expected fields")
    return fields


def _check_scalar_fields(
    version: object,
    run_id: object,
    kind: object,
    sender: object,
    receiver: object,
    stage: object,
    direction: object,
    microbatch: object,
    step: object,
) -> None:
    if type(version) is not int or version != PROTOCOL_VERSION:
        raise MalformedFrame(
            f"protocol version {str(version)[:16]} is not {PROTOCOL_VERSION}", reason="unsupported version"
        )
    for text in (run_id, sender, receiver):
        _require(
            type(text) is str and 0 < len(text) <= MAX_ID_CHARS,
            "run id, sender and receiver must be short strings",
        )
    _require(type(kind) is str and kind in _KINDS, "unknown kind")  # type first: a list is unhashable
    _require(type(direction) is str and direction in _DIRECTIONS, "unknown direction")
    _require(_is_int_in(stage, NO_STAGE, MAX_STAGE), "stage out of range")
    _require(
        _is_int_in(microbatch, 0, MAX_U63) and _is_int_in(step, 0, MAX_U63), "microbatch or step out of range"
    )


_KINDS = {k.value: k for k in Kind}
_DIRECTIONS = {d.value: d for d in Direction}


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise MalformedFrame(message)


def _is_int_in(value: object, low: int, high: int) -> bool:
    return type(value) is int and low <= value <= high


def _decode_specs(specs: object, limits: TensorLimits) -> tuple[TensorSpec, ...]:
    """Structure only; dtype and shape policy is checked later, after the signature (`_check_sizes`)."""
    _require(type(specs) is list, "tensor list is not a list")
    assert isinstance(specs, list)
    if len(specs) > limits.max_tensors:
        raise TensorPolicyError(f"{len(specs)} tensors > {limits.max_tensors}", reason="too many tensors")
    out, names = [], set()
    for spec in specs:
        _require(type(spec) is list and len(spec) == 3, "tensor entry is not [name, dtype, shape]")
        name, dtype, shape = spec
        _require(
            type(name) is str and len(name) <= MAX_NAME_CHARS and name not in names,
            "bad or repeated tensor name",
        )
        _require(type(dtype) is str and len(dtype) <= 16, "dtype is not a short string")
        _require(type(shape) is list and len(shape) <= limits.max_rank, "shape is not a short list")
        names.add(name)
        out.append(TensorSpec(name, dtype, tuple(shape)))
    return tuple(out)


def _check_meta(meta: object) -> dict[str, MetaValue]:
    _require(type(meta) is dict and len(meta) <= MAX_META_ENTRIES, "metadata is not a small map")
    assert isinstance(meta, dict)
    for key, value in meta.items():
        _require(
            type(key) is str and 0 < len(key) <= MAX_META_KEY_CHARS, "metadata key is not a short string"
        )
        if type(value) is list:
            _require(len(value) <= MAX_META_LIST_LEN, "metadata list too long")
            for item in value:
                _check_meta_scalar(item)
        else:
            _check_meta_scalar(value)
    return meta


def _check_meta_scalar(value: object) -> None:
    # Scalars and strings only: no bytes (nothing that could be a pickle or a nested structure to walk).
    if value is None or type(value) is bool:
        return
    if type(value) is int:
        _require(-(1 << 63) <= value <= MAX_U63, "metadata int out of range")
    elif type(value) is float:
        _require(math.isfinite(value), "metadata float must be finite")
    elif type(value) is str:
        _require(len(value) <= MAX_META_STR_CHARS, "metadata string too long")
    else:
        raise MalformedFrame(f"metadata value of type {type(value).__name__} is not allowed")


def _check_context(header: Header, expect: Expectation) -> None:
    for name in ("run_id", "kind", "stage", "direction", "receiver"):
        got, want = getattr(header, name), getattr(expect, name)
        if got != want:
            raise WrongContext(
                f"{name} is {str(getattr(got, 'value', got))[:64]!r}, expected {str(getattr(want, 'value', want))!r}"
            )


def _check_sizes(header: Header, payload_len: int, limits: TensorLimits) -> list[int]:
    sizes = [codec.check_spec(t.dtype, list(t.shape), limits) for t in header.tensors]
    total = sum(sizes)
    if total > limits.max_bytes:
        raise TensorPolicyError(
            f"tensors of {total} bytes > cap {limits.max_bytes}", reason="tensor too large"
        )
    if total != payload_len:
        raise SizeMismatch(f"payload has {payload_len} bytes, its tensors need {total}")
    return sizes
