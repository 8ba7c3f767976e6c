"""`python -m tools.shard_rss DIR NUM_SHARDS`: memory of a learner sampling batches from memmapped token shards.

Writes NUM_SHARDS random uint16 shards of 2^24 tokens (32 MiB each) under DIR (kept for the next run), samples
2000 batches of 8 x 256 tokens through `ShardStream` and `BatchSampler`, and prints VmRSS split into anonymous
memory (the process's own) and file-backed pages (page cache mapped in, reclaimable), before and after.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import numpy as np
import torch

from node.ml.data import BatchSampler
from node.ml.shards import ShardStream

SHARD_TOKENS = 2**24
BATCHES = 2000


def rss_mib() -> dict[str, int]:
    with open("/proc/self/status") as status:
        lines = [line for line in status if line.startswith(("VmRSS", "RssAnon", "RssFile"))]
    return {line.split(":")[0]: int(line.split()[1]) // 1024 for line in lines}


def main(argv: list[str]) -> int:
    root, count = Path(argv[0]), int(argv[1])
    root.mkdir(parents=True, exist_ok=True)
    paths = []
    for i in range(count):
        path = root / f"s{i}.tokens"
        if not path.exists():
            np.random.default_rng(i).integers(0, 256, SHARD_TOKENS, dtype=np.uint16).tofile(path)
        paths.append(path)
    before = rss_mib()
    sampler = BatchSampler(
        ShardStream(paths, "uint16"),
        batch_size=8,
        context_len=256,
        generator=torch.Generator().manual_seed(0),
    )
    started = time.perf_counter()
    for _ in range(BATCHES):
        sampler.next_batch()
    rate = BATCHES / (time.perf_counter() - started)
    print(f"dataset {count * SHARD_TOKENS * 2 / 2**20:.0f} MiB, {BATCHES} batches of 8x256 at {rate:.0f}/s")
    print(f"RSS MiB before {before}, after {rss_mib()}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
