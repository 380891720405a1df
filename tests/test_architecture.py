"""The package's imports follow its layer table (docs/architecture.md): no import from a lower floor
to a higher one, no circle of imports between modules.

Every `import` statement of every module counts, including those inside functions (a lazy import
is still a dependency); imports under `if TYPE_CHECKING:` count for the floors but not for circles
(they never run). The table is read from docs/architecture.md, its only copy.
"""
from __future__ import annotations

import ast
import functools
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "torchneuron"
TABLE = ROOT / "docs" / "architecture.md"


@dataclass(frozen=True)
class Import:
    source: str        # importing module
    target: str        # imported module of the package
    line: int
    typing_only: bool  # under `if TYPE_CHECKING:`

    def where(self) -> str:
        return f"{_path(self.source)}:{self.line}"


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


_PATHS: dict[str, Path] = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
_EXTENSIONS = {_module_name(p.with_name(p.name.split(".")[0] + ".so")) for p in PACKAGE.rglob("*.so")}  # _C


def _path(module: str) -> str:
    return str(_PATHS[module].relative_to(ROOT))


def floors() -> list[list[str]]:
    """The first column of the layer table, highest floor first: each a list of module prefixes."""
    text = TABLE.read_text()
    section = text.split("## Layers", 1)[1].split("\n## ", 1)[0]
    result = []
    for row in re.findall(r"^\|([^|]*)\|", section, flags=re.M):
        entries = re.findall(r"`([^`]+)`", row)
        if not entries:
            continue
        prefixes = []
        for entry in entries:
            name = entry.rstrip("/").removesuffix(".py")
            prefixes.append("torchneuron" if name == "__init__" else f"torchneuron.{name.replace('/', '.')}")
        result.append(prefixes)
    return result


def floor_of(module: str, table: list[list[str]]) -> int | None:
    """The floor's height (0 = lowest) of `module`, by its longest matching prefix in the table."""
    best, height = -1, None
    for index, prefixes in enumerate(table):
        for prefix in prefixes:
            exact_only = prefix == "torchneuron"  # the package's __init__, not everything under it
            if module == prefix or (not exact_only and module.startswith(prefix + ".")):
                if len(prefix) > best:
                    best, height = len(prefix), len(table) - 1 - index
    return height


def _typing_blocks(tree: ast.AST) -> set[int]:
    ids = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for child in node.body:
                ids.update(id(n) for n in ast.walk(child))
    return ids


def _resolve(module: str, is_package: bool, node: ast.Import | ast.ImportFrom) -> list[str]:
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if node.level:
        base = module.split(".") if is_package else module.split(".")[:-1]
        base = base[:len(base) - (node.level - 1)]
        origin = ".".join(base + ([node.module] if node.module else []))
    else:
        origin = node.module or ""
    # `from pkg import name` imports the module pkg.name when there is one, else pkg
    return [f"{origin}.{a.name}" if f"{origin}.{a.name}" in _PATHS or f"{origin}.{a.name}" in _EXTENSIONS else origin
            for a in node.names]


@functools.cache
def package_imports() -> tuple[Import, ...]:
    found: dict[Import, None] = {}  # in order, without repeats
    for module, path in sorted(_PATHS.items()):
        tree = ast.parse(path.read_text(), str(path))
        typing_only = _typing_blocks(tree)
        for node in ast.walk(tree):
            if not isinstance(node, (ast.Import, ast.ImportFrom)):
                continue
            for target in _resolve(module, path.name == "__init__.py", node):
                if target != "torchneuron" and not target.startswith("torchneuron."):
                    continue
                if target in _EXTENSIONS:  # a compiled module imports nothing of the package
                    continue
                while target not in _PATHS and "." in target:  # an attribute of a module
                    target = target.rsplit(".", 1)[0]
                imp = Import(module, target, node.lineno, id(node) in typing_only)
                if target != module:
                    found[imp] = None
    return tuple(found)


def upward_imports(imports: Sequence[Import], table: list[list[str]]) -> list[str]:
    problems = []
    names = {height: ", ".join(f"`{p}`" for p in table[len(table) - 1 - height]) for height in range(len(table))}
    for imp in imports:
        low, high = floor_of(imp.source, table), floor_of(imp.target, table)
        if low is not None and high is not None and high > low:
            problems.append(
                f"{imp.where()}: {imp.source} (floor {names[low]}) imports {imp.target} (floor {names[high]}), a "
                "higher floor. Fix: move what it needs down to its own floor or below, or have the higher floor "
                "pass it in (a registration or argument) — see docs/architecture.md.")
    return problems


def cycles(imports: Sequence[Import]) -> list[list[Import]]:
    """One circle of imports per strongly connected group of modules (runtime imports only)."""
    graph: dict[str, list[Import]] = {}
    for imp in imports:
        if not imp.typing_only:
            graph.setdefault(imp.source, []).append(imp)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[set[str]] = []

    def visit(root: str) -> None:  # Tarjan's algorithm, iterative
        work = [(root, iter(graph.get(root, ())))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, edges = work[-1]
            for edge in edges:
                if edge.target not in index:
                    index[edge.target] = low[edge.target] = len(index)
                    stack.append(edge.target)
                    on_stack.add(edge.target)
                    work.append((edge.target, iter(graph.get(edge.target, ()))))
                    break
                if edge.target in on_stack:
                    low[node] = min(low[node], index[edge.target])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    group = set()
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        group.add(member)
                        if member == node:
                            break
                    if len(group) > 1:
                        groups.append(group)

    for module in sorted(graph):
        if module not in index:
            visit(module)
    return [_circle(graph, group) for group in groups]


def _circle(graph: dict[str, list[Import]], group: set[str]) -> list[Import]:
    """A shortest circle through the group's first module (breadth-first within the group)."""
    start = min(group)
    came_from: dict[str, Import] = {}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for edge in graph.get(node, ()):
                if edge.target not in group:
                    continue
                if edge.target == start:
                    path = [edge]
                    while path[0].source != start:
                        path.insert(0, came_from[path[0].source])
                    return path
                if edge.target not in came_from:
                    came_from[edge.target] = edge
                    following.append(edge.target)
        frontier = following
    raise AssertionError(f"no circle in {group}")


def test_every_module_has_a_floor():
    table = floors()
    assert len(table) >= 10, f"could not read the layer table of {TABLE}"
    missing = [_path(m) for m in _PATHS if floor_of(m, table) is None]
    assert not missing, (
        "These modules belong to no floor of docs/architecture.md's layer table: " + ", ".join(missing)
        + ". Fix: add a row for their folder (or module) at the floor they belong to.")


def test_no_import_goes_up_a_floor():
    problems = upward_imports(package_imports(), floors())
    assert not problems, f"{len(problems)} import(s) from a lower floor to a higher one:\n" + "\n".join(problems)


def test_no_import_circles():
    found = cycles(package_imports())
    lines = []
    for circle in found:
        lines.append(" -> ".join([circle[0].source] + [edge.target for edge in circle]))
        lines.extend(f"    {edge.where()}: imports {edge.target}" for edge in circle)
    assert not found, (
        f"{len(found)} circle(s) of imports between modules:\n" + "\n".join(lines)
        + "\nFix: move what both sides need into a module below them both (or merge them); a function-level "
        "import does not break a circle.")


def test_the_checker_finds_what_it_must():
    """The checks themselves: an upward import and a circle in a made-up graph are reported."""
    table = [["torchneuron.compiler"], ["torchneuron.runtime"]]
    _PATHS.setdefault("torchneuron.runtime.fake_a", PACKAGE / "runtime" / "__init__.py")
    _PATHS.setdefault("torchneuron.runtime.fake_b", PACKAGE / "runtime" / "__init__.py")
    try:
        up = Import("torchneuron.runtime.fake_a", "torchneuron.compiler", 7, False)
        assert len(upward_imports([up], table)) == 1
        assert "runtime/__init__.py:7" in upward_imports([up], table)[0]
        assert upward_imports([Import("torchneuron.compiler", "torchneuron.runtime.fake_a", 1, False)], table) == []
        a_to_b = Import("torchneuron.runtime.fake_a", "torchneuron.runtime.fake_b", 3, False)
        b_to_a = Import("torchneuron.runtime.fake_b", "torchneuron.runtime.fake_a", 4, False)
        found = cycles([a_to_b, b_to_a])
        assert [[e.line for e in c] for c in found] == [[3, 4]]
        assert cycles([a_to_b, Import(b_to_a.source, b_to_a.target, 4, True)]) == []
    finally:
        del _PATHS["torchneuron.runtime.fake_a"], _PATHS["torchneuron.runtime.fake_b"]
