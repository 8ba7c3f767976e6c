"""Cost of the signed wire protocol next to the transfer it protects, and of the tensor codec next to a clone.

Two hivemind P2P daemons on loopback in one process; requests go through our bounded framed streams
(`protocol.rpc`, raw libp2p streams through p2pd). For 1, 4 and 16 MiB float32 activations (plus 64 MiB for
throughput), sampled in turns so that every path sees the same background load, it measures:

- `transfer_s`: the median round trip of a plain (unsigned) payload of that size (tensor to bytes, call, frombuffer)
  to a handler that answers 32 bytes;
- `signing_share` (the headline, goal < 3 %): the wall time the crypto adds to the streaming path
  (`seal_streaming`: payload sent first straight from the tensor and hashed piece by piece as it is written, head
  signed and sent last; the receiver hashes each chunk as it lands), as the median over turns of (signed round trip -
  the same path with every digest, signature and verification switched off, see `crypto_off`) / `transfer_s`;
- `old_signing_share`: the same for the previous path, measured in the same turns: `seal` copies the tensor into the
  frame and hashes it before a byte is sent, then the frame streams (the receiver side is the same);
- `crypto_in_path_share` / `old_crypto_in_path_share`: the time spent inside the crypto calls of both ends (every
  BLAKE3 update and digest, the signature, the verification; see `crypto_timed`) / `transfer_s`, with no credit for
  overlap: the CPU the crypto costs, whether or not it hides behind the transfer (the headline before streaming);
- `crypto_cpu_share`: the crypto steps timed alone (2 x one-pass digest of the payload + one signature + one
  verification) / `transfer_s`;
- `end_to_end_overhead` = median(signed, streaming) / median(transfer) - 1: crypto plus header and finite check
  (`old_end_to_end_overhead`: the previous path, which also copies the tensor into the frame).

Sender and receiver live in one process here (one event loop thread for both ends, plus two p2pd daemons), on a
2-core machine shared with other work: read the figures with the load average recorded beside them.

Codec: `codec_vs_clone` = throughput of the codec round trip (tensor -> wire bytes -> checked tensor, i.e. two copies
and a finite-value scan) divided by the throughput of `tensor.clone()` of the same 16 MiB tensor (one copy).

Everything is measured twice: with glibc's default allocator (the headline: what a node gets today), then after
`mallopt` tells glibc to keep freed memory (see `keep_freed_memory`), which removes the page faults of fresh
multi-MiB buffers that otherwise dominate the codec and part of the signed path.

Torch runs with one intra-op thread (see `main`). BLAKE3 hashes on one thread on the stream and in `seal` (pieces hot
in cache), and with its own threads from 1 MiB in the timed-alone digest.
Run: `python -m benchmarks.protocol [--reps N]`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ctypes
import dataclasses
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from hivemind.p2p import P2P

from benchmarks.common import plot_path, write_result
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
from protocol.identity import NodeIdentity, verify_signature
from protocol.replay import ReplayGuard
from protocol.rpc import FramedServer, Route, StreamConfig, call_framed, route_limits

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


async def measure_wire(reps: int) -> dict[int, dict[str, float]]:
    with tempfile.TemporaryDirectory() as tmp:
        server_id = NodeIdentity.load_or_create(Path(tmp) / "server.key")
        client_id = NodeIdentity.load_or_create(Path(tmp) / "client.key")
        server_p2p = await P2P.create(identity_path=str(server_id.path), check_if_identity_free=False)
        client_p2p = await P2P.create(
            initial_peers=await server_p2p.get_visible_maddrs(),
            identity_path=str(client_id.path),
            check_if_identity_free=False,
        )
        ctx = Context(
            run_id="bench",
            kind=Kind.ACTIVATION,
            receiver=server_id.peer_id,
            stage=0,
            direction=Direction.FORWARD,
        )
        guard = ReplayGuard()

        async def raw(frame: bytearray, remote_peer: str) -> bytes:
            tensor = torch.frombuffer(frame, dtype=torch.float32)  # the unsigned baseline: no checks at all
            return tensor[:8].numpy().tobytes()

        async def signed(frame: bytearray, remote_peer: str) -> bytes:
            _, tensor = open_frame(
                frame, remote_peer=remote_peer, expect=ctx, limits=LIMITS, replay=guard, now=time.time()
            )
            return tensor[:8].numpy().tobytes()

        cap = max_frame_bytes(LIMITS)
        routes = {
            "raw": Route(raw, cap, digest_payload=False),
            "signed": Route(signed, cap),  # the payload digest runs while the chunks arrive
        }
        # One 64 MiB frame is over the default bytes-in-flight cap of a peer; the benchmark measures the path, not it.
        limits = dataclasses.replace(
            route_limits(routes, StreamConfig()),
            max_bytes_in_flight_per_peer=2 * cap,
            max_bytes_in_flight_total=4 * cap,
        )
        server = FramedServer(server_p2p, routes, limits=limits)
        await server.start()
        try:
            return {
                mib: await _measure_size(client_p2p, server_id, client_id, ctx, mib, reps)
                for mib in SIZES_MIB
            }
        finally:
            await server.stop()
            await client_p2p.shutdown()
            await server_p2p.shutdown()


def _paths(
    call: Callable[[str, Any], Awaitable[None]], client_id: NodeIdentity, ctx: Context, tensor: torch.Tensor
) -> tuple[dict[str, Callable[[], Awaitable[None]]], dict[str, list[float]]]:
    """The round trips measured in turns, and the crypto time each signed one spends in the path."""
    counter = iter(range(1 << 30))
    in_path: dict[str, list[float]] = {"streamed": [], "sealed": []}

    def frame(streamed: bool) -> Any:
        sealer = seal_streaming if streamed else seal
        return sealer(client_id, ctx, microbatch=next(counter), step=1, now=time.time(), tensor=tensor)

    def signed(name: str) -> Callable[[], Awaitable[None]]:
        async def once() -> None:
            clock = [0.0]
            with crypto_timed(clock):
                await call("signed", frame(name == "streamed"))
            in_path[name].append(clock[0])

        return once

    def nocrypto(streamed: bool) -> Callable[[], Awaitable[None]]:
        async def once() -> None:
            with crypto_off():  # the same path with digests, signature and verification off
                await call("signed", frame(streamed))

        return once

    async def raw_once() -> None:
        await call("raw", codec.encode_tensor(tensor)[2])

    paths = {
        "transfer": raw_once,
        "streamed": signed("streamed"),
        "streamed_nocrypto": nocrypto(True),
        "sealed": signed("sealed"),
        "sealed_nocrypto": nocrypto(False),
    }
    return paths, in_path


async def _measure_size(
    client_p2p: P2P, server_id: NodeIdentity, client_id: NodeIdentity, ctx: Context, mib: int, reps: int
) -> dict[str, float]:
    reps = max(9, reps * 4 // (mib + 3))  # fewer repetitions for the big sizes
    tensor = torch.randn(mib * MIB // 4)

    async def call(name: str, frame: Any) -> None:
        await call_framed(client_p2p, server_id.peer_id, name, frame, max_response_bytes=64, timeout_s=60)

    paths, in_path = _paths(call, client_id, ctx, tensor)
    for once in paths.values():  # warm the connection and every path
        await once()
    for clocks in in_path.values():
        clocks.clear()
    frame, payload = (
        seal(client_id, ctx, microbatch=0, step=1, now=time.time(), tensor=tensor),
        codec.tensor_bytes(tensor),
    )
    times: dict[str, list[float]] = {name: [] for name in paths}
    crypto_samples = []
    for _ in range(reps):  # in turns, so that every path sees the same background load
        for name, once in paths.items():
            start = time.perf_counter()
            await once()
            times[name].append(time.perf_counter() - start)
        crypto_samples.append(crypto_costs_s(client_id, frame, payload))
    crypto = {key: statistics.median(sample[key] for sample in crypto_samples) for key in crypto_samples[0]}
    return _summary(mib, reps, times, in_path, crypto)


def _summary(
    mib: int,
    reps: int,
    times: dict[str, list[float]],
    in_path: dict[str, list[float]],
    crypto: dict[str, float],
) -> dict[str, float]:
    median = {name: statistics.median(t) for name, t in times.items()}
    transfer_s = median["transfer"]
    # Paired by turn: the load a turn saw cancels out of its difference (not out of its noise).
    wall_s, old_wall_s = (
        statistics.median(s - n for s, n in zip(times[name], times[f"{name}_nocrypto"], strict=True))
        for name in ("streamed", "sealed")
    )
    crypto_s, old_crypto_s = (statistics.median(in_path[name]) for name in ("streamed", "sealed"))
    return {
        "reps": reps,
        "transfer_s": transfer_s,
        **{f"{name}_transfer_s": median[name] for name in times if name != "transfer"},
        "throughput_mib_s": mib / transfer_s,
        "signed_throughput_mib_s": mib / median["streamed"],
        "crypto_wall_s": wall_s,
        "signing_share": wall_s / transfer_s,
        "old_crypto_wall_s": old_wall_s,
        "old_signing_share": old_wall_s / transfer_s,
        "crypto_s": crypto_s,
        "crypto_in_path_share": crypto_s / transfer_s,
        "old_crypto_s": old_crypto_s,
        "old_crypto_in_path_share": old_crypto_s / transfer_s,
        **crypto,
        "crypto_cpu_share": crypto["crypto_cpu_s"] / transfer_s,
        "end_to_end_overhead": median["streamed"] / transfer_s - 1,
        "old_end_to_end_overhead": median["sealed"] / transfer_s - 1,
    }


def plot(runs: dict[str, dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    wire, codec_default = runs["default_malloc"]["wire"], runs["default_malloc"]["codec"]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.2))
    x = range(len(SIZES_MIB))
    floor_ms = 1e-3  # the log axis needs a positive bar
    series = (
        ("transfer (unsigned)", "transfer_s", None),
        (
            "wall time the crypto adds, previous (hash in seal, then send)",
            "old_crypto_wall_s",
            "old_signing_share",
        ),
        ("wall time the crypto adds, now (hashed while streaming)", "crypto_wall_s", "signing_share"),
    )
    for k, (label, key, share_key) in enumerate(series):
        xs = [i + (k - 1) * 0.27 for i in x]
        heights = [max(wire[m][key] * 1e3, floor_ms) for m in SIZES_MIB]  # a negative difference: noise
        ax1.bar(xs, heights, 0.27, label=label)
        if share_key is not None:
            for xi, h, mib in zip(xs, heights, SIZES_MIB, strict=True):
                ax1.annotate(f"{wire[mib][share_key]:.1%}", (xi, h), ha="center", va="bottom", fontsize=7)
    ax1.set_yscale("log")
    ax1.set_xticks(list(x), [f"{mib} MiB" for mib in SIZES_MIB])
    ax1.set_ylabel("ms (median)")
    ax1.set_title("Signing cost vs loopback transfer (hivemind p2pd)")
    ax1.legend()
    bars = {"tensor.clone()": codec_default["clone_mib_s"], "codec round trip": codec_default["codec_mib_s"]}
    if "keep_freed_memory" in runs:
        bars["codec round trip,\nglibc keeps freed memory"] = runs["keep_freed_memory"]["codec"][
            "codec_mib_s"
        ]
    ax2.bar(list(bars), list(bars.values()))
    ax2.set_ylabel("MiB/s (16 MiB float32)")
    ax2.set_title(f"Codec at {codec_default['codec_vs_clone']:.2f}x clone throughput (default malloc)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def measure(reps: int) -> dict[str, Any]:
    return {"wire": asyncio.run(measure_wire(reps)), "codec": codec_vs_clone(16 * MIB, reps=max(9, reps))}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--reps", type=int, default=100, help="repetitions of a 1 MiB transfer (fewer for larger)"
    )
    args = parser.parse_args(argv)
    # One intra-op thread: on a shared 2-core machine, OpenMP with 2 threads made every torch op here ~10x slower
    # (a sum of 16 MiB: 11 ms against 0.8 ms) whenever another process held a core, and p2pd always does here.
    torch.set_num_threads(1)
    load_before = os.getloadavg()[0]
    runs = {"default_malloc": measure(args.reps)}
    if keep_freed_memory():
        runs["keep_freed_memory"] = measure(args.reps)
    wire, codec_figures = runs["default_malloc"]["wire"], runs["default_malloc"]["codec"]
    headline = {f"signing_share_{mib}mib": round(wire[mib]["signing_share"], 4) for mib in SHARE_SIZES_MIB}
    headline |= {
        f"old_signing_share_{mib}mib": round(wire[mib]["old_signing_share"], 4) for mib in SHARE_SIZES_MIB
    }
    headline["codec_vs_clone"] = round(codec_figures["codec_vs_clone"], 3)
    detail = {
        # other processes share these 2 cores: read the figures with the load around them
        "load_average_1min": os.getloadavg()[0],
        "load_average_1min_at_start": load_before,
        "definitions": {
            "signing_share": "median per turn of (streaming signed round trip - the same with digests, signature and "
            "verification off) / median unsigned transfer round trip: the wall time the crypto adds",
            "old_signing_share": "the same for the previous path (seal hashes the payload before it is sent), "
            "measured in the same turns",
            "crypto_in_path_share": "median time inside the crypto calls of a streaming signed round trip (BLAKE3 on "
            "both ends, sign, verify; no credit for overlap) / median unsigned transfer round trip",
            "crypto_cpu_share": "(sign + verify + one-pass BLAKE3 digest of the payload twice, each timed alone) / "
            "median unsigned transfer round trip",
            "end_to_end_overhead": "median signed round trip (seal+call+open) / median unsigned round trip - 1",
            "codec_vs_clone": "clone time / codec round-trip time (encode + checked decode) for 16 MiB float32",
        },
        "runs": {
            mode: {"wire": {f"{mib}mib": f for mib, f in run["wire"].items()}, "codec": run["codec"]}
            for mode, run in runs.items()
        },
    }
    path = write_result(NAME, headline, detail)
    plot(runs, plot_path(NAME))
    print(f"wrote {path}")
    for key, value in headline.items():
        print(f"  {key}: {value}")
    for mode, run in runs.items():
        print(f"  {mode}: codec_vs_clone {run['codec']['codec_vs_clone']:.3f}")
        for mib, f in run["wire"].items():
            print(
                f"    {mib:>2} MiB: transfer {f['transfer_s'] * 1e3:7.1f} ms ({f['throughput_mib_s']:.0f} MiB/s), "
                f"crypto adds {f['crypto_wall_s'] * 1e3:5.2f} ms ({f['signing_share']:.2%}; "
                f"old path {f['old_signing_share']:.2%}; in path {f['crypto_in_path_share']:.2%}, "
                f"old {f['old_crypto_in_path_share']:.2%}; alone {f['crypto_cpu_share']:.2%}), "
                f"end-to-end overhead {f['end_to_end_overhead']:+.1%}"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
