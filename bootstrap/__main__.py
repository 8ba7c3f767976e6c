"""`python -m bootstrap [--config bootstrap.toml] [--run run.toml] [--listen MADDR] [--http HOST:PORT] [...]`: run a
DHT entry point that publishes the signed run manifest; prints the multiaddrs to share. Settings are loaded by
`node.config.load_bootstrap_config` (defaults < bootstrap.toml < HIVENODE_BOOTSTRAP < flags; docs/config.md).
Errors: one line on stderr, exit 1 (2 for usage)."""

from __future__ import annotations

import asyncio
import signal
import sys
from collections.abc import Sequence

from bootstrap.server import Bootstrap, announce_lines, run_bootstrap
from node.config import BootstrapConfig, load_bootstrap_config
from node.context import LogContext, setup_logging
from protocol.errors import ConfigError, HivenodeError

EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2


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
    try:
        config = load_bootstrap_config(sys.argv[1:] if argv is None else argv)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_USAGE
    log_context = LogContext()
    log_context.role = "bootstrap"
    setup_logging(config.log_level, log_context)
    try:
        return asyncio.run(_run(config, log_context))
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except HivenodeError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_FAILED


if __name__ == "__main__":
    sys.exit(main())
