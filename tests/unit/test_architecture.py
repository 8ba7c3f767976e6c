"""Ratchets: conventions written down as tests, so the architecture does not drift."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("node", "protocol", "verification", "bootstrap")
# Modules whose job is networking may import asyncio; the rest of protocol/ and all of verification/ stay pure.
PURE_EXEMPT = {"protocol/rpc.py", "protocol/dht_io.py"}


def _imports(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module.split(".")[0])
    return names


def _files(package: str) -> list[Path]:
    return sorted((ROOT / package).rglob("*.py"))


def test_verification_and_protocol_do_not_import_node() -> None:
    for package in ("protocol", "verification"):
        for path in _files(package):
            assert "node" not in _imports(path), f"{path.relative_to(ROOT)} imports node/"


def test_pure_cores_do_not_touch_sockets_or_event_loops() -> None:
    banned = {"asyncio", "socket", "aiohttp"}
    for package in ("protocol", "verification"):
        for path in _files(package):
            rel = str(path.relative_to(ROOT))
            if rel in PURE_EXEMPT:
                continue
            hits = _imports(path) & banned
            assert not hits, f"{rel} imports {sorted(hits)}"
    for path in _files("node/diloco"):
        if path.name == "sync_client.py":  # the learner-side shell around the cores
            continue
        assert not _imports(path) & {"asyncio", "socket", "hivemind", "aiohttp"}, path


def test_no_pickle_on_any_module() -> None:
    for package in PACKAGES:
        for path in _files(package):
            text = path.read_text()
            assert "pickle.load" not in text and "cloudpickle" not in text, path
            for line in text.splitlines():
                if "torch.load(" in line:
                    assert "weights_only=True" in line, f"{path}: {line.strip()}"


def _prints_outside_cli_functions(tree: ast.AST) -> list[int]:
    """Line numbers of print() calls not inside a CLI function (`main` or `*_command`)."""
    lines: list[int] = []

    def visit(node: ast.AST, in_cli: bool) -> None:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            in_cli = in_cli or node.name == "main" or node.name.endswith("_command")
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "print" and not in_cli:
            lines.append(node.lineno)
        for child in ast.iter_child_nodes(node):
            visit(child, in_cli)

    visit(tree, False)
    return lines


def test_no_print_outside_entry_points() -> None:
    allowed = {"__main__.py", "demo.py", "simulate.py", "train_local.py"}
    for package in PACKAGES:
        for path in _files(package):
            if path.name in allowed:
                continue
            lines = _prints_outside_cli_functions(ast.parse(path.read_text()))
            assert not lines, f"print() in {path.relative_to(ROOT)} at lines {lines}; use logging"
