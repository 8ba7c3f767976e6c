"""The loss probe's base stays readable while commits drop its version (`syncer_core.probe_base` pins a spilled
base: its file is held open). The probe scores a push in a worker thread, reading the base version from its spill
file a chunk at a time; a commit on the loop meanwhile may drop that version from the history and delete its file,
and the probe's next read failed (FileNotFoundError: the push's scoring raised). Control: the history's own mapping
of the same version, unpinned, fails after the drop."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from node.diloco.spill import SpilledTensors
from node.diloco.syncer_core import probe_base
from tests.unit.test_push_spill import spilled_host

pytestmark = pytest.mark.timeout(60)


def test_a_pinned_probe_base_survives_its_version_being_dropped(tmp_path: Path) -> None:
    core = spilled_host(tmp_path).core
    history = core.history
    original = {n: t.clone() for n, t in core.fragment_tensors(0).items()}
    # version 0 replaced by 1 (its file written as a commit writes it), so version 0 is a spilled base
    history.publish(0, 1, original, time.monotonic(), spilled=history.spill_now(0, original))
    base, unpinned = probe_base(core, 0, 0), history.at(0, 0)
    assert isinstance(base, SpilledTensors) and isinstance(unpinned, SpilledTensors)
    for version in (
        2,
        3,
    ):  # commits go on while the probe's thread holds the base: version 0 leaves the history
        history.publish(0, version, original, time.monotonic())
    assert history.at(0, 0) is None and not (tmp_path / base.key).exists()
    assert all(
        torch.equal(base[n], t) for n, t in original.items()
    )  # the probe still reads what it started with
    name = next(iter(original))
    with pytest.raises(FileNotFoundError):  # control: unpinned, the same version is gone
        unpinned.chunk(name, 0, 4)
