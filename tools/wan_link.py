"""Run one emulated WAN link in front of a local node: `python -m tools.wan_link --target 127.0.0.1:PORT`.

Start the node with `announce_maddrs=["/ip4/127.0.0.1/tcp/<proxy port>"]` (or give peers the proxy's address) so
its traffic crosses the link. Ctrl+C stops it and prints what the proxy did.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import logging
import signal

from tools.wan_proxy import LinkProfile, WanProxy


def _host_port(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    return host.strip("[]"), int(port)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--target", type=_host_port, required=True, help="HOST:PORT the node listens on")
    parser.add_argument("--listen", type=_host_port, default=("127.0.0.1", 0), help="HOST:PORT (port 0: any)")
    parser.add_argument("--delay-ms", type=float, default=0.0, help="one-way delay")
    parser.add_argument(
        "--jitter-ms", type=float, default=0.0, help="uniform +- jitter on each chunk's delay"
    )
    parser.add_argument("--bandwidth-bytes-per-s", type=float, default=None, help="per direction")
    parser.add_argument(
        "--reset-every-s", type=float, default=None, help="mean connection life before a reset"
    )
    parser.add_argument("--stall-every-s", type=float, default=None, help="mean time between stalls")
    parser.add_argument("--stall-s", type=float, default=0.0, help="length of each stall")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--stats-every-s", type=float, default=10.0, help="print stats this often (0: never)")
    return parser.parse_args(argv)


async def run(args: argparse.Namespace) -> None:
    profile = LinkProfile(
        delay_s=args.delay_ms / 1000,
        jitter_s=args.jitter_ms / 1000,
        bandwidth_bytes_per_s=args.bandwidth_bytes_per_s,
        reset_every_s=args.reset_every_s,
        stall_every_s=args.stall_every_s,
        stall_s=args.stall_s,
        seed=args.seed,
    )
    (target_host, target_port), (listen_host, listen_port) = args.target, args.listen
    proxy = WanProxy(
        target_host=target_host,
        target_port=target_port,
        profile=profile,
        listen_host=listen_host,
        listen_port=listen_port,
    )
    await proxy.start()
    print(f"WAN proxy listening on {listen_host}:{proxy.port} -> {target_host}:{target_port}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        while not stop.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), args.stats_every_s or None)
            print(dataclasses.asdict(proxy.stats), flush=True)
    finally:
        await proxy.stop()


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    asyncio.run(run(parse_args()))


if __name__ == "__main__":
    main()
