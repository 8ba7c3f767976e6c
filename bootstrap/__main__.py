"""`python -m bootstrap [--run run.toml] [--listen MADDR] [--identity PATH] [--http HOST:PORT] [...]`: run a DHT entry
point that publishes the signed run manifest; prints the multiaddrs to share. Errors: one line on stderr, exit 1
(2 for usage)."""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys
from collections.abc import Sequence
from pathlib import Path

from bootstrap.server import Bootstrap, BootstrapConfig, announce_lines, run_bootstrap
from node.config import LOG_LEVELS, default_state_dir, parse_host_port
from node.context import LogContext, setup_logging
from protocol.errors import ConfigError, HivenodeError

EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m bootstrap", description="Run a hivenode bootstrap peer.")
    add = parser.add_argument
    add("--run", type=Path, metavar="run.toml", help="run settings (default: the built-in default run)")
    add(
        "--listen",
        action="append",
        metavar="MADDR",
        help="DHT listen multiaddr (default /ip4/127.0.0.1/tcp/0)",
    )
    add("--announce", action="append", metavar="MADDR", help="public multiaddr to announce (repeatable)")
    add(
        "--join", action="append", metavar="MADDR", help="another bootstrap or hivemind-dht peer (repeatable)"
    )
    add("--identity", type=Path, metavar="PATH", help="DHT key (default: <state-dir>/identity.key)")
    add("--owner-key", type=Path, metavar="PATH", help="key that signs the manifest (default: --identity)")
    add("--authorize-syncer", action="append", default=[], metavar="PEER_ID", help="add an authorized syncer")
    add(
        "--authorize-verifier",
        action="append",
        default=[],
        metavar="PEER_ID",
        help="add an authorized verifier",
    )
    add("--http", default="127.0.0.1:0", metavar="HOST:PORT", help="HTTP address (default 127.0.0.1:0)")
    add("--maddrs-file", type=Path, metavar="PATH", help="write our multiaddrs here, one per line")
    add(
        "--state-dir",
        type=Path,
        metavar="DIR",
        help="identity and state (default: ~/.local/state/hivenode/bootstrap)",
    )
    add("--log-level", choices=LOG_LEVELS, default="INFO")
    return parser


def config_from_args(args: argparse.Namespace) -> BootstrapConfig:
    host, port = parse_host_port(args.http)
    try:
        return BootstrapConfig(
            state_dir=args.state_dir or default_state_dir("bootstrap"),
            identity_path=args.identity,
            owner_key_path=args.owner_key,
            run_path=args.run,
            authorize_syncers=tuple(args.authorize_syncer),
            authorize_verifiers=tuple(args.authorize_verifier),
            listen=tuple(args.listen or ("/ip4/127.0.0.1/tcp/0",)),
            announce=tuple(args.announce or ()),
            join=tuple(args.join or ()),
            http_host=host,
            http_port=port,
            maddrs_file=args.maddrs_file,
        )
    except ValueError as e:
        raise ConfigError(str(e)) from None


def _print_ready(bootstrap: Bootstrap) -> None:
    print("\n".join(announce_lines(bootstrap)), flush=True)


async def _run(config: BootstrapConfig, log_context: LogContext) -> int:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, stop.set)  # the only thing a signal does
    await run_bootstrap(config, stop, _print_ready, log_context)
    return EXIT_OK


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    log_context = LogContext()
    log_context.role = "bootstrap"
    setup_logging(args.log_level, log_context)
    try:
        return asyncio.run(_run(config_from_args(args), log_context))
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except HivenodeError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_FAILED


if __name__ == "__main__":
    sys.exit(main())
