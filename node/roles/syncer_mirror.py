"""A standby syncer's mirror of the active one: every `mirror_every_s` it pulls the fragments whose version moved
(parameters, momentum, merged ledger, publication time, and with each the seniority table's most recently merged
identities, node.diloco.seniority) so a takeover can resume from them (see
node.roles.syncer: the freshest of this mirror and the checkpoint file wins)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from typing import Any

from node.diloco.outer import STATE_PREFIX
from node.diloco.seniority import SeniorityStateError, seniority_from_chunks
from node.diloco.sync_client import STATE_ROUTE, FramedSyncTransport, fragment_bytes, fragment_limits
from node.diloco.sync_types import SyncUnavailable
from node.ml.checkpoint import SyncerSnapshot, ledger_from_json
from node.roles.syncer_rpc import SyncerHost, wall_offset
from protocol.replay import ReplayGuard

logger = logging.getLogger(__name__)


class StateMirror:
    """The latest state pulled from the active syncer (`snapshot`, None until the first pull)."""

    def __init__(self, role: SyncerHost, replay: ReplayGuard) -> None:
        self.role = role
        self.snapshot: SyncerSnapshot | None = None
        self._replay = replay  # the role's guard of control answers
        self._transport: FramedSyncTransport | None = None

    async def run(self, stop: asyncio.Event) -> None:
        from node.context import wait_or_stop

        while True:
            if not self.role.active and self.role.primary is not None and self.role.core is not None:
                try:
                    await self.once()
                except SyncUnavailable as e:
                    logger.debug("mirror: %s", e)
            if await wait_or_stop(stop, self.role.config.mirror_every_s):
                return

    async def once(self) -> None:
        role = self.role
        assert role.core is not None
        if self._transport is None:
            self._transport = FramedSyncTransport(
                role.p2p,
                role.ctx.identity,
                role.ctx.records,
                role.plan,
                authorized_syncers=role.ctx.manifest.authorized_syncers,
            )
        base = self.snapshot or role.core.snapshot(role.ctx.run_id, role.term, wall_offset=wall_offset())
        view = await self._transport.versions(list(base.versions), 0.0)
        changed = [f for f, v in enumerate(view.versions) if v > base.versions[f]]
        if not changed:
            return
        params, momentum, versions = dict(base.params), dict(base.momentum), list(base.versions)
        ledger, seniority = list(base.merged), base.seniority
        published = list(base.published_wall) or [0.0] * role.plan.num_fragments
        for fragment in changed:
            opened = await self._fetch_state(view.syncer, fragment)
            for name in role.plan.fragments[fragment].names:
                params[name] = opened.tensors[f"param/{name}"]
                if f"momentum/{name}" in opened.tensors:
                    momentum[STATE_PREFIX + name] = opened.tensors[f"momentum/{name}"]
            versions[fragment] = opened.header.step
            wall = opened.meta.get("published_wall")
            published[fragment] = (
                float(wall) if type(wall) is float and math.isfinite(wall) and wall > 0 else 0.0
            )
            with contextlib.suppress(ValueError, TypeError):
                entries = ledger_from_json(str(opened.meta.get("merged", "[]")))
                ledger = [e for e in ledger if e[1] != fragment] + [e for e in entries if e[1] == fragment]
            try:  # the table is global: the latest answer's is the freshest (absent: an older syncer)
                if "seniority" in opened.meta:
                    seniority = seniority_from_chunks(opened.meta["seniority"])
            except SeniorityStateError as e:
                logger.warning("mirror: ignoring the seniority state of fragment %d: %s", fragment, e)
        self.snapshot = SyncerSnapshot(
            run_id=role.ctx.run_id,
            term=view.term,
            versions=tuple(versions),
            params=params,
            momentum=momentum,
            merges=base.merges,
            tokens_merged=base.tokens_merged,
            merged=tuple(ledger),
            published_wall=tuple(published),
            seniority=seniority,
        )

    async def _fetch_state(self, syncer: str, fragment: int) -> Any:
        """One fragment's state from the active syncer (its STATE route), opened; SyncUnavailable if refused."""
        from protocol.envelope import Context, Kind, max_frame_bytes, open_envelope, seal
        from protocol.errors import ProtocolError, RemoteRefused

        ctx = self.role.ctx
        assert self._transport is not None
        state_limits = fragment_limits(self.role.plan, factor=2)
        frame = seal(
            ctx.identity,
            Context(run_id=ctx.run_id, kind=Kind.CONTROL, receiver=syncer),
            microbatch=fragment,
            step=0,
            now=time.time(),
            meta={"fragment": fragment},
        )
        try:
            peer, answer = await self._transport._call(
                STATE_ROUTE,
                frame,
                max_frame_bytes(state_limits),
                answer_bytes=fragment_bytes(self.role.plan, fragment, factor=2),  # params and momentum
            )
            return open_envelope(
                answer,
                remote_peer=peer,
                expect=Context(run_id=ctx.run_id, kind=Kind.VERSION, receiver=ctx.peer_id),
                limits=state_limits,
                replay=self._replay,
                now=time.time(),
            )
        except (RemoteRefused, ProtocolError) as e:
            raise SyncUnavailable(f"state of fragment {fragment}: {e}") from None
