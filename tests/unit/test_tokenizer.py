"""The run's BPE tokenizer: training, the manifest's hash and vocabulary, the fetch by hash, and refusal of
a tokenizer that is not the one the signed manifest names (with the negative control: unchecked, the wrong
vocabulary would be trained on)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
import torch
from aiohttp import web

from node.ml.data import load_corpus
from node.ml.tokenizer import Tokenizer, tokenizer_sha256, tokenizer_spec, train_bpe, verify_tokenizer
from node.swarm.tokenizer_fetch import obtain_tokenizer, tokenizer_urls
from protocol.errors import TokenizerMismatch
from protocol.manifest import RunManifest, parse_run_toml

TEXTS = [f"def function_{i}(x):\n    return x * {i} + total_{i % 7}\n" for i in range(400)]


@pytest.fixture(scope="module")
def blob() -> bytes:
    return train_bpe(iter(TEXTS), 300, show_progress=False)


def _tampered(blob: bytes) -> bytes:
    """The same vocabulary size with the ids of two tokens of TEXTS[0] swapped: loads, encodes differently."""
    doc = json.loads(blob)
    vocab = doc["model"]["vocab"]
    used = list(dict.fromkeys(Tokenizer(blob).encode(TEXTS[0].encode())))[:2]
    a, b = (token for token, index in vocab.items() if index in used)
    vocab[a], vocab[b] = vocab[b], vocab[a]
    return json.dumps(doc).encode()


def test_trained_bpe_round_trips_bytes_and_compresses(blob: bytes) -> None:
    tokenizer = Tokenizer(blob)
    assert tokenizer.vocab_size == 300 and tokenizer.end_of_text is not None
    text = "def function_3(x):\n    return x * 3 + total_3\n"
    ids = tokenizer.encode(text.encode())
    assert tokenizer.decode(ids) == text
    assert len(ids) < len(text.encode()) / 2  # merges learned: far fewer tokens than bytes
    assert all(0 <= i < 300 for i in tokenizer.encode("ünïcödé ✓ never seen".encode()))  # bytes fall back


def test_verify_refuses_another_tokenizer_negative_control_shows_it_would_differ(blob: bytes) -> None:
    spec = tokenizer_spec(blob)
    assert verify_tokenizer(blob, spec).sha256 == spec["sha256"]
    bad = _tampered(blob)
    with pytest.raises(TokenizerMismatch, match="sha256"):
        verify_tokenizer(bad, spec)
    # negative control: the tampered file is a working tokenizer of the same size that tokenizes the same
    # text differently, so without the hash check a peer would silently train on another vocabulary
    unchecked = Tokenizer(bad)
    sample = " ".join(TEXTS[:20]).encode()
    assert unchecked.vocab_size == spec["vocab_size"]
    assert unchecked.encode(sample) != Tokenizer(blob).encode(sample)


def test_manifest_signs_hash_and_vocabulary_and_sizes_the_model_from_it(blob: bytes) -> None:
    spec = tokenizer_spec(blob)
    manifest = RunManifest(tokenizer=spec)
    assert manifest.model["vocab_size"] == 300
    assert RunManifest.from_canonical_bytes(manifest.to_canonical_bytes()) == manifest
    assert RunManifest().model["vocab_size"] == 256  # no tokenizer: raw bytes
    with pytest.raises(ValueError, match="vocab_size"):
        RunManifest(tokenizer=spec, model={"vocab_size": 256})
    with pytest.raises(ValueError, match="sha256"):
        RunManifest(tokenizer={"sha256": "zz", "vocab_size": 300})
    toml = f'[tokenizer]\nsha256 = "{spec["sha256"]}"\nvocab_size = 300\n'
    assert parse_run_toml(toml).model["vocab_size"] == 300


def test_corpus_encodes_with_the_run_tokenizer(blob: bytes) -> None:
    corpus = load_corpus(None)
    tokenizer = Tokenizer(blob)
    raw = corpus.validation_stream()
    encoded = corpus.with_encoder(tokenizer.encode).validation_stream()
    assert 0 < len(encoded) < len(raw)
    assert int(encoded.tokens.max()) < 300
    inputs, targets = encoded.windows(torch.tensor([0, 5]), 8)
    assert inputs.dtype == torch.int64 and torch.equal(inputs[:, 1:], targets[:, :-1])


def test_fetch_by_hash_verifies_caches_and_refuses_a_wrong_blob(blob: bytes, tmp_path: Path) -> None:
    spec = tokenizer_spec(blob)
    served = {"blob": blob}

    async def handler(request: web.Request) -> web.Response:
        return web.Response(body=served["blob"])

    async def scenario() -> None:
        app = web.Application()
        app.router.add_get("/api/tokenizer/{sha256}", handler)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = runner.addresses[0][1]
        try:
            urls = tokenizer_urls(spec["sha256"], [f"http://127.0.0.1:{port}/api/swarm"], [])
            assert urls == [f"http://127.0.0.1:{port}/api/tokenizer/{spec['sha256']}"]
            served["blob"] = _tampered(blob)  # a bootstrap (or a proxy) serving another tokenizer
            with pytest.raises(TokenizerMismatch, match="could not obtain"):
                await obtain_tokenizer(spec, tmp_path / "a", urls, timeout_s=5)
            assert not list((tmp_path).glob("*/tokenizer-*.json")), "a refused blob is never cached"
            # negative control: asked for the tampered blob's own hash, the same server is accepted
            bad_spec = {"sha256": tokenizer_sha256(served["blob"]), "vocab_size": 300}
            assert (await obtain_tokenizer(bad_spec, tmp_path / "b", urls, timeout_s=5)) is not None
            served["blob"] = blob
            got = await obtain_tokenizer(spec, tmp_path / "c", urls, timeout_s=5)
            assert got is not None and got.sha256 == spec["sha256"]
            assert (tmp_path / "c" / f"tokenizer-{spec['sha256']}.json").read_bytes() == blob
            served["blob"] = b"{}"  # the server goes bad: the verified cache answers
            again = await obtain_tokenizer(spec, tmp_path / "c", urls, timeout_s=5)
            assert again is not None and again.sha256 == spec["sha256"]
        finally:
            await runner.cleanup()

    asyncio.run(asyncio.wait_for(scenario(), 30))


def test_no_tokenizer_means_raw_bytes(tmp_path: Path) -> None:
    assert asyncio.run(obtain_tokenizer({}, tmp_path, [], timeout_s=1)) is None
