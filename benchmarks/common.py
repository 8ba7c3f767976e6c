"""Shared helpers for benchmark scripts: one JSON per benchmark with a `headline` object, plus a plot."""

from __future__ import annotations

import json
import platform
import time
from pathlib import Path
from typing import Any

RESULTS_DIR = Path(__file__).resolve().parent / "results"


def machine_info() -> dict[str, Any]:
    """What the figures were measured on; these machines are noisy, so ratios matter more than absolutes."""
    import os

    import torch

    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cpus": os.cpu_count(),
        "platform": platform.platform(),
    }


def write_result(name: str, headline: dict[str, Any], detail: dict[str, Any] | None = None) -> Path:
    """Write benchmarks/results/<name>.json with `headline`, `detail`, and machine facts; return its path."""
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    path = RESULTS_DIR / f"{name}.json"
    payload = {
        "name": name,
        "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "machine": machine_info(),
        "headline": headline,
        **(detail or {}),
    }
    path.write_text(json.dumps(payload, indent=2, sort_keys=False, default=float) + "\n")
    return path


def plot_path(name: str) -> Path:
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    return RESULTS_DIR / f"{name}.png"
