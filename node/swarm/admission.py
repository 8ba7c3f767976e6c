"""A node's side of admission (protocol.admission): solve the run's proof-of-work once, cache it, hand it to the
sync transport that sends it with every push.

The proof is bound to the run id and to our peer id, so it is cached in the state dir (`admission.json`, keyed
by both) and survives restarts: a node pays once per identity and run. A cached proof of fewer bits than the
manifest asks now (the owner raised the difficulty) is solved again. Solving runs in a worker thread, with its
progress in the log (expected 2^pow_bits hashes; 22 bits: a few seconds of one core).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from protocol.admission import AdmissionRefused, AdmissionSpec, solve, verify_admission
from protocol.manifest import write_atomically

if TYPE_CHECKING:
    from node.context import NodeContext

logger = logging.getLogger(__name__)
ADMISSION_FILE = "admission.json"
PROGRESS_EVERY = 1 << 21  # hashes between two progress lines (about 2 s of one core)


def _key(run_id: str, peer_id: str) -> str:
    return f"{run_id}/{peer_id}"


def _load(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def cached_nonce(state_dir: Path, spec: AdmissionSpec, run_id: str, peer_id: str) -> int | None:
    """The cached nonce for (run, peer), if it still passes the manifest's difficulty."""
    entry = _load(state_dir / ADMISSION_FILE).get(_key(run_id, peer_id))
    if not isinstance(entry, dict):
        return None
    nonce = entry.get("nonce")
    try:
        verify_admission(spec, run_id, peer_id, nonce)
    except AdmissionRefused:
        return None
    return nonce if type(nonce) is int else None


def store_nonce(state_dir: Path, run_id: str, peer_id: str, nonce: int, bits: int) -> None:
    path = state_dir / ADMISSION_FILE
    data = _load(path)
    data[_key(run_id, peer_id)] = {"nonce": nonce, "bits": bits, "solved_at": round(time.time(), 3)}
    state_dir.mkdir(parents=True, exist_ok=True)
    write_atomically(path, json.dumps(data, indent=1, sort_keys=True))


def obtain_proof(state_dir: Path, spec: AdmissionSpec, run_id: str, peer_id: str) -> int | None:
    """The push meta's admission value: the nonce of the cached proof or of a new one (solved here, blocking);
    None when the run asks for no proof (open, or an allow-list: the syncer checks our peer id)."""
    if spec.mode != "pow":
        return None
    nonce = cached_nonce(state_dir, spec, run_id, peer_id)
    if nonce is not None:
        logger.info("admission: cached proof-of-work of %d bits for this run", spec.pow_bits)
        return nonce
    expected = 2**spec.pow_bits
    logger.info(
        "admission: solving the run's proof-of-work (%d bits, ~%d hashes expected)", spec.pow_bits, expected
    )
    started = time.monotonic()

    def progress(tried: int) -> None:
        logger.info(
            "admission: %.1f M hashes tried (%.0f%% of the expected), %.1f s",
            tried / 1e6,
            100.0 * tried / expected,
            time.monotonic() - started,
        )

    nonce = solve(run_id, peer_id, spec.pow_bits, progress=progress, progress_every=PROGRESS_EVERY)
    elapsed = time.monotonic() - started
    logger.info("admission: proof-of-work solved in %.1f s (nonce %d), cached", elapsed, nonce)
    store_nonce(state_dir, run_id, peer_id, nonce, spec.pow_bits)
    return nonce


async def admission_meta(ctx: NodeContext) -> int | None:
    """`obtain_proof` for this node, in a worker thread (the node keeps heartbeating while it solves)."""
    spec: AdmissionSpec = ctx.manifest.admission
    started = time.monotonic()
    meta = await asyncio.to_thread(
        obtain_proof, Path(ctx.config.state_dir), spec, ctx.run_id, ctx.identity.peer_id
    )
    # our heartbeats carry it from now on (membership.build_heartbeat)
    ctx.admission_proof = meta
    if meta is not None:
        ctx.events.emit("admission_proof", bits=spec.pow_bits, seconds=round(time.monotonic() - started, 3))
    return meta
