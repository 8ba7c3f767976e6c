"""`python -m node trust list|forget RUN_ID [--state-dir DIR]`: the owner keys this node pinned, per run id.

The pins themselves (trust on first use, what "the same run" means, the file format) are `protocol.manifest.
OwnerPins`; this module only shows and edits them. It starts nothing and reaches no network.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from node.config import default_state_dir
from protocol.manifest import OwnerPin, OwnerPins, format_time, short_key

EXIT_OK, EXIT_USAGE = 0, 2


def build_trust_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m node trust",
        description="Show or remove the run owners this node trusts. A node pins the owner key of each run id "
        "the first time it joins it; a run id already pinned to another owner is refused until you forget it.",
    )
    commands = parser.add_subparsers(dest="action", required=True, metavar="{list,forget}")
    state_help = f"the node's state directory (default: {default_state_dir('node')})"
    listing = commands.add_parser("list", help="print every pinned run: run id, name, owner key, first seen")
    listing.add_argument("--state-dir", type=Path, metavar="DIR", help=state_help)
    forget = commands.add_parser(
        "forget", help="remove the pin of one run id (its owner is re-pinned on join)"
    )
    forget.add_argument("run_id", metavar="RUN_ID", help="the run id, as `trust list` prints it")
    forget.add_argument("--state-dir", type=Path, metavar="DIR", help=state_help)
    return parser


def trust_command(argv: Sequence[str]) -> int:
    args = build_trust_parser().parse_args(argv)
    pins = OwnerPins((args.state_dir or default_state_dir("node")) / OwnerPins.FILENAME)
    if args.action == "list":
        return list_command(pins)
    return forget_command(pins, args.run_id)


def pin_lines(pins: Sequence[OwnerPin]) -> list[str]:
    """One aligned line per pin, under a header."""
    width = max([len("RUN NAME")] + [len(pin.run_name) for pin in pins])
    lines = [f"{'RUN ID':40}  {'RUN NAME':{width}}  {'OWNER':11}  FIRST SEEN"]
    for pin in pins:
        lines.append(
            f"{pin.run_id:40}  {pin.run_name:{width}}  {short_key(pin.owner):11}  {format_time(pin.first_seen)}"
        )
    return lines


def list_command(pins: OwnerPins) -> int:
    found = pins.pins()
    if found:
        print(f"{len(found)} pinned run(s) in {pins.path}:")
        print("\n".join(pin_lines(found)))
    else:
        print(f"no pinned runs in {pins.path}")
    if pins.legacy:
        names = ", ".join(f"{name!r} -> {short_key(owner)}" for name, owner in sorted(pins.legacy.items()))
        print(
            f"ignored: {len(pins.legacy)} old name-keyed pin(s) ({names}); runs are re-pinned by run id on join"
        )
    return EXIT_OK


def forget_command(pins: OwnerPins, run_id: str) -> int:
    removed = pins.forget(run_id)
    if removed is None:
        print(
            f"error: no pin for run id {run_id!r} in {pins.path}; `python -m node trust list` shows the pinned ones",
            file=sys.stderr,
        )
        return EXIT_USAGE
    print(
        f"forgot run {removed.run_id} ({removed.run_name!r}, owner {removed.owner}); "
        "the next join of this run id pins its owner again"
    )
    return EXIT_OK
