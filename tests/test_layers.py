"""No import in tpflow/ runs from a lower layer to a higher one, no module imports itself round a cycle, and no
function or file is too long to hold one thing.

The layers are written down in docs/architecture.md ("## Layers"): a table whose rows name a layer and the modules
and packages it holds (`tpflow/x.py`, `tpflow/pkg/`). This test reads that table and every module's imports from its
syntax tree (top-level, inside functions and under ``if TYPE_CHECKING``: a lazy or type-only import is an arrow
too), so the page and the code cannot disagree: a module the table does not place, an arrow that climbs, or a cycle
fails here with the file and line of each import to change.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "tpflow"
LAYER_ROW = re.compile(r"^\| (\d+)\. ([\w ]+) \| [^|]+ \| (.+) \|\s*$")  # number. name | holds | modules
PLACE = re.compile(r"`(tpflow/(?:\w+/)*(?:\w+\.py)?)`")


def layer_table(text: str) -> dict[str, tuple[int, str]]:
    """Each place the "## Layers" table names (a module path or a package folder) -> (layer number, layer name)."""
    match = re.search(r"^## Layers\s*$(.*?)(?=^## |\Z)", text, re.M | re.S)
    assert match, 'docs/architecture.md has no "## Layers" section'
    places: dict[str, tuple[int, str]] = {}
    for line in match.group(1).splitlines():
        row = LAYER_ROW.match(line)
        if row is None:
            continue
        for place in PLACE.findall(row.group(3)):
            assert place not in places, f"{place} is placed in two layers"
            places[place] = (int(row.group(1)), row.group(2).strip())
    assert places, "the Layers table places no module"
    return places


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def imports(name: str, path: Path, known: dict[str, Path]) -> Iterator[tuple[str, int]]:
    """The tpflow modules ``name`` imports, each with the line of its import (``from tpflow import registry`` is an
    import of ``tpflow.registry``; ``from tpflow.x import y`` of ``tpflow.x``, or of ``tpflow.x.y`` if a module)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*up, *([node.module] if node.module else [])])
            submodules = [f"{base}.{alias.name}" for alias in node.names if f"{base}.{alias.name}" in known]
            targets = submodules if len(submodules) == len(node.names) else [base, *submodules]
        else:
            continue
        for target in targets:
            while target and target not in known:  # a name inside a module: the module
                target = target.rpartition(".")[0]
            if target.startswith("tpflow") and target != name:
                yield target, node.lineno


def layer_of(name: str, path: Path, places: dict[str, tuple[int, str]]) -> tuple[int, str] | None:
    """The layer of the module: its own row, else its innermost package's row."""
    relative = path.relative_to(ROOT).as_posix()
    if relative in places:
        return places[relative]
    folder = path.parent
    while folder != ROOT:
        key = folder.relative_to(ROOT).as_posix() + "/"
        if key in places:
            return places[key]
        folder = folder.parent
    return None


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_every_module_has_a_layer_and_no_import_climbs_or_cycles():
    places = layer_table((ROOT / "docs" / "architecture.md").read_text())
    known = modules()
    unplaced = [p.relative_to(ROOT).as_posix() for n, p in known.items() if layer_of(n, p, places) is None]
    assert not unplaced, f"docs/architecture.md's Layers table places no layer for: {unplaced}"
    stale = [place for place in places if not (ROOT / place).exists()]
    assert not stale, f"the Layers table names what does not exist: {stale}"
    climbing, graph = [], {name: set() for name in known}
    for name, path in known.items():
        (here, here_name) = layer_of(name, path, places)
        for target, line in imports(name, path, known):
            graph[name].add(target)
            there, there_name = layer_of(target, known[target], places)
            if there > here:
                where = f"{path.relative_to(ROOT).as_posix()}:{line}"
                climbing.append(f"{where} {name} ({here}. {here_name}) imports {target} ({there}. {there_name})")
    assert not climbing, "imports that run up a layer:\n" + "\n".join(climbing)
    assert not cycles(graph), f"import cycles: {cycles(graph)}"


def test_the_check_sees_an_arrow_that_climbs_and_a_cycle(tmp_path):
    """The parts of the check on a made-up case: a function-level import of a higher layer is found with its line,
    and a two-module cycle is reported."""
    path = tmp_path / "tpflow" / "low.py"
    path.parent.mkdir()
    path.write_text("import os\n\n\ndef f():\n    from tpflow.high import thing\n    from tpflow import low\n")
    known = {"tpflow.low": path, "tpflow.high": tmp_path / "tpflow" / "high.py"}
    assert list(imports("tpflow.low", path, known)) == [("tpflow.high", 5)]
    assert cycles({"a": {"b"}, "b": {"a"}, "c": {"a"}}) == [["a", "b"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def _functions(path: Path):
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            body = node.body
            doc = (
                body[0] if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) else None
            )
            yield node.name, node.end_lineno - node.lineno + 1 - (doc.end_lineno - doc.lineno + 1 if doc else 0)


def test_functions_and_files_are_small():
    """No function in tpflow/ over 60 lines from its def to its last line (docstring excluded), no file over 450
    lines: a longer one holds more than one thing."""
    files = sorted(PACKAGE.rglob("*.py"))
    long = [f"{p.relative_to(PACKAGE)}:{name} {n}" for p in files for name, n in _functions(p) if n > 60]
    large = [f"{p.relative_to(PACKAGE)} {n}" for p in files if (n := len(p.read_text().splitlines())) > 450]
    assert not long and not large, (long, large)
