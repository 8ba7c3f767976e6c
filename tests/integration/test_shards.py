"""Token shards end to end: a real bootstrap serves a prepared folder (`--data-dir`), a real learner downloads its
assigned shards into its state dir, refuses a corrupt cached shard and fetches it again, and trains on them; the
syncer measures its held-out loss on the held-out shards alone;
the fetcher resumes a partial download with a Range request and refuses a shard the bootstrap serves wrong."""

from __future__ import annotations

import asyncio
import hashlib
from dataclasses import replace
from pathlib import Path

import pytest

from node.ml.prepare import PrepareConfig, TokenizerInfo, prepare
from node.ml.shards import ShardIndex, file_sha256, shard_path
from node.swarm.shard_fetch import PART_SUFFIX, ShardSource, download_shard, ensure_shards, obtain_index
from protocol.errors import DataError, ShardMismatch
from protocol.identity import NodeIdentity
from tests.integration.procs import Bootstrap, RunSpec, procs, read_events, wait_until, write_node_toml

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

RUN = RunSpec(name="shards-test", seed=5)


def _prepared(root: Path) -> tuple[Path, ShardIndex]:
    corpus = root / "corpus"
    corpus.mkdir()
    for n in range(6):
        words = (hashlib.sha256(f"{n}/{i}".encode()).hexdigest() for i in range(1500))
        (corpus / f"doc{n}.txt").write_text("\n".join(f"{i} {w}" for i, w in enumerate(words)))
    out = root / "prepared"
    index = prepare([corpus], out, TokenizerInfo(), PrepareConfig(shard_tokens=32_768, heldout_shards=2))
    return out, index


def _corrupt(path: Path, offset: int = 100) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0xFF
    path.write_bytes(bytes(data))


def _source(cache: Path, bootstrap: Bootstrap) -> ShardSource:
    return ShardSource(cache=cache, bases=[bootstrap.http_url], timeout_s=20.0, attempts=2)


def test_bootstrap_serves_shards_and_a_learner_trains_on_verified_ones(tmp_path: Path) -> None:
    prepared, index = _prepared(tmp_path)
    assert len(index.train) >= 4
    syncer_key = tmp_path / "syncer.key"
    spec = replace(RUN, authorized_syncers=(NodeIdentity.load_or_create(syncer_key).peer_id,))
    run = spec.write_run_toml(tmp_path / "run.toml")
    node_toml = write_node_toml(
        tmp_path / "node.toml", learner={"min_step_s": 0.3}, syncer={"eval_every_merges": 1}
    )
    learner_state = tmp_path / "learner"
    seeded = shard_path(learner_state / "data", index.train[0].name)  # a cached shard gone bad on disk
    seeded.parent.mkdir(parents=True)
    seeded.write_bytes(shard_path(prepared, index.train[0].name).read_bytes())
    _corrupt(seeded)
    with procs(tmp_path) as group:
        bootstrap = group.start_bootstrap("--run", str(run), "--data-dir", str(prepared), state="bootstrap")
        assert bootstrap.swarm()["settings"]["data"] == {"source": "shards", "index_sha256": index.sha256()}
        syncer = group.join_node(bootstrap, "syncer", identity=syncer_key, config=node_toml, state="syncer")
        learner = group.join_node(bootstrap, "learner", config=node_toml, state="learner", max_steps=100_000)
        events = wait_until(
            lambda: read_events(learner_state, "learner_shards"), 90, what="the learner's shards"
        )
        assert events[0]["shards"] == len(
            index.train
        )  # the only learner: every training shard, no held-out one
        wait_until(lambda: (learner.try_status().get("inner_step") or 0) >= 2, 60, what="training steps")
        for entry in index.shards:  # all there, and all verified (the corrupt one replaced)
            assert file_sha256(shard_path(learner_state / "data", entry.name)) == entry.name
        # the syncer's held-out loss is measured on the held-out shards, and it fetched nothing else
        wait_until(
            lambda: syncer.try_status().get("held_out_loss") is not None, 60, what="syncer held-out loss"
        )
        fetched = {p.name.removesuffix(".tokens") for p in (tmp_path / "syncer" / "data").glob("*.tokens")}
        assert fetched == set(index.heldout)
        log = learner.stderr_path.read_text()
        assert "refused" in log and index.train[0].name[:12] in log, log[-3000:]
        asyncio.run(_resume_and_refuse(tmp_path / "fetch", bootstrap, prepared, index))


async def _resume_and_refuse(cache: Path, bootstrap: Bootstrap, prepared: Path, index: ShardIndex) -> None:
    source = _source(cache, bootstrap)
    assert await obtain_index(index.sha256(), source) == index
    with pytest.raises(DataError):
        await obtain_index("0" * 64, _source(cache / "other", bootstrap))  # not the index it serves
    # Range resume: half the shard already on disk, only the rest comes over the wire
    entry = index.train[1]
    whole = shard_path(prepared, entry.name).read_bytes()
    cache.mkdir(parents=True, exist_ok=True)
    part = shard_path(cache, entry.name).with_name(f"{entry.name}.tokens{PART_SUFFIX}")
    part.write_bytes(whole[: len(whole) // 2])
    received = await download_shard(bootstrap.http_url, entry, cache, 20.0)
    assert received == len(whole) - len(whole) // 2
    assert shard_path(cache, entry.name).read_bytes() == whole and not part.exists()
    # a resumed download whose first half is corrupt is refused as a whole and the part deleted
    other = index.train[2]
    bad = bytearray(shard_path(prepared, other.name).read_bytes()[: other.bytes // 2])
    bad[7] ^= 1
    part = shard_path(cache, other.name).with_name(f"{other.name}.tokens{PART_SUFFIX}")
    part.write_bytes(bytes(bad))
    with pytest.raises(ShardMismatch):
        await download_shard(bootstrap.http_url, other, cache, 20.0)
    assert not part.exists()
    # served wrong: the bootstrap's copy corrupted (same size): refused on every try, never placed in the cache
    victim = index.train[3]
    _corrupt(shard_path(prepared, victim.name))
    with pytest.raises(DataError, match="could not obtain shard"):
        await ensure_shards(index, [victim.name], source)
    assert not shard_path(cache, victim.name).exists()
