"""Bounded request/response streams over hivemind P2P, with the size caps enforced below any handler.

hivemind's protobuf handlers read each message whole, with a length the peer declares, before a handler runs: a peer
that declares 1 GiB can make the receiver buffer hundreds of MiB. So every RPC of ours is a raw libp2p stream
(`P2P.add_binary_stream_handler`) carrying our own framing::

    preamble: magic "HVNF" | u8 version | u8 status | u16 head bytes | u64 total bytes | u32 chunk count  (20 bytes)
    chunks:   u32 length (1..max_chunk_bytes) | bytes          (repeated exactly `chunk count` times)

`head bytes` is 0 for a body sent in order. A signed frame sealed while it streams (`envelope.StreamingFrame`) is
sent payload first and head last: then it is the size of the head, and the receiver writes the first
`total - head bytes` bytes it reads after the head's place and the last ones in front, so the body it hands on is
the frame in its usual layout, its payload hashed as it arrived.

The receiver checks the preamble against the cap of that handler (which comes from our config, never from the peer)
before it reads or allocates anything else, then reads each chunk under a timeout, counting chunks and bytes and
refusing any chunk that would pass the declared total. The body buffer grows chunk by chunk as the chunks land, so
memory follows the bytes that arrived, never the size a peer declared. Bodies are signed envelopes, so the reader
also hashes each chunk's payload bytes as they land in that buffer (`envelope.FrameDigester`): `open_envelope` then
finds the digest already made, and hashing overlaps the transfer instead of being a pass of its own. A request is one message with status REQUEST; the
answer is one message with status OK (the handler's bytes) or ERROR (a short reason tag). A route may take its large
requests into a file instead (`SpillRoute`, the syncer's push: `protocol.frame_file`): the same caps, reservations
and digest, each chunk written where the buffer would have held it, and the file removed if the request does not
arrive whole or once its handler returned (unless the handler took it over).

`remote_peer`, as handed to handlers, is the Noise-authenticated caller (`StreamInfo.peer_id` from the daemon).
Every `ProtocolError` the stream layer or a handler raises is answered with its reason, logged, and counted against
the remote peer in `PeerStrikes` unless the fault may be ours (see `blames_remote`).

Load limits sit above all of that (p2pd runs libp2p with `InfiniteLimits`, so nothing below us sheds load). Before
a byte of a request is read, the server asks its `PeerLimiter` for a rate token of that route and a stream slot of
that peer; once the preamble has declared the request's size it checks that the request could fit the peer's and
the node's bytes-in-flight caps beside what is held now (`PeerLimiter.admit_bytes`), then reserves each chunk's
bytes against those caps before reading it (`FrameReservation`: a peer holds budget only for what it has sent) and
gives them all back once the handler returned or the request was refused. A chunk past a cap refuses the whole
request, logged; its handler never runs, so nothing of it is merged. A refused peer gets a quick typed answer
(`throttled: <limit>; retry_after_s=<s>`, raised as `PeerThrottled` by `call_framed`), is counted, and is not struck:
being over a limit is load. A peer refused for its own behaviour more than the limiter's flood threshold is
flooding: that is logged once per flood window and recorded as one "flood" strike per window.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import math
import re
import struct
import time
from collections import Counter, OrderedDict
from collections.abc import Awaitable, Callable, Mapping
from contextlib import suppress
from dataclasses import dataclass
from pathlib import Path

from hivemind.p2p import P2P, PeerID
from hivemind.p2p.p2p_daemon_bindings.datastructures import StreamInfo

from protocol.envelope import FrameDigester, ReceivedFrame, StreamingFrame
from protocol.errors import (
    FrameTooLarge,
    MalformedFrame,
    ProtocolError,
    RemoteRefused,
    SignerMismatch,
    SizeMismatch,
    StreamClosed,
    StreamTimeout,
)
from protocol.frame_file import FileSink, FrameFile
from protocol.limits import (
    GLOBAL_STREAMS,
    OTHER_RPCS,
    STREAMS,
    Admission,
    FloodReport,
    FrameReservation,
    LimitsConfig,
    PeerLimiter,
    RateLimit,
    Throttled,
)

logger = logging.getLogger(__name__)

MAGIC = b"HVNF"
WIRE_VERSION = 1
PROTOCOL_PREFIX = "hivenode.framed.v1."
MAX_ERROR_BYTES = 1024
_PREAMBLE = struct.Struct(">4sBBHQI")
_CHUNK_HEADER = struct.Struct(">I")
_NAME_RE = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
_MAX_HEAD_BYTES = 0xFFFF  # the preamble's u16

Body = bytes | bytearray | memoryview | StreamingFrame
Handler = Callable[[bytearray, str], Awaitable[Body | None]]
FileHandler = Callable[[FrameFile, str], Awaitable[Body | None]]
RejectHook = Callable[[str, str, ProtocolError], None]  # (remote peer, handler name, error)
ThrottleHook = Callable[[str, str, Admission], None]  # (remote peer, handler name, refusal)
THROTTLED_PREFIX = "throttled: "
BUSY = "busy"
_STREAM_LIMITS = frozenset({STREAMS, GLOBAL_STREAMS})
FLOOD_STRIKE = "flood"
# Routes that do real work (a stage forward, a fragment merge) set their own `Route.rate` from their service time.
# The default only bounds cheap-call spam: an honest caller that waits for each answer makes at most a few hundred
# calls a second on loopback (the wire tests do), so 500/s with a burst of 1000 per peer and route never refuses it,
# while a flood of thousands a second from one identity is cut to that before any handler runs.
DEFAULT_ROUTE_RATE = RateLimit(rate_per_s=500.0, burst=1000.0)
# All peers and routes of one server together: what one asyncio handler loop can turn around on a 2-core node.
DEFAULT_GLOBAL_RATE = RateLimit(rate_per_s=2000.0, burst=4000.0)


class Status(enum.IntEnum):
    REQUEST = 0
    OK = 1
    ERROR = 2


@dataclass(frozen=True, kw_only=True, slots=True)
class StreamConfig:
    """Limits of the stream layer; the per-handler byte caps live in `Route`."""

    max_chunk_bytes: int = (
        1 << 20
    )  # largest chunk accepted, and the size we send (keep it equal on all nodes)
    chunk_timeout_s: float = 10.0  # wait for any single read or write (preamble, chunk header, chunk)
    message_timeout_s: float = 120.0  # wait for a whole request to arrive (64 MiB at ~0.5 MiB/s)
    max_streams_per_peer: int = 8  # concurrent requests served per remote peer
    max_streams: int = 64  # concurrent requests served in total
    linger_s: float = 1.0  # after refusing a request, how long to keep the stream open so the refusal is read
    linger_bytes: int = 4 << 20  # and how much of the caller's unread request to discard meanwhile
    max_lingering: int = 256  # refusals lingering at once; past it a refusal closes at once (a flood)

    def __post_init__(self) -> None:
        if not 0 < self.max_chunk_bytes <= 0xFFFFFFFF:
            raise ValueError(f"max_chunk_bytes must be in (0, 2**32), got {self.max_chunk_bytes}")
        if (
            self.chunk_timeout_s <= 0
            or self.message_timeout_s <= 0
            or self.linger_s < 0
            or self.linger_bytes < 0
        ):
            raise ValueError("timeouts must be positive")
        if self.max_streams_per_peer <= 0 or self.max_streams <= 0 or self.max_lingering < 0:
            raise ValueError("stream limits must be positive")


@dataclass(frozen=True, slots=True)
class SpillRoute:
    """A route's large requests go to a file as their chunks arrive (`protocol.frame_file`), not into memory: a
    request declaring `min_bytes` or more is written to a new file of `directory()` (asked per request; None: kept
    in memory) and handed to `handler` as a `FrameFile`, removed once the handler returns unless it took the file."""

    directory: Callable[[], Path | None]
    handler: FileHandler  # async (frame file, remote_peer) -> answer bytes or None
    min_bytes: int = 8 << 20  # smaller requests stay in memory (a few chunks: no file for a small frame)


@dataclass(frozen=True, slots=True)
class Route:
    handler: Handler  # async (frame, remote_peer) -> answer bytes or None (an empty answer)
    max_request_bytes: int
    rate: RateLimit | None = None  # per-peer request rate of this route; None: `DEFAULT_ROUTE_RATE`
    digest_payload: bool = True  # hash the frame payload as it arrives (off: bodies that are not frames)
    spill: SpillRoute | None = None  # large requests into a file (the syncer's push); None: all in memory

    def __post_init__(self) -> None:
        if self.max_request_bytes < 0:
            raise ValueError("max_request_bytes must be >= 0")


@dataclass(frozen=True, slots=True)
class Preamble:
    status: Status
    total_bytes: int
    num_chunks: int
    head_bytes: int = 0  # > 0: the body's first head_bytes bytes come last on the wire


def protocol_name(name: str) -> str:
    if not _NAME_RE.match(name):
        raise ValueError(f"handler name {name!r} must match {_NAME_RE.pattern}")
    return PROTOCOL_PREFIX + name


def blames_remote(error: ProtocolError) -> bool:
    """Whether a rejection counts against the authenticated remote peer.

    `blame_sender` is about the frame's claimed signer. For a SignerMismatch that signer is cleared, but the remote
    peer did send the frame, so it is the one struck; clock skew and early closes stay unblamed.
    """
    return error.blame_sender or isinstance(error, SignerMismatch)


# ------------------------------------------------------------------------------------------------ pure framing


def encode_preamble(
    status: Status, total_bytes: int, chunk_bytes: int, *, head_bytes: int = 0, num_chunks: int | None = None
) -> bytes:
    if num_chunks is None:
        num_chunks = -(-total_bytes // chunk_bytes)
    return _PREAMBLE.pack(MAGIC, WIRE_VERSION, status, head_bytes, total_bytes, num_chunks)


def parse_preamble(
    raw: bytes, *, max_bytes: int, max_chunk_bytes: int, statuses: frozenset[Status]
) -> Preamble:
    """Check a peer's preamble against our caps; nothing is allocated from its numbers before this passes.

    Raises:
        MalformedFrame: bad magic, version, status, a chunk count that does not fit the total, or a head larger
            than the total (or on an ERROR answer).
        FrameTooLarge: the declared total is over `max_bytes` (`MAX_ERROR_BYTES` for an ERROR answer).
    """
    magic, version, status, head_bytes, total, num_chunks = _PREAMBLE.unpack(raw)
    if magic != MAGIC:
        raise MalformedFrame("stream does not start with the framing magic")
    if version != WIRE_VERSION:
        raise MalformedFrame(f"framing version {version} is not {WIRE_VERSION}", reason="unsupported version")
    if status not in {s.value for s in statuses}:
        raise MalformedFrame(f"unexpected stream status {status}")
    cap = MAX_ERROR_BYTES if status == Status.ERROR else max_bytes
    if total > cap:
        raise FrameTooLarge(f"stream declares {total} bytes > cap {cap}")
    # Every chunk carries at least one byte and at most max_chunk_bytes, so the count is pinned by the total:
    # a peer cannot make us loop over empty chunks.
    if not -(-total // max_chunk_bytes) <= num_chunks <= total:
        raise MalformedFrame(f"{num_chunks} chunks cannot carry {total} bytes")
    if head_bytes > total or (head_bytes and status == Status.ERROR):
        raise MalformedFrame(
            f"a head of {head_bytes} bytes does not fit a {total}-byte {Status(status).name}"
        )
    return Preamble(Status(status), total, num_chunks, head_bytes)


class Reassembler:
    """Collects the chunks of one message, refusing any chunk that breaks what the preamble declared.

    With `digest`, the body is taken for a signed frame and its payload is hashed chunk by chunk as it arrives
    (`FrameDigester`), so `open_envelope` needs no separate pass over it.
    """

    def __init__(
        self,
        preamble: Preamble,
        *,
        max_chunk_bytes: int,
        digest: bool = False,
        spill_dir: Path | None = None,
    ) -> None:
        self.preamble = preamble
        self.max_chunk_bytes = max_chunk_bytes
        self.received_bytes = 0
        self.received_chunks = 0
        # The buffer grows chunk by chunk (appends to a bytearray move no bytes once it is large: glibc remaps it),
        # so memory follows the bytes that arrived, which the server reserves chunk by chunk, and never the size
        # the peer declared. When the head comes last its place (<= 64 KiB) is made up front. With `spill_dir`
        # the chunks go to a new file there instead (`FileSink`): a chunk in memory at a time.
        self._buffer: ReceivedFrame | FileSink = (
            ReceivedFrame(preamble.head_bytes)
            if spill_dir is None
            else FileSink(spill_dir, preamble.total_bytes, preamble.head_bytes)
        )
        # when the head comes last: its size, and the payload bytes read before it
        self._head = preamble.head_bytes
        self._payload = preamble.total_bytes - preamble.head_bytes
        start = self._head if self._head else None
        self._buffer.digester = FrameDigester(preamble.total_bytes, payload_start=start) if digest else None

    @property
    def done(self) -> bool:
        return self.received_chunks == self.preamble.num_chunks

    @property
    def buffered_bytes(self) -> int:
        """Bytes the body buffer holds now: what arrived (plus the head's place, when the head comes last)."""
        return len(self._buffer)

    def next_chunk_length(self, raw_header: bytes) -> int:
        """Validate a chunk header before its body is read."""
        length: int
        (length,) = _CHUNK_HEADER.unpack(raw_header)
        if self.done:
            raise MalformedFrame(f"chunk {self.received_chunks + 1} of {self.preamble.num_chunks}")
        if not 0 < length <= self.max_chunk_bytes:
            raise MalformedFrame(f"chunk of {length} bytes is not in [1, {self.max_chunk_bytes}]")
        if self.received_bytes + length > self.preamble.total_bytes:
            raise FrameTooLarge(
                f"stream sends {self.received_bytes + length} bytes, more than the {self.preamble.total_bytes} declared",
                reason="more than declared",
            )
        return length

    def add(self, data: bytes) -> None:
        """Place one chunk (its length already passed `next_chunk_length`); `data` must not change afterwards."""
        start = self.received_bytes
        piece = memoryview(data)
        # bytes of this chunk in the payload (all of it when the body comes in order), appended to the buffer;
        # the rest (the head, sent last) goes in front
        split = len(piece) if not self._head else max(0, min(len(piece), self._payload - start))
        if split:
            self._buffer.extend(piece[:split])  # not item assignment, which drops the digest
        if split < len(piece):
            head_at = start + split - self._payload
            if isinstance(self._buffer, FileSink):
                self._buffer.place(head_at, piece[split:])
            else:
                with memoryview(self._buffer) as view:
                    view[head_at : head_at + len(piece) - split] = piece[split:]
        self.received_bytes += len(piece)
        self.received_chunks += 1
        if self._buffer.digester is not None:
            arrived = self._head + min(self.received_bytes, self._payload)  # in-order: 0 + all received
            # (a file's digester reads only the frame's first 4 bytes, the header length: its `prefix`)
            mine = self._buffer.prefix if isinstance(self._buffer, FileSink) else self._buffer
            with memoryview(mine) as view:
                self._buffer.digester.advance(view, arrived, piece[:split])

    def finish(self) -> ReceivedFrame | FrameFile:
        """The whole body: in memory, or the closed file it was written to."""
        if not self.done or self.received_bytes != self.preamble.total_bytes:
            raise SizeMismatch(f"{self.received_bytes} of {self.preamble.total_bytes} declared bytes arrived")
        if isinstance(self._buffer, FileSink):
            return self._buffer.finish()
        return self._buffer

    def discard(self) -> None:
        """The body will not be finished (a refused chunk, a broken or timed-out stream): a file is removed."""
        if isinstance(self._buffer, FileSink):
            self._buffer.discard()


# ------------------------------------------------------------------------------------------------ stream I/O


async def _read_exactly(reader: asyncio.StreamReader, n: int, timeout_s: float) -> bytes:
    try:
        return await asyncio.wait_for(reader.readexactly(n), timeout_s)
    except asyncio.TimeoutError:
        raise StreamTimeout(f"no {n} bytes within {timeout_s} s") from None
    except (asyncio.IncompleteReadError, ConnectionError) as e:
        raise StreamClosed(f"stream ended while reading {n} bytes ({type(e).__name__})") from None


async def read_message(
    reader: asyncio.StreamReader,
    *,
    max_bytes: int,
    config: StreamConfig,
    statuses: frozenset[Status],
    digest: bool = False,
    preamble_timeout_s: float | None = None,
) -> tuple[Status, ReceivedFrame]:
    """Read one framed message, holding every cap; see `parse_preamble` and `Reassembler` for the errors. The
    preamble is awaited `preamble_timeout_s` (None: the chunk timeout), the rest chunk by chunk."""
    wait_s = config.chunk_timeout_s if preamble_timeout_s is None else preamble_timeout_s
    raw = await _read_exactly(reader, _PREAMBLE.size, wait_s)
    preamble = parse_preamble(
        raw, max_bytes=max_bytes, max_chunk_bytes=config.max_chunk_bytes, statuses=statuses
    )
    digest = digest and preamble.status != Status.ERROR
    body = await _read_chunks(reader, preamble, config, digest=digest)
    assert isinstance(body, ReceivedFrame)  # (no spill directory given)
    return preamble.status, body


async def _read_chunks(
    reader: asyncio.StreamReader,
    preamble: Preamble,
    config: StreamConfig,
    *,
    digest: bool,
    reserve: Callable[[int], None] | None = None,
    spill_dir: Path | None = None,
) -> ReceivedFrame | FrameFile:
    """The body a checked preamble announced, its buffer grown as its chunks land (or written to a new file of
    `spill_dir`, removed again if the body does not arrive whole). `reserve(length)` is called with each chunk's
    checked length before a byte of that chunk is read, and raises to refuse it."""
    parts = Reassembler(preamble, max_chunk_bytes=config.max_chunk_bytes, digest=digest, spill_dir=spill_dir)
    try:
        while not parts.done:
            length = parts.next_chunk_length(
                await _read_exactly(reader, _CHUNK_HEADER.size, config.chunk_timeout_s)
            )
            if reserve is not None:
                reserve(length)
            parts.add(await _read_exactly(reader, length, config.chunk_timeout_s))
        return parts.finish()
    except BaseException:  # a refusal, a broken stream, the message timeout's cancellation: no file is left
        parts.discard()
        raise


async def write_message(
    writer: asyncio.StreamWriter,
    status: Status,
    body: Body,
    *,
    config: StreamConfig,
) -> None:
    """Frame `body` as one message (preamble, then chunks of `config.max_chunk_bytes`), draining as it goes.

    A `StreamingFrame` goes payload first, each piece hashed once it is handed to the socket, and its signed head
    last (`head bytes` in the preamble); one whose head does not fit the preamble's u16 is laid out and sent whole.
    """
    if isinstance(body, StreamingFrame):
        if 0 < body.head_bytes <= _MAX_HEAD_BYTES and body.payload_bytes:
            await _write_streaming(writer, status, body, config=config)
            return
        body = body.to_bytes()
    view = memoryview(body).cast("B")
    chunk = config.max_chunk_bytes
    writer.write(encode_preamble(status, len(view), chunk))
    for offset in range(0, len(view), chunk):
        part = view[offset : offset + chunk]
        writer.write(_CHUNK_HEADER.pack(len(part)))
        writer.write(part)
        await asyncio.wait_for(writer.drain(), config.chunk_timeout_s)
    await asyncio.wait_for(writer.drain(), config.chunk_timeout_s)


async def _write_streaming(
    writer: asyncio.StreamWriter, status: Status, frame: StreamingFrame, *, config: StreamConfig
) -> None:
    chunk = config.max_chunk_bytes
    pieces = frame.pieces(chunk)
    head_chunks = -(-frame.head_bytes // chunk)
    writer.write(
        encode_preamble(
            status, len(frame), chunk, head_bytes=frame.head_bytes, num_chunks=len(pieces) + head_chunks
        )
    )
    hasher = frame.new_hasher()
    for piece in pieces:
        writer.write(_CHUNK_HEADER.pack(len(piece)))
        writer.write(piece)
        hasher.update(piece)  # while the daemon reads what the socket took
        await asyncio.wait_for(writer.drain(), config.chunk_timeout_s)
    await hasher.settled()
    head = memoryview(frame.head(hasher))
    for offset in range(0, len(head), chunk):
        writer.write(_CHUNK_HEADER.pack(len(head[offset : offset + chunk])))
        writer.write(head[offset : offset + chunk])
    await asyncio.wait_for(writer.drain(), config.chunk_timeout_s)


async def _discard_until_closed(reader: asyncio.StreamReader, *, max_bytes: int, timeout_s: float) -> None:
    """Read and drop what the caller still sends, until it closes, `max_bytes` or `timeout_s`.

    Closing a stream that still has unread bytes makes the daemon reset it, and the caller then loses our answer
    (measured: BrokenPipeError on its read). Lingering briefly lets an honest caller read why it was refused; the
    bytes and the time are capped, and nothing is kept.
    """
    loop = asyncio.get_running_loop()
    deadline, discarded = loop.time() + timeout_s, 0
    while discarded < max_bytes and (remaining := deadline - loop.time()) > 0:
        chunk = await asyncio.wait_for(reader.read(1 << 16), remaining)
        if not chunk:
            return
        discarded += len(chunk)


async def _close(writer: asyncio.StreamWriter, timeout_s: float) -> None:
    writer.close()
    with suppress(Exception):
        await asyncio.wait_for(writer.wait_closed(), timeout_s)


# ------------------------------------------------------------------------------------------------ strikes


class PeerStrikes:
    """Rejections blamed on each peer, by reason. Bounded: the least recently struck peers are forgotten first."""

    def __init__(self, max_peers: int = 65536) -> None:
        if max_peers <= 0:
            raise ValueError("max_peers must be positive")
        self.max_peers = max_peers
        self._counts: OrderedDict[str, Counter[str]] = OrderedDict()

    def record(self, peer_id: str, reason: str) -> int:
        """Count one strike; return the peer's total."""
        counts = self._counts.pop(peer_id, None) or Counter()
        counts[reason] += 1
        self._counts[peer_id] = counts
        while len(self._counts) > self.max_peers:
            self._counts.popitem(last=False)
        return sum(counts.values())

    def count(self, peer_id: str, reason: str | None = None) -> int:
        counts = self._counts.get(peer_id)
        if counts is None:
            return 0
        return sum(counts.values()) if reason is None else counts[reason]

    def reasons(self, peer_id: str) -> dict[str, int]:
        return dict(self._counts.get(peer_id, {}))

    def snapshot(self) -> dict[str, dict[str, int]]:
        return {peer: dict(counts) for peer, counts in self._counts.items()}


# ------------------------------------------------------------------------------------------------ server / client


class PeerThrottled(RemoteRefused):
    """A server refused a framed call for load: `limit` names the cap; retrying before `retry_after_s` is pointless
    (inf: the call can never pass, e.g. a request larger than the peer's whole bytes-in-flight budget)."""

    def __init__(self, message: str, *, reason: str, limit: str, retry_after_s: float) -> None:
        super().__init__(message, reason=reason)
        self.limit = limit
        self.retry_after_s = retry_after_s


def throttle_reason(admission: Admission) -> str:
    """The reason tag a refused caller receives: `busy` for the stream caps (the tag older nodes already send and
    understand), else `throttled: <limit>[; retry_after_s=<s>]`."""
    if admission.reason in _STREAM_LIMITS:
        return BUSY
    tag = THROTTLED_PREFIX + admission.reason
    if admission.retry_after_s > 0:
        tag += f"; retry_after_s={admission.retry_after_s:.3f}"
    return tag


def parse_throttle(reason: str) -> tuple[str, float] | None:
    """(limit, retry_after_s) from a `throttle_reason` tag; None for any other reason."""
    if reason == BUSY:
        return STREAMS, 0.0
    if not reason.startswith(THROTTLED_PREFIX):
        return None
    limit, _, hint = reason[len(THROTTLED_PREFIX) :].partition("; retry_after_s=")
    try:
        retry_after_s = float(hint) if hint else 0.0
    except ValueError:
        retry_after_s = 0.0
    if math.isnan(retry_after_s) or retry_after_s < 0:
        retry_after_s = 0.0
    return limit, retry_after_s


def route_limits(routes: Mapping[str, Route], config: StreamConfig) -> LimitsConfig:
    """The `LimitsConfig` a server uses when none is given: each route's rate (or the default) per peer, and the
    stream caps of `config`."""
    return LimitsConfig(
        default_rate=DEFAULT_ROUTE_RATE,
        rpc_rates={name: route.rate or DEFAULT_ROUTE_RATE for name, route in routes.items()},
        global_rate=DEFAULT_GLOBAL_RATE,
        max_streams_per_peer=config.max_streams_per_peer,
        max_streams_total=max(config.max_streams, config.max_streams_per_peer),
    )


class FramedServer:
    """Serves `routes` (name -> Route, or name -> (handler, max_request_bytes)) as bounded streams on `p2p`.

    `limiter` (else a `PeerLimiter` built from `limits`, else from `route_limits`) is consulted before any request
    is read. There is no switch to turn it off: a server without limits is one given limits nobody reaches.
    """

    def __init__(
        self,
        p2p: P2P,
        routes: Mapping[str, Route | tuple[Handler, int]],
        *,
        config: StreamConfig | None = None,
        strikes: PeerStrikes | None = None,
        on_reject: RejectHook | None = None,
        limits: LimitsConfig | None = None,
        limiter: PeerLimiter | None = None,
        on_throttle: ThrottleHook | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        for name in routes:
            protocol_name(name)
            if name == OTHER_RPCS:
                raise ValueError(f"{OTHER_RPCS!r} is not a route name")
        self.p2p = p2p
        self.routes = {name: r if isinstance(r, Route) else Route(*r) for name, r in routes.items()}
        self.config = config or StreamConfig()
        self.strikes = strikes if strikes is not None else PeerStrikes()
        self.on_reject = on_reject
        self.on_throttle = on_throttle
        if limiter is None:
            limiter = PeerLimiter(limits or route_limits(self.routes, self.config))
        self.limiter = limiter
        self.clock = clock
        self.floods: Counter[str] = Counter()  # flood windows logged per peer
        self._flood_logged_at: OrderedDict[str, float] = OrderedDict()
        self._lingering = 0
        self._tasks: set[asyncio.Task[None]] = set()
        self._started = False

    @property
    def _active(self) -> dict[str, int]:
        """Open streams per peer (what the stream caps count)."""
        return {
            peer: s.num_open_streams for peer, s in self.limiter.stats().peers.items() if s.num_open_streams
        }

    async def start(self) -> None:
        for name, route in self.routes.items():
            await self.p2p.add_binary_stream_handler(
                protocol_name(name), self._make_stream_handler(name, route)
            )
        self._started = True

    async def stop(self) -> None:
        """Unregister the handlers and cancel requests in flight."""
        if self._started:
            for name in self.routes:
                with suppress(Exception):  # the daemon may already be gone
                    await self.p2p.remove_binary_stream_handler(protocol_name(name))
            self._started = False
        for task in list(self._tasks):
            task.cancel()
        if self._tasks:
            await asyncio.wait(self._tasks, timeout=self.config.chunk_timeout_s)

    def _make_stream_handler(
        self, name: str, route: Route
    ) -> Callable[[StreamInfo, asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]:
        async def handle(
            info: StreamInfo, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
        ) -> None:
            task = asyncio.current_task()
            assert task is not None
            self._tasks.add(task)
            try:
                await self._serve(name, route, info.peer_id.to_base58(), reader, writer)
            finally:
                self._tasks.discard(task)
                await _close(writer, self.config.chunk_timeout_s)

        return handle

    async def _serve(
        self, name: str, route: Route, remote: str, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        admission = self.limiter.open_stream(remote, name, self.clock())  # before reading a single byte
        if not admission:
            await self._throttle(remote, name, admission, reader, writer)
            return
        try:
            answer = await self._handle(name, route, remote, reader)
        except Throttled as e:
            await self._throttle(remote, name, e.admission, reader, writer)
            return
        except ProtocolError as e:
            self._reject(remote, name, e)
            await self._answer_error(reader, writer, e.reason)
            return
        except Exception:
            logger.exception("%s: handler failed on a request from %s", name, remote[:16])
            await self._answer_error(reader, writer, "internal error")
            return
        finally:
            self.limiter.close_stream(remote, name)
        try:
            await write_message(writer, Status.OK, answer, config=self.config)
        except (ConnectionError, asyncio.TimeoutError) as e:
            logger.debug("%s: answer to %s not delivered: %r", name, remote[:16], e)

    async def _handle(self, name: str, route: Route, remote: str, reader: asyncio.StreamReader) -> Body:
        """Read the request under the caps (each chunk's bytes reserved before it is read), then run the handler;
        the reservation is given back once the handler returns or the request is refused."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.config.message_timeout_s
        raw = await _read_exactly(reader, _PREAMBLE.size, self.config.chunk_timeout_s)
        preamble = parse_preamble(
            raw,
            max_bytes=route.max_request_bytes,
            max_chunk_bytes=self.config.max_chunk_bytes,
            statuses=frozenset({Status.REQUEST}),
        )
        spill = route.spill
        spill_dir = (
            spill.directory() if spill is not None and preamble.total_bytes >= spill.min_bytes else None
        )
        with self.limiter.frame(remote, preamble.total_bytes, self.clock()) as held:
            try:
                frame = await asyncio.wait_for(
                    _read_chunks(
                        reader,
                        preamble,
                        self.config,
                        digest=route.digest_payload,
                        reserve=lambda length: self._take_chunk(name, remote, held, preamble, length),
                        spill_dir=spill_dir,
                    ),
                    max(0.0, deadline - loop.time()),
                )
            except asyncio.TimeoutError:
                raise StreamTimeout(
                    f"request not complete within {self.config.message_timeout_s} s"
                ) from None
            if isinstance(frame, FrameFile):
                assert spill is not None
                try:
                    answer = await spill.handler(frame, remote)
                finally:
                    frame.remove()  # unless the handler took it
            else:
                answer = await route.handler(frame, remote)
        return b"" if answer is None else answer

    def _take_chunk(
        self, name: str, remote: str, held: FrameReservation, preamble: Preamble, length: int
    ) -> None:
        """Reserve one chunk of a request; past a cap the whole request is refused (`Throttled`) and its handler
        never runs."""
        admission = held.take(length, self.clock())
        if admission:
            return
        logger.info(
            "%s: refused a request from %s at chunk %d of %d: %s (%d of %d declared bytes held, %d in flight here)",
            name,
            remote[:16],
            held.num_chunks + 1,
            preamble.num_chunks,
            admission.reason,
            held.held_bytes,
            preamble.total_bytes,
            self.limiter.bytes_in_flight,
        )
        raise Throttled(admission)

    async def _throttle(
        self,
        remote: str,
        name: str,
        admission: Admission,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
    ) -> None:
        """Refuse for load: counted by the limiter, never a strike; a flood is logged and struck once per window."""
        if admission.flood is not None:
            self._note_flood(remote, name, admission.flood)
        if self.on_throttle is not None:
            self.on_throttle(remote, name, admission)
        logger.debug("%s: throttled %s: %s", name, remote[:16], admission.reason)
        await self._answer_error(reader, writer, throttle_reason(admission))

    def _note_flood(self, remote: str, name: str, flood: FloodReport) -> None:
        now = self.clock()
        last = self._flood_logged_at.get(remote)
        if last is not None and now - last < flood.window_s:
            return
        self._flood_logged_at[remote] = now
        self._flood_logged_at.move_to_end(remote)
        while len(self._flood_logged_at) > self.strikes.max_peers:
            self._flood_logged_at.popitem(last=False)
        self.floods[remote] += 1
        if len(self.floods) > self.strikes.max_peers:
            del self.floods[next(iter(self.floods))]
        self.strikes.record(remote, FLOOD_STRIKE)
        logger.warning("%s: peer %s is flooding: %s", name, remote[:16], flood.reason)

    def _reject(self, remote: str, name: str, error: ProtocolError) -> None:
        blamed = blames_remote(error)
        if blamed:
            self.strikes.record(remote, error.reason)
        # Unblamed refusals (clock skew, a caller that hung up) are routine; blamed ones are worth a warning.
        logger.log(
            logging.WARNING if blamed else logging.INFO,
            "%s: refused a request from %s: %s (%s)%s",
            name,
            remote[:16],
            error.reason,
            error,
            "" if blamed else " [not blamed]",
        )
        if self.on_reject is not None:
            self.on_reject(remote, name, error)

    async def _answer_error(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, reason: str
    ) -> None:
        with suppress(Exception):  # the caller may be gone; the refusal is already logged
            await write_message(writer, Status.ERROR, reason.encode()[:MAX_ERROR_BYTES], config=self.config)
            if self._lingering >= self.config.max_lingering:
                return  # under a flood, holding every refused stream open would itself be the exhaustion
            self._lingering += 1
            try:
                await _discard_until_closed(
                    reader, max_bytes=self.config.linger_bytes, timeout_s=self.config.linger_s
                )
            finally:
                self._lingering -= 1


async def call_framed(
    p2p: P2P,
    peer_id: str,
    name: str,
    frame: Body,
    *,
    max_response_bytes: int,
    timeout_s: float,
    config: StreamConfig | None = None,
    answer_wait_s: float | None = None,
) -> bytearray:
    """Send `frame` to handler `name` on `peer_id` and return its answer (a private bytearray). The answer's first
    bytes are awaited `answer_wait_s` from the call's start (None: the chunk timeout, 10 s), for a handler that
    answers only after a long judgement (a syncer's push: node.diloco.push_wait).

    Raises:
        PeerThrottled: the server refused for load (`.limit`, `.retry_after_s`); a RemoteRefused.
        RemoteRefused: the server answered with an error (its reason tag in `.reason`).
        ProtocolError: the answer broke the framing or `max_response_bytes` (blame the server).
        asyncio.TimeoutError: no full answer within `timeout_s`.
        P2PDaemonError / ConnectionError: the stream could not be opened or broke.
    """
    return await asyncio.wait_for(
        _call_framed(p2p, peer_id, name, frame, max_response_bytes, config or StreamConfig(), answer_wait_s),
        timeout_s,
    )


async def _call_framed(
    p2p: P2P,
    peer_id: str,
    name: str,
    frame: Body,
    max_response_bytes: int,
    config: StreamConfig,
    answer_wait_s: float | None = None,
) -> bytearray:
    _, reader, writer = await p2p.call_binary_stream_handler(PeerID.from_base58(peer_id), protocol_name(name))
    # Read while writing: a server that refuses the preamble answers at once, and we stop sending.
    sending = asyncio.ensure_future(_send_request(writer, frame, config))
    try:
        status, body = await read_message(
            reader,
            max_bytes=max_response_bytes,
            config=config,
            statuses=frozenset({Status.OK, Status.ERROR}),
            digest=True,  # answers are mostly signed frames; hashing a small other answer costs nothing
            preamble_timeout_s=answer_wait_s,
        )
    finally:
        sending.cancel()
        with suppress(asyncio.CancelledError):
            await sending
        await _close(writer, config.chunk_timeout_s)
    if status == Status.ERROR:
        reason = body.decode(errors="replace")
        message = f"{peer_id[:16]}... refused {name}: {reason}"
        throttle = parse_throttle(reason)
        if throttle is not None:
            raise PeerThrottled(message, reason=reason, limit=throttle[0], retry_after_s=throttle[1])
        raise RemoteRefused(message, reason=reason)
    return body


async def _send_request(writer: asyncio.StreamWriter, frame: Body, config: StreamConfig) -> None:
    with suppress(ConnectionError, asyncio.TimeoutError):  # if the server hung up, its answer says why
        await write_message(writer, Status.REQUEST, frame, config=config)
