"""How the driver's requests reach a stage replica (`HopTransport`): over hivemind P2P framed streams
(`FramedTransport`) or to `StageService` handlers in this process (`DirectTransport`, for tests and the harness)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from typing import TYPE_CHECKING, Protocol

from protocol.envelope import StreamingFrame
from protocol.errors import ProtocolError, RemoteRefused
from protocol.rpc import Body, Route, call_framed

logger = logging.getLogger(__name__)

if TYPE_CHECKING:
    from hivemind.p2p import P2P


class HopTransport(Protocol):
    """Moves one request frame to a replica's handler and returns its answer frame.

    Raises RemoteRefused (the replica refused, with its reason), asyncio.TimeoutError, or a connection error.
    """

    async def call(
        self, peer_id: str, rpc: str, frame: Body, *, timeout_s: float, max_response_bytes: int
    ) -> bytes | bytearray: ...


class FramedTransport:
    """`HopTransport` over hivemind P2P framed streams; dials a replica's announced addresses on first use."""

    def __init__(self, p2p: P2P, *, connect_timeout_s: float = 5.0) -> None:
        self.p2p = p2p
        self.connect_timeout_s = connect_timeout_s
        self.maddrs: dict[str, tuple[str, ...]] = {}
        self._dialed: set[str] = set()

    def forget(self, peer_id: str) -> None:
        self._dialed.discard(peer_id)

    async def _dial(self, peer_id: str) -> None:
        if peer_id in self._dialed or not self.maddrs.get(peer_id):
            return
        from hivemind.p2p import PeerID

        from node.swarm.relay import DaemonMaddr

        self._dialed.add(peer_id)
        # hivemind's P2P has no public connect; its daemon client does. Peers usually already know each other
        # through the DHT, so a failure here is only logged: the stream open below is what counts. A relayed replica
        # is reachable only at the circuits it announces, which p2pd reads only in `DaemonMaddr`'s encoding.
        client = self.p2p._client
        try:
            await asyncio.wait_for(
                client.connect(PeerID.from_base58(peer_id), [DaemonMaddr(m) for m in self.maddrs[peer_id]]),
                self.connect_timeout_s,
            )
        except Exception as e:  # the daemon reports dial errors with several types; the call below decides
            logger.debug("dialing %s failed: %r", peer_id[-8:], e)

    async def call(
        self, peer_id: str, rpc: str, frame: Body, *, timeout_s: float, max_response_bytes: int
    ) -> bytes | bytearray:
        await self._dial(peer_id)
        return await call_framed(
            self.p2p, peer_id, rpc, frame, max_response_bytes=max_response_bytes, timeout_s=timeout_s
        )


class RouteProvider(Protocol):
    """What serves a replica's RPCs: `StageService` in production, anything with the same routes in tests."""

    def routes(self) -> Mapping[str, Route]: ...


class DirectTransport:
    """`HopTransport` that calls `StageService` handlers in this process (no network), as a FramedServer would:
    a `ProtocolError` of the handler becomes a `RemoteRefused` with its reason."""

    def __init__(self, caller: str, services: Mapping[str, RouteProvider]) -> None:
        self.caller = caller
        self.services = services

    async def call(
        self, peer_id: str, rpc: str, frame: Body, *, timeout_s: float, max_response_bytes: int
    ) -> bytes | bytearray:
        service = self.services.get(peer_id)
        if service is None:
            raise ConnectionError(f"no replica {peer_id[-8:]} in this process")
        handler = service.routes()[rpc].handler
        try:
            request = frame.to_bytes() if isinstance(frame, StreamingFrame) else bytearray(frame)
            answer = await asyncio.wait_for(handler(request, self.caller), timeout_s)
        except ProtocolError as e:
            raise RemoteRefused(f"{peer_id[-8:]} refused {rpc}: {e.reason}", reason=e.reason) from None
        answer = answer or b""
        if isinstance(answer, StreamingFrame):
            answer = answer.to_bytes()
        if len(answer) > max_response_bytes:
            raise ProtocolError("answer over the cap")
        return answer
