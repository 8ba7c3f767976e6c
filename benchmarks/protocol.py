"""Cost of the signed wire protocol next to the transfer it protects, and of the tensor codec next to a clone.

Two hivemind P2P daemons on loopback, a sender and a receiver; requests go through our bounded framed streams
(`protocol.rpc`, raw libp2p streams through p2pd), for 1, 4 and 16 MiB float32 activations (plus 64 MiB for
throughput).

Method (`benchmarks.paired`): this 2-core box is shared, its load drifts by more than the few percent to resolve,
and a fixed order of paths (signed always right before crypto-off, as the previous turns ran them) turns the
carry-over between adjacent calls into a bias (two runs of the same code gave +1.3 % and -3.1 % at 16 MiB). So
every figure is a comparison of two arms, run as many blocks of two adjacent round trips, arm a first in exactly
half the blocks, the blocks of all comparisons shuffled together (seeded), after 3 discarded warm-up calls of
every path. A share is the median over blocks of (arm a / arm b - 1), with a 95 % percentile bootstrap interval
over blocks. Each call is prepared the same way whatever its arm (the receiver's crypto switched for it over the
`mode` route, outside the timed span). The comparisons:

- `signing_share` (the headline, goal: < 3 % at 16 MiB, `signing_goal_met` = the interval's upper end < 3 %):
  a = the streaming signed round trip (`seal_streaming`: payload sent first straight from the tensor and hashed
  piece by piece as it is written, head signed and sent last; the receiver hashes each chunk as it lands), b = the
  same path with every digest, signature and verification switched off (`crypto_off`): the wall time the crypto
  adds to the transfer without it;
- `aa_share`: the A/A control, a and b both the crypto-off path, the same procedure: what the method reports when
  there is nothing to find (its bias, and its noise as the interval's width);
- `old_signing_share`: the same as `signing_share` for the previous path (`seal` copies the tensor into the frame
  and hashes it before a byte is sent);
- `end_to_end_overhead`: a = the streaming signed round trip, b = a plain payload of that size (tensor to bytes,
  call, frombuffer, to a handler that answers 32 bytes; its median is `transfer_s`): crypto plus header and
  finite check.

Beside them: `signing_share_of_raw_transfer` (the median paired difference over `transfer_s`, the previous runs'
scale), `crypto_in_path_share` (time inside both ends' crypto calls, no credit for overlap, see `crypto_timed`; 30
calls after the schedule), `crypto_cpu_share` (2 x one-pass digest + one signature + one verification, timed
alone), and the CPU each group of processes spends per call (`cpu_*`, from /proc in 10 ms ticks: means only).

Every figure is measured in two layouts:

- `wire_separate` (the headline): the receiver runs in a process of its own (`serve_receiver`, started by this one),
  as on a real pair of nodes. Each end then has its own event loop, GIL and hashing thread, so one end's hashing
  overlaps the other end's I/O as it does between two machines; the sender switches the receiver's crypto per call
  over a `mode` route (`ReceiverCrypto`), outside the timed call.
- `wire` (secondary; `--separate-only` skips it): both ends in this process, on one event loop thread and one
  hashing thread, so both ends' hashing serializes with all the I/O, which no real transfer does.

Both layouts still share this machine's 2 cores with two p2pd daemons: the crypto can hide behind the transfer only
where a core is idle, so read the figures with the load average recorded beside them. A block in which the daemons
dropped a stream is not counted (`failed_blocks`; the run stops past a tenth of the blocks).

Codec: `codec_vs_clone` = throughput of the codec round trip (tensor -> wire bytes -> checked tensor, i.e. two copies
and a finite-value scan) divided by the throughput of `tensor.clone()` of the same 16 MiB tensor (one copy).

Everything is measured again under two allocators unless `--default-malloc-only`: with glibc's default allocator
(the headline: what a node gets today), then after `mallopt` tells glibc to keep freed memory (see
`keep_freed_memory`), which removes the page faults of fresh multi-MiB buffers.

Torch runs with one intra-op thread (see `main`). BLAKE3 hashes on one thread on the stream and in `seal` (pieces hot
in cache), and with its own threads from 1 MiB in the timed-alone digest.
Run: `python -m benchmarks.protocol [--blocks N] [--default-malloc-only] [--separate-only]`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ctypes
import dataclasses
import json
import os
import random
import statistics
import struct
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from hivemind.p2p import P2P

from benchmarks.common import plot_path, write_result
from benchmarks.paired import Block, Comparison, paired_share, schedule
from protocol import codec, envelope
from protocol.codec import TensorLimits
from protocol.envelope import (
    SIGNATURE_DOMAIN,
    Context,
    Direction,
    Kind,
    max_frame_bytes,
    open_frame,
    payload_digest,
    seal,
    seal_streaming,
)
from protocol.errors import ProtocolError
from protocol.identity import NodeIdentity, verify_signature
from protocol.replay import ReplayGuard
from protocol.rpc import FramedServer, Route, StreamConfig, call_framed, route_limits
from tools.proctree import cpu_seconds

NAME = "protocol"
MIB = 1 << 20
SIZES_MIB = (1, 4, 16, 64)
SHARE_SIZES_MIB = (1, 4, 16)
LIMITS = TensorLimits(max_bytes=64 * MIB)


def median_s(fn: Callable[[], Any], reps: int) -> float:
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def crypto_costs_s(sender: NodeIdentity, frame: bytes | bytearray, payload: memoryview) -> dict[str, float]:
    """One sample of each crypto step timed alone (sign and verify averaged over 10 calls: microseconds)."""
    header_len = int.from_bytes(frame[:4], "big")
    message = SIGNATURE_DOMAIN + frame[4 : 4 + header_len]
    signature = bytes(frame[4 + header_len : 4 + header_len + 64])
    start = time.perf_counter()
    payload_digest([payload])
    digest_s = time.perf_counter() - start
    start = time.perf_counter()
    for _ in range(10):
        sender.sign(message)
    sign_s = (time.perf_counter() - start) / 10
    start = time.perf_counter()
    for _ in range(10):
        verify_signature(sender.peer_id, message, signature)
    verify_s = (time.perf_counter() - start) / 10
    return {
        "digest_s": digest_s,
        "sign_s": sign_s,
        "verify_s": verify_s,
        "crypto_cpu_s": 2 * digest_s + sign_s + verify_s,
    }


class _NoHash:
    """Stands in for a BLAKE3 hasher while the crypto is off: hashes nothing, digests to zeros."""

    def update(self, data: object) -> None:
        pass

    def digest(self, length: int = 32) -> bytes:
        return bytes(length)


def _timed(fn: Callable[..., Any], clock: list[float]) -> Callable[..., Any]:
    """`fn`, adding the time of each call to `clock[0]`."""

    def run(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            clock[0] += time.perf_counter() - start

    return run


class _TimedHasher:
    """A BLAKE3 hasher that adds the time of each of its calls to a shared clock."""

    def __init__(self, hasher: Any, clock: list[float]) -> None:
        self.update = _timed(hasher.update, clock)
        self.digest = _timed(hasher.digest, clock)


@contextlib.contextmanager
def _crypto_replaced(
    new_hasher: Callable[..., Any], verify: Callable[..., bool], sign: Callable[..., bytes]
) -> Iterator[None]:
    """Replace the hasher factory, the signature check and the signing of the envelope path for the block (sender
    and receiver both live in this process)."""
    saved = envelope._new_hasher, envelope.verify_signature, NodeIdentity.sign
    envelope._new_hasher, envelope.verify_signature, NodeIdentity.sign = new_hasher, verify, sign  # type: ignore
    try:
        yield
    finally:
        envelope._new_hasher, envelope.verify_signature, NodeIdentity.sign = saved  # type: ignore[method-assign]


def crypto_timed(clock: list[float]) -> contextlib.AbstractContextManager[None]:
    """Add to `clock[0]` the time spent inside every digest, signature and verification call of the envelope path:
    the crypto's time on the path, where it runs, with no credit for overlap."""
    new_hasher, verify, sign = envelope._new_hasher, envelope.verify_signature, NodeIdentity.sign
    return _crypto_replaced(
        lambda num_bytes, parallel=False: _TimedHasher(new_hasher(num_bytes, parallel=parallel), clock),
        _timed(verify, clock),
        _timed(sign, clock),
    )


def crypto_off() -> contextlib.AbstractContextManager[None]:
    """Switch off every digest, signature and verification of the envelope path, leaving its copies, header
    encoding, checks and tensor building as they are."""
    return _crypto_replaced(
        lambda num_bytes, parallel=False: _NoHash(),
        lambda peer_id, data, signature: True,
        lambda self, data: bytes(64),
    )


def codec_vs_clone(num_bytes: int, reps: int) -> dict[str, float]:
    """Codec round trip (encode to wire bytes, checked decode) against `tensor.clone()`, plus its two halves."""
    tensor = torch.randn(num_bytes // 4)
    dtype, shape, data = codec.encode_tensor(tensor)

    def roundtrip() -> None:
        wire_dtype, wire_shape, wire_bytes = codec.encode_tensor(tensor)
        codec.decode_tensor(wire_dtype, list(wire_shape), wire_bytes, LIMITS)

    codec_s = median_s(roundtrip, reps)
    clone_s = median_s(tensor.clone, reps)
    return {
        "codec_roundtrip_s": codec_s,
        "clone_s": clone_s,
        "encode_s": median_s(lambda: codec.encode_tensor(tensor), reps),
        "decode_s": median_s(lambda: codec.decode_tensor(dtype, list(shape), data, LIMITS), reps),
        "codec_mib_s": num_bytes / MIB / codec_s,
        "clone_mib_s": num_bytes / MIB / clone_s,
        "codec_vs_clone": clone_s / codec_s,
    }


def keep_freed_memory() -> bool:
    """Tell glibc to keep freed big blocks instead of returning them to the OS (mallopt; Linux/glibc only).

    By default the fresh multi-MiB buffers of a decode are unmapped or trimmed on free and faulted in again on the
    next message; that, not copying, dominates the codec round trip here (measured 29 ms against 4 ms at 16 MiB).
    """
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return False
    m_trim_threshold, m_mmap_threshold = -1, -3
    return bool(libc.mallopt(m_trim_threshold, 1 << 30) and libc.mallopt(m_mmap_threshold, 256 << 20))


class ReceiverCrypto:
    """The receiver's crypto when it runs in a process of its own (`serve_receiver`): the sender switches it per
    path over the `mode` route, off (as `crypto_off`) or timed (as `crypto_timed`); each switch answers the time
    the receiver spent inside its crypto calls since the last one."""

    def __init__(self) -> None:
        self.off = False
        self.clock = [0.0]

    def installed(self) -> contextlib.AbstractContextManager[None]:
        new_hasher, verify, sign = envelope._new_hasher, envelope.verify_signature, NodeIdentity.sign
        timed_verify = _timed(verify, self.clock)

        def hasher(num_bytes: int, parallel: bool = False) -> Any:
            return (
                _NoHash() if self.off else _TimedHasher(new_hasher(num_bytes, parallel=parallel), self.clock)
            )

        def check(peer_id: str, data: bytes, signature: bytes) -> bool:
            return True if self.off else bool(timed_verify(peer_id, data, signature))

        return _crypto_replaced(hasher, check, sign)

    def switch(self, off: bool) -> float:
        spent, self.clock[0], self.off = self.clock[0], 0.0, off
        return spent


def _daemon_pid(p2p: P2P) -> int:
    return int(p2p._child.pid)  # type: ignore[attr-defined]  # hivemind keeps its p2pd process private


@dataclasses.dataclass
class CpuMeter:
    """The processes of a transfer in two groups: the Python ends (event loop plus hashing thread) and the daemons."""

    python: list[int]
    p2pd: list[int]

    def read(self) -> dict[str, float]:
        return {
            group: sum(map(cpu_seconds, pids))
            for group, pids in (("python", self.python), ("p2pd", self.p2pd))
        }


class CpuTally:
    """CPU seconds per path and group over the turns. /proc counts in clock ticks (10 ms), so only the mean over
    many turns means anything: it tells where the wall time the crypto adds goes (its CPU, or waiting)."""

    def __init__(self) -> None:
        self._sums: dict[str, dict[str, float]] = {}
        self._counts: dict[str, int] = {}

    def add(self, path: str, cpu_s: dict[str, float]) -> None:
        sums = self._sums.setdefault(path, {})
        for group, seconds in cpu_s.items():
            sums[group] = sums.get(group, 0.0) + seconds
        self._counts[path] = self._counts.get(path, 0) + 1

    def summary(self) -> dict[str, float]:
        means = {
            f"cpu_{path}_{group}_s": total / self._counts[path]
            for path, sums in self._sums.items()
            for group, total in sums.items()
            if path in ("transfer", "streamed", "streamed_nocrypto")
        }
        if "cpu_streamed_python_s" in means:
            means["crypto_cpu_added_s"] = (
                means["cpu_streamed_python_s"] - means["cpu_streamed_nocrypto_python_s"]
            )
        return means


def _context(receiver: str) -> Context:
    return Context(
        run_id="bench", kind=Kind.ACTIVATION, receiver=receiver, stage=0, direction=Direction.FORWARD
    )


def _server(p2p: P2P, receiver: str, switch: ReceiverCrypto | None) -> FramedServer:
    """The receiving end: an unsigned route, a signed one (the payload digest runs while the chunks arrive) and,
    when the receiver has a process of its own, the `mode` route that switches its crypto."""
    ctx, guard = _context(receiver), ReplayGuard()

    async def raw(frame: bytearray, remote_peer: str) -> bytes:
        tensor = torch.frombuffer(frame, dtype=torch.float32)  # the unsigned baseline: no checks at all
        return tensor[:8].numpy().tobytes()

    async def signed(frame: bytearray, remote_peer: str) -> bytes:
        _, tensor = open_frame(
            frame, remote_peer=remote_peer, expect=ctx, limits=LIMITS, replay=guard, now=time.time()
        )
        return tensor[:8].numpy().tobytes()

    cap = max_frame_bytes(LIMITS)
    routes = {"raw": Route(raw, cap, digest_payload=False), "signed": Route(signed, cap)}
    if switch is not None:

        async def mode(body: bytearray, remote_peer: str) -> bytes:
            return struct.pack(">d", switch.switch(off=bytes(body) == b"off"))

        routes["mode"] = Route(mode, 8, digest_payload=False)
    # One 64 MiB frame is over the default bytes-in-flight cap of a peer; the benchmark measures the path, not it.
    limits = dataclasses.replace(
        route_limits(routes, StreamConfig()),
        max_bytes_in_flight_per_peer=2 * cap,
        max_bytes_in_flight_total=4 * cap,
    )
    return FramedServer(p2p, routes, limits=limits)


async def serve_receiver(key_path: str) -> None:
    """The receiving end in a process of its own: prints its addresses as one JSON line, serves until stdin closes."""
    identity = NodeIdentity.load_or_create(Path(key_path))
    p2p = await P2P.create(identity_path=str(identity.path), check_if_identity_free=False)
    switch = ReceiverCrypto()
    server = _server(p2p, identity.peer_id, switch)
    with switch.installed():
        await server.start()
        try:
            maddrs = [str(a) for a in await p2p.get_visible_maddrs()]
            print(
                json.dumps({"maddrs": maddrs, "pid": os.getpid(), "p2pd_pid": _daemon_pid(p2p)}), flush=True
            )
            await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)  # until the sender is done
        finally:
            await server.stop()
            await p2p.shutdown()


@contextlib.asynccontextmanager
async def _receiver_process(key_path: Path, keep_freed: bool) -> AsyncIterator[dict[str, Any]]:
    """`serve_receiver` in a child process (this checkout's code); yields its hello (addresses and pids)."""
    args = [sys.executable, "-m", "benchmarks.protocol", "--serve", str(key_path)]
    child = await asyncio.create_subprocess_exec(
        *args,
        *(["--keep-freed-memory"] if keep_freed else []),
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
        cwd=Path(__file__).resolve().parent.parent,
    )
    assert child.stdin is not None and child.stdout is not None
    try:
        line = await asyncio.wait_for(child.stdout.readline(), 60)
        if not line:
            raise RuntimeError(f"receiver process exited with {await child.wait()}")
        yield json.loads(line)
    finally:
        child.stdin.close()
        try:
            await asyncio.wait_for(child.wait(), 30)
        except asyncio.TimeoutError:
            child.kill()
            await child.wait()


def blocks_for(mib: int, blocks: int) -> int:
    """Blocks per comparison at one size: `blocks` for the sizes of the signing share, a tenth (at least 10) for
    the 64 MiB throughput figure, whose calls take ~0.3 s each."""
    return blocks if mib in SHARE_SIZES_MIB else max(10, blocks // 10)


async def measure_wire(blocks: int, *, separate: bool, keep_freed: bool) -> dict[int, dict[str, Any]]:
    """The wire figures, with the receiver in this process (`separate` False: one event loop for both ends) or in a
    process of its own (then its crypto is switched per path over the `mode` route)."""
    with tempfile.TemporaryDirectory() as tmp:
        server_id = NodeIdentity.load_or_create(Path(tmp) / "server.key")
        client_id = NodeIdentity.load_or_create(Path(tmp) / "client.key")
        async with contextlib.AsyncExitStack() as stack:
            if separate:
                hello = await stack.enter_async_context(_receiver_process(server_id.path, keep_freed))
                maddrs: list[Any] = hello["maddrs"]
                meter = CpuMeter(python=[os.getpid(), hello["pid"]], p2pd=[hello["p2pd_pid"]])
            else:
                server_p2p = await P2P.create(identity_path=str(server_id.path), check_if_identity_free=False)
                stack.push_async_callback(server_p2p.shutdown)
                server = _server(server_p2p, server_id.peer_id, None)
                await server.start()
                stack.push_async_callback(server.stop)
                maddrs = await server_p2p.get_visible_maddrs()
                meter = CpuMeter(python=[os.getpid()], p2pd=[_daemon_pid(server_p2p)])
            client_p2p = await P2P.create(
                initial_peers=maddrs, identity_path=str(client_id.path), check_if_identity_free=False
            )
            stack.push_async_callback(client_p2p.shutdown)
            meter.p2pd.append(_daemon_pid(client_p2p))
            return {
                mib: await _measure_size(
                    client_p2p,
                    server_id,
                    client_id,
                    mib,
                    blocks_for(mib, blocks),
                    separate=separate,
                    meter=meter,
                )
                for mib in SIZES_MIB
            }


def _paths(
    call: Callable[[str, Any], Awaitable[bytes]], client_id: NodeIdentity, ctx: Context, tensor: torch.Tensor
) -> tuple[dict[str, Callable[[], Awaitable[None]]], list[float]]:
    """The round trips compared, and the crypto time each `streamed_timed` one spends in the path (sender side;
    the caller adds the receiver's)."""
    counter = iter(range(1 << 30))
    in_path: list[float] = []

    def frame(streamed: bool) -> Any:
        sealer = seal_streaming if streamed else seal
        return sealer(client_id, ctx, microbatch=next(counter), step=1, now=time.time(), tensor=tensor)

    def signed(streamed: bool) -> Callable[[], Awaitable[None]]:
        async def once() -> None:
            await call("signed", frame(streamed))

        return once

    def nocrypto(streamed: bool) -> Callable[[], Awaitable[None]]:
        async def once() -> None:
            with crypto_off():  # the same path with digests, signature and verification off
                await call("signed", frame(streamed))

        return once

    async def timed_once() -> None:
        clock = [0.0]
        with crypto_timed(clock):
            await call("signed", frame(True))
        in_path.append(clock[0])

    async def raw_once() -> None:
        await call("raw", codec.encode_tensor(tensor)[2])

    paths = {
        "transfer": raw_once,
        "streamed": signed(True),
        "streamed_nocrypto": nocrypto(True),
        "sealed": signed(False),
        "sealed_nocrypto": nocrypto(False),
        "streamed_timed": timed_once,
    }
    return paths, in_path


# The interleaved comparisons (see benchmarks.paired): arm a against arm b, A/B share = median over blocks a/b - 1.
SIGNING = Comparison("signing", "streamed", "streamed_nocrypto")  # the headline
AA = Comparison("aa", "streamed_nocrypto", "streamed_nocrypto")  # the control: nothing to find
OLD_SIGNING = Comparison("old_signing", "sealed", "sealed_nocrypto")
END_TO_END = Comparison("end_to_end", "streamed", "transfer")
COMPARISONS = (SIGNING, AA, OLD_SIGNING, END_TO_END)
WARMUP_ROUNDS = 3  # calls of every path before the schedule, not recorded
IN_PATH_CALLS = 30  # `streamed_timed` calls after the schedule, for `crypto_in_path_share`
CRYPTO_ALONE_SAMPLES = 20


@dataclasses.dataclass
class Runner:
    """Runs one call of a path as every arm gets it: the receiver's crypto switched for the path first (outside the
    timed span), then the round trip timed, with the CPU each group of processes spent meanwhile."""

    paths: dict[str, Callable[[], Awaitable[None]]]
    receiver_crypto: Callable[[bool], Awaitable[float]]
    meter: CpuMeter
    cpu: CpuTally = dataclasses.field(default_factory=CpuTally)

    async def once(self, name: str) -> float:
        await self.receiver_crypto(name.endswith("nocrypto"))
        cpu_before = self.meter.read()
        start = time.perf_counter()
        await self.paths[name]()
        elapsed = time.perf_counter() - start
        self.cpu.add(name, {group: t - cpu_before[group] for group, t in self.meter.read().items()})
        return elapsed

    async def block(self, block: Block) -> tuple[float, float]:
        """The block's two calls in its order; (arm a's time, arm b's time)."""
        first, second = [await self.once(name) for name in block.order]
        return (first, second) if block.a_first else (second, first)


async def _measure_size(
    client_p2p: P2P,
    server_id: NodeIdentity,
    client_id: NodeIdentity,
    mib: int,
    blocks_each: int,
    *,
    separate: bool,
    meter: CpuMeter,
) -> dict[str, Any]:
    tensor = torch.randn(mib * MIB // 4)

    async def call(name: str, frame: Any) -> bytes:
        return await call_framed(
            client_p2p, server_id.peer_id, name, frame, max_response_bytes=64, timeout_s=60
        )

    async def receiver_crypto(off: bool) -> float:
        """Switch the receiver's crypto (its own process only); the time it spent in crypto calls until now."""
        if not separate:
            return 0.0  # one process: the sender's switches cover both ends
        return float(struct.unpack(">d", await call("mode", b"off" if off else b"on"))[0])

    paths, in_path = _paths(call, client_id, _context(server_id.peer_id), tensor)
    runner = Runner(paths, receiver_crypto, meter)
    for _ in range(WARMUP_ROUNDS):  # the connection, every path and the allocator warmed; not recorded
        for name in paths:
            await runner.once(name)
    runner.cpu, in_path[:] = CpuTally(), []
    samples, failed = await _run_schedule(runner, mib, blocks_each)
    for _ in range(IN_PATH_CALLS):  # the crypto's time inside the path, both ends
        await runner.once("streamed_timed")
        in_path[-1] += await receiver_crypto(False)
    frame = seal(client_id, _context(server_id.peer_id), microbatch=0, step=1, now=time.time(), tensor=tensor)
    alone = [
        crypto_costs_s(client_id, frame, codec.tensor_bytes(tensor)) for _ in range(CRYPTO_ALONE_SAMPLES)
    ]
    crypto = {key: statistics.median(sample[key] for sample in alone) for key in alone[0]}
    return (
        _summary(mib, samples, statistics.median(in_path), crypto)
        | runner.cpu.summary()
        | {"failed_blocks": failed}
    )


async def _run_schedule(
    runner: Runner, mib: int, blocks_each: int
) -> tuple[dict[str, tuple[list[float], list[float]]], int]:
    """Every comparison's blocks, interleaved at random (seeded by size); per comparison (arm a, arm b) times."""
    samples: dict[str, tuple[list[float], list[float]]] = {c.name: ([], []) for c in COMPARISONS}
    failed = 0
    blocks = schedule(COMPARISONS, blocks_each, random.Random(f"protocol-{mib}"))
    for block in blocks:
        try:
            a_s, b_s = await runner.block(block)
        # a stream the daemons dropped (seen on this shared box): the block is not counted
        except ProtocolError as e:
            failed += 1
            print(f"  {mib} MiB: a block failed ({e!r}), not counted", file=sys.stderr)
            if failed > len(blocks) // 10:
                raise
            continue
        arm_a, arm_b = samples[block.comparison.name]
        arm_a.append(a_s)
        arm_b.append(b_s)
    return samples, failed


def _summary(
    mib: int,
    samples: dict[str, tuple[list[float], list[float]]],
    crypto_s: float,
    crypto: dict[str, float],
) -> dict[str, Any]:
    shares = {name: paired_share(*arms) for name, arms in samples.items()}
    by_path: dict[str, list[float]] = {}
    for c in COMPARISONS:
        for path, times in zip((c.a, c.b), samples[c.name], strict=True):
            by_path.setdefault(path, []).extend(times)
    median = {path: statistics.median(times) for path, times in by_path.items()}
    transfer_s = median["transfer"]
    figures: dict[str, Any] = {"blocks_per_comparison": shares["signing"].blocks, "transfer_s": transfer_s}
    figures |= {f"{path}_transfer_s": t for path, t in median.items() if path != "transfer"}
    for name, key in (("signing", "signing_share"), ("aa", "aa_share"), ("old_signing", "old_signing_share")):
        s = shares[name]
        figures |= {key: s.share, f"{key}_ci95_low": s.ci95_low, f"{key}_ci95_high": s.ci95_high}
    e2e = shares["end_to_end"]
    return figures | {
        "crypto_wall_s": shares["signing"].median_diff_s,
        "old_crypto_wall_s": shares["old_signing"].median_diff_s,
        # the previous scale: the crypto's median paired difference over the plain (raw) transfer
        "signing_share_of_raw_transfer": shares["signing"].median_diff_s / transfer_s,
        "throughput_mib_s": mib / transfer_s,
        "signed_throughput_mib_s": mib / median["streamed"],
        "crypto_s": crypto_s,
        "crypto_in_path_share": crypto_s / transfer_s,
        **crypto,
        "crypto_cpu_share": crypto["crypto_cpu_s"] / transfer_s,
        "end_to_end_overhead": e2e.share,
        "end_to_end_overhead_ci95_low": e2e.ci95_low,
        "end_to_end_overhead_ci95_high": e2e.ci95_high,
    }


GOAL_SHARE = 0.03  # issue 20: signing adds < 3 % to the wall time of a 16 MiB transfer


def _share_points(ax: Any, wire: dict[int, dict[str, Any]], title: str) -> None:
    """Each share with its 95 % interval per size: the streaming path, the previous one and the A/A control."""
    series = (
        ("signing, hashed while streaming", "signing_share"),
        ("signing, previous (hash in seal, then send)", "old_signing_share"),
        ("A/A control (crypto off vs crypto off)", "aa_share"),
    )
    for k, (label, key) in enumerate(series):
        xs = [i + (k - 1) * 0.2 for i in range(len(SHARE_SIZES_MIB))]
        points = [wire[mib][key] * 100 for mib in SHARE_SIZES_MIB]
        low = [p - wire[mib][f"{key}_ci95_low"] * 100 for p, mib in zip(points, SHARE_SIZES_MIB, strict=True)]
        high = [
            wire[mib][f"{key}_ci95_high"] * 100 - p for p, mib in zip(points, SHARE_SIZES_MIB, strict=True)
        ]
        ax.errorbar(xs, points, yerr=[low, high], fmt="o", capsize=4, label=label)
        for x, p in zip(xs, points, strict=True):
            ax.annotate(f"{p:.1f}", (x, p), xytext=(4, 0), textcoords="offset points", fontsize=7)
    ax.axhline(GOAL_SHARE * 100, color="red", linestyle="--", linewidth=1, label="goal: < 3 %")
    ax.axhline(0, color="grey", linewidth=0.5)
    ax.set_xticks(range(len(SHARE_SIZES_MIB)), [f"{mib} MiB" for mib in SHARE_SIZES_MIB])
    ax.set_ylabel("wall time added, % (median of paired ratios, 95 % CI)")
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=7)


def plot(runs: dict[str, dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    default = runs["default_malloc"]
    codec_default = default["codec"]
    layouts = [("wire_separate", "sender and receiver processes"), ("wire", "both ends on one event loop")]
    layouts = [(where, label) for where, label in layouts if where in default]
    fig, axes = plt.subplots(1, len(layouts) + 1, figsize=(6 * (len(layouts) + 1), 4.6))
    for ax, (where, label) in zip(axes, layouts, strict=False):
        _share_points(ax, default[where], f"Signing share over a loopback transfer (p2pd), {label}")
    bars = {"tensor.clone()": codec_default["clone_mib_s"], "codec round trip": codec_default["codec_mib_s"]}
    if "keep_freed_memory" in runs:
        bars["codec round trip,\nglibc keeps freed memory"] = runs["keep_freed_memory"]["codec"][
            "codec_mib_s"
        ]
    axes[-1].bar(list(bars), list(bars.values()))
    axes[-1].set_ylabel("MiB/s (16 MiB float32)")
    axes[-1].set_title(
        f"Codec at {codec_default['codec_vs_clone']:.2f}x clone throughput (default malloc)", fontsize=10
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def measure(blocks: int, *, keep_freed: bool, one_process: bool) -> dict[str, Any]:
    run = {"wire_separate": asyncio.run(measure_wire(blocks, separate=True, keep_freed=keep_freed))}
    if one_process:
        run["wire"] = asyncio.run(measure_wire(blocks, separate=False, keep_freed=keep_freed))
    return run | {"codec": codec_vs_clone(16 * MIB, reps=100)}


DEFINITIONS = {
    "method": "per size, blocks of two adjacent round trips (arm a, arm b) in a balanced, shuffled order (a first "
    "in half the blocks), the blocks of all comparisons interleaved at random; 3 warm-up calls of every path "
    "discarded; a share is the median over blocks of a/b - 1, its interval a 95 % percentile bootstrap over blocks",
    "signing_share": "a = streaming signed round trip, b = the same path with every digest, signature and "
    "verification off: the wall time the crypto adds to the transfer without it",
    "aa_share": "the A/A control: a and b both the crypto-off path, same procedure; what the method reports when "
    "there is nothing to find (its bias and noise)",
    "old_signing_share": "the same as signing_share for the previous path (seal hashes the payload before it is sent)",
    "signing_share_of_raw_transfer": "median paired difference (signed - crypto off) / median plain transfer "
    "round trip (tensor bytes, no header, no checks): the previous runs' scale",
    "signing_goal_met": "the upper end of the 95 % interval of signing_share at 16 MiB (separate processes) < 3 %",
    "crypto_in_path_share": "median time inside the crypto calls of a streaming signed round trip (BLAKE3 on "
    "both ends, sign, verify; no credit for overlap; 30 calls after the schedule) / median plain transfer",
    "crypto_cpu_share": "(sign + verify + one-pass BLAKE3 digest of the payload twice, each timed alone) / "
    "median plain transfer round trip",
    "end_to_end_overhead": "a = streaming signed round trip (seal+call+open), b = plain transfer round trip",
    "codec_vs_clone": "clone time / codec round-trip time (encode + checked decode) for 16 MiB float32",
    "wire_separate": "sender and receiver in processes of their own (the headline); wire: both in one process",
}


def _headline(runs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    run = runs["default_malloc"]
    headline: dict[str, Any] = {}
    for prefix, where in (("", "wire_separate"), ("one_process_", "wire")):
        for key in ("signing_share", "aa_share", "old_signing_share") if where in run else ():
            for mib in SHARE_SIZES_MIB:
                f = run[where][mib]
                headline[f"{prefix}{key}_{mib}mib"] = round(f[key], 4)
                headline[f"{prefix}{key}_{mib}mib_ci95"] = [
                    round(f[f"{key}_ci95_{e}"], 4) for e in ("low", "high")
                ]
    headline["signing_goal_met"] = bool(run["wire_separate"][16]["signing_share_ci95_high"] < GOAL_SHARE)
    headline["codec_vs_clone"] = round(run["codec"]["codec_vs_clone"], 3)
    return headline


def _print(headline: dict[str, Any], runs: dict[str, dict[str, Any]]) -> None:
    for key, value in headline.items():
        print(f"  {key}: {value}")
    for mode, run in runs.items():
        print(f"  {mode}: codec_vs_clone {run['codec']['codec_vs_clone']:.3f}")
        for where in ("wire_separate", "wire") if "wire" in run else ("wire_separate",):
            print(f"   {where}")
            for mib, f in run[where].items():
                print(
                    f"    {mib:>2} MiB: plain transfer {f['transfer_s'] * 1e3:6.1f} ms, crypto off "
                    f"{f['streamed_nocrypto_transfer_s'] * 1e3:6.1f} ms; signing "
                    f"{_ci(f, 'signing_share')}, A/A {_ci(f, 'aa_share')}, old path {_ci(f, 'old_signing_share')}, "
                    f"in path {f['crypto_in_path_share']:.1%}, alone {f['crypto_cpu_share']:.1%}, end to end "
                    f"{_ci(f, 'end_to_end_overhead')}; CPU per call (python, p2pd) signed "
                    f"{f['cpu_streamed_python_s'] * 1e3:.1f}, {f['cpu_streamed_p2pd_s'] * 1e3:.1f} ms, crypto off "
                    f"{f['cpu_streamed_nocrypto_python_s'] * 1e3:.1f}, {f['cpu_streamed_nocrypto_p2pd_s'] * 1e3:.1f} ms"
                )


def _ci(figures: dict[str, Any], key: str) -> str:
    return f"{figures[key]:+.2%} [{figures[f'{key}_ci95_low']:+.2%}, {figures[f'{key}_ci95_high']:+.2%}]"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--blocks", type=int, default=100, help="blocks per comparison at 1, 4 and 16 MiB (a tenth at 64 MiB)"
    )
    parser.add_argument(
        "--default-malloc-only",
        action="store_true",
        help="skip the second pass with glibc keeping freed memory",
    )
    parser.add_argument(
        "--separate-only",
        action="store_true",
        help="skip the one-process layout (both ends on one event loop)",
    )
    parser.add_argument("--serve", metavar="KEY", help=argparse.SUPPRESS)  # the receiver process
    parser.add_argument("--keep-freed-memory", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    # One intra-op thread: on a shared 2-core machine, OpenMP with 2 threads made every torch op here ~10x slower
    # (a sum of 16 MiB: 11 ms against 0.8 ms) whenever another process held a core, and p2pd always does here.
    torch.set_num_threads(1)
    if args.serve:
        if args.keep_freed_memory:
            keep_freed_memory()
        asyncio.run(serve_receiver(args.serve))
        return 0
    load_before = os.getloadavg()[0]
    one_process = not args.separate_only
    runs = {"default_malloc": measure(args.blocks, keep_freed=False, one_process=one_process)}
    if not args.default_malloc_only and keep_freed_memory():
        runs["keep_freed_memory"] = measure(args.blocks, keep_freed=True, one_process=one_process)
    headline = _headline(runs)
    detail = {
        # other processes share these 2 cores: read the figures with the load around them
        "load_average_1min": os.getloadavg()[0],
        "load_average_1min_at_start": load_before,
        "command": "python -m benchmarks.protocol " + " ".join(sys.argv[1:] if argv is None else argv),
        "definitions": DEFINITIONS,
        "runs": {
            mode: {
                where: ({f"{mib}mib": f for mib, f in figures.items()} if where != "codec" else figures)
                for where, figures in run.items()
            }
            for mode, run in runs.items()
        },
    }
    path = write_result(NAME, headline, detail)
    plot(runs, plot_path(NAME))
    print(f"wrote {path}")
    _print(headline, runs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
