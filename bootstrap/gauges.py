"""The swarm's figures as Prometheus gauges on the bootstrap's `/metrics`: live peers by role and health, bans,
merges, tokens, throughput, goodput and loss (from the bootstrap's `SwarmHistory`), and manifest publishes."""

from __future__ import annotations

from collections.abc import Mapping

from prometheus_client import CollectorRegistry, Counter, Gauge

from node.status.swarm_view import SwarmHistory


class SwarmGauges:
    """The bootstrap's own metrics, registered on the node's registry so one `/metrics` serves both."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.peers = Gauge("hivenode_swarm_peers", "Live peers by role", ["role"], registry=registry)
        self.manifest_publishes = Counter(
            "hivenode_manifest_publishes", "Manifest and discovery publishes", ["result"], registry=registry
        )
        self.health = Gauge(
            "hivenode_swarm_peers_by_health",
            "Peers on the swarm map by health",
            ["health"],
            registry=registry,
        )
        self.bans = Gauge("hivenode_swarm_bans", "Peers with a ban record", registry=registry)
        self.merges = Gauge(
            "hivenode_swarm_merges",
            "Fragment versions published since this bootstrap started watching",
            registry=registry,
        )
        self.tokens = Gauge(
            "hivenode_swarm_tokens",
            "Tokens processed by the swarm since this bootstrap started watching",
            registry=registry,
        )
        self.throughput = Gauge(
            "hivenode_swarm_throughput_tokens_per_second",
            "Tokens/s processed (last sample)",
            registry=registry,
        )
        self.goodput = Gauge(
            "hivenode_swarm_goodput_tokens_per_second", "Tokens/s that count (last sample)", registry=registry
        )
        self.loss = Gauge(
            "hivenode_swarm_train_loss",
            "Mean training loss of unbanned peers (last sample)",
            registry=registry,
        )

    def count_publish(self, ok: bool) -> None:
        self.manifest_publishes.labels(result="ok" if ok else "refused").inc()

    def set_roles(self, by_role: Mapping[str, int]) -> None:
        """Live peers by role; a role nobody holds any more disappears rather than staying at its last count."""
        self.peers.clear()
        for role, count in by_role.items():
            self.peers.labels(role=role).set(count)

    def update(self, history: SwarmHistory) -> None:
        """The history's totals and its last sample (figures the sample lacks keep their previous value)."""
        last = history.samples[-1] if history.samples else {}
        for health, count in (last.get("by_health") or {}).items():
            self.health.labels(health=health).set(count)
        self.bans.set(len(history.bans))
        self.merges.set(history.merges_total)
        self.tokens.set(history.tokens_total)
        for gauge, key in ((self.throughput, "throughput"), (self.goodput, "goodput"), (self.loss, "loss")):
            if last.get(key) is not None:
                gauge.set(last[key])
