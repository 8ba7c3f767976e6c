"""`python -m node export --from URL`: what a syncer's status server hands out, and the checks the fetching side
makes on it (owner signature, checkpoint content hash, tokenizer pin). A real aiohttp server on loopback."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from aiohttp import ClientSession, web

from node.ml.checkpoint import CheckpointStore, SyncerSnapshot
from node.ml.export import checkpoint_params
from node.status.export import ExportFetchError, ExportFiles, FetchedExport, add_export_routes, fetch_export
from protocol.identity import NodeIdentity
from protocol.manifest import SignedManifest, default_manifest

pytestmark = pytest.mark.timeout(60)

OWNER = NodeIdentity.generate()
SIGNED = SignedManifest.sign(default_manifest(), OWNER)


def _store(root: Path) -> CheckpointStore:
    store = CheckpointStore(root / "syncer", SIGNED.run_id)
    params = {"w": torch.arange(6, dtype=torch.float32).reshape(2, 3)}
    store.save(SyncerSnapshot(run_id=SIGNED.run_id, term=1, versions=(3,), params=params, momentum={}))
    return store


def _serve_and_fetch(files: ExportFiles | None, work: Path, url_suffix: str = "") -> FetchedExport:
    async def scenario() -> FetchedExport:
        app = web.Application()
        add_export_routes(app, lambda: files)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        host, port = runner.addresses[0][:2]
        try:
            return await asyncio.to_thread(
                fetch_export, f"http://{host}:{port}{url_suffix}", work, timeout_s=10
            )
        finally:
            await runner.cleanup()

    return asyncio.run(asyncio.wait_for(scenario(), 30))


def test_fetch_gives_the_newest_checkpoint_checked_and_the_signed_run(tmp_path: Path) -> None:
    store = _store(tmp_path)
    fetched = _serve_and_fetch(ExportFiles(SIGNED, store, None), tmp_path / "work")
    assert fetched.run_id == SIGNED.run_id and fetched.owner == OWNER.peer_id
    assert fetched.checkpoint.read_bytes() == store.paths()[0].read_bytes()
    assert torch.equal(checkpoint_params(fetched.checkpoint)["w"], torch.arange(6.0).reshape(2, 3))
    assert fetched.tokenizer is None  # a byte-level run


def _flip_a_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-1] ^= 0x01  # a tensor byte: the file still loads, its content no longer matches its name
    path.write_bytes(bytes(data))


def test_a_damaged_checkpoint_is_refused_by_its_content_name(tmp_path: Path) -> None:
    store = _store(tmp_path)
    _flip_a_byte(store.paths()[0])
    with pytest.raises(ExportFetchError, match="does not match its name"):
        _serve_and_fetch(ExportFiles(SIGNED, store, None), tmp_path / "work")
    assert not any((tmp_path / "work").glob("*.safetensors"))  # nothing refused is left behind


@pytest.mark.parametrize(
    "tamper, message",
    [
        (lambda s: replace(s, signature=bytes(64)), "not signed by its claimed owner"),
        (lambda s: replace(s, owner=NodeIdentity.generate().peer_id), "not signed by its claimed owner"),
    ],
)
def test_a_manifest_without_its_owners_signature_is_refused(
    tmp_path: Path, tamper: Callable[[SignedManifest], SignedManifest], message: str
) -> None:
    store = _store(tmp_path)
    with pytest.raises(ExportFetchError, match=message):
        _serve_and_fetch(ExportFiles(tamper(SIGNED), store, None), tmp_path / "work")


def test_a_node_with_nothing_to_export_says_why(tmp_path: Path) -> None:
    with pytest.raises(ExportFetchError, match="not a syncer"):
        _serve_and_fetch(ExportFiles(SIGNED, None, None), tmp_path / "work")
    empty = CheckpointStore(tmp_path / "empty", SIGNED.run_id)
    with pytest.raises(ExportFetchError, match="no checkpoint written yet"):
        _serve_and_fetch(ExportFiles(SIGNED, empty, None), tmp_path / "work")
    with pytest.raises(ExportFetchError, match="HTTP 404"):
        _serve_and_fetch(None, tmp_path / "work")


def test_only_listed_checkpoints_are_served(tmp_path: Path) -> None:
    """The name in the URL is matched against the store's listing; it never becomes a path."""
    store = _store(tmp_path)
    (tmp_path / "syncer" / "secret.txt").write_text("not for export")
    listed = store.paths()[0].name
    names = [listed, "..%2Fsecret.txt", "secret.txt", listed.replace("-", "_")]

    async def scenario() -> list[int]:
        app = web.Application()
        add_export_routes(app, lambda: ExportFiles(SIGNED, store, None))
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        host, port = runner.addresses[0][:2]
        codes = []
        try:
            async with ClientSession() as session:
                for name in names:
                    url = f"http://{host}:{port}/api/export/checkpoint/{name}"
                    async with session.get(url) as response:
                        codes.append(response.status)
        finally:
            await runner.cleanup()
        return codes

    assert asyncio.run(asyncio.wait_for(scenario(), 30)) == [
        200,
        404,
        404,
        404,
    ]  # the listed one: the control
