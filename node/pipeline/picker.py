"""Which stage replica the driver asks next: the usable replicas of a stage (announced, not banned, not
cooling down after failures) and the router's choice among them. No I/O; the clock is passed in."""

from __future__ import annotations

import random
from collections.abc import Callable, Collection, Sequence

from node.pipeline.accounting import MicrobatchAbandoned
from node.pipeline.routing import ReplicaInfo, ReplicaRouter


class ReplicaPicker:
    """Chooses a replica per hop through `router`, and remembers the last one chosen at each stage (the
    verifier's status shows it as the route). `replicas` and `banned` are read afresh on every choice."""

    def __init__(
        self,
        *,
        num_stages: int,
        replicas: Callable[[], Sequence[ReplicaInfo]],
        router: ReplicaRouter,
        banned: Callable[[], Collection[str]],
        rng: random.Random,
        clock: Callable[[], float],
    ) -> None:
        self.num_stages = num_stages
        self.replicas = replicas
        self.router = router
        self.banned = banned
        self.rng = rng
        self.clock = clock
        self.last_route: list[str | None] = [None] * num_stages

    def missing_stages(self, now: float | None = None) -> list[int]:
        """Stages with no usable replica right now (nothing can be driven until each has one)."""
        now = self.clock() if now is None else now
        banned = set(self.banned())
        usable = {
            r.stage
            for r in self.replicas()
            if r.peer_id not in banned and not self.router.is_blocked(r.peer_id, now)
        }
        return [s for s in range(self.num_stages) if s not in usable]

    def choose(self, stage: int, tokens: int, tried: set[str]) -> str:
        """The replica to send `tokens` tokens to at `stage`, none of `tried`; MicrobatchAbandoned if none."""
        choice = self.router.choose(
            self.replicas(),
            stage=stage,
            tokens=tokens,
            now=self.clock(),
            rng=self.rng,
            exclude=tried,
            banned=self.banned(),
        )
        if choice is None:
            raise MicrobatchAbandoned(f"no usable replica for stage {stage} (tried {len(tried)})")
        self.last_route[stage] = choice.peer_id
        return choice.peer_id

    def others(self, stage: int, replica: str) -> list[str]:
        """The usable replicas of `stage` but `replica` (candidates to recompute its answer)."""
        banned = set(self.banned())
        now = self.clock()
        return [
            r.peer_id
            for r in self.replicas()
            if r.stage == stage
            and r.peer_id != replica
            and r.peer_id not in banned
            and not self.router.is_blocked(r.peer_id, now)
        ]

    def draw(self, peers: list[str]) -> str:
        """Remove and return a random one of `peers` (not empty)."""
        return peers.pop(self.rng.randrange(len(peers)))

    def blame(self, replica: str) -> float:
        """A failure that is `replica`'s fault: the router cools it down; returns the cooldown in seconds."""
        return self.router.record_failure(replica, self.clock())
