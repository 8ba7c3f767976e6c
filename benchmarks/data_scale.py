"""Data at scale (issue 17, "Data"): prepare and download throughput, and a learner's memory while it samples a
dataset 4x larger than its memory budget. Its figures go into benchmarks/results/scale.json (`data`, headline keys
`data_*`) through `python -m benchmarks.scale --only-data`; alone: `python -m benchmarks.data_scale`.

- **prepare**: synthetic text files (words drawn from a fixed list, one document per line) tokenized into shards by
  `node.ml.prepare.prepare` (what `python -m bootstrap data prepare` runs), with the byte tokenizer and with a
  byte-level BPE trained here on the first MiB of the same text: input MiB/s and tokens/s.
- **download**: the bootstrap's own shard routes (`bootstrap.data_serve.DataApi`, aiohttp, HTTP Range) served by a
  child process (`--serve DIR`) on loopback; a learner's `ensure_shards` fetches every shard into an empty cache,
  each checked against its sha256 before it is kept: MiB/s, wire, hash and write together.
- **budget**: a child process started inside a memory cgroup (v1 `memory.limit_in_bytes`, measured here; v2's
  `memory.max` is written the same way but was not tried, and may also need `+memory` in the parent's
  `cgroup.subtree_control`) of `budget_mib`, everything from its interpreter's start charged to it (page cache included), samples batches from
  `dataset_factor` x budget of token shards through the learner's reader (`ShardStream`, memmapped shards, and
  `BatchSampler`) until the pages its windows touched add up to `touch_factor` x the budget. It records its
  anonymous and file-backed RSS and the cgroup's usage along the way, and the bytes it read from storage. The
  negative control runs the same child reading the shards whole into memory (what every peer did with the corpus
  before token shards): past the budget the kernel kills it. The shards are written by this process, synced and
  dropped from the page cache first (`posix_fadvise(DONTNEED)`), so the child reads them from storage, not from
  pages another cgroup paid for. Without a writable memory cgroup (not root, no controller) this part is skipped
  with its reason.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from node.ml.prepare import PrepareConfig, TokenizerInfo, prepare
from node.ml.shards import ShardIndex
from tools.proctree import status_bytes

MiB = 2**20
PAGE = os.sysconf("SC_PAGE_SIZE")
_WORD_LIST = (
    "the of and to in is was for on that with as by at from this be are or an it his which not but had have "
    "were their they one all been has more when there can if who will into its so than other some time only "
    "what about after would these first two may then could between where most over such before through also "
    "data model token shard learner syncer merge round fragment version quorum verifier stage replica"
)
WORDS = tuple(_WORD_LIST.split())


@dataclass(frozen=True, kw_only=True, slots=True)
class DataScaleConfig:
    text_mib: int = 64  # prepare's input with the byte tokenizer (also what the download serves)
    bpe_text_mib: int = 8  # prepare's input with the BPE tokenizer (slower per byte)
    bpe_vocab: int = 4096
    bpe_shard_tokens: int = 2**19  # BPE's input holds fewer tokens: smaller shards, so some are held out
    shard_tokens: int = 2**23  # prepare's default: 16 MiB of uint16 tokens
    budget_mib: int = 768  # the learner's memory cgroup
    dataset_factor: float = 4.0  # dataset bytes = this x the budget
    window_tokens: int = 1024  # context of the sampled windows
    batch_rows: int = 64
    touch_factor: float = 2.0  # sample until the windows' pages add up to this x the budget
    cgroup: bool = True  # False: skip the budget part (tests)


def synthetic_text(directory: Path, mib: int, seed: int) -> list[Path]:
    """`mib` MiB of text in files of at most 16 MiB, one document of 20-400 words per line."""
    directory.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    words = np.array(WORDS)
    paths, left, n = [], mib * MiB, 0
    while left > 0:
        lines, size = [], 0
        while size < min(left, 16 * MiB):
            line = " ".join(words[rng.integers(0, len(words), int(rng.integers(20, 400)))])
            lines.append(line)
            size += len(line) + 1
        path = directory / f"part{n:03d}.txt"
        path.write_text("\n".join(lines) + "\n")
        paths.append(path)
        left, n = left - size, n + 1
    return paths


def _lines(paths: list[Path], limit_bytes: int) -> Iterator[str]:
    seen = 0
    for path in paths:
        with path.open() as handle:
            for line in handle:
                yield line
                seen += len(line)
                if seen >= limit_bytes:
                    return


def bpe_tokenizer(texts: list[Path], vocab: int) -> TokenizerInfo:
    from node.ml.tokenizer import Tokenizer, train_bpe

    tokenizer = Tokenizer(train_bpe(_lines(texts, MiB), vocab, show_progress=False))
    return TokenizerInfo(
        encode=tokenizer.encode,
        vocab_size=tokenizer.vocab_size,
        sha256=tokenizer.sha256,
        end_of_text=tokenizer.end_of_text,
    )


def measure_prepare(
    texts: list[Path], out: Path, tokenizer: TokenizerInfo, shard_tokens: int
) -> dict[str, Any]:
    size = sum(p.stat().st_size for p in texts)
    started = time.perf_counter()
    index = prepare(texts, out, tokenizer, PrepareConfig(shard_tokens=shard_tokens))
    seconds = time.perf_counter() - started
    tokens = sum(s.tokens for s in index.shards)
    return {
        "input_mib": round(size / MiB, 1),
        "tokens": tokens,
        "shards": len(index.shards),
        "seconds": round(seconds, 2),
        "input_mib_s": round(size / MiB / seconds, 1),
        "tokens_per_s": round(tokens / seconds),
    }


def serve(directory: Path) -> int:
    """Child: the bootstrap's shard routes over `directory` on a loopback port (printed), until killed."""
    from aiohttp import web

    from bootstrap.data_serve import DataApi, ServedData
    from node.ml.shards import INDEX_FILENAME, parse_index

    blob = (directory / INDEX_FILENAME).read_bytes()
    index = parse_index(blob)
    app = web.Application()
    DataApi(ServedData(directory, index, blob, index.sha256())).add_routes(app)

    async def main() -> None:
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        print(runner.addresses[0][1], flush=True)
        await asyncio.Event().wait()

    asyncio.run(main())
    return 0


def measure_download(prepared: Path, index: ShardIndex, cache: Path) -> dict[str, Any]:
    from node.swarm.shard_fetch import ShardSource, ensure_shards

    command = [sys.executable, "-m", "benchmarks.data_scale", "--serve", str(prepared)]
    root = Path(__file__).resolve().parents[1]
    server = subprocess.Popen(command, cwd=root, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        assert server.stdout is not None
        port = int(server.stdout.readline())  # blocks until the server listens (or exits: "" -> ValueError)
        source = ShardSource(cache=cache, bases=[f"http://127.0.0.1:{port}"], timeout_s=60.0, attempts=1)
        names = [entry.name for entry in index.shards]
        started = time.perf_counter()
        asyncio.run(ensure_shards(index, names, source))
        seconds = time.perf_counter() - started
    finally:
        os.kill(server.pid, signal.SIGKILL)
        server.communicate()
    total = sum(entry.bytes for entry in index.shards)
    return {
        "shards": len(names),
        "mib": round(total / MiB, 1),
        "seconds": round(seconds, 2),
        "mib_s": round(total / MiB / seconds, 1),
    }


def write_token_shards(directory: Path, total_bytes: int, shard_bytes: int) -> list[Path]:
    """Random uint16 token shards adding up to `total_bytes`, synced and dropped from the page cache."""
    directory.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    paths = []
    for n in range(max(1, total_bytes // shard_bytes)):
        path = directory / f"s{n:04d}.tokens"
        rng.integers(0, 4096, shard_bytes // 2, dtype=np.uint16).tofile(path)
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
        paths.append(path)
    return paths


class MemoryCgroup:
    """A memory cgroup of our own under this process's, with a limit; v1 or v2, whichever this machine mounts."""

    def __init__(self, path: Path, v1: bool) -> None:
        self.path, self.v1 = path, v1

    @classmethod
    def create(cls, name: str, limit_bytes: int) -> MemoryCgroup | str:
        """The cgroup, or why none could be made (the reason the budget part is skipped)."""
        try:
            lines = Path("/proc/self/cgroup").read_text().splitlines()
        except OSError as e:
            return f"no /proc/self/cgroup: {e}"
        v1 = [line.split(":", 2)[2] for line in lines if line.split(":")[1:2] == ["memory"]]
        v2 = [line.split(":", 2)[2] for line in lines if line.startswith("0::")]
        if v1 and Path("/sys/fs/cgroup/memory").is_dir():
            path, limit_file, is_v1 = (
                Path("/sys/fs/cgroup/memory", v1[0].lstrip("/"), name),
                "memory.limit_in_bytes",
                True,
            )
        elif v2:
            path, limit_file, is_v1 = Path("/sys/fs/cgroup", v2[0].lstrip("/"), name), "memory.max", False
        else:
            return "no memory cgroup controller mounted"
        try:
            path.mkdir(exist_ok=True)
            (path / limit_file).write_text(str(limit_bytes))
        except OSError as e:
            return f"cannot create a memory cgroup at {path}: {e}"
        return cls(path, is_v1)

    def _read(self, v1_name: str, v2_name: str) -> int | None:
        try:
            return int((self.path / (v1_name if self.v1 else v2_name)).read_text().split()[0])
        except (OSError, ValueError, IndexError):
            return None

    def peak(self) -> int | None:
        return self._read("memory.max_usage_in_bytes", "memory.peak")

    def oom_kills(self) -> int | None:
        try:
            text = (self.path / ("memory.oom_control" if self.v1 else "memory.events")).read_text()
        except OSError:
            return None
        counts = dict(line.split() for line in text.splitlines() if len(line.split()) == 2)
        return int(counts["oom_kill"]) if "oom_kill" in counts else None

    def usage_file(self) -> Path:
        return self.path / ("memory.usage_in_bytes" if self.v1 else "memory.current")

    def remove(self) -> None:
        for _ in range(50):  # the kernel frees a cgroup shortly after its last process exits
            try:
                self.path.rmdir()
                return
            except OSError:
                time.sleep(0.1)


def _status() -> dict[str, int]:
    """RssAnon and RssFile (bytes) of this process, and the bytes it read from storage."""
    out = {field: status_bytes(field) for field in ("RssAnon", "RssFile")}
    with open("/proc/self/io") as io:
        for line in io:
            if line.startswith("read_bytes"):
                out["read_bytes"] = int(line.split()[1])
    return out


def _sample(usage_file: str, **extra: int) -> str:
    try:
        cgroup = int(Path(usage_file).read_text().split()[0])
    except (OSError, ValueError, IndexError):
        cgroup = -1
    return json.dumps({**extra, **_status(), "cgroup": cgroup})


def child_stream(shards: Path, usage_file: str, window: int, rows: int, batches: int) -> int:
    """Child: the learner's reader over every shard, a sample line every 1/20 of the batches."""
    import torch

    from node.ml.data import BatchSampler
    from node.ml.shards import ShardStream

    paths = sorted(shards.glob("*.tokens"))
    sampler = BatchSampler(
        ShardStream(paths, "uint16"),
        batch_size=rows,
        context_len=window,
        generator=torch.Generator().manual_seed(0),
    )
    print(_sample(usage_file, batch=0), flush=True)
    every = max(1, batches // 20)
    started = time.perf_counter()
    for n in range(1, batches + 1):
        sampler.next_batch()
        if n % every == 0 or n == batches:
            print(
                _sample(usage_file, batch=n, seconds_x1000=int(1000 * (time.perf_counter() - started))),
                flush=True,
            )
    return 0


def child_whole(shards: Path, usage_file: str) -> int:
    """Child, the negative control: every shard read whole into memory and kept (the corpus loaded in RAM)."""
    held = []
    print(_sample(usage_file, loaded=0), flush=True)
    for path in sorted(shards.glob("*.tokens")):
        held.append(np.fromfile(path, dtype=np.uint16))
        print(_sample(usage_file, loaded=sum(a.nbytes for a in held)), flush=True)
    return 0


def run_child(
    cgroup: MemoryCgroup, mode: str, shards: Path, extra: list[str], timeout_s: float
) -> dict[str, Any]:
    """Start `python -m benchmarks.data_scale --child MODE` inside `cgroup` (from its exec on) and collect its
    sample lines and how it ended."""
    python = shlex.join(
        [
            sys.executable,
            "-m",
            "benchmarks.data_scale",
            "--child",
            mode,
            "--shards",
            str(shards),
            "--usage-file",
            str(cgroup.usage_file()),
            *extra,
        ]
    )
    procs = cgroup.path / "cgroup.procs"
    root = Path(__file__).resolve().parents[1]
    proc = subprocess.Popen(
        ["sh", "-c", f"echo $$ > {shlex.quote(str(procs))} && exec {python}"],
        cwd=root,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        stdout, stderr = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.kill(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
    samples = [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]
    return {
        "returncode": proc.returncode,
        "killed": proc.returncode == -signal.SIGKILL,
        "samples": samples,
        "cgroup_peak": cgroup.peak(),
        "oom_kills": cgroup.oom_kills(),
        "stderr_tail": stderr[-600:],
    }


def batches_to_touch(config: DataScaleConfig) -> int:
    """Batches whose windows span `touch_factor` x the budget of pages (a window of W + 1 uint16 tokens at a random
    offset spans (W + 1) x 2 / PAGE + 1 pages on average; MADV_RANDOM reads no more than those)."""
    pages_per_window = (config.window_tokens + 1) * 2 / PAGE + 1
    target = config.touch_factor * config.budget_mib * MiB
    return max(1, int(target / (pages_per_window * PAGE * config.batch_rows)))


def measure_budget(config: DataScaleConfig, work: Path) -> dict[str, Any]:
    budget = config.budget_mib * MiB
    cgroup = MemoryCgroup.create(f"hivenode-data-{os.getpid()}", budget)
    if isinstance(cgroup, str):
        return {"skipped": cgroup}
    try:
        total = int(config.dataset_factor * budget)
        shards = write_token_shards(work / "tokens", total, config.shard_tokens * 2)
        batches = batches_to_touch(config)
        extra = [
            "--window",
            str(config.window_tokens),
            "--rows",
            str(config.batch_rows),
            "--batches",
            str(batches),
        ]
        stream = run_child(cgroup, "stream", work / "tokens", extra, timeout_s=1800)
        for path in shards:  # the control reads from storage too, not from what the first child left cached
            fd = os.open(path, os.O_RDONLY)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            os.close(fd)
        whole = run_child(cgroup, "whole", work / "tokens", [], timeout_s=1800)
    finally:
        cgroup.remove()
    return {
        "budget_bytes": budget,
        "dataset_bytes": sum(p.stat().st_size for p in shards),
        "shards": len(shards),
        "batches": batches,
        "stream": stream,
        "whole": whole,
    }


def summarize_budget(part: dict[str, Any]) -> dict[str, Any]:
    """Headline figures of the budget part: did the reader stay within it, and did its own memory stay flat."""
    if "skipped" in part:
        return {"data_budget_skipped": part["skipped"]}
    samples = part["stream"]["samples"]
    warm = samples[min(1, len(samples) - 1)]  # after the first 1/20 of the batches: imports and buffers done
    last = samples[-1]
    loaded = [s["loaded"] for s in part["whole"]["samples"]]
    return {
        "data_budget_mib": part["budget_bytes"] // MiB,
        "data_dataset_mib": part["dataset_bytes"] // MiB,
        "data_read_from_storage_mib": round(last["read_bytes"] / MiB, 1),
        "data_rss_anon_warm_mib": round(warm["RssAnon"] / MiB, 1),
        "data_rss_anon_end_mib": round(last["RssAnon"] / MiB, 1),
        "data_rss_anon_growth_mib": round((last["RssAnon"] - warm["RssAnon"]) / MiB, 1),
        "data_cgroup_peak_mib": round((part["stream"]["cgroup_peak"] or 0) / MiB, 1),
        "data_reader_survived": part["stream"]["returncode"] == 0,
        "data_whole_read_killed": part["whole"]["killed"],
        "data_whole_read_loaded_mib": round(max(loaded, default=0) / MiB, 1),
    }


def run(config: DataScaleConfig, work: Path) -> dict[str, Any]:
    texts = synthetic_text(work / "text", config.text_mib, seed=0)
    byte = measure_prepare(texts, work / "prepared", TokenizerInfo(), config.shard_tokens)
    print(f"prepare (bytes): {byte}", flush=True)
    bpe_texts = synthetic_text(work / "text_bpe", config.bpe_text_mib, seed=1)
    bpe = measure_prepare(
        bpe_texts, work / "prepared_bpe", bpe_tokenizer(bpe_texts, config.bpe_vocab), config.bpe_shard_tokens
    )
    print(f"prepare (BPE {config.bpe_vocab}): {bpe}", flush=True)
    from node.ml.shards import INDEX_FILENAME, parse_index

    index = parse_index((work / "prepared" / INDEX_FILENAME).read_bytes())
    download = measure_download(work / "prepared", index, work / "cache")
    print(f"download: {download}", flush=True)
    budget = measure_budget(config, work) if config.cgroup else {"skipped": "not asked (--no-budget)"}
    return {
        "config": asdict(config),
        "prepare_bytes": byte,
        "prepare_bpe": bpe,
        "download": download,
        "budget": budget,
    }


def headline(data: dict[str, Any]) -> dict[str, Any]:
    return {
        "data_prepare_mib_s": data["prepare_bytes"]["input_mib_s"],
        "data_prepare_tokens_s": data["prepare_bytes"]["tokens_per_s"],
        "data_prepare_mib_s_bpe": data["prepare_bpe"]["input_mib_s"],
        "data_prepare_tokens_s_bpe": data["prepare_bpe"]["tokens_per_s"],
        "data_download_mib_s": data["download"]["mib_s"],
        **summarize_budget(data["budget"]),
    }


def plot(data: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    part = data["budget"]
    if "skipped" not in part:
        budget = part["budget_bytes"] / MiB
        samples = part["stream"]["samples"]
        x = [s["read_bytes"] / MiB for s in samples]
        for key, label in (
            ("RssAnon", "anonymous RSS"),
            ("RssFile", "file-backed RSS"),
            ("cgroup", "cgroup usage"),
        ):
            left.plot(x, [s[key] / MiB for s in samples], marker=".", label=label)
        left.axhline(budget, color="red", linestyle="--", label=f"budget {budget:.0f} MiB")
        left.set(
            xlabel="MiB read from storage",
            ylabel="MiB",
            title=f"learner reader, dataset {part['dataset_bytes'] / MiB:.0f} MiB",
        )
        whole = part["whole"]["samples"]
        for key, label in (("RssAnon", "anonymous RSS"), ("cgroup", "cgroup usage")):
            right.plot(
                [s["loaded"] / MiB for s in whole], [s[key] / MiB for s in whole], marker=".", label=label
            )
        right.axhline(budget, color="red", linestyle="--", label="budget")
        end = "killed by the kernel" if part["whole"]["killed"] else f"exit {part['whole']['returncode']}"
        right.set(xlabel="MiB loaded", ylabel="MiB", title=f"control: shards read whole ({end})")
        left.legend(fontsize=8)
        right.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--child", choices=["stream", "whole"], default=None, help=argparse.SUPPRESS)
    parser.add_argument("--serve", type=Path, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--shards", type=Path, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--usage-file", default="", help=argparse.SUPPRESS)
    parser.add_argument("--window", type=int, default=1024, help=argparse.SUPPRESS)
    parser.add_argument("--rows", type=int, default=64, help=argparse.SUPPRESS)
    parser.add_argument("--batches", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--budget-mib", type=int, default=DataScaleConfig().budget_mib)
    parser.add_argument("--text-mib", type=int, default=DataScaleConfig().text_mib)
    parser.add_argument("--no-budget", action="store_true", help="skip the memory-budget part")
    args = parser.parse_args(argv)
    if args.serve is not None:
        return serve(args.serve)
    if args.child == "stream":
        return child_stream(args.shards, args.usage_file, args.window, args.rows, args.batches)
    if args.child == "whole":
        return child_whole(args.shards, args.usage_file)
    config = DataScaleConfig(budget_mib=args.budget_mib, text_mib=args.text_mib, cgroup=not args.no_budget)
    with tempfile.TemporaryDirectory(prefix="data-scale-") as work:
        data = run(config, Path(work))
    print(json.dumps(headline(data), indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
