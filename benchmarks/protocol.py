"""Cost of the signed wire protocol next to the transfer it protects, and of the tensor codec next to a clone.

Two hivemind P2P daemons on loopback in one process; requests go through our bounded framed streams
(`protocol.rpc`, raw libp2p streams through p2pd). For 1, 4 and 16 MiB float32 activations (plus 64 MiB for
throughput) it measures:

- `transfer_s`: the median round trip of a plain (unsigned) payload of that size to a handler that answers 32 bytes;
- `crypto_s`: the median cost of what signing adds on the two ends: BLAKE3 digest of the payload on the sender and
  on the receiver, one Ed25519 signature and one verification (over the ~200-byte header), sampled in turns with
  the transfers so that both see the same background load; `signing_share` = crypto_s / transfer_s (goal: < 3 %);
- `end_to_end_overhead`: measured directly, median(seal + call + open) / median(raw bytes + call + frombuffer) - 1.
  It includes the crypto plus the header, the extra frame copy and the finite check, and is noisy on 2 shared cores.

Codec: `codec_vs_clone` = throughput of the codec round trip (tensor -> wire bytes -> checked tensor, i.e. two copies
and a finite-value scan) divided by the throughput of `tensor.clone()` of the same 16 MiB tensor (one copy).

Everything is measured twice: with glibc's default allocator (the headline: what a node gets today), then after
`mallopt` tells glibc to keep freed memory (see `keep_freed_memory`), which removes the page faults of fresh
multi-MiB buffers that otherwise dominate the codec and part of the signed path.

Torch runs with one intra-op thread (see `main`); BLAKE3 uses its own threads for payloads of 1 MiB and more.
Run: `python -m benchmarks.protocol [--reps N]`.
"""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from hivemind.p2p import P2P

from benchmarks.common import plot_path, write_result
from protocol import codec
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
)
from protocol.identity import NodeIdentity, verify_signature
from protocol.replay import ReplayGuard
from protocol.rpc import FramedServer, Route, call_framed

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


def crypto_costs_s(sender: NodeIdentity, frame: bytes, payload: memoryview) -> dict[str, float]:
    """One sample of each crypto step of the signed path (sign and verify averaged over 10 calls: microseconds)."""
    header_len = int.from_bytes(frame[:4], "big")
    message = SIGNATURE_DOMAIN + frame[4 : 4 + header_len]
    signature = frame[4 + header_len : 4 + header_len + 64]
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
        "crypto_s": 2 * digest_s + sign_s + verify_s,
    }


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
        server = FramedServer(server_p2p, {"raw": Route(raw, cap), "signed": Route(signed, cap)})
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


async def _measure_size(
    client_p2p: P2P, server_id: NodeIdentity, client_id: NodeIdentity, ctx: Context, mib: int, reps: int
) -> dict[str, float]:
    reps = max(3, reps * 4 // (mib + 3))  # fewer repetitions for the big sizes
    tensor = torch.randn(mib * MIB // 4)
    counter = iter(range(1 << 30))

    async def call(name: str, frame: bytes) -> None:
        await call_framed(client_p2p, server_id.peer_id, name, frame, max_response_bytes=64, timeout_s=60)

    async def raw_once() -> None:
        await call("raw", codec.encode_tensor(tensor)[2])

    async def signed_once() -> None:
        frame = seal(client_id, ctx, microbatch=next(counter), step=1, now=time.time(), tensor=tensor)
        await call("signed", frame)

    await raw_once()  # warm the connection
    await signed_once()
    frame, payload = (
        seal(client_id, ctx, microbatch=0, step=1, now=time.time(), tensor=tensor),
        codec.tensor_bytes(tensor),
    )
    raw_times, signed_times, crypto_samples = [], [], []
    for _ in range(reps):  # in turns, so that all three see the same background load
        for once, times in ((raw_once, raw_times), (signed_once, signed_times)):
            start = time.perf_counter()
            await once()
            times.append(time.perf_counter() - start)
        crypto_samples.append(crypto_costs_s(client_id, frame, payload))
    raw_s, signed_s = statistics.median(raw_times), statistics.median(signed_times)
    crypto = {key: statistics.median(sample[key] for sample in crypto_samples) for key in crypto_samples[0]}
    return {
        "reps": reps,
        "transfer_s": raw_s,
        "signed_transfer_s": signed_s,
        "throughput_mib_s": mib / raw_s,
        "signed_throughput_mib_s": mib / signed_s,
        **crypto,
        "signing_share": crypto["crypto_s"] / raw_s,
        # a projection, not a measurement: the same crypto next to the wire time alone on a 1 Gbit/s link
        "signing_share_at_1gbit_projected": crypto["crypto_s"] / (mib * MIB * 8 / 1e9),
        "end_to_end_overhead": signed_s / raw_s - 1,
    }


def plot(runs: dict[str, dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    wire, codec_default = runs["default_malloc"]["wire"], runs["default_malloc"]["codec"]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.2))
    x = range(len(SIZES_MIB))
    ax1.bar(
        [i - 0.2 for i in x],
        [wire[m]["transfer_s"] * 1e3 for m in SIZES_MIB],
        0.4,
        label="transfer (unsigned)",
    )
    ax1.bar(
        [i + 0.2 for i in x],
        [wire[m]["crypto_s"] * 1e3 for m in SIZES_MIB],
        0.4,
        label="sign+verify+2 digests",
    )
    for i, mib in enumerate(SIZES_MIB):
        share = wire[mib]["signing_share"]
        ax1.annotate(f"{share:.1%}", (i + 0.2, wire[mib]["crypto_s"] * 1e3), ha="center", va="bottom")
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
        "--reps", type=int, default=20, help="repetitions of a 1 MiB transfer (fewer for larger)"
    )
    args = parser.parse_args(argv)
    # One intra-op thread: on a shared 2-core machine, OpenMP with 2 threads made every torch op here ~10x slower
    # (a sum of 16 MiB: 11 ms against 0.8 ms) whenever another process held a core, and p2pd always does here.
    torch.set_num_threads(1)
    runs = {"default_malloc": measure(args.reps)}
    if keep_freed_memory():
        runs["keep_freed_memory"] = measure(args.reps)
    wire, codec_figures = runs["default_malloc"]["wire"], runs["default_malloc"]["codec"]
    headline = {f"signing_share_{mib}mib": round(wire[mib]["signing_share"], 4) for mib in SHARE_SIZES_MIB}
    headline["codec_vs_clone"] = round(codec_figures["codec_vs_clone"], 3)
    detail = {
        "load_average_1min": os.getloadavg()[0],  # other processes share these 2 cores: read figures with it
        "definitions": {
            "signing_share": "(sign + verify + BLAKE3 digest on both ends) / median unsigned transfer round trip",
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
                f"crypto {f['crypto_s'] * 1e3:5.2f} ms ({f['signing_share']:.2%}), "
                f"end-to-end overhead {f['end_to_end_overhead']:+.1%}"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
