"""The copycat's eavesdropping channel, for tests and benchmarks only (issue 18): a directory where an honest
"source" learner leaves each contribution the syncer took from it and where a copycat attacker
(node.diloco.attack_transport, kind `copycat`) reads it back. It stands for whatever channel colluders or an
eavesdropper would use; the syncer never sees it.

One file per (fragment, base version): `fragment<F>-base<B>.safetensors`, the source's latest contribution built
on that version, written atomically (a temporary file in the same directory, then a rename), so a reader sees the
whole file or none. safetensors only (never a pickle): a file that does not parse, names another fragment or base
in its metadata, or lacks a tensor the reader expects (or holds one of another shape) reads as absent.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Mapping
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import safe_open, save_file

logger = logging.getLogger(__name__)

KEEP_VERSIONS = (
    2  # files per fragment kept below the newest base written (older ones are no use to a copycat)
)
_NAME = re.compile(r"^fragment(\d+)-base(\d+)\.safetensors$")


def file_name(fragment: int, base_version: int) -> str:
    return f"fragment{fragment}-base{base_version}.safetensors"


class CopyChannel:
    """The directory; `write` is the source's side, `read` the copycat's."""

    def __init__(self, directory: Path | str) -> None:
        self.dir = Path(directory)

    def write(self, fragment: int, base_version: int, params: Mapping[str, torch.Tensor]) -> Path:
        """Leave `params` (a contribution on `base_version`) for the copycat; replaces an earlier one on that base."""
        self.dir.mkdir(parents=True, exist_ok=True)
        path = self.dir / file_name(fragment, base_version)
        tmp = self.dir / f".{path.name}.{os.getpid()}.tmp"
        tensors = {n: t.detach().to("cpu", torch.float32).contiguous() for n, t in params.items()}
        meta = {"fragment": str(fragment), "base_version": str(base_version)}
        try:
            save_file(tensors, str(tmp), metadata=meta)
            os.replace(tmp, path)  # atomic: the copycat never reads half a file
        finally:
            tmp.unlink(missing_ok=True)
        self._prune(fragment, base_version)
        return path

    def read(
        self, fragment: int, base_version: int, expected: Mapping[str, torch.Tensor]
    ) -> dict[str, torch.Tensor] | None:
        """The source's contribution on (`fragment`, `base_version`) with the names and shapes of `expected`, or
        None when there is none (yet) or the file is not a valid one (logged)."""
        path = self.dir / file_name(fragment, base_version)
        if not path.exists():
            return None
        try:
            with safe_open(str(path), framework="pt") as handle:  # one read: metadata and tensors
                meta = handle.metadata() or {}
                tensors = {name: handle.get_tensor(name) for name in handle.keys()}  # noqa: SIM118 (not a dict)
        except (SafetensorError, OSError, ValueError, RuntimeError) as e:
            logger.warning("copy channel: %s does not read: %s", path.name, e)
            return None
        if meta.get("fragment") != str(fragment) or meta.get("base_version") != str(base_version):
            logger.warning("copy channel: %s names another contribution: %s", path.name, meta)
            return None
        for name, t in expected.items():
            if name not in tensors or tuple(tensors[name].shape) != tuple(t.shape):
                logger.warning("copy channel: %s lacks %s or has another shape", path.name, name)
                return None
        return {name: tensors[name] for name in expected}

    def _prune(self, fragment: int, newest: int) -> None:
        for path in self.dir.iterdir():
            match = _NAME.match(path.name)
            if match and int(match[1]) == fragment and int(match[2]) < newest - KEEP_VERSIONS:
                path.unlink(missing_ok=True)
