"""`python -m bootstrap data prepare --input FILE_OR_DIR... --out DIR [--tokenizer tokenizer.json]
[--shard-tokens N] [--heldout-shards K] [--text-field NAME] [--quiet]`: tokenize a corpus into the shards a
bootstrap serves (`--data-dir DIR`); see docs/data.md."""

from __future__ import annotations

import argparse
import importlib
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from node.ml.prepare import DEFAULT_SHARD_TOKENS, PrepareConfig, Progress, TokenizerInfo, prepare
from protocol.errors import DataError, TokenizerMismatch

EXIT_OK, EXIT_FAILED = 0, 1


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m bootstrap data", description=__doc__)
    parser.add_argument("action", choices=["prepare"])
    parser.add_argument("--input", type=Path, nargs="+", required=True, metavar="PATH")
    parser.add_argument("--out", type=Path, required=True, metavar="DIR", help="where shards and index go")
    parser.add_argument("--tokenizer", type=Path, metavar="tokenizer.json", help="default: raw bytes")
    parser.add_argument(
        "--shard-tokens", type=int, default=DEFAULT_SHARD_TOKENS, metavar="N", help="tokens per shard"
    )
    parser.add_argument("--heldout-shards", type=int, default=1, metavar="K", help="shards kept out (1)")
    parser.add_argument("--text-field", default="text", help="jsonl field / parquet column (text)")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    return parser


def _tokenizer(path: Path | None) -> TokenizerInfo:
    if path is None:
        return TokenizerInfo()
    from node.ml.tokenizer import Tokenizer

    tokenizer = Tokenizer(path.read_bytes())
    return TokenizerInfo(
        encode=tokenizer.encode,
        vocab_size=tokenizer.vocab_size,
        sha256=tokenizer.sha256,
        end_of_text=tokenizer.end_of_text,
    )


def _progress_bar(total_bytes: int) -> Progress:
    tqdm: Any = importlib.import_module("tqdm").tqdm  # installed with hivemind; untyped

    bar: Progress = tqdm(total=total_bytes, unit="B", unit_scale=True, desc="prepare", file=sys.stderr)
    return bar


def data_command(argv: Sequence[str]) -> int:
    args = _parser().parse_args(list(argv))
    started = time.monotonic()
    try:
        config = PrepareConfig(
            shard_tokens=args.shard_tokens, heldout_shards=args.heldout_shards, text_field=args.text_field
        )
        progress = None if args.quiet else _progress_bar
        index = prepare(args.input, args.out, _tokenizer(args.tokenizer), config, progress)
    except (OSError, ValueError, DataError, TokenizerMismatch) as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_FAILED
    tokens = sum(s.tokens for s in index.shards)
    elapsed = time.monotonic() - started
    print(
        f"wrote {args.out}: {len(index.shards)} shards ({len(index.heldout)} held out), {tokens} tokens "
        f"({index.dtype}), index sha256 {index.sha256()}, in {elapsed:.1f} s ({tokens / max(elapsed, 1e-9):.0f} "
        f"tokens/s); serve it with python -m bootstrap --data-dir {args.out}",
        flush=True,
    )
    return EXIT_OK
