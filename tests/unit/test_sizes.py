"""Ratchet on unit size: no function over 60 lines and no class over 400 lines, outside an allow-list that may
only shrink (a listed unit may not grow, and an entry that is gone or back within the limit must be deleted)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ROOTS = ("node", "protocol", "verification", "bootstrap", "tools")
ALLOWLIST = Path(__file__).with_name("size_allowlist.txt")
LIMITS = {"function": 60, "class": 400}


def measure(path: Path, rel: str) -> dict[tuple[str, str], int]:
    """Every function (methods and nested ones included) and class in one file: (kind, 'rel:qualname') -> lines."""
    sizes: dict[tuple[str, str], int] = {}

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                kind = "class" if isinstance(child, ast.ClassDef) else "function"
                qualname = prefix + child.name
                sizes[(kind, f"{rel}:{qualname}")] = (child.end_lineno or child.lineno) - child.lineno + 1
                visit(child, qualname + ".")
            else:
                visit(child, prefix)

    visit(ast.parse(path.read_text(), str(path)), "")
    return sizes


def offenders(root: Path, roots: tuple[str, ...] = ROOTS) -> dict[tuple[str, str], int]:
    """The units over their kind's limit under the given top-level directories of `root`."""
    found: dict[tuple[str, str], int] = {}
    for top in roots:
        for path in sorted((root / top).rglob("*.py")):
            for key, lines in measure(path, path.relative_to(root).as_posix()).items():
                if lines > LIMITS[key[0]]:
                    found[key] = lines
    return found


def load_allowlist(path: Path) -> dict[tuple[str, str], int]:
    """Lines `kind path:qualname lines`; blank lines and `#` comments are skipped."""
    entries: dict[tuple[str, str], int] = {}
    for number, raw in enumerate(path.read_text().splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        parts = line.split()
        if len(parts) != 3 or parts[0] not in LIMITS or not parts[2].isdigit():
            raise ValueError(f"{path.name}:{number}: expected 'kind path:qualname lines', got {raw!r}")
        entries[(parts[0], parts[1])] = int(parts[2])
    return entries


def violations(found: dict[tuple[str, str], int], allowed: dict[tuple[str, str], int]) -> list[str]:
    """What breaks the ratchet: unlisted offenders, listed units that grew, and stale entries (a unit that shrank
    but is still over the limit passes; lower its entry when convenient)."""
    problems: list[str] = []
    for (kind, name), lines in sorted(found.items()):
        limit = allowed.get((kind, name))
        if limit is None:
            problems.append(f"{kind} {name} is {lines} lines (limit {LIMITS[kind]}): split it")
        elif lines > limit:
            problems.append(f"{kind} {name} grew to {lines} lines (allow-listed at {limit}): shrink it")
    for kind, name in sorted(set(allowed) - set(found)):
        problems.append(f"{kind} {name} is gone or within the limit: delete its allow-list entry")
    return problems


def test_no_unit_over_its_limit_outside_the_allowlist() -> None:
    problems = violations(offenders(ROOT), load_allowlist(ALLOWLIST))
    assert not problems, "\n".join(problems)


def test_checker_reports_a_long_function_and_a_stale_entry(tmp_path: Path) -> None:
    body = "\n".join(f"    x{i} = {i}" for i in range(69))
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "mod.py").write_text(f"def short():\n    return 1\n\n\ndef long():\n{body}\n")
    found = offenders(tmp_path, ("pkg",))
    assert found == {("function", "pkg/mod.py:long"): 70}
    assert violations(found, {}) == ["function pkg/mod.py:long is 70 lines (limit 60): split it"]
    assert violations(found, {("function", "pkg/mod.py:long"): 70}) == []
    assert "grew to 70" in violations(found, {("function", "pkg/mod.py:long"): 65})[0]
    stale = violations({}, {("class", "pkg/mod.py:Gone"): 500})
    assert stale == ["class pkg/mod.py:Gone is gone or within the limit: delete its allow-list entry"]


def test_allowlist_rejects_a_malformed_line(tmp_path: Path) -> None:
    bad = tmp_path / "list.txt"
    bad.write_text("function node/x.py:f\n")
    try:
        load_allowlist(bad)
    except ValueError as error:
        assert "list.txt:1" in str(error)
    else:
        raise AssertionError("a line without a size was accepted")
