"""The optional capabilities a component may declare (tpflow.interfaces.CAPABILITIES): read in one way, with the
declared default, so that a plugin that declares none of them works and no module guesses its own default."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import tpflow
from tpflow.interfaces import CAPABILITIES, capability

PACKAGE = Path(tpflow.__file__).resolve().parent


class Bare:
    """A component that declares nothing beyond its protocol's members."""


def test_a_component_that_declares_nothing_gets_the_declared_defaults():
    assert {name: capability(Bare(), name) for name in CAPABILITIES} == CAPABILITIES
    assert capability(tpflow.build("credit", "branch"), "reads_branches") is True  # what a component declares
    with pytest.raises(KeyError, match="not a declared capability"):
        capability(Bare(), "needs_everything")


def test_no_module_reads_a_capability_with_a_default_of_its_own():
    """``getattr(component, "<capability>", default)`` anywhere in tpflow would be a second, possibly different,
    default: every such read goes through ``capability``."""
    found = []
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "getattr" and len(node.args) == 3:
                name = node.args[1]
                if isinstance(name, ast.Constant) and name.value in CAPABILITIES:
                    found.append(f"{path.relative_to(PACKAGE)}:{node.lineno} {name.value}")
    assert not found, found


COMPONENTS = {"backbone", "sampler", "reward", "credit", "optimizer", "plan"}  # what train/ names its components


def _named(node: ast.expr) -> str | None:
    """The name an expression reads a component by: ``optimizer``, ``self.optimizer``, ``self.epoch_sampler.plan``."""
    return node.attr if isinstance(node, ast.Attribute) else node.id if isinstance(node, ast.Name) else None


def test_every_capability_the_trainer_reads_is_declared():
    """train/ asks a component for an optional member only through ``capability``, with a name ``CAPABILITIES``
    declares: ``getattr(reward, "zscored_parts", None)`` was a capability no one declared, with a default of its
    own, and a name handed to ``capability`` that is not declared raises only when that path runs."""
    undeclared = []
    for path in sorted((PACKAGE / "train").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Call) or len(node.args) < 2 or not isinstance(node.args[1], ast.Constant):
                continue
            function = getattr(node.func, "id", None)
            of_component = function in ("getattr", "hasattr") and _named(node.args[0]) in COMPONENTS
            if (of_component or function == "capability") and node.args[1].value not in CAPABILITIES:
                undeclared.append(f"{path.relative_to(PACKAGE)}:{node.lineno} {function}(..., {node.args[1].value!r})")
    assert not undeclared, "read from a component but not declared in tpflow.interfaces.CAPABILITIES:\n" + "\n".join(
        undeclared
    )
