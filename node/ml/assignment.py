"""Which training shards each learner reads: a pure function of the epoch, the live learners and the shards.

Every learner computes the same table from the same inputs (the sorted ids of the live learners, the epoch, the
index's training shards), so no coordination is needed: within one epoch the learners' shard sets are disjoint
and together cover every training shard. Each shard goes to the learner ranking highest for it (rendezvous
hashing on epoch, shard and peer id), skipping learners that already hold their fair share (ceil(shards /
learners)); that keeps the split balanced, and when a learner joins or leaves most shards stay where they were,
so a rebalance moves few downloads. A new epoch reshuffles everything: the epoch counts merged rounds
(`epoch_of`), one epoch being the rounds the live learners take to train the training tokens once, so every
learner agrees on it from the versions it holds. With fewer shards than learners, the
shard-less learners are given one shard each, chosen the same way (they overlap: the owner should cut more
shards). Held-out shards are never passed in.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass


def _rank(epoch: int, shard: str, peer_id: str) -> bytes:
    return hashlib.sha256(f"assign/{epoch}/{shard}/{peer_id}".encode()).digest()


@dataclass(frozen=True, slots=True)
class ShardAssignment:
    """The table for one epoch: learner id -> the shard names it trains on, in a stable order."""

    epoch: int
    learners: tuple[str, ...]  # sorted, unique
    table: dict[str, tuple[str, ...]]

    @classmethod
    def compute(cls, shards: Sequence[str], learners: Iterable[str], epoch: int) -> ShardAssignment:
        peers = tuple(sorted(set(learners)))
        if not peers:
            raise ValueError("an assignment needs at least one learner")
        if not shards:
            raise ValueError("an assignment needs at least one training shard")
        if len(set(shards)) != len(shards):
            raise ValueError("shard names repeat")
        cap = math.ceil(len(shards) / len(peers))
        table: dict[str, list[str]] = {p: [] for p in peers}
        # shards in a per-epoch order, so which learner fills up first is not always the same
        order = sorted(shards, key=lambda s: hashlib.sha256(f"order/{epoch}/{s}".encode()).digest())
        for shard in order:
            ranked = sorted(peers, key=lambda p: _rank(epoch, shard, p), reverse=True)
            owner = next(p for p in ranked if len(table[p]) < cap)
            table[owner].append(shard)
        for peer in peers:  # fewer shards than learners: the rest overlap, one shard each
            if not table[peer]:
                table[peer].append(max(shards, key=lambda s: _rank(epoch, s, peer)))
        return cls(epoch, peers, {p: tuple(sorted(v)) for p, v in table.items()})

    def shards_for(self, peer_id: str) -> tuple[str, ...]:
        """The shards of `peer_id`; KeyError when it is not one of the table's learners."""
        if peer_id in self.table:
            return self.table[peer_id]
        raise KeyError(f"{peer_id} is not among this assignment's learners")


def epoch_of(rounds: int, *, train_tokens: int, learners: int, tokens_per_round: int) -> int:
    """The data epoch after `rounds` merged rounds: an epoch lasts the rounds that `learners` learners, each
    training `tokens_per_round` tokens a round (H inner steps of the run's batch), take to train `train_tokens`
    once. Learners agree on it from the versions they hold (a learner a version behind lags by one round at most);
    churn changes its length, and with it, at worst, the epoch, which is only a reshuffle."""
    if min(train_tokens, learners, tokens_per_round) < 1:
        raise ValueError("epoch_of needs train_tokens, learners and tokens_per_round >= 1")
    per_epoch = math.ceil(train_tokens / (learners * tokens_per_round))
    return max(0, rounds) // per_epoch


def assign(peer_id: str, shards: Sequence[str], live_learners: Iterable[str], epoch: int) -> tuple[str, ...]:
    """The shards `peer_id` trains on in `epoch`, given the other live learners (it counts itself in)."""
    return ShardAssignment.compute(shards, {*live_learners, peer_id}, epoch).shards_for(peer_id)


def moved(before: ShardAssignment, after: ShardAssignment) -> int:
    """How many (learner, shard) pairs the second table adds: the downloads a rebalance costs."""
    return sum(len(set(after.table[p]) - set(before.table.get(p, ()))) for p in after.learners)
