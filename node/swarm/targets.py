"""Join targets: turning `--join` multiaddrs and bootstrap URLs into the multiaddrs to dial (`JoinPlan`).

An http bootstrap also hands over the run's signed manifest, which is verified here and still checked against its
owner's pin later (`node.swarm.discovery`).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlparse

import aiohttp
from hivemind.utils.multiaddr import Multiaddr

from protocol.errors import ConfigError, JoinError
from protocol.keys import is_peer_id
from protocol.manifest import OwnerPins, SignedManifest, maddr_peer_id, run_bootstraps

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class JoinPlan:
    """Where to dial, and the run an http bootstrap vouched for (still checked against its owner signature)."""

    maddrs: tuple[str, ...]
    hinted: SignedManifest | None = None

    @property
    def entry_ids(self) -> frozenset[str]:
        """The peer ids we dial first: a run one of them signed or names as a bootstrap is the run they meant."""
        return frozenset(p for m in self.maddrs if (p := maddr_peer_id(m)) is not None)


def is_url(target: str) -> bool:
    return target.startswith(("http://", "https://"))


def check_multiaddr(text: str) -> str:
    """Validate a `--join` multiaddr: it must parse and end in /p2p/<Ed25519 peer id>; raise ConfigError."""
    try:
        maddr = Multiaddr(text)
    except Exception as e:  # the multiaddr library raises a zoo of types for malformed input
        raise ConfigError(f"--join {text!r} is not a multiaddr ({e})") from None
    try:
        peer_id = maddr.value_for_protocol("p2p")
    except Exception:  # ProtocolLookupError when there is no /p2p/ part
        peer_id = None
    if not peer_id or not is_peer_id(peer_id):
        raise ConfigError(
            f"--join {text!r} must end in /p2p/<peer id> of an Ed25519 key (12D3KooW...): copy the line the "
            "bootstrap printed"
        )
    return str(maddr)


def swarm_url(target: str) -> str:
    """A bootstrap URL given with or without its `/api/swarm` path."""
    parsed = urlparse(target)
    if not parsed.hostname:
        raise ConfigError(f"--join {target!r} is not a usable URL")
    if parsed.path in ("", "/"):
        return target.rstrip("/") + "/api/swarm"
    return target


async def fetch_json(url: str, timeout_s: float) -> Any:
    """GET a JSON document; raise JoinError with one line on any failure."""
    try:
        timeout = aiohttp.ClientTimeout(total=timeout_s)
        async with aiohttp.ClientSession(timeout=timeout) as session, session.get(url) as response:
            if response.status != 200:
                raise JoinError(f"{url} answered HTTP {response.status}")
            return await response.json(content_type=None)
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as e:
        detail = str(e) or type(e).__name__
        raise JoinError(f"cannot fetch {url}: {detail}") from None


async def resolve_join(targets: Sequence[str], timeout_s: float, pins: OwnerPins | None = None) -> JoinPlan:
    """Multiaddrs are used as given; URLs are asked for their signed manifest and `bootstrap_maddrs`."""
    maddrs: list[str] = []
    hinted: SignedManifest | None = None
    for target in targets:
        if not is_url(target):
            maddrs.append(check_multiaddr(target))
            continue
        url = swarm_url(target)
        signed, listed = read_swarm_document(url, await fetch_json(url, timeout_s), pins)
        hinted = hinted or signed
        maddrs.extend(listed)
    return JoinPlan(tuple(dict.fromkeys(maddrs)), hinted)


def read_swarm_document(url: str, data: object, pins: OwnerPins | None) -> tuple[SignedManifest, list[str]]:
    """What a bootstrap URL vouches for, trusted only as far as its signed manifest goes: the manifest must be
    there and signed by its owner (ManifestRejected), its run id's pin must hold (OwnerPinMismatch, checked
    before anything is dialled), and of the `bootstrap_maddrs` (plain, unsigned JSON) only those of the run's
    signed bootstraps (its owner, `manifest.bootstraps`) are kept; JoinError when none is."""
    if not isinstance(data, dict) or not isinstance(data.get("manifest"), str):
        raise JoinError(f"{url} serves no signed run manifest (is it a hivenode bootstrap?)")
    signed = SignedManifest.from_b64(data["manifest"])
    manifest = signed.verify()  # a tampered manifest stops the join here, with ManifestRejected
    if pins is not None and pins.pinned(signed.run_id) not in (None, signed.owner):
        pins.check_and_pin(signed.run_id, signed.owner, run_name=manifest.name)  # raises, with the fix
    listed = data.get("bootstrap_maddrs")
    if not isinstance(listed, list) or not listed:
        raise JoinError(f"{url} lists no bootstrap_maddrs (is it a hivenode bootstrap?)")
    allowed = run_bootstraps(signed, manifest)
    kept = [check_multiaddr(str(m)) for m in listed[:16] if maddr_peer_id(str(m)) in allowed]
    if len(kept) < len(listed[:16]):
        logger.warning(
            "%s listed %d multiaddr(s) of peers that are not bootstraps of run %s: ignored",
            url,
            len(listed[:16]) - len(kept),
            signed.run_id[:12],
        )
    if not kept:
        raise JoinError(
            f"{url} lists no bootstrap of the run it serves ({manifest.name!r}, {signed.run_id}): its "
            "bootstrap_maddrs name peers its owner did not sign in; refusing to dial them"
        )
    return signed, kept
