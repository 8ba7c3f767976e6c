"""The bootstrap: a stable DHT entry point that owns the run's manifest and serves the swarm's HTTP view.

It runs a hivemind DHT peer with a persistent identity (stable peer id; with a fixed listen port, a stable
multiaddr across restarts), signs the run manifest with the owner key, publishes it under the run's manifest key
and the well-known discovery key (and re-publishes it before it expires), heartbeats as role `bootstrap`, and
serves `GET /api/status`, `GET /api/swarm`, `GET /metrics` and `/` (static files under bootstrap/static/), the run's
tokenizer by hash and, with `--data-dir`, its token shards (`/api/data/`, bootstrap/data_serve.py).

The bootstrap keeps the swarm's history itself (`node.status.swarm_view.SwarmHistory`): every snapshot of the records
(taken each heartbeat period even when nobody polls) is fed to it, with the merge details the active syncer lists
in its own `/api/status` when it serves one. `/api/swarm` then carries `history` (time series, merges, bans),
`events` (newest first), `map` (peers by stage, role and health) and `scores` (per learner, the syncer's evidence
factor, held-out slope, merge weight, trust, refusals and ban, from the same status: `node.status.learner_scores`)
for the dashboard; every event is also appended to `<state_dir>/swarm-events.jsonl`, and the swarm's figures are
gauges on `/metrics`. Local tools add events of
their own (the demo announces its injected faults) by appending JSON lines to `<state_dir>/notes.jsonl`, read at
every snapshot. Peers that announced leaving are listed apart (`leaving`), so the history tells a clean leave
from a lost peer. Other sections come from
providers registered with `Bootstrap.add_section(name, provider)`; a provider gets the document built so far and
returns its section.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import os
import sqlite3
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web
from hivemind.utils import get_dht_time

from bootstrap.data_serve import DataApi, load_data
from bootstrap.gauges import SwarmGauges
from bootstrap.ledger import LEDGER_FILENAME, ContributionLedger, LeaderboardApi
from bootstrap.owner_roles import OwnerRole, OwnerRoles, local_join_maddr, prepare_roles
from node.config import BootstrapConfig, NetworkConfig, run_sentinel_config
from node.context import VERSION, LogContext, NodeMetrics, RestartPolicy, TaskSupervisor, wait_or_stop
from node.status.http import metrics_response, start_site, summarize_bans
from node.status.learner_scores import learner_scores
from node.status.swarm_view import NOTES_FILENAME, SwarmHistory, ViewConfig
from node.swarm import (
    REACH_ROUTE,
    Membership,
    Redialer,
    check_multiaddr,
    reach_check_route,
    reach_limits,
    start_dht,
)
from node.swarm.http_client import read_bounded
from protocol.dht_io import SwarmRecords, publish_discovery
from protocol.errors import ConfigError, HivenodeError, TokenizerMismatch
from protocol.identity import IdentityLock, NodeIdentity
from protocol.manifest import (
    RunManifest,
    SignedManifest,
    authorize,
    default_manifest,
    load_run_toml,
    run_bootstraps,
)
from protocol.records import Heartbeat, HivenodeRecordValidator, RecordLimits, RunRules
from protocol.rpc import FramedServer

logger = logging.getLogger(__name__)

STATIC_DIR = Path(__file__).resolve().parent / "static"
MAX_REMEMBERED_PEERS = (
    256  # peers whose bans we keep asking about after they stop heartbeating (one get each)
)
SectionProvider = Callable[[dict[str, Any]], Any]
MAX_EVENTS_SERVED = 200  # newest events in /api/swarm
MAX_POINTS_SERVED = 600  # points per time series in /api/swarm's history (thinned evenly)
MAX_PEER_SERIES_SERVED = 24  # per-peer loss series (the most recently seen peers)
MAX_MERGES_SERVED = 300  # newest merges
# in the state dir: every event the bootstrap saw, one JSON per line
SWARM_EVENTS_FILENAME = "swarm-events.jsonl"
MAX_SYNCER_STATUS_BYTES = 1 << 20  # the syncer's /api/status we read for merge details
MAX_NOTES_BYTES = 1 << 16  # of <state_dir>/notes.jsonl read per snapshot


def load_tokenizer(config: BootstrapConfig, manifest: RunManifest) -> tuple[RunManifest, bytes | None]:
    """The manifest naming `--tokenizer`'s hash and vocabulary, and the blob to serve (None: raw bytes)."""
    from node.ml.tokenizer import tokenizer_spec

    if config.tokenizer_path is None:
        if manifest.tokenizer:
            raise ConfigError(
                "run.toml names a [tokenizer]: start the bootstrap with --tokenizer tokenizer.json"
            )
        return manifest, None
    try:
        blob = config.tokenizer_path.read_bytes()
        spec = tokenizer_spec(blob)
    except (OSError, TokenizerMismatch) as e:
        raise ConfigError(f"--tokenizer {config.tokenizer_path}: {e}") from None
    if manifest.tokenizer and manifest.tokenizer != spec:
        raise ConfigError(
            f"--tokenizer {config.tokenizer_path} is {spec}, run.toml names {manifest.tokenizer}"
        )
    model = {**manifest.model, "vocab_size": spec["vocab_size"]}
    try:
        return dataclasses.replace(manifest, tokenizer=spec, model=model), blob
    except ValueError as e:
        raise ConfigError(f"--tokenizer {config.tokenizer_path}: {e}") from None


def load_manifest(
    config: BootstrapConfig, owner_roles: tuple[OwnerRole, ...] = (), bootstraps: tuple[str, ...] = ()
) -> RunManifest:
    """The run to publish; its SENTINEL settings are checked here, so a typo stops the owner, not every verifier.
    It authorizes the keys of `--authorize-*`, those of the roles the bootstrap runs itself and `bootstraps`."""
    manifest = load_run_toml(config.run_path) if config.run_path is not None else default_manifest()
    run_sentinel_config(manifest.sentinel, str(config.run_path or "the built-in run"))
    own = {role: tuple(r.peer_id for r in owner_roles if r.role == role) for role in ("syncer", "verifier")}
    return authorize(
        manifest,
        syncers=(*config.authorize_syncers, *own["syncer"]),
        verifiers=(*config.authorize_verifiers, *own["verifier"]),
        bootstraps=(*config.authorize_bootstraps, *bootstraps),
    )


def read_run(
    config: BootstrapConfig, identity: str | None = None, owner: str | None = None
) -> tuple[RunManifest, tuple[OwnerRole, ...]]:
    """The manifest to sign and the owner's roles it authorizes (their keys created on first use); our own
    peer id `identity` is listed among the run's bootstraps when it is not the `owner`'s."""
    plain = load_manifest(config)
    owner_roles = prepare_roles(config, plain)
    ours = (identity,) if identity is not None and identity != owner else ()
    return load_manifest(config, owner_roles, ours), owner_roles


class Bootstrap:
    """One bootstrap process. `start()` then `run(stop)`; `close()` in a finally."""

    def __init__(
        self, config: BootstrapConfig, identity: NodeIdentity, owner: NodeIdentity, manifest: RunManifest
    ):
        self.config = config
        self.identity = identity
        self.owner = owner
        self.manifest, self.tokenizer_blob = load_tokenizer(config, manifest)
        self.manifest, self.data = load_data(config, self.manifest)
        manifest = self.manifest
        self.signed = SignedManifest.sign(manifest, owner)
        self.rules = RunRules.from_manifest(self.signed, manifest)
        self.bootstrap_peers = run_bootstraps(self.signed, manifest)  # who may be listed as a bootstrap
        self.metrics = NodeMetrics()
        self.gauges = SwarmGauges(self.metrics.registry)
        self.history = SwarmHistory(ViewConfig(sample_period_s=manifest.heartbeat_period_s))
        self.sections: dict[str, SectionProvider] = {
            "events": lambda _doc: self.history.events_json(MAX_EVENTS_SERVED),
            "history": lambda _doc: self.history.history_json(
                max_points=MAX_POINTS_SERVED,
                max_peer_series=MAX_PEER_SERIES_SERVED,
                max_merges=MAX_MERGES_SERVED,
            ),
            "map": self.history.swarm_map,
            # per learner, the active syncer's scores (evidence, merge weight, trust, refusals, ban and reason)
            "scores": lambda _doc: learner_scores(self._syncer_status),
        }
        self._syncer_status: dict[str, Any] | None = None
        self._events_logged = self._notes_offset = 0  # last event seq logged; bytes of notes.jsonl read
        self.dht: Any = None
        self._p2p: Any = None  # our replica of the DHT's daemon, for the reach checks we serve
        self._reach: FramedServer | None = None
        self.records: SwarmRecords | None = None
        self.owner_records: SwarmRecords | None = None
        self.membership: Membership | None = None
        self.maddrs: tuple[str, ...] = ()
        self.http_address = ""
        self._runner: web.AppRunner | None = None
        self._seen_peers: dict[str, None] = {}  # insertion-ordered set, bounded
        self._snapshot: tuple[float, dict[str, Any]] | None = None
        self._snapshot_lock = asyncio.Lock()
        self._started_at = time.monotonic()
        self.owner_roles: OwnerRoles | None = None  # the syncer/verifier children, once started
        self.ledger: ContributionLedger | None = None  # who contributed what (bootstrap/ledger.py)

    @property
    def run_id(self) -> str:
        return self.signed.run_id

    def add_section(self, name: str, provider: SectionProvider) -> None:
        """Fill `/api/swarm[name]` from `provider(document_so_far)` (e.g. `events`, `history`)."""
        self.sections[name] = provider

    async def start(self) -> None:
        config = self.config
        network = _network(config)
        joins = [check_multiaddr(m) for m in config.join]
        self.dht = start_dht(self.identity, joins, network, HivenodeRecordValidator([self.rules]))
        timeout_s = config.request_timeout_s
        self.records = SwarmRecords(self.dht, self.rules, self.identity, timeout_s=timeout_s)
        self.owner_records = SwarmRecords(self.dht, self.rules, self.owner, timeout_s=timeout_s)
        self.maddrs = tuple(str(m) for m in self.dht.get_visible_maddrs())
        self.membership = Membership(
            self.records,
            period_s=self.manifest.heartbeat_period_s,
            heartbeat=self._heartbeat,
            metrics=self.metrics,
        )
        await self.publish_manifest()
        self.ledger = ContributionLedger(config.state_dir / LEDGER_FILENAME, self.run_id)
        self._runner, self.http_address = await start_site(self._app(), config.http_host, config.http_port)
        if config.serve_reach_checks:
            await self._serve_reach_checks()
        await self.membership.announce()
        if config.maddrs_file is not None:
            _write_lines(config.maddrs_file, self.maddrs)
        self.metrics.info.info({"peer_id": self.identity.peer_id, "run_id": self.run_id, "role": "bootstrap"})

    async def _serve_reach_checks(self) -> None:
        """Dial joining nodes back at the addresses they announce, so they learn whether peers can reach them."""
        self._p2p = await self.dht.replicate_p2p()
        route = reach_check_route(self._p2p)
        self._reach = FramedServer(self._p2p, {REACH_ROUTE: route}, limits=reach_limits())
        await self._reach.start()

    def _heartbeat(self, now: float) -> Heartbeat:
        return Heartbeat(
            role="bootstrap",
            state="serving",
            http=self.http_address,
            maddrs=self.maddrs[:8],
            version=VERSION,
            sent_at=now,
            mode="direct",  # every peer joins by dialing a bootstrap at its own addresses
        )

    async def publish_manifest(self) -> bool:
        assert self.owner_records is not None
        expiration = get_dht_time() + min(
            self.config.republish_period_s * self.config.manifest_ttl_periods,
            RecordLimits().max_ttl_manifest_s,
        )
        ok_manifest = await self.owner_records.publish_manifest(self.signed, expiration=expiration)
        ok_discovery = await publish_discovery(
            self.dht, self.owner, self.signed, expiration=expiration, timeout_s=self.config.request_timeout_s
        )
        ok = ok_manifest and ok_discovery
        self.gauges.count_publish(ok)
        if not ok:
            logger.warning(
                "manifest publish was refused (manifest %s, discovery %s)", ok_manifest, ok_discovery
            )
        return ok

    async def _republish(self, stop: asyncio.Event) -> None:
        while not await wait_or_stop(stop, self.config.republish_period_s):
            try:
                await self.publish_manifest()
            except asyncio.TimeoutError:
                logger.warning("manifest re-publish timed out")

    async def _observe(self, stop: asyncio.Event) -> None:
        """Refresh the swarm snapshot every heartbeat period, so /metrics, the history and the seen-peer list
        stay current even when nobody polls /api/swarm."""
        timeout = aiohttp.ClientTimeout(total=self.config.syncer_status_timeout_s)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            while not await wait_or_stop(stop, self.manifest.heartbeat_period_s):
                try:
                    document = await self.swarm_document()
                except asyncio.TimeoutError:
                    logger.warning("the DHT did not answer a swarm snapshot in time")
                    continue
                self._syncer_status = await _fetch_syncer_status(session, document.get("syncer") or [])
                self._update_ledger(document)

    def _update_ledger(self, document: dict[str, Any]) -> None:
        """Live peers and the active syncer's recent merges into the contribution ledger."""
        if self.ledger is None:
            return
        now = time.time()
        try:
            live = document.get("peers") or []
            peers = [(str(p["peer_id"]), str(p["role"])) for p in live if p.get("role") != "bootstrap"]
            self.ledger.observe_peers(peers, now, self.manifest.heartbeat_period_s)
            self.ledger.record_merges((self._syncer_status or {}).get("recent_merges") or [], now)
            if self._syncer_status is not None:
                self.ledger.record_admission(self._syncer_status, now)
        except (
            sqlite3.Error
        ) as e:  # a full disk or a locked file: the swarm goes on, the ledger catches up later
            logger.warning("cannot update the contribution ledger %s: %s", self.ledger.path, e)

    def _log_events(self) -> None:
        """Append new swarm events (joins, departures, stragglers, merges, bans) to `<state_dir>/swarm-events.jsonl`."""
        events = self.history.events_after(self._events_logged)
        if not events:
            return
        self._events_logged = events[-1]["seq"]
        try:
            self.config.state_dir.mkdir(parents=True, exist_ok=True)
            with (self.config.state_dir / SWARM_EVENTS_FILENAME).open("a") as log:
                log.writelines(json.dumps(e, default=str) + "\n" for e in events)
        except OSError as e:
            logger.warning("cannot append to the swarm event log: %s", e)

    def _read_notes(self, now: float) -> None:
        """New complete lines of `<state_dir>/notes.jsonl` (at most `MAX_NOTES_BYTES` a look) into the events."""
        try:
            with (self.config.state_dir / NOTES_FILENAME).open("rb") as notes:
                notes.seek(self._notes_offset)
                chunk = notes.read(MAX_NOTES_BYTES)
        except OSError:
            return  # no notes file: nobody adds events
        complete = chunk[: chunk.rfind(b"\n") + 1] or (chunk if len(chunk) == MAX_NOTES_BYTES else b"")
        self._notes_offset += len(complete)
        self.history.add_notes(complete.splitlines(), now)

    async def run(self, stop: asyncio.Event) -> None:
        assert self.membership is not None
        supervisor = TaskSupervisor()
        supervisor.restart_counter = self.metrics.task_restarts
        supervisor.spawn("heartbeat", partial(self.membership.run, stop), policy=RestartPolicy())
        supervisor.spawn("republish", partial(self._republish, stop), policy=RestartPolicy())
        supervisor.spawn("observe", partial(self._observe, stop), policy=RestartPolicy())
        if self.config.join:  # other bootstraps: re-dial them if a partition leaves us alone
            redialer = Redialer(self.dht, self.config.join, _network(self.config))
            supervisor.spawn("redial", partial(redialer.run, stop), policy=RestartPolicy())
        try:
            stopped: asyncio.Future[Any] = asyncio.ensure_future(stop.wait())
            await asyncio.wait([stopped, supervisor.fatal], return_when=asyncio.FIRST_COMPLETED)
            stopped.cancel()
            if supervisor.fatal.done():
                error = supervisor.fatal.result()
                raise HivenodeError(f"a background task failed for good: {type(error).__name__}: {error}")
        finally:
            stop.set()
            await self.membership.leave(self.config.shutdown_timeout_s / 2)
            await supervisor.shutdown(self.config.shutdown_timeout_s / 2)

    async def close(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
        if self._reach is not None:
            await self._reach.stop()
            self._reach = None
        if self._p2p is not None:
            await self._p2p.shutdown()  # a replica: closes our connection, the DHT owns the daemon
            self._p2p = None
        if self.dht is not None:
            self.dht.shutdown()
            self.dht = None
        if self.ledger is not None:
            self.ledger.close()
            self.ledger = None

    # ---- HTTP ----

    def _app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/api/status", self._handle_status)
        app.router.add_get("/api/swarm", self._handle_swarm)
        app.router.add_get("/metrics", self._handle_metrics)
        app.router.add_get("/api/tokenizer/{sha256}", self._handle_tokenizer)
        if self.data is not None:
            DataApi(self.data).add_routes(app)
        if self.ledger is not None:
            LeaderboardApi(self.ledger, self.swarm_document).add_routes(app)
        app.router.add_get("/", self._handle_index)
        if STATIC_DIR.is_dir():
            app.router.add_static("/static/", STATIC_DIR)
        return app

    def status(self) -> dict[str, Any]:
        return {
            "peer_id": self.identity.peer_id,
            "role": "bootstrap",
            "run_id": self.run_id,
            "run_name": self.manifest.name,
            "owner": self.owner.peer_id,
            "stage": None,
            "state": "serving",
            "inner_step": None,
            "tokens": None,
            "loss": None,
            "maddrs": list(self.maddrs),
            "version": VERSION,
            "uptime_s": round(time.monotonic() - self._started_at, 1),
            "owner_roles": self.owner_roles.status() if self.owner_roles is not None else [],
        }

    async def _handle_tokenizer(self, request: web.Request) -> web.Response:
        """The run's tokenizer.json, by the hash the signed manifest names (peers verify it again)."""
        if self.tokenizer_blob is None or request.match_info["sha256"] != self.manifest.tokenizer.get(
            "sha256"
        ):
            return web.Response(status=404, text="no such tokenizer in this run\n")
        return web.Response(body=self.tokenizer_blob, content_type="application/json")

    async def _handle_status(self, _request: web.Request) -> web.Response:
        return web.json_response(self.status())

    async def _handle_metrics(self, _request: web.Request) -> web.Response:
        return metrics_response(self.metrics.registry)

    async def _handle_index(self, _request: web.Request) -> web.StreamResponse:
        index = STATIC_DIR / "index.html"
        if index.is_file():
            return web.FileResponse(index)
        return web.Response(text=f"hivenode bootstrap for run {self.manifest.name}: see /api/swarm\n")

    async def _handle_swarm(self, _request: web.Request) -> web.Response:
        try:
            document = await self.swarm_document()
        except asyncio.TimeoutError:
            return web.json_response({"error": "the DHT did not answer in time"}, status=503)
        return web.json_response(document)

    async def swarm_document(self) -> dict[str, Any]:
        """The /api/swarm document, from a snapshot at most `swarm_cache_s` old."""
        async with self._snapshot_lock:
            now = time.monotonic()
            if self._snapshot is None or now - self._snapshot[0] > self.config.swarm_cache_s:
                self._snapshot = (now, await self._build_swarm_document())
            return self._snapshot[1]

    async def _build_swarm_document(self) -> dict[str, Any]:
        assert self.records is not None
        listed = await self.records.list_peers(include_leaving=True)
        peers = [p for p in listed if not p.heartbeat.leaving]
        for peer in peers:
            self._seen_peers[peer.peer_id] = None
        while len(self._seen_peers) > MAX_REMEMBERED_PEERS:
            del self._seen_peers[next(iter(self._seen_peers))]
        syncers = await self.records.list_syncers()
        bans = await self.records.list_bans(self._seen_peers)
        by_role: dict[str, int] = {}
        for peer in peers:
            by_role[peer.heartbeat.role] = by_role.get(peer.heartbeat.role, 0) + 1
        self.gauges.set_roles(by_role)
        # only the bootstraps the owner signed into the manifest: a heartbeat claiming the role adds nothing
        other_bootstraps = [
            m
            for p in peers
            if p.heartbeat.role == "bootstrap" and p.peer_id in self.bootstrap_peers
            for m in p.heartbeat.maddrs
        ]
        document: dict[str, Any] = {
            "run_id": self.run_id,
            "run_name": self.manifest.name,
            "owner": self.owner.peer_id,
            "manifest": self.signed.to_b64(),
            "settings": self.manifest.to_dict(),
            "time": get_dht_time(),
            "peers": [p.to_json() for p in peers],
            "leaving": [p.to_json() for p in listed if p.heartbeat.leaving],
            "bans": summarize_bans(bans, self.manifest.ban_quorum),
            "syncer": [s.to_json() for s in syncers],
            "bootstrap_maddrs": list(dict.fromkeys([*self.maddrs, *other_bootstraps])),
        }
        self._read_notes(document["time"])
        self.history.observe({**document, "syncer_status": self._syncer_status}, document["time"])
        self.gauges.update(self.history)
        self._log_events()
        for name, provider in self.sections.items():
            document[name] = provider(document)
        return document


async def _fetch_syncer_status(
    session: aiohttp.ClientSession, syncers: list[dict[str, Any]]
) -> dict[str, Any] | None:
    """The `/api/status` of the active syncer (its merge details), or None if it serves none or does not answer.
    Syncers are authorized by the run owner, so the address they publish is one the bootstrap may ask."""
    active = [s for s in syncers if s.get("state") == "active" and s.get("http")]
    if not active:
        return None
    syncer = max(active, key=lambda s: (s.get("term", 0), s.get("sent_at", 0.0)))
    url = f"http://{syncer['http']}/api/status"
    try:
        async with session.get(url) as response:
            if response.status != 200:
                return None
            body = await read_bounded(response.content, MAX_SYNCER_STATUS_BYTES + 1)
    except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as e:
        logger.debug("syncer status %s: %s", url, e)
        return None
    if len(body) > MAX_SYNCER_STATUS_BYTES:
        return None
    try:
        status = json.loads(body)
    except ValueError:
        return None
    return status if isinstance(status, dict) else None


def _network(config: BootstrapConfig) -> NetworkConfig:
    return NetworkConfig(
        listen=config.listen,
        announce=config.announce,
        join_timeout_s=config.join_timeout_s,
        request_timeout_s=config.request_timeout_s,
        use_relay=config.relay,  # nodes nobody can dial reserve a slot here (node.swarm.relay)
    )


def _write_lines(path: Path, lines: tuple[str, ...]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(f"{line}\n" for line in lines))
    os.replace(tmp, path)


def announce_lines(bootstrap: Bootstrap) -> list[str]:
    """What the operator should copy: the run, our multiaddrs (one per line), how to join, the dashboard."""
    lines = [f"run {bootstrap.manifest.name} {bootstrap.run_id} (owner {bootstrap.owner.peer_id})"]
    lines += list(bootstrap.maddrs)
    if bootstrap.maddrs:
        lines.append(f"join with: python -m node --join {bootstrap.maddrs[0]}")
    lines.append(f"dashboard: http://{bootstrap.http_address}/")
    for role in bootstrap.owner_roles.roles if bootstrap.owner_roles is not None else ():
        lines.append(f"owner's {role.role}: {role.peer_id} (log: {role.log_path})")
    if bootstrap.config.relay:
        lines.append("relay: on (nodes that cannot be dialed reserve a slot here; --no-relay turns it off)")
    else:
        lines.append("relay: off (nodes that cannot be dialed run in client mode)")
    return lines


async def run_bootstrap(
    config: BootstrapConfig,
    stop: asyncio.Event,
    on_ready: Callable[[Bootstrap], None],
    log_context: LogContext | None = None,
) -> None:
    """The whole life of a bootstrap process; raises HivenodeError subclasses with one-line messages."""
    load_manifest(config)  # a bad run file is the first thing to hear about
    identity = NodeIdentity.load_or_create(config.identity_file)
    if log_context is not None:
        log_context.peer_id = identity.peer_id
    # never create an owner key on the fly: a typo would silently start a different run
    owner = NodeIdentity.load(config.owner_key_path) if config.owner_key_path else identity
    manifest, owner_roles = read_run(config, identity.peer_id, owner.peer_id)
    with IdentityLock(config.identity_file):
        bootstrap = Bootstrap(config, identity, owner, manifest)
        try:
            await bootstrap.start()
            children = OwnerRoles(
                owner_roles, local_join_maddr(bootstrap.maddrs), config_path=config.roles_config_path
            )
            bootstrap.owner_roles = children
            on_ready(bootstrap)
            kept = asyncio.ensure_future(children.run(stop))
            try:
                await bootstrap.run(stop)
            finally:
                stop.set()  # the children get their graceful stop while our DHT still answers them
                await kept
        finally:
            await bootstrap.close()
