"""Ratchets: conventions written down as tests, so the architecture does not drift."""

from __future__ import annotations

import ast
import textwrap
from collections.abc import Iterable, Mapping
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("node", "protocol", "verification", "bootstrap")
GRAPH_PACKAGES = (*PACKAGES, "tools")
IO_MODULES = frozenset({"asyncio", "socket", "aiohttp", "hivemind"})
WIRE_IO_MODULES = frozenset(
    {"asyncio", "socket", "aiohttp"}
)  # protocol/ may name hivemind's DHT record types
# (importer prefix, imported prefix, why): what a layer must never import. Prefixes match whole dotted names.
FORBIDDEN = (
    ("protocol", "node", "protocol/ is the wire: it reads no node state"),
    ("protocol", "verification", "protocol/ is below the verification policies"),
    ("protocol", "bootstrap", "protocol/ is below every process"),
    ("verification", "node", "verification/ policies are pure and reusable by the simulator"),
    ("verification", "bootstrap", "verification/ policies are pure"),
    ("node.context", "node.roles", "the context sits below every role"),
    ("node.context", "node.swarm", "the context sits below the swarm layer"),
    ("node.context", "node.status", "the context sits below the status API"),
    ("node.ml", "node.roles", "models and data know nothing of roles"),
    ("node.ml", "node.pipeline", "models and data know nothing of routing"),
    (
        "node.diloco",
        "node.roles",
        "DiLoCo cores and the sync transport know nothing of the roles that use them",
    ),
    ("node.pipeline", "node.roles", "the pipeline driver knows stages only through the wire"),
    ("node.swarm", "node.roles", "membership and discovery serve every role"),
    ("bootstrap", "node.roles", "the bootstrap runs no training role in-process"),
)
# Pure cores: no event loop, socket or P2P import (the simulator and the unit tests drive them with a fake clock).
PURE_PACKAGES = (
    "verification",
    "node.diloco",
    "node.pipeline.picker",
    "node.pipeline.accounting",
    "node.pipeline.routing",
)
PURE_EXEMPT = frozenset(
    {"protocol.rpc", "protocol.dht_io"}
)  # the framed-stream and DHT codecs are the I/O edge
TRANSPORT_SUFFIXES = ("sync_client", "transport")  # node/diloco modules that are the sync transport shell
# The one module of a node package that may import tools/: the CLI dispatching `python -m node demo`.
TOOLS_IMPORTERS = frozenset({"node.__main__"})


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


def module_names(root: Path, packages: Iterable[str]) -> dict[str, Path]:
    """Dotted module name -> file, for every .py file under `packages` (a package is named by its __init__)."""
    mods: dict[str, Path] = {}
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            mods[".".join(parts)] = path
    return mods


def _imported_names(module: str, path: Path) -> set[str]:
    """Every dotted name an import statement anywhere in the file names (function-level imports included)."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*up, base] if base else up)
            names.add(base)
            names.update(f"{base}.{alias.name}" for alias in node.names)
    return names


def import_graph(root: Path, packages: Iterable[str]) -> tuple[dict[str, set[str]], dict[str, set[str]]]:
    """(internal edges module -> modules it imports, external top-level names each module imports)."""
    mods = module_names(root, packages)

    def resolve(name: str) -> str | None:
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {m: set() for m in mods}
    external: dict[str, set[str]] = {m: set() for m in mods}
    for module, path in mods.items():
        for name in _imported_names(module, path):
            target = resolve(name)
            if target is None:
                external[module].add(name.split(".")[0])
            elif target != module and not module.startswith(target + "."):  # a package's own __init__
                graph[module].add(target)
    return graph, external


def import_cycles(graph: Mapping[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            v, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[v] = min(low[v], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                component = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    component.append(w)
                    if w == v:
                        break
                if len(component) > 1:
                    cycles.append(sorted(component))
    return cycles


def _within(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


def layer_violations(graph: Mapping[str, set[str]], external: Mapping[str, set[str]]) -> list[str]:
    found = []
    for module, targets in sorted(graph.items()):
        for target in sorted(targets):
            for importer, imported, why in FORBIDDEN:
                if _within(module, importer) and _within(target, imported):
                    found.append(f"{module} imports {target}: {why}")
            if _within(target, "tools") and not _within(module, "tools") and module not in TOOLS_IMPORTERS:
                found.append(f"{module} imports {target}: nothing a node runs imports tools/")
    for module, names in sorted(external.items()):
        pure = any(_within(module, p) for p in PURE_PACKAGES) and module not in PURE_EXEMPT
        if (
            pure
            and not module.rpartition(".")[2].endswith(TRANSPORT_SUFFIXES)
            and (hits := names & IO_MODULES)
        ):
            found.append(f"{module} imports {sorted(hits)}: pure cores do no I/O")
    return found


def test_no_import_cycles_function_level_imports_included() -> None:
    graph, _ = import_graph(ROOT, GRAPH_PACKAGES)
    assert len(graph) > 50, "the checker found too few modules to mean anything"
    assert import_cycles(graph) == []


def test_layers_import_only_downwards() -> None:
    graph, external = import_graph(ROOT, GRAPH_PACKAGES)
    assert layer_violations(graph, external) == []


def test_benchmarks_do_not_import_tests() -> None:
    for path in sorted((ROOT / "benchmarks").rglob("*.py")):
        assert "tests" not in {name.split(".")[0] for name in _imported_names("benchmarks.x", path)}, path


def _write_tree(root: Path, files: Mapping[str, str]) -> None:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))


def test_checker_catches_a_function_level_cycle_and_layer_breaks(tmp_path: Path) -> None:
    """Negative control: a temporary tree with one violation of each kind, each reported."""
    _write_tree(
        tmp_path,
        {
            "protocol/__init__.py": "",
            "protocol/wire.py": "def f():\n    from node.roles import stage\n",  # cycle + protocol -> node
            "node/__init__.py": "",
            "node/roles/__init__.py": "",
            "node/roles/stage.py": "from protocol import wire\n",
            "node/diloco/__init__.py": "",
            "node/diloco/merge.py": "import asyncio\nfrom tools import demo\n",  # I/O in a core; imports tools
            "tools/__init__.py": "",
            "tools/demo.py": "import node.roles.stage\n",
        },
    )
    graph, external = import_graph(tmp_path, ("protocol", "node", "tools"))
    assert import_cycles(graph) == [["node.roles.stage", "protocol.wire"]]
    found = "\n".join(layer_violations(graph, external))
    assert "protocol.wire imports node.roles.stage" in found
    assert "node.diloco.merge imports ['asyncio']" in found
    assert "node.diloco.merge imports tools.demo" in found
    assert "tools.demo imports" not in found  # tools/ may import anything


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
    allowed = {"__main__.py"}
    for package in PACKAGES:
        for path in _files(package):
            if path.name in allowed:
                continue
            lines = _prints_outside_cli_functions(ast.parse(path.read_text()))
            assert not lines, f"print() in {path.relative_to(ROOT)} at lines {lines}; use logging"
