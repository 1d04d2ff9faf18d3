"""The package's import graph: data flows down, so the components never import the training loop, inspect or the
CLI, and no two modules import each other (directly or around a cycle), counting imports inside functions too."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "tpflow"
COMPONENTS = ("rewards", "backbones", "samplers", "credit", "optim")
ABOVE = ("tpflow.train", "tpflow.inspect", "tpflow.cli", "tpflow.launch")


def _module(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _graph() -> dict[str, set[str]]:
    """module -> the tpflow modules it imports anywhere in its file (``from a import b`` counts a.b if it is one)."""
    modules = {_module(p): p for p in PACKAGE.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        targets: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                targets |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                targets |= {f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in modules else node.module
                            for a in node.names}  # fmt: skip
        graph[name] = {t for t in targets if t in modules and t != name}
    return graph


def test_components_do_not_import_the_layers_above_them():
    bad = [
        (name, target)
        for name, targets in _graph().items()
        if name.split(".")[1:2] and name.split(".")[1] in COMPONENTS
        for target in targets
        if target.startswith(ABOVE)
    ]
    assert not bad, f"components importing train/inspect/CLI: {bad}"


def test_no_import_cycle():
    graph = _graph()

    # Packages import their submodules to re-export them; an edge from a package's own __init__ to its children is
    # the usual direction, so a cycle through a package's __init__ and its child is not counted.
    def edges(name: str) -> set[str]:
        return {t for t in graph[name] if not t.startswith(name + ".") and not name.startswith(t + ".")}

    state: dict[str, int] = {}  # 1 on the stack, 2 done
    stack: list[str] = []

    def visit(name: str) -> list[str] | None:
        state[name] = 1
        stack.append(name)
        for target in sorted(edges(name)):
            if state.get(target) == 1:
                return stack[stack.index(target) :] + [target]
            if target not in state and (cycle := visit(target)):
                return cycle
        stack.pop()
        state[name] = 2
        return None

    for name in sorted(graph):
        if name not in state and (cycle := visit(name)):
            raise AssertionError("import cycle: " + " -> ".join(cycle))
