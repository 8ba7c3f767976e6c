"""Getting the run's token shards onto this node: a local mirror, the state-dir cache, else the bootstrap's
`/api/data/` by hash, every byte checked against the signed manifest before it is read.

The index is fetched by the sha256 the manifest names (`data.index_sha256`) and refused if it hashes otherwise.
A shard downloads into `<name>.tokens.part`, appending: an interrupted download resumes with an HTTP Range
request for the missing tail, then the whole file is hashed against its name (`verify_shard`). A mismatch is a
`ShardMismatch`, logged; the file is deleted and fetched again (from the next bootstrap, up to `attempts` rounds),
never trained on. A cached shard that no longer verifies (a disk error, an edit) is refused and refetched alike.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import aiohttp

from node.ml.shards import (
    INDEX_FILENAME,
    MAX_INDEX_BYTES,
    ShardEntry,
    ShardIndex,
    parse_index,
    shard_path,
    verify_shard,
    write_atomic,
)
from node.swarm.http_client import read_bounded
from protocol.errors import DataError, ShardMismatch

logger = logging.getLogger(__name__)

CHUNK_BYTES = 1 << 20
PART_SUFFIX = ".part"


@dataclass(frozen=True, kw_only=True, slots=True)
class ShardSource:
    """Where a node looks for the run's data, in order: `mirror`, `cache`, then each HTTP base."""

    cache: Path  # <state_dir>/data: verified shards are kept here
    bases: Sequence[str]  # http://host:port of bootstraps
    mirror: Path | None = None  # a local copy of a prepared folder (shared disk, rsync): read in place
    timeout_s: float = 60.0  # bounds each HTTP request
    attempts: int = 3  # rounds over the bases before a shard is given up


async def obtain_index(sha256: str, source: ShardSource) -> ShardIndex:
    """The run's shard index: the mirror's or the cached one if it hashes to `sha256`, else downloaded."""
    cached = source.cache / f"index-{sha256}.json"
    for path in ([source.mirror / INDEX_FILENAME] if source.mirror else []) + [cached]:
        if path.is_file():
            try:
                return parse_index(path.read_bytes(), sha256)
            except DataError as e:
                logger.warning("shard index at %s refused (%s)", path, e)
    reason = "no bootstrap HTTP address known (join by URL, or wait for the bootstrap's heartbeat)"
    for base in source.bases:
        try:
            blob = await _get_bounded(f"{base}/api/data/index", source.timeout_s, MAX_INDEX_BYTES)
            index = parse_index(blob, sha256)
        except (DataError, OSError, aiohttp.ClientError, asyncio.TimeoutError) as e:
            logger.warning("shard index from %s refused or failed: %s", base, e or type(e).__name__)
            reason = f"{base}: {e or type(e).__name__}"
            continue
        write_atomic(cached, blob)
        return index
    raise DataError(f"could not obtain the run's shard index {sha256[:12]}: {reason}")


async def _get_bounded(url: str, timeout_s: float, max_bytes: int) -> bytes:
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    async with aiohttp.ClientSession(timeout=timeout) as session, session.get(url) as response:
        if response.status != 200:
            raise DataError(f"{url} answered HTTP {response.status}")
        blob = await read_bounded(response.content, max_bytes + 1)
    if len(blob) > max_bytes:
        raise DataError(f"{url} sent more than {max_bytes} bytes")
    return blob


async def download_shard(base: str, entry: ShardEntry, directory: Path, timeout_s: float) -> int:
    """Fetch one shard into `directory`, resuming a `.part` file with a Range request; verify it and move it
    into place. Returns the bytes received. ShardMismatch (file deleted) if it is not the shard it claims."""
    final = shard_path(directory, entry.name)
    part = final.with_name(final.name + PART_SUFFIX)
    directory.mkdir(parents=True, exist_ok=True)
    have = part.stat().st_size if part.exists() else 0
    if have >= entry.bytes:  # complete or overlong: check it as it is
        have = entry.bytes if have == entry.bytes else _restart(part)
    received = 0
    if have < entry.bytes:
        received = await _receive(f"{base}/api/data/shard/{entry.name}", part, have, entry.bytes, timeout_s)
    try:
        await asyncio.to_thread(verify_shard, part, entry)
    except ShardMismatch:
        part.unlink(missing_ok=True)
        raise
    part.replace(final)
    return received


def _restart(part: Path) -> int:
    part.unlink(missing_ok=True)
    return 0


async def _receive(url: str, part: Path, have: int, total: int, timeout_s: float) -> int:
    headers = {"Range": f"bytes={have}-"} if have else {}
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    async with (
        aiohttp.ClientSession(timeout=timeout) as session,
        session.get(url, headers=headers) as response,
    ):
        if response.status == 200 and have:  # no ranges here: start over
            logger.info("%s ignored the Range request: downloading from the start", url)
            have = 0
        elif response.status not in (200, 206):
            raise DataError(f"{url} answered HTTP {response.status}")
        received = 0
        with part.open("r+b" if have else "wb") as out:
            out.seek(have)
            out.truncate()
            async for chunk in response.content.iter_chunked(CHUNK_BYTES):
                if have + received + len(chunk) > total:
                    raise ShardMismatch(f"{url} sent more than the {total} bytes the index names")
                out.write(chunk)
                received += len(chunk)
    return received


async def ensure_shards(index: ShardIndex, names: Sequence[str], source: ShardSource) -> list[Path]:
    """Local, verified paths of the shards `names` (mirror, cache, else downloaded); DataError if one cannot be
    had from any source after `source.attempts` rounds."""
    return [await _ensure_one(index.entry(name), source) for name in names]


async def _ensure_one(entry: ShardEntry, source: ShardSource) -> Path:
    for path in _local_candidates(entry, source):
        try:
            await asyncio.to_thread(verify_shard, path, entry)
            return path
        except ShardMismatch:  # logged by verify_shard
            if path.parent == source.cache:
                path.unlink(missing_ok=True)  # ours: drop it and fetch again
        except OSError:
            continue
    reason = "no bootstrap HTTP address known"
    for attempt in range(source.attempts):
        for base in source.bases:
            try:
                received = await download_shard(base, entry, source.cache, source.timeout_s)
            except (DataError, OSError, aiohttp.ClientError, asyncio.TimeoutError) as e:
                logger.warning("shard %s from %s (try %d): %s", entry.name[:12], base, attempt + 1, e)
                reason = f"{base}: {e or type(e).__name__}"
                continue
            logger.info("shard %s: %d bytes fetched from %s", entry.name[:12], received, base)
            return shard_path(source.cache, entry.name)
    raise DataError(f"could not obtain shard {entry.name[:12]}: {reason}")


def _local_candidates(entry: ShardEntry, source: ShardSource) -> list[Path]:
    paths = [shard_path(source.mirror, entry.name)] if source.mirror is not None else []
    paths.append(shard_path(source.cache, entry.name))
    return [p for p in paths if p.is_file()]
