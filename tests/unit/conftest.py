"""Fixtures shared by the unit suites."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from node.diloco.syncer_core import SyncerCore


@pytest.fixture(params=[False, True], ids=["params-in-memory", "params-on-disk"])
def params_mode(
    request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[bool]:
    """A syncer suite run twice (`pytest.mark.usefixtures("params_mode")`): as written, and with every `SyncerCore`
    it builds keeping its global parameters on disk (`params_on_disk`, node.diloco.param_store), in the spill
    directory it was given or in a fresh one."""
    if request.param:
        built = SyncerCore.__init__

        def on_disk(self: SyncerCore, plan: Any, params: Any, **options: Any) -> None:
            spill: Path | None = options.get("spill_dir")
            options["spill_dir"] = spill if spill is not None else tmp_path_factory.mktemp("params-on-disk")
            built(self, plan, params, **{**options, "params_on_disk": True})

        monkeypatch.setattr(SyncerCore, "__init__", on_disk)
    yield request.param
