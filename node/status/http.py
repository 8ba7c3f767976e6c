"""HTTP status of a node (`GET /api/status`, `GET /metrics`), the aiohttp helpers the bootstrap reuses, and the
text summary behind `python -m node status <url-or-multiaddr>`."""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Gauge, generate_latest

from node.context import VERSION, NodeContext
from node.ml.checkpoint import CheckpointStore
from node.status.export import ExportFiles, add_export_routes

if TYPE_CHECKING:
    from node.roles.registry import Role
    from node.swarm.membership import Membership
from protocol.errors import ConfigError
from protocol.records import BanRecord

logger = logging.getLogger(__name__)

StatusSource = Callable[[], dict[str, Any]]


async def start_site(app: web.Application, host: str, port: int) -> tuple[web.AppRunner, str]:
    """Serve `app` on host:port (0 = any free port); return the runner and the bound `host:port`."""
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    try:
        await site.start()
    except OSError as e:
        await runner.cleanup()
        raise ConfigError(f"cannot listen for HTTP on {host}:{port}: {e.strerror or e}") from None
    bound_host, bound_port = runner.addresses[0][:2]
    return runner, f"{bound_host}:{bound_port}"


def metrics_response(registry: CollectorRegistry) -> web.Response:
    response = web.Response(body=generate_latest(registry))
    response.headers["Content-Type"] = CONTENT_TYPE_LATEST
    return response


# Numeric fields of a role's status exported as gauges on every scrape, so each process's /metrics carries its
# role's progress without every role registering its own metrics.
STATUS_GAUGES: dict[str, tuple[str, str]] = {
    "inner_step": ("hivenode_inner_step", "Inner steps done (merges, for a syncer)"),
    "tokens": (
        "hivenode_tokens",
        "Tokens processed since the process started (for a syncer: tokens the global model was trained on)",
    ),
    "throughput": ("hivenode_throughput_tokens_per_second", "Tokens per second over the last seconds"),
    "loss": ("hivenode_loss", "Latest training loss (held-out loss of the global model, for a syncer)"),
    "held_out_loss": ("hivenode_held_out_loss", "Latest held-out loss this process measured"),
    "load": ("hivenode_load", "Busy fraction or queue length the role announces"),
    "merges": ("hivenode_merges", "Merges this syncer committed"),
    "tokens_merged": (
        "hivenode_tokens_merged",
        "Tokens (capped) in the merges this syncer committed, counted once per fragment",
    ),
    "learner_bans": ("hivenode_syncer_learner_bans", "Learner bans this syncer decided since it started"),
    "live_holders": (
        "hivenode_syncer_live_holders",
        "Live learners and stages the syncer expects contributions from",
    ),
    "microbatches_completed": (
        "hivenode_microbatches_completed",
        "Pipeline microbatches this verifier completed",
    ),
    "microbatches_served": ("hivenode_microbatches_served", "Microbatches this stage served"),
    "val_loss": ("hivenode_val_loss", "Held-out loss of the pipeline this verifier measured"),
}


# Per-peer values of a role's status ({peer: {label: value}}) exported as gauges labelled peer and the name here.
LABELLED_GAUGES: dict[str, tuple[str, str, str]] = {
    "refusals_by_peer": (
        "hivenode_syncer_refused_contributions",
        "Contributions the syncer refused, per learner and reason (the learner ledger, bounded)",
        "reason",
    ),
    "scores_by_peer": (
        "hivenode_syncer_peer_score",
        "Per learner, its latest score at the syncer: evidence_factor and held_out_slope of its last scored"
        " contribution, merge_weight (its last share of a merge), trust (probation, if refused), banned (1 or 0)",
        "score",
    ),
}


class StatusMetrics:
    """Gauges mirroring the numeric fields of a status document (see STATUS_GAUGES), updated at scrape time; a
    gauge appears once its field has a number (a learner exports no merge count)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        self._gauges: dict[str, Gauge] = {}

    def update(self, status: dict[str, Any]) -> None:
        for key, (name, help_text) in STATUS_GAUGES.items():
            value = status.get(key)
            if isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value):
                if key not in self._gauges:
                    self._gauges[key] = Gauge(name, help_text, registry=self.registry)
                self._gauges[key].set(value)
        for key, (name, help_text, label) in LABELLED_GAUGES.items():
            counts = status.get(key)
            if not isinstance(counts, dict):
                continue
            if key not in self._gauges:
                self._gauges[key] = Gauge(name, help_text, ("peer", label), registry=self.registry)
            for peer, reasons in counts.items():
                for reason, count in (reasons or {}).items():
                    self._gauges[key].labels(str(peer), str(reason)).set(count)


class StatusServer:
    """`/api/status` (JSON from a status source), `/metrics` (this node's own Prometheus registry, plus gauges
    of the role's status fields) and `/api/export` (a syncer's newest checkpoint, node.status.export)."""

    def __init__(self, host: str, port: int, registry: CollectorRegistry) -> None:
        self.host, self.port, self.registry = host, port, registry
        self.status_metrics = StatusMetrics(registry)
        self._source: StatusSource = dict
        self._runner: web.AppRunner | None = None
        self.app = web.Application()
        self.app.router.add_get("/api/status", self._status)
        self.app.router.add_get("/metrics", self._metrics)
        self._export: Callable[[], ExportFiles | None] = lambda: None
        add_export_routes(self.app, lambda: self._export())

    def set_status_source(self, source: StatusSource) -> None:
        self._source = source

    def set_export_source(self, source: Callable[[], ExportFiles | None]) -> None:
        """What `/api/export` hands to `python -m node export --from URL` (node.status.export)."""
        self._export = source

    async def _status(self, _request: web.Request) -> web.Response:
        return web.json_response(self._source())

    async def _metrics(self, _request: web.Request) -> web.Response:
        try:
            self.status_metrics.update(self._source())
        except Exception:  # a role whose status cannot be read must not take /metrics down with it
            logger.exception("status source failed while serving /metrics")
        return metrics_response(self.registry)

    async def start(self) -> str:
        self._runner, address = await start_site(self.app, self.host, self.port)
        return address

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None


_STARTED_AT = time.monotonic()


def export_files(ctx: NodeContext, role: Role) -> ExportFiles:
    """What `/api/export` hands out: the signed manifest and tokenizer, and a syncer's checkpoints."""
    store = getattr(role, "checkpoints", None)
    return ExportFiles(
        ctx.signed_manifest,
        store if isinstance(store, CheckpointStore) else None,
        None if ctx.tokenizer is None else ctx.tokenizer.blob,
    )


def node_status(ctx: NodeContext, role: Role, membership: Membership) -> dict[str, Any]:
    """The /api/status document: fixed fields first, then whatever the role fills (state, inner_step, ...)."""
    status: dict[str, Any] = {
        "peer_id": ctx.peer_id,
        "role": ctx.role_name,
        "run_id": ctx.run_id,
        "run_name": ctx.manifest.name,
        "stage": ctx.stage,
        "device": ctx.device,
        "state": "idle",
        "inner_step": None,
        "tokens": None,
        "loss": None,
        "version": VERSION,
        "uptime_s": round(time.monotonic() - _STARTED_AT, 1),
        "last_heartbeat_at": membership.last_ok_at,
        "tasks": ctx.supervisor.status(),
        "connectivity": ctx.connectivity,  # {"mode": direct | relay | client, "reason": ..., ...}
    }
    status.update(role.status())
    return status


def summarize_bans(bans: dict[str, list[BanRecord]], bans_required: int) -> list[dict[str, Any]]:
    """One entry per accused peer: who signed, and whether enough distinct verifiers did for the ban to hold."""
    out = []
    for offender, records in sorted(bans.items()):
        verifiers = sorted({r.verifier for r in records})
        out.append(
            {
                "offender": offender,
                "verifiers": verifiers,
                "in_effect": len(verifiers) >= bans_required,
                "notices": [r.to_json() for r in records],
            }
        )
    return out


# ---- `python -m node status` ----
