"""Long fuzzing campaigns over every network decode path (reliability.md §7), and the seed corpus they start from.

    python -m tools.fuzz                          # every target, 60 s each, atheris if installed
    python -m tools.fuzz --target record --seconds 3600
    python -m tools.fuzz --engine hypothesis --examples 200000
    python -m tools.fuzz --write-corpus           # regenerate tests/fuzz/corpus/ (deterministic)

Targets: the six of `tests/fuzz/test_fuzz_records.py` (DHT records, manifests, the store RPC behind the quota,
reach checks, throttle tags) plus the envelope opener, the tensor codec and the stream reassembler (whose CI
property tests live beside them). With atheris (libFuzzer, coverage-guided; `pip install atheris`), each target runs
in its own process from a scratch copy of its committed seeds, and crashing inputs are written to `--artifacts`;
without it, hypothesis drives the same targets with `--examples` inputs each (random and mutated seeds). Either way
the script prints the number of executions per target and in total, and exits non-zero if any target failed.
"""

from __future__ import annotations

import argparse
import logging
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

DONE = re.compile(r"Done (\d+) runs in (\d+) second")
STAT = re.compile(r"^#(\d+)\s", re.M)


def _extra_targets() -> dict[str, Callable[[bytes], None]]:
    """Targets whose CI property tests live in the other fuzz files: raw bytes in, only ProtocolError out."""
    import asyncio

    import torch

    from protocol.codec import TensorLimits, decode_tensor
    from protocol.envelope import Context, Direction, Kind, open_envelope
    from protocol.errors import ProtocolError
    from protocol.replay import ReplayGuard
    from protocol.rpc import Status, StreamConfig, read_message
    from tests.fuzz.test_fuzz_records import CALLER, OWNER

    limits = TensorLimits(max_bytes=1 << 12, max_tensors=3)
    ctx = Context(
        run_id="fuzz", kind=Kind.GRADIENT, receiver=OWNER.peer_id, stage=1, direction=Direction.BACKWARD
    )
    stream_config = StreamConfig(max_chunk_bytes=512, chunk_timeout_s=1.0)
    loop = asyncio.new_event_loop()

    sealed = set(_extra_seeds()["envelope"])

    def envelope(data: bytes) -> None:
        try:
            open_envelope(
                data, remote_peer=CALLER.peer_id, expect=ctx, limits=limits, replay=ReplayGuard(), now=0.0
            )
        except ProtocolError:
            return
        assert data in sealed, "admitted a frame that is not byte for byte one its sender sealed"

    def codec(data: bytes) -> None:
        if len(data) < 2:
            return
        dtype = ["float32", "bfloat16", "int64", "object", "V8"][data[0] % 5]
        rank = data[1] % 5
        shape = list(data[2 : 2 + rank])
        try:
            tensor = decode_tensor(dtype, shape, data[2 + rank :], TensorLimits(max_bytes=4096, max_rank=4))
        except ProtocolError:
            return
        assert tensor.numel() * tensor.element_size() == len(data) - 2 - rank and torch.isfinite(tensor).all()

    def stream(data: bytes) -> None:
        reader = asyncio.StreamReader(loop=loop)
        reader.feed_data(data)
        reader.feed_eof()
        try:
            _, body = loop.run_until_complete(
                read_message(
                    reader, max_bytes=4096, config=stream_config, statuses=frozenset({Status.REQUEST})
                )
            )
        except ProtocolError:
            return
        assert len(body) <= 4096

    return {"envelope": envelope, "codec": codec, "stream": stream}


def all_targets() -> dict[str, Callable[[bytes], None]]:
    from tests.fuzz.test_fuzz_records import TARGETS

    return {**TARGETS, **_extra_targets()}


def seeds_for(target: str) -> list[bytes]:
    from tests.fuzz.test_fuzz_records import load_corpus

    if target in ("envelope", "codec", "stream"):
        return _extra_seeds()[target]
    return load_corpus(target)


def _extra_seeds() -> dict[str, list[bytes]]:
    import torch

    from protocol.envelope import Context, Direction, Kind, seal
    from protocol.rpc import Status, encode_preamble
    from tests.fuzz.test_fuzz_records import CALLER, OWNER

    ctx = Context(
        run_id="fuzz", kind=Kind.GRADIENT, receiver=OWNER.peer_id, stage=1, direction=Direction.BACKWARD
    )
    frame = seal(CALLER, ctx, microbatch=1, step=2, now=0.0, tensor=torch.arange(6.0), nonce=b"n" * 16)
    body = b"hello stream"
    message = encode_preamble(Status.REQUEST, len(body), 512) + len(body).to_bytes(4, "big") + body
    return {"envelope": [bytes(frame)], "codec": [bytes([0, 2, 2, 2]) + b"\0" * 16], "stream": [message]}


# ---- corpus -----------------------------------------------------------------------------------------------------


def write_corpus() -> None:
    from tests.fuzz.test_fuzz_records import CORPUS, seed_corpus

    for target, seeds in seed_corpus().items():
        folder = CORPUS / target
        folder.mkdir(parents=True, exist_ok=True)
        for name, blob in seeds.items():
            (folder / f"seed-{name}").write_bytes(blob)
        print(f"{target}: {len(seeds)} seed(s) in {folder.relative_to(REPO)}")


# ---- engines ----------------------------------------------------------------------------------------------------


def run_atheris_child(target: str, corpus_dir: str, seconds: int, artifacts: str) -> None:
    """In a child process: libFuzzer on one target until `seconds` pass (atheris.Fuzz never returns)."""
    import atheris

    with atheris.instrument_imports(include=["protocol", "node"]):
        fn = all_targets()[target]

    def one_input(data: bytes) -> None:
        fn(data)

    argv = [
        sys.argv[0],
        corpus_dir,
        f"-max_total_time={seconds}",
        "-rss_limit_mb=2048",
        f"-artifact_prefix={artifacts}/",
    ]
    atheris.Setup(argv, one_input)
    atheris.Fuzz()


def run_atheris(targets: list[str], seconds: int, artifacts: Path) -> dict[str, tuple[int, bool]]:
    results = {}
    artifacts.mkdir(parents=True, exist_ok=True)
    for target in targets:
        (artifacts / target).mkdir(parents=True, exist_ok=True)  # libFuzzer writes crashing inputs here
        with tempfile.TemporaryDirectory(prefix=f"fuzz-{target}-") as scratch:
            for i, seed in enumerate(seeds_for(target)):
                Path(scratch, f"seed{i}").write_bytes(seed)
            started = time.monotonic()
            child = subprocess.run(
                [sys.executable, __file__, "--child", target, scratch, str(seconds), str(artifacts / target)],
                capture_output=True,
                text=True,
                timeout=seconds + 120,
                cwd=REPO,
            )
            done = DONE.search(child.stderr)
            stats = STAT.findall(child.stderr)
            runs = int(done.group(1)) if done else int(stats[-1]) if stats else 0
            ok = child.returncode == 0
            results[target] = (runs, ok)
            rate = runs / max(1e-9, time.monotonic() - started)
            print(
                f"{target:14s} {runs:>12,d} executions ({rate:,.0f}/s) {'ok' if ok else 'FAILED'}", flush=True
            )
            if not ok:
                print(child.stderr[-3000:], file=sys.stderr)
    return results


def run_hypothesis(targets: list[str], examples: int) -> dict[str, tuple[int, bool]]:
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    from tests.fuzz.test_fuzz_records import _mutated

    def campaign(fn: Callable[[bytes], None], seeds: list[bytes]) -> tuple[int, bool]:
        count = 0
        strategy = st.one_of(st.binary(max_size=1024), _mutated(seeds)) if seeds else st.binary(max_size=1024)

        @settings(
            max_examples=examples, deadline=None, database=None, suppress_health_check=list(HealthCheck)
        )
        @given(strategy)
        def run(data: bytes) -> None:
            nonlocal count
            count += 1
            fn(data)

        try:
            run()
        except Exception as e:  # a property failed: hypothesis has shrunk and printed the input
            print(f"{e!r}", file=sys.stderr)
            return count, False
        return count, True

    results = {}
    for target in targets:
        started = time.monotonic()
        runs, ok = results[target] = campaign(all_targets()[target], seeds_for(target))
        rate = runs / max(1e-9, time.monotonic() - started)
        print(f"{target:14s} {runs:>12,d} executions ({rate:,.0f}/s) {'ok' if ok else 'FAILED'}", flush=True)
    return results


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--child"]:
        run_atheris_child(argv[1], argv[2], int(argv[3]), argv[4])
        return 0
    parser = argparse.ArgumentParser(prog="python -m tools.fuzz", description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", action="append", help="a target (repeatable; default: all)")
    parser.add_argument("--engine", choices=("auto", "atheris", "hypothesis"), default="auto")
    parser.add_argument("--seconds", type=int, default=60, help="per target, with atheris (default 60)")
    parser.add_argument("--examples", type=int, default=20_000, help="per target, with hypothesis")
    parser.add_argument("--artifacts", type=Path, default=Path(tempfile.gettempdir()) / "hivenode-fuzz")
    parser.add_argument("--write-corpus", action="store_true", help="regenerate tests/fuzz/corpus/ and exit")
    args = parser.parse_args(argv)
    if args.write_corpus:
        write_corpus()
        return 0
    targets = args.target or sorted(all_targets())
    unknown = set(targets) - set(all_targets())
    if unknown:
        parser.error(f"unknown target(s) {sorted(unknown)}; known: {sorted(all_targets())}")
    engine = args.engine
    if engine == "auto":
        engine = "atheris" if shutil.which(sys.executable) and _has_atheris() else "hypothesis"
    print(f"engine: {engine}", flush=True)
    logging.disable(logging.WARNING)  # refusals are the point here; their log lines would drown the counts
    if engine == "atheris":
        results = run_atheris(targets, args.seconds, args.artifacts)
    else:
        results = run_hypothesis(targets, args.examples)
    total = sum(runs for runs, _ in results.values())
    failed = sorted(t for t, (_, ok) in results.items() if not ok)
    print(f"total: {total:,d} executions over {len(results)} target(s); failed: {failed or 'none'}")
    return 1 if failed else 0


def _has_atheris() -> bool:
    try:
        import atheris  # noqa: F401
    except ImportError:
        return False
    return True


if __name__ == "__main__":
    sys.exit(main())
