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
