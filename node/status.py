"""HTTP status of a node (`GET /api/status`, `GET /metrics`), the aiohttp helpers the bootstrap reuses, and the
text summary behind `python -m node status <url-or-multiaddr>`."""

from __future__ import annotations

import logging
import math
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from aiohttp import web
from hivemind.utils import get_dht_time
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Gauge, generate_latest

from node.config import NetworkConfig
from node.runtime import VERSION, NodeContext, short_id
from protocol.dht_io import SwarmRecords, fetch_discovery
from protocol.errors import ConfigError, HivenodeError
from protocol.identity import NodeIdentity
from protocol.records import BanRecord, HivenodeRecordValidator, RunRules

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
    "tokens": ("hivenode_tokens", "Tokens processed since the process started (merged, for a syncer)"),
    "throughput": ("hivenode_throughput_tokens_per_second", "Tokens per second over the last seconds"),
    "loss": ("hivenode_loss", "Latest training loss (held-out loss of the global model, for a syncer)"),
    "held_out_loss": ("hivenode_held_out_loss", "Latest held-out loss this process measured"),
    "load": ("hivenode_load", "Busy fraction or queue length the role announces"),
    "merges": ("hivenode_merges", "Merges this syncer committed"),
    "tokens_merged": ("hivenode_tokens_merged", "Tokens (capped) in the merges this syncer committed"),
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


class StatusServer:
    """`/api/status` (JSON from a status source) and `/metrics` (this node's own Prometheus registry, plus gauges
    of the role's status fields)."""

    def __init__(self, host: str, port: int, registry: CollectorRegistry) -> None:
        self.host, self.port, self.registry = host, port, registry
        self.status_metrics = StatusMetrics(registry)
        self._source: StatusSource = dict
        self._runner: web.AppRunner | None = None
        self.app = web.Application()
        self.app.router.add_get("/api/status", self._status)
        self.app.router.add_get("/metrics", self._metrics)

    def set_status_source(self, source: StatusSource) -> None:
        self._source = source

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


def node_status(ctx: NodeContext, role: Any, membership: Any) -> dict[str, Any]:
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


def render_swarm(data: dict[str, Any]) -> str:
    """A text summary of an /api/swarm document (with the bootstrap's history when it has one)."""
    lines = [f"run {data.get('run_name', '?')} ({data.get('run_id', '?')})"]
    peers = data.get("peers") or []
    lines.append(f"{len(peers)} live peer(s)")
    for peer in peers:
        stage = peer.get("stage")
        where = f" stage {stage}" if stage is not None else ""
        step = peer.get("inner_step")
        loss = peer.get("loss")
        lines.append(
            f"  {short_id(str(peer.get('peer_id', '')))}  {peer.get('role', '?'):9}{where:9} {peer.get('state', '?'):10}"
            f" step {step if step is not None else '-'}  {peer.get('throughput', 0.0):.0f} tok/s"
            f"  loss {f'{loss:.3f}' if isinstance(loss, int | float) else '-'}  {peer.get('http', '')}"
        )
    syncers = data.get("syncer") or []
    lines.append(f"{len(syncers)} syncer record(s)")
    for record in syncers:
        versions = " ".join(str(v) for v in record.get("versions") or [])
        lines.append(
            f"  {short_id(str(record.get('peer_id', '')))}  {record.get('state', '?')} term {record.get('term', '?')}"
            f"  versions [{versions}]"
        )
    bans = data.get("bans") or []
    lines.append(f"{len(bans)} banned peer(s)")
    for ban in bans:
        reasons = sorted({n.get("reason", "") for n in ban.get("notices") or []} - {""})
        signed = ", ".join(short_id(v) for v in ban.get("verifiers") or [])
        effect = "in effect" if ban.get("in_effect") else "not yet in effect"
        lines.append(
            f"  {short_id(str(ban.get('offender', '')))}  {effect}, signed by {signed}: {'; '.join(reasons)}"
        )
    lines += _history_lines(data.get("history"))
    for maddr in data.get("bootstrap_maddrs") or []:
        lines.append(f"bootstrap {maddr}")
    return "\n".join(lines)


def _last_number(values: object) -> float | None:
    if not isinstance(values, list):
        return None
    numbers = [v for v in values if isinstance(v, int | float) and not isinstance(v, bool)]
    return numbers[-1] if numbers else None


def _history_lines(history: object) -> list[str]:
    """What the bootstrap's history adds: current rates, merges, the latest held-out loss."""
    if not isinstance(history, dict) or not history.get("t"):
        return []
    throughput, goodput = _last_number(history.get("throughput")), _last_number(history.get("goodput"))
    totals = history.get("totals") if isinstance(history.get("totals"), dict) else {}
    evals = [p for p in history.get("eval") or [] if isinstance(p, dict)]
    line = (
        f"swarm: {throughput or 0:,.0f} tok/s processed, goodput {goodput or 0:,.0f} tok/s"
        f" ({history.get('goodput_source', '?')}); {totals.get('merges', 0)} merges seen"
    )
    if evals:
        line += f"; held-out loss {evals[-1].get('loss')}"
    return [line]


async def swarm_from_dht(maddrs: list[str], network: NetworkConfig) -> list[dict[str, Any]]:
    """Ask the DHT directly (no bootstrap HTTP needed): one /api/swarm-shaped summary per run found there."""
    from node.swarm import start_dht

    with tempfile.TemporaryDirectory(prefix="hivenode-status-") as tmp:
        identity = NodeIdentity.load_or_create(Path(tmp) / "identity.key")  # throwaway: we only read
        dht = start_dht(identity, maddrs, network, HivenodeRecordValidator())
        try:
            timeout_s = network.request_timeout_s
            summaries = []
            for signed in await fetch_discovery(dht, timeout_s=timeout_s, now=get_dht_time()):
                manifest = signed.verify()
                rules = RunRules.from_manifest(signed, manifest)
                dht.add_validators([HivenodeRecordValidator([rules])])  # the DHT process drops unknown runs
                records = SwarmRecords(dht, rules, identity, timeout_s=timeout_s)
                peers = await records.list_peers()
                syncers = await records.list_syncers()
                bans = await records.list_bans(p.peer_id for p in peers)
                summaries.append(
                    {
                        "run_id": signed.run_id,
                        "run_name": manifest.name,
                        "peers": [p.to_json() for p in peers],
                        "syncer": [s.to_json() for s in syncers],
                        "bans": summarize_bans(bans, manifest.bans_required),
                        "bootstrap_maddrs": maddrs,
                    }
                )
            return summaries
        finally:
            dht.shutdown()


async def status_command(target: str, timeout_s: float = 10.0) -> int:
    """Print a summary of the swarm behind `target` (a bootstrap URL or a multiaddr); return an exit code."""
    from node.swarm import check_multiaddr, fetch_json, is_url, swarm_url

    if is_url(target):
        print(render_swarm(await fetch_json(swarm_url(target), timeout_s)))
        return 0
    network = NetworkConfig(join_timeout_s=timeout_s, request_timeout_s=min(timeout_s, 5.0), client_mode=True)
    summaries = await swarm_from_dht([check_multiaddr(target)], network)
    if not summaries:
        raise HivenodeError(f"no hivenode run is published on the DHT behind {target}")
    print("\n\n".join(render_swarm(s) for s in summaries))
    return 0
