"""The run's token shards, served by the bootstrap: `GET /api/data/index` (the index whose sha256 the signed
manifest names) and `GET /api/data/shard/<sha256>` (one shard, with HTTP Range, so a download resumes).

`--data-dir DIR` points at a folder `python -m bootstrap data prepare` wrote. Its index joins the manifest as
`data = {source = "shards", index_sha256 = ...}` (part of the run's identity), after checking that it was cut
with the run's tokenizer. Peers verify every byte against the manifest, so serving is plain file serving.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from pathlib import Path

from aiohttp import web

from node.config import BootstrapConfig
from node.ml.shards import BYTE_TOKENIZER, INDEX_FILENAME, ShardIndex, parse_index, shard_path
from protocol.errors import ConfigError, DataError
from protocol.manifest import SHARDS_SOURCE, RunManifest, Scalar

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class ServedData:
    directory: Path
    index: ShardIndex
    index_blob: bytes
    index_sha256: str


def load_data(config: BootstrapConfig, manifest: RunManifest) -> tuple[RunManifest, ServedData | None]:
    """The manifest naming `--data-dir`'s index, and what to serve (None: the run's data spec as it is)."""
    if config.data_dir is None:
        if manifest.data.get("source") == SHARDS_SOURCE:
            raise ConfigError('run.toml trains on data source "shards": start the bootstrap with --data-dir')
        return manifest, None
    where = f"--data-dir {config.data_dir}"
    try:
        blob = (config.data_dir / INDEX_FILENAME).read_bytes()
        index = parse_index(blob)
    except (OSError, DataError) as e:
        raise ConfigError(f"{where}: {e}") from None
    served = ServedData(config.data_dir, index, blob, index.sha256())
    _check_against_run(where, served, manifest)
    data: dict[str, Scalar] = {"source": SHARDS_SOURCE, "index_sha256": served.index_sha256}
    if manifest.data.get("source") == SHARDS_SOURCE and dict(manifest.data) != data:
        raise ConfigError(f"{where} holds index {served.index_sha256}, run.toml names {manifest.data}")
    logger.info(
        "serving %d token shards (%d held out) of index %s from %s",
        len(index.shards),
        len(index.heldout),
        served.index_sha256[:12],
        config.data_dir,
    )
    return dataclasses.replace(manifest, data=data), served


def _check_against_run(where: str, served: ServedData, manifest: RunManifest) -> None:
    index = served.index
    run_tokenizer = str(manifest.tokenizer.get("sha256", BYTE_TOKENIZER))
    if index.tokenizer != run_tokenizer:
        raise ConfigError(
            f"{where} was cut with tokenizer {index.tokenizer[:12]}, the run's is {run_tokenizer[:12]}: prepare "
            "it again with the run's --tokenizer"
        )
    if index.vocab_size != manifest.model["vocab_size"]:
        raise ConfigError(
            f"{where}: vocabulary {index.vocab_size}, the run's is {manifest.model['vocab_size']}"
        )
    for entry in index.shards:  # sizes only: hashing a large corpus at every start would take minutes
        path = shard_path(served.directory, entry.name)
        if not path.is_file() or path.stat().st_size != entry.bytes:
            raise ConfigError(f"{where}: shard {entry.name} is missing or has the wrong size")


class DataApi:
    """The two routes; every request names what it wants by hash, anything else is 404."""

    def __init__(self, served: ServedData) -> None:
        self.served = served
        self._names = {entry.name for entry in served.index.shards}

    def add_routes(self, app: web.Application) -> None:
        app.router.add_get("/api/data/index", self._handle_index)
        app.router.add_get("/api/data/shard/{name}", self._handle_shard)

    async def _handle_index(self, _request: web.Request) -> web.Response:
        return web.Response(
            body=self.served.index_blob,
            content_type="application/json",
            headers={"X-Index-Sha256": self.served.index_sha256},
        )

    async def _handle_shard(self, request: web.Request) -> web.StreamResponse:
        name = request.match_info["name"]
        if name not in self._names:
            return web.Response(status=404, text="no such shard in this run\n")
        return web.FileResponse(shard_path(self.served.directory, name))
