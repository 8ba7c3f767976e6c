"""The syncer's durable state: global fragments, outer momentum and fragment versions in one safetensors file.

Layout: tensors `param/<name>` (the global parameters, float32) and `outer_momentum/<name>` (the Nesterov
buffers, as `OuterNesterov.state_dict` names them), plus string metadata: `format`, `run_id`, `term`,
`versions` (JSON list, one per fragment of the run plan), `merges`, `tokens_merged`, `merged` (the ledger) and
`published_wall` (JSON list: when each fragment's version was published, wall clock). Files are written
to a temporary name and renamed, so a reader (a standby syncer sharing the directory, or this syncer after
a crash) sees either the previous checkpoint or the new one, never half of one. Nothing is unpickled.
"""

from __future__ import annotations

import json
import logging
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from node.diloco.outer import STATE_PREFIX

logger = logging.getLogger(__name__)

FORMAT = "hivenode-syncer-v1"
PARAM_PREFIX = "param/"


@dataclass(frozen=True, kw_only=True, slots=True)
class SyncerSnapshot:
    """Everything a syncer needs to resume: what it serves and how its outer optimiser moves next."""

    run_id: str
    term: int
    versions: tuple[int, ...]
    params: dict[str, torch.Tensor]
    momentum: dict[str, torch.Tensor]  # keys as OuterNesterov.state_dict gives them (STATE_PREFIX + name)
    merges: int = 0
    tokens_merged: int = 0
    # (peer, fragment, base version, steps, tokens) already merged: see SyncerCore.merged_ledger
    merged: tuple[tuple[str, int, int, int, int], ...] = ()
    # per fragment, when its current version was published (wall clock, 0 if unknown): a successor caps the
    # counters of work built on it by the time since then, not since it restored
    published_wall: tuple[float, ...] = ()


class CheckpointError(ValueError):
    """A checkpoint file is unreadable, of another run, or does not match the expected tensors."""


def checkpoint_path(directory: Path, run_id: str) -> Path:
    return directory / f"syncer-{run_id[:16]}.safetensors"


def save_checkpoint(path: Path, snapshot: SyncerSnapshot) -> None:
    """Write `snapshot` atomically (temp file in the same directory, fsync, rename)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tensors = {
        PARAM_PREFIX + name: t.detach().to("cpu", torch.float32).contiguous()
        for name, t in snapshot.params.items()
    }
    for key, t in snapshot.momentum.items():
        if not key.startswith(STATE_PREFIX):
            raise ValueError(f"momentum key {key!r} lacks the {STATE_PREFIX!r} prefix")
        tensors[key] = t.detach().to("cpu", torch.float32).contiguous()
    metadata = {
        "format": FORMAT,
        "run_id": snapshot.run_id,
        "term": str(snapshot.term),
        "versions": json.dumps(list(snapshot.versions)),
        "merges": str(snapshot.merges),
        "tokens_merged": str(snapshot.tokens_merged),
        "merged": json.dumps([list(entry) for entry in snapshot.merged]),
        "published_wall": json.dumps([float(t) for t in snapshot.published_wall]),
    }
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    save_file(tensors, str(tmp), metadata=metadata)
    with open(tmp, "rb") as handle:
        os.fsync(handle.fileno())
    os.replace(tmp, path)


def load_checkpoint(
    path: Path, *, run_id: str, expected: Mapping[str, tuple[int, ...]], num_fragments: int
) -> SyncerSnapshot:
    """Read and check a checkpoint: same run, exactly the `expected` parameter names and shapes, finite
    values, one version per fragment. Raises CheckpointError (FileNotFoundError if there is none)."""
    if not path.exists():
        raise FileNotFoundError(path)
    try:
        from safetensors import safe_open

        with safe_open(str(path), framework="pt") as handle:
            metadata = handle.metadata() or {}
        tensors = load_file(str(path))
    except (SafetensorError, OSError, ValueError) as e:
        raise CheckpointError(f"{path}: unreadable checkpoint ({e})") from None
    if metadata.get("format") != FORMAT or metadata.get("run_id") != run_id:
        raise CheckpointError(f"{path}: not a checkpoint of run {run_id[:12]}")
    try:
        merged = tuple(ledger_from_json(metadata.get("merged", "[]")))
        versions = json.loads(metadata["versions"])
        term, merges, tokens = int(metadata["term"]), int(metadata["merges"]), int(metadata["tokens_merged"])
    except (KeyError, ValueError) as e:
        raise CheckpointError(f"{path}: bad metadata ({e})") from None
    if not (
        isinstance(versions, list)
        and len(versions) == num_fragments
        and all(type(v) is int and v >= 0 for v in versions)
    ):
        raise CheckpointError(f"{path}: versions do not fit {num_fragments} fragments")
    published = _published_wall(metadata.get("published_wall"), num_fragments)
    params = {k[len(PARAM_PREFIX) :]: v for k, v in tensors.items() if k.startswith(PARAM_PREFIX)}
    momentum = {k: v for k, v in tensors.items() if k.startswith(STATE_PREFIX)}
    if set(params) != set(expected):
        raise CheckpointError(f"{path}: parameter names differ from the run's model")
    for name, shape in expected.items():
        if tuple(params[name].shape) != tuple(shape):
            raise CheckpointError(f"{path}: {name} has shape {tuple(params[name].shape)}, expected {shape}")
    for key, t in {**params, **momentum}.items():
        if not bool(torch.isfinite(t).all()):
            raise CheckpointError(f"{path}: {key} holds non-finite values")
    for key, t in momentum.items():
        name = key[len(STATE_PREFIX) :]
        if name not in expected or tuple(t.shape) != tuple(expected[name]):
            raise CheckpointError(f"{path}: momentum {key} does not fit the model")
    return SyncerSnapshot(
        run_id=run_id,
        term=term,
        versions=tuple(versions),
        params=params,
        momentum=momentum,
        merges=merges,
        tokens_merged=tokens,
        merged=merged,
        published_wall=published,
    )


def _published_wall(text: str | None, num_fragments: int) -> tuple[float, ...]:
    """Optional metadata (older checkpoints lack it): unknown or malformed reads as no publication times."""
    try:
        values = json.loads(text) if text else []
    except ValueError:
        return ()
    ok = (
        isinstance(values, list)
        and len(values) == num_fragments
        and all(type(v) in (int, float) and math.isfinite(v) and v >= 0 for v in values)
    )
    return tuple(float(v) for v in values) if ok else ()


def ledger_from_json(text: str) -> list[tuple[str, int, int, int, int]]:
    """Parse a merged-counters ledger; ValueError on anything but a list of [peer, fragment, base, steps, tokens]."""
    data = json.loads(text)
    if not isinstance(data, list):
        raise ValueError("ledger is not a list")
    out = []
    for item in data:
        ok = isinstance(item, list) and len(item) == 5 and isinstance(item[0], str) and len(item[0]) <= 128
        if not ok or not all(type(v) is int and v >= 0 for v in item[1:]):
            raise ValueError("bad ledger entry")
        out.append((item[0], item[1], item[2], item[3], item[4]))
    return out
