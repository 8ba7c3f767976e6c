"""HTTP bodies larger than one network read arrive whole (node.swarm.http_client.read_bounded): a real aiohttp
server on loopback, the node's real fetches. The negative control is aiohttp's `StreamReader.read(n)`, which the
fetches used: it returned the first buffered piece, and a 229 KB tokenizer (an 8k BPE) was refused as another
vocabulary, so no BPE run of that size could be joined."""

from __future__ import annotations

import asyncio
import os
import random
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

import aiohttp
import pytest
from aiohttp import web

from node.ml.tokenizer import MAX_TOKENIZER_BYTES, tokenizer_spec, train_bpe
from node.swarm.http_client import read_bounded
from node.swarm.tokenizer_fetch import fetch_tokenizer

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

BODY = os.urandom(2**20)
PIECE_BYTES = 32 * 1024


@asynccontextmanager
async def serving(body: bytes) -> AsyncIterator[str]:
    """An aiohttp server on 127.0.0.1:0 answering `body` at /blob in 32 KiB pieces a few ms apart (as a body
    arrives over a real link: on loopback a whole body may sit in the buffer before the first read); yields the
    URL."""

    async def blob(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "application/octet-stream"})
        response.content_length = len(body)
        await response.prepare(request)
        for start in range(0, len(body), PIECE_BYTES):
            await response.write(body[start : start + PIECE_BYTES])
            await asyncio.sleep(0.002)
        await response.write_eof()
        return response

    app = web.Application()
    app.router.add_get("/blob", blob)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    try:
        yield f"http://127.0.0.1:{port}/blob"
    finally:
        await runner.cleanup()


async def _get(url: str, read: Callable[[aiohttp.StreamReader], Awaitable[bytes]]) -> bytes:
    async with aiohttp.ClientSession() as session, session.get(url) as response:
        return await read(response.content)


def test_a_body_of_several_reads_arrives_whole_and_the_old_read_cut_it() -> None:
    async def main() -> tuple[bytes, bytes, bytes]:
        async with serving(BODY) as url:
            whole = await _get(url, lambda c: read_bounded(c, len(BODY) + 1))
            capped = await _get(url, lambda c: read_bounded(c, 1000))
            old = await _get(url, lambda c: c.read(len(BODY) + 1))  # the negative control
        return whole, capped, old

    whole, capped, old = asyncio.run(main())
    assert whole == BODY
    assert capped == BODY[:1000]  # past the caller's maximum: no more is read
    assert len(old) < len(BODY), "aiohttp's read(n) returned the whole body: the control shows nothing"


def test_a_bpe_tokenizer_larger_than_one_read_is_fetched_and_verified() -> None:
    rng = random.Random(0)
    words = [
        "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(2, 9)))
        for _ in range(5000)
    ]
    texts = iter([" ".join(rng.choice(words) for _ in range(2000)) for _ in range(200)])
    blob = train_bpe(texts, 4096, show_progress=False)
    assert 2**16 < len(blob) <= MAX_TOKENIZER_BYTES  # more than one network read
    spec = tokenizer_spec(blob)

    async def main() -> str:
        async with serving(blob) as url:
            tokenizer = await fetch_tokenizer(url, spec, timeout_s=30.0)
        return str(tokenizer.sha256)

    assert asyncio.run(main()) == spec["sha256"]
