"""Reading an HTTP body whole, within a bound: what the tokenizer, shard-index and syncer-status fetches share.

aiohttp's `StreamReader.read(n)` returns what is buffered, up to n bytes, not the body up to n: a tokenizer of
229 KB (an 8k BPE) came back cut at the first network read and was refused as "another vocabulary".
"""

from __future__ import annotations

import aiohttp

CHUNK_BYTES = 1 << 16


async def read_bounded(content: aiohttp.StreamReader, limit: int) -> bytes:
    """The body to its end, or its first `limit` bytes when it is longer (callers pass their maximum + 1 and
    refuse a body of more than the maximum without reading the rest)."""
    chunks: list[bytes] = []
    total = 0
    async for chunk in content.iter_chunked(CHUNK_BYTES):
        chunks.append(chunk)
        total += len(chunk)
        if total >= limit:
            break
    return b"".join(chunks)[:limit]
