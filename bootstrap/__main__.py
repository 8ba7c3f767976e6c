"""`python -m bootstrap [--config bootstrap.toml] [--run run.toml] [--tokenizer tokenizer.json] [--listen MADDR]
[--http HOST:PORT] [...]`: run a DHT entry point that publishes the signed run manifest; prints the multiaddrs to
share. `python -m bootstrap tokenizer train --out tokenizer.json --vocab-size N [--data SPEC]`: train the run's
byte-level BPE on its corpus. `python -m bootstrap data prepare --input PATH... --out DIR`: tokenize a corpus
into the token shards a bootstrap serves with `--data-dir DIR` (bootstrap/data_cli.py). Settings are loaded by
`node.config.load_bootstrap_config` (defaults < bootstrap.toml < HIVENODE_BOOTSTRAP < flags; docs/config.md).
Errors: one line on stderr, exit 1 (2 for usage)."""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys
import time
from collections.abc import Sequence
from pathlib import Path

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


def tokenizer_command(argv: Sequence[str]) -> int:
    """`tokenizer train`: a byte-level BPE on the run's corpus (the built-in one without --data)."""
    parser = argparse.ArgumentParser(
        prog="python -m bootstrap tokenizer", description=tokenizer_command.__doc__
    )
    parser.add_argument("action", choices=["train"])
    parser.add_argument("--out", type=Path, required=True, metavar="tokenizer.json")
    parser.add_argument("--vocab-size", type=int, default=8192, metavar="N", help="tokens (default 8192)")
    parser.add_argument(
        "--data", metavar="SPEC", help="corpus as for `python -m node --data` (default: built-in)"
    )
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    args = parser.parse_args(list(argv))
    from node.ml.data import load_corpus
    from node.ml.tokenizer import tokenizer_spec, train_bpe

    started = time.monotonic()
    try:
        corpus = load_corpus(args.data)
        texts = (piece.data.decode("utf-8", errors="replace") for piece in corpus.train)
        blob = train_bpe(texts, args.vocab_size, show_progress=not args.quiet)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_bytes(blob)
    except (OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_FAILED
    spec = tokenizer_spec(blob)
    print(
        f"wrote {args.out}: {spec['vocab_size']} tokens, sha256 {spec['sha256']}, trained on "
        f"{corpus.train_bytes} bytes in {time.monotonic() - started:.1f} s; start the bootstrap with "
        f"--tokenizer {args.out}",
        flush=True,
    )
    return EXIT_OK


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] == ["tokenizer"]:
        return tokenizer_command(args[1:])
    if args[:1] == ["data"]:
        from bootstrap.data_cli import data_command

        return data_command(args[1:])
    try:
        config = load_bootstrap_config(args)
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
