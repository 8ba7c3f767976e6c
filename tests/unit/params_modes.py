"""`IN_MEMORY_ONLY`: a test of a syncer suite run with the `params_mode` fixture (tests/unit/conftest.py) that checks
how the core keeps its parameters in memory (tensors shared, read in at a commit, held as dicts): run in that mode
only. Its on-disk counterpart is in tests/unit/test_params_on_disk.py."""

from __future__ import annotations

import pytest

IN_MEMORY_ONLY = pytest.mark.parametrize("params_mode", [False], ids=["params-in-memory"], indirect=True)
