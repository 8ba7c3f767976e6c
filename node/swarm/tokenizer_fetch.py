"""Getting the run's tokenizer onto this node: the state-dir cache, else the bootstrap's HTTP API by hash.

The signed manifest names the tokenizer by sha256 (`[tokenizer]`); the bootstrap serves the blob at
`GET /api/tokenizer/<sha256>`. Whatever comes back is checked against the manifest (`verify_tokenizer`)
before it is cached or used: a mismatch is a `TokenizerMismatch`, logged and refused, never trained on.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import aiohttp

from node.ml.tokenizer import MAX_TOKENIZER_BYTES, Tokenizer, verify_tokenizer
from node.swarm.http_client import read_bounded
from protocol.errors import TokenizerMismatch

logger = logging.getLogger(__name__)


def tokenizer_urls(sha256: str, join: Iterable[str], peers: Sequence[Any]) -> list[str]:
    """Where to ask, in order: bootstraps joined by URL, then every live peer announcing role bootstrap."""
    return [f"{base}/api/tokenizer/{sha256}" for base in bootstrap_bases(join, peers)]


def bootstrap_bases(join: Iterable[str], peers: Sequence[Any]) -> list[str]:
    """HTTP bases (`http://host:port`) of the bootstraps: joined by URL, then live peers with role bootstrap."""
    bases: list[str] = []
    for entry in join:
        if entry.startswith(("http://", "https://")):
            scheme, _, rest = entry.partition("://")
            bases.append(f"{scheme}://{rest.split('/', 1)[0]}")
    for peer in peers:
        heartbeat = getattr(peer, "heartbeat", None)
        if heartbeat is not None and heartbeat.role == "bootstrap" and heartbeat.http:
            bases.append(f"http://{heartbeat.http}")
    return list(dict.fromkeys(bases))


async def fetch_tokenizer(url: str, spec: dict[str, Any], *, timeout_s: float) -> Tokenizer:
    """GET one URL and verify the blob against `spec`; TokenizerMismatch if it is not the run's."""
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    async with aiohttp.ClientSession(timeout=timeout) as session, session.get(url) as response:
        if response.status != 200:
            raise TokenizerMismatch(f"{url} answered HTTP {response.status}")
        blob = await read_bounded(response.content, MAX_TOKENIZER_BYTES + 1)
    if len(blob) > MAX_TOKENIZER_BYTES:
        raise TokenizerMismatch(f"{url} sent more than {MAX_TOKENIZER_BYTES} bytes")
    return verify_tokenizer(blob, spec)


async def obtain_tokenizer(
    spec: dict[str, Any], state_dir: Path, urls: Sequence[str], *, timeout_s: float
) -> Tokenizer | None:
    """The run's tokenizer (None for raw bytes): from the cache if it verifies, else the first URL whose
    blob verifies. Raises TokenizerMismatch (every source failed or was refused), naming the last reason."""
    if not spec:
        return None
    cache = state_dir / f"tokenizer-{spec['sha256']}.json"
    if cache.exists():
        try:
            return verify_tokenizer(cache.read_bytes(), spec)
        except TokenizerMismatch as e:
            logger.warning("cached tokenizer refused (%s); fetching it again", e)
    reason = "no bootstrap HTTP address known (join by URL, or wait for the bootstrap's heartbeat)"
    for url in urls:
        try:
            tokenizer = await fetch_tokenizer(url, spec, timeout_s=timeout_s)
        except TokenizerMismatch as e:
            logger.error("tokenizer from %s refused: %s", url, e)
            reason = str(e)
            continue
        except (OSError, aiohttp.ClientError, asyncio.TimeoutError) as e:
            logger.warning("tokenizer fetch from %s failed: %s", url, e or type(e).__name__)
            reason = f"{url}: {e or type(e).__name__}"
            continue
        _write_atomic(cache, tokenizer.blob)
        logger.info(
            "tokenizer %s (%d tokens) fetched from %s", spec["sha256"][:12], tokenizer.vocab_size, url
        )
        return tokenizer
    raise TokenizerMismatch(f"could not obtain the run's tokenizer {spec['sha256'][:12]}: {reason}")


def _write_atomic(path: Path, blob: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_suffix(".tmp")
    temporary.write_bytes(blob)
    os.replace(temporary, path)
