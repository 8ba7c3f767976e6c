"""The life of a node: identity and its lock -> join -> heartbeats, status API and the role under a supervisor -> stop.

`run_node` is the whole sequence; every wait in it is bounded by a named config timeout.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable
from functools import partial
from typing import Any

from node import swarm
from node.config import NodeConfig
from node.context import (
    EventLog,
    LogContext,
    NodeContext,
    NodeMetrics,
    RestartPolicy,
    TaskSupervisor,
    events_path,
    resolve_device,
)
from node.roles import registry as roles
from node.status import http as status
from node.status.progress import JoinProgress
from protocol.errors import HivenodeError
from protocol.identity import IdentityLock, NodeIdentity

logger = logging.getLogger(__name__)

ReadyCallback = Callable[[NodeContext], None]


async def run_node(
    config: NodeConfig,
    stop: asyncio.Event,
    log_context: LogContext,
    on_ready: ReadyCallback | None = None,
    progress: JoinProgress | None = None,
) -> None:
    """Join, serve until stopped, leave; `on_ready(ctx)` once the node is announced and serving; `progress`
    is told each phase of the join (node.status.progress).

    Raises HivenodeError subclasses with one-line messages for the CLI.
    """
    progress = progress or JoinProgress(time.monotonic)
    device = resolve_device(config.device)
    threading.Thread(target=_preload_model_code, name="preload", daemon=True).start()
    identity = NodeIdentity.load_or_create(config.identity_file)
    log_context.peer_id = identity.peer_id
    with IdentityLock(config.identity_file):
        progress.enter("connecting", f"dialing {len(config.join)} entry point(s)")
        joined = await swarm.join(config, identity, on_phase=progress.enter)
        try:
            await _serve(config, identity, joined, stop, log_context, device, on_ready, progress)
        finally:
            joined.dht.shutdown()
            logger.info("stopped (pid %d)", os.getpid())


def _preload_model_code() -> None:
    """transformers' modules, imported while the DHT join waits on the network (a failure shows up later,
    where the model is built, with its real error)."""
    try:
        from node.ml.model import preload

        preload()
    except Exception as e:  # the import is retried where it is needed
        logger.debug("preloading the model code failed: %s", e)


async def _serve(
    config: NodeConfig,
    identity: NodeIdentity,
    joined: Any,
    stop: asyncio.Event,
    log_context: LogContext,
    device: str,
    on_ready: ReadyCallback | None,
    progress: JoinProgress,
) -> None:
    ctx = _build_context(config, identity, joined, log_context, device)
    role: Any = None

    def heartbeat(now: float) -> Any:
        role_status = role.status() if role is not None else {"state": "joining"}
        return swarm.build_heartbeat(ctx, role_status, joined.maddrs, now=now)

    period_s = ctx.manifest.heartbeat_period_s
    membership = swarm.Membership(ctx.records, period_s=period_s, heartbeat=heartbeat, metrics=ctx.metrics)
    server = status.StatusServer(config.http.host, config.http.port, ctx.metrics.registry)
    try:
        progress.enter("tokenizer/data", "the run's tokenizer")
        ctx.tokenizer = await _tokenizer(ctx, membership)
        choice = await _choose_role(ctx, joined, membership)
        progress.enter("state load", f"role {choice.role}")
        role = roles.build_role(choice.role, ctx)
        ctx.status_source = partial(status.node_status, ctx, role, membership)
        server.set_status_source(ctx.status_source)
        server.set_export_source(partial(status.export_files, ctx, role))
        ctx.http_address = await server.start()
        ctx.metrics.info.info({"peer_id": identity.peer_id, "run_id": ctx.run_id, "role": choice.role})
        with contextlib.suppress(asyncio.TimeoutError):  # the heartbeat loop retries; it logs the failure
            await membership.announce()
        ctx.events.emit("joined", run_id=ctx.run_id, role=choice.role, stage=choice.stage, why=choice.reason)
        _note_reachability(ctx, joined)
        _spawn_tasks(ctx, joined, membership, role, stop)
        if on_ready is not None:
            on_ready(ctx)
        await _wait_for_end(stop, ctx.supervisor)
    finally:
        stop.set()
        await membership.leave(timeout_s=config.shutdown_timeout_s / 2)
        await ctx.supervisor.shutdown(config.shutdown_timeout_s / 2)
        await server.stop()
        ctx.events.emit("left")
        ctx.events.close()


def _build_context(
    config: NodeConfig, identity: NodeIdentity, joined: Any, log_context: LogContext, device: str
) -> NodeContext:
    """The node's shared state once joined: event log, metrics and a supervisor counting restarts into them."""
    events = EventLog(events_path(config), peer_id=identity.peer_id)
    metrics = NodeMetrics()
    supervisor = TaskSupervisor(events)
    supervisor.restart_counter = metrics.task_restarts
    return NodeContext(
        config=config,
        identity=identity,
        signed_manifest=joined.signed,
        manifest=joined.manifest,
        dht=joined.dht,
        records=joined.records,
        metrics=metrics,
        events=events,
        supervisor=supervisor,
        log_context=log_context,
        device=device,
        # set before the first heartbeat, which carries its mode
        connectivity=joined.connectivity.as_dict() if joined.connectivity is not None else {},
    )


async def _tokenizer(ctx: NodeContext, membership: swarm.Membership) -> Any:
    """The run's BPE tokenizer, verified against the signed manifest (None for raw bytes); raises
    TokenizerMismatch when no source gives the right one: a node never trains on another vocabulary."""
    if not ctx.manifest.tokenizer:
        return None
    from node.swarm.tokenizer_fetch import obtain_tokenizer, tokenizer_urls

    spec = dict(ctx.manifest.tokenizer)
    peers = await membership.peers_or_empty()
    urls = tokenizer_urls(str(spec["sha256"]), ctx.config.join, peers)
    timeout_s = ctx.config.network.request_timeout_s
    return await obtain_tokenizer(spec, ctx.config.state_dir, urls, timeout_s=timeout_s)


async def _choose_role(ctx: NodeContext, joined: Any, membership: swarm.Membership) -> roles.RoleChoice:
    """Pick the role (and stage) from the config and the peers seen so far; record it on the context and logs."""
    config = ctx.config
    peers = await membership.peers_or_empty()
    placing = ctx.manifest.num_stages > 1 and config.role in ("auto", "stage") and config.stage is None
    measured = roles.measurements_of(await _measured(membership, peers)) if placing else []
    choice = roles.choose_role(
        config.role,
        config.stage,
        ctx.identity.peer_id,
        ctx.manifest,
        peers,
        joined.now,
        client_mode=joined.client_mode or config.network.client_mode,
        relayed=joined.relayed,
        measured=measured,
        placement=_placement_config(config) if placing else None,
    )
    ctx.role_name, ctx.stage, ctx.log_context.role = choice.role, choice.stage, choice.role
    return choice


async def _measured(membership: swarm.Membership, peers: list[Any], tries: int = 3) -> list[Any]:
    """The verifiers' `measured` records for placement. Where stage replicas serve but none is found, ask again
    (twice, a second apart): one DHT read can miss a record on a busy swarm, and placement would then believe
    the replicas' own figures, which is what a liar wants."""
    found: list[Any] = []
    for attempt in range(tries):
        found = await membership.measured_or_empty()
        if found or not any(p.heartbeat.role == "stage" for p in peers) or attempt == tries - 1:
            break
        await asyncio.sleep(1.0)
    return found


def _placement_config(config: NodeConfig) -> Any:
    """This node's `[stage_options] rebalance` settings: the slack its placement gives announced throughputs."""
    from node.roles.stage import stage_config  # imports torch: only when a stage may be placed

    return stage_config(config.stage_options).rebalance


def _spawn_tasks(
    ctx: NodeContext, joined: Any, membership: swarm.Membership, role: Any, stop: asyncio.Event
) -> None:
    """Heartbeats and redials restart on failure; the role ending ends the node."""
    supervisor = ctx.supervisor
    supervisor.spawn("heartbeat", partial(membership.run, stop), policy=RestartPolicy())
    if joined.entry_points:
        redialer = swarm.Redialer(joined.dht, joined.entry_points, ctx.config.network, events=ctx.events)
        supervisor.spawn("redial", partial(redialer.run, stop), policy=RestartPolicy())
    supervisor.spawn("role", partial(role.run, ctx, stop), ends_node=True)


def _note_reachability(ctx: NodeContext, joined: Any) -> None:
    """The `connectivity` event (direct / relay / client, and why) and, when a bootstrap checked, what it saw."""
    events = ctx.events
    if ctx.connectivity:
        events.emit("connectivity", **ctx.connectivity)
    reach = joined.reachability
    if reach is not None:
        events.emit(
            "reachability",
            reachable=reach.reachable,
            client_mode=joined.client_mode,
            checked=list(reach.checked),
            dialable=list(reach.dialable),
            observed=list(reach.observed),
        )


async def _wait_for_end(stop: asyncio.Event, supervisor: TaskSupervisor) -> None:
    waiters: dict[asyncio.Future[Any], str] = {
        asyncio.ensure_future(stop.wait()): "stop requested",
        asyncio.ensure_future(supervisor.ended.wait()): "role finished",
        supervisor.fatal: "a task failed",
    }
    done, pending = await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
    for future in pending:
        if future is not supervisor.fatal:
            future.cancel()
    logger.info("stopping: %s", ", ".join(sorted(waiters[f] for f in done)))
    if supervisor.fatal.done():
        error = supervisor.fatal.result()
        raise HivenodeError(f"a background task failed for good: {type(error).__name__}: {error}") from error
