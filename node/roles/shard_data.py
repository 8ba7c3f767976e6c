"""The roles' side of prepared token shards (`data.source = "shards"` in the manifest; docs/data.md).

A learner takes the training shards `node.ml.assignment` gives it among the live learners (the table is
recomputed when the live set or the epoch changes, see `LearnerRole`; the epoch counts merged rounds), downloads them (node.swarm.shard_fetch) and reads them
through memmaps (node.ml.shards.ShardStream). Its held-out evaluation, and the syncer's held-out loss and loss
probe, read the index's held-out shards, which no learner is ever assigned. `--data DIR` on such a run names a
local mirror of the prepared folder (read in place once its shards verify).
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from node.ml.assignment import ShardAssignment, epoch_of
from node.ml.shards import ShardIndex, ShardStream
from node.swarm.shard_fetch import ShardSource, ensure_shards, obtain_index
from node.swarm.tokenizer_fetch import bootstrap_bases
from protocol.manifest import SHARDS_SOURCE

if TYPE_CHECKING:
    from node.context import NodeContext

logger = logging.getLogger(__name__)

DATA_DIRNAME = "data"  # under the state dir: the verified shards and index this node downloaded


def uses_shards(manifest: Any) -> bool:
    return manifest.data.get("source") == SHARDS_SOURCE


@dataclass(frozen=True, slots=True)
class ShardData:
    """The run's index and where its shards come from, for one node."""

    index: ShardIndex
    source: ShardSource

    async def stream(self, names: tuple[str, ...]) -> ShardStream:
        paths = await ensure_shards(self.index, names, self.source)
        return ShardStream(paths, self.index.dtype)

    async def heldout_stream(self) -> ShardStream:
        return await self.stream(self.index.heldout)

    def assignment(self, peer_id: str, live_learners: list[str], epoch: int = 0) -> ShardAssignment:
        names = [s.name for s in self.index.train]
        return ShardAssignment.compute(names, {*live_learners, peer_id}, epoch)

    def epoch(self, rounds: int, learners: int, tokens_per_round: int) -> int:
        """`epoch_of` over this index's training tokens."""
        train_tokens = max(1, sum(s.tokens for s in self.index.train))
        return epoch_of(
            rounds, train_tokens=train_tokens, learners=max(1, learners), tokens_per_round=tokens_per_round
        )


async def open_shard_data(ctx: NodeContext) -> ShardData:
    """The index the signed manifest names, from a mirror (`--data DIR`), the cache or a bootstrap."""
    peers = await _peers(ctx)
    source = ShardSource(
        cache=ctx.config.state_dir / DATA_DIRNAME,
        bases=bootstrap_bases(ctx.config.join, peers),
        mirror=Path(ctx.config.data).expanduser() if ctx.config.data else None,
        timeout_s=max(60.0, ctx.config.network.request_timeout_s),
    )
    index = await obtain_index(str(ctx.manifest.data["index_sha256"]), source)
    logger.info(
        "shard index %s: %d training shards, %d held out",
        str(ctx.manifest.data["index_sha256"])[:12],
        len(index.train),
        len(index.heldout),
    )
    return ShardData(index, source)


async def live_learners(ctx: NodeContext) -> list[str]:
    return sorted(p.peer_id for p in await _peers(ctx) if p.heartbeat.role == "learner")


async def _peers(ctx: NodeContext) -> list[Any]:
    try:
        peers: list[Any] = await ctx.records.list_peers()
    except asyncio.TimeoutError:
        logger.warning("the DHT did not list the peers in time; assuming none")
        return []
    return peers
