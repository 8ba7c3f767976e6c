"""What a running syncer gives to `python -m node export --from URL`: its newest checkpoint, the signed run
manifest and the run's tokenizer, over the node's status HTTP server, and the client side that fetches and
checks them.

Nothing read over HTTP is trusted as it is: the manifest must carry its owner's signature, the checkpoint's
bytes must hash to its content-addressed name (node.ml.checkpoint.CheckpointStore), and the tokenizer must hash
to the manifest's pin. Checkpoints are safetensors, never pickles.
"""

from __future__ import annotations

import json
import logging
import re
import shutil
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from aiohttp import web

from node.ml.checkpoint import CheckpointError, CheckpointStore
from node.ml.tokenizer import TokenizerMismatch, verify_tokenizer
from protocol.errors import ManifestRejected
from protocol.manifest import RunManifest, SignedManifest

logger = logging.getLogger(__name__)

_CHECKPOINT_NAME = re.compile(r"syncer-[0-9a-f]{16}-[0-9a-f]{16}\.safetensors")
MAX_EXPORT_INDEX_BYTES = 1 << 20


class ExportFetchError(ValueError):
    """The URL gave nothing exportable, or something that failed a check (signature, hash, shape)."""


@dataclass(frozen=True, slots=True)
class ExportFiles:
    """What this node can hand out: always the signed manifest; a checkpoint store on a syncer."""

    signed_manifest: SignedManifest
    checkpoints: CheckpointStore | None
    tokenizer: bytes | None

    def newest_checkpoint(self) -> Path | None:
        if self.checkpoints is None:
            return None
        found = [p for p in self.checkpoints.paths() if _CHECKPOINT_NAME.fullmatch(p.name)]
        return found[0] if found else None


ExportSource = Callable[[], ExportFiles]


def add_export_routes(app: web.Application, source: Callable[[], ExportFiles | None]) -> None:
    """`GET /api/export` (index), `/api/export/checkpoint/<name>` (the file), `/api/export/tokenizer`."""

    def files_or_404() -> ExportFiles:
        files = source()
        if files is None:
            raise web.HTTPNotFound(text=json.dumps({"error": "this node exports nothing"}))
        return files

    async def index(_request: web.Request) -> web.Response:
        files = files_or_404()
        newest = files.newest_checkpoint()
        reason = None
        if newest is None:
            reason = "not a syncer" if files.checkpoints is None else "no checkpoint written yet"
        return web.json_response(
            {
                "run_id": files.signed_manifest.run_id,
                "manifest": files.signed_manifest.to_b64(),
                "checkpoint": None if newest is None else newest.name,
                "tokenizer": files.tokenizer is not None,
                "reason": reason,
            }
        )

    async def checkpoint(request: web.Request) -> web.StreamResponse:
        files = files_or_404()
        name = request.match_info["name"]
        # only a file the store lists right now: the name never reaches the filesystem as a path
        wanted = [p for p in (files.checkpoints.paths() if files.checkpoints else []) if p.name == name]
        if not wanted or not _CHECKPOINT_NAME.fullmatch(name):
            raise web.HTTPNotFound(text=json.dumps({"error": f"no checkpoint {name!r} (pruned?)"}))
        return web.FileResponse(wanted[0])

    async def tokenizer(_request: web.Request) -> web.Response:
        files = files_or_404()
        if files.tokenizer is None:
            raise web.HTTPNotFound(text=json.dumps({"error": "the run has no BPE tokenizer (raw bytes)"}))
        return web.Response(body=files.tokenizer, content_type="application/json")

    app.router.add_get("/api/export", index)
    app.router.add_get("/api/export/checkpoint/{name}", checkpoint)
    app.router.add_get("/api/export/tokenizer", tokenizer)


@dataclass(frozen=True, slots=True)
class FetchedExport:
    manifest: RunManifest
    run_id: str
    owner: str
    checkpoint: Path
    tokenizer: bytes | None


def fetch_export(url: str, workdir: Path, *, timeout_s: float = 60.0) -> FetchedExport:
    """Fetch and check what a syncer's status server exports; the checkpoint lands in `workdir`."""
    base = url.rstrip("/")
    index = _get_json(f"{base}/api/export", timeout_s)
    try:
        signed = SignedManifest.from_b64(index.get("manifest"))
        manifest = signed.verify()
    except ManifestRejected as e:
        raise ExportFetchError(f"{url}: the run manifest is refused: {e}") from None
    if index.get("run_id") != signed.run_id:
        raise ExportFetchError(f"{url}: run id {index.get('run_id')!r} is not the signed manifest's")
    name = index.get("checkpoint")
    if not isinstance(name, str) or not _CHECKPOINT_NAME.fullmatch(name):
        why = index.get("reason") or "no checkpoint named"
        raise ExportFetchError(f"{url}: nothing to export yet ({why}); export from the syncer once it merged")
    store = CheckpointStore(workdir, signed.run_id)
    if not name.startswith(f"syncer-{signed.run_id[:16]}-"):
        raise ExportFetchError(f"{url}: checkpoint {name} is not of run {signed.run_id[:16]}")
    path = workdir / name
    _download(f"{base}/api/export/checkpoint/{name}", path, timeout_s)
    try:
        store.check_hash(path)
    except CheckpointError as e:
        path.unlink(missing_ok=True)
        raise ExportFetchError(f"{url}: {e}") from None
    blob = _tokenizer(base, manifest, timeout_s) if manifest.tokenizer else None
    return FetchedExport(manifest, signed.run_id, signed.owner, path, blob)


def _tokenizer(base: str, manifest: RunManifest, timeout_s: float) -> bytes:
    blob = _get_bytes(f"{base}/api/export/tokenizer", timeout_s, limit=64 << 20)
    try:
        verify_tokenizer(blob, manifest.tokenizer)
    except TokenizerMismatch as e:
        raise ExportFetchError(f"{base}: the tokenizer is refused: {e}") from None
    return blob


def _get_json(url: str, timeout_s: float) -> dict[str, Any]:
    body = _get_bytes(url, timeout_s, limit=MAX_EXPORT_INDEX_BYTES)
    try:
        doc = json.loads(body)
    except ValueError as e:
        raise ExportFetchError(f"{url}: not JSON ({e})") from None
    if not isinstance(doc, dict):
        raise ExportFetchError(f"{url}: expected a JSON object")
    return doc


def _open(url: str, timeout_s: float) -> Any:
    if not url.startswith(("http://", "https://")):
        raise ExportFetchError(f"{url}: --from takes the syncer's status URL (http://host:port)")
    try:
        return urllib.request.urlopen(url, timeout=timeout_s)  # noqa: S310 (scheme checked above)
    except urllib.error.HTTPError as e:
        detail = e.read(4096).decode(errors="replace")
        raise ExportFetchError(f"{url}: HTTP {e.code} {detail}") from None
    except (urllib.error.URLError, OSError) as e:
        raise ExportFetchError(f"{url}: cannot reach it ({getattr(e, 'reason', e)})") from None


def _get_bytes(url: str, timeout_s: float, *, limit: int) -> bytes:
    with _open(url, timeout_s) as response:
        body: bytes = response.read(limit + 1)
    if len(body) > limit:
        raise ExportFetchError(f"{url}: answer larger than {limit} bytes")
    return body


def _download(url: str, path: Path, timeout_s: float) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with _open(url, timeout_s) as response, open(path, "wb") as out:
        shutil.copyfileobj(response, out, length=8 << 20)
    logger.info("downloaded %s (%d bytes)", path.name, path.stat().st_size)
