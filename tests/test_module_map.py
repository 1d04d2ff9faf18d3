"""docs/architecture.md's module map lists every module of tpflow/, and only modules that exist.

The map is written by hand (what each file holds), so it is held to the tree here, read when the test runs: under
"## Modules", every table row names one module, `tpflow/a/b.py` (a package's row, `tpflow/a/`, stands for its
`__init__.py`), and the set of rows must be the set of ``*.py`` files under tpflow/. Whoever adds, moves or deletes
a module updates the map in the same commit, so it cannot go stale again.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODULE_ROW = re.compile(r"^\| `(tpflow/(?:\w+/)*(?:\w+\.py)?)` \| *[^|\s]")  # a module, then what it holds
HEADER_OR_RULE = re.compile(r"^\|\s*(module\s*\|\s*holds|-+\s*\|\s*-+)\s*\|\s*$")


def map_section(text: str) -> str:
    """The text of the page's "## Modules" section (to the next level-2 heading)."""
    match = re.search(r"^## Modules\s*$(.*?)(?=^## |\Z)", text, re.M | re.S)
    assert match, 'docs/architecture.md has no "## Modules" section'
    return match.group(1)


def mapped_modules(section: str) -> tuple[list[str], list[str]]:
    """The modules the section's table rows name (a package row as its __init__.py), and the rows that name none
    or say nothing of what it holds."""
    modules, malformed = [], []
    for line in section.splitlines():
        if not line.startswith("|") or HEADER_OR_RULE.match(line):
            continue
        match = MODULE_ROW.match(line)
        if match is None:
            malformed.append(line)
            continue
        path = match.group(1)
        modules.append(path + "__init__.py" if path.endswith("/") else path)
    return modules, malformed


def tree_modules(root: Path) -> set[str]:
    return {p.relative_to(root).as_posix() for p in (root / "tpflow").rglob("*.py") if "__pycache__" not in p.parts}


def differences(listed: list[str], actual: set[str]) -> list[str]:
    found = [f"{m}: not in docs/architecture.md's module map (add a row)" for m in sorted(actual - set(listed))]
    found += [f"{m}: in the module map, but there is no such file" for m in sorted(set(listed) - actual)]
    found += [f"{m}: listed twice" for m in sorted({m for m in listed if listed.count(m) > 1})]
    return found


def test_the_module_map_lists_every_module_of_tpflow_and_no_other():
    section = map_section((ROOT / "docs" / "architecture.md").read_text(encoding="utf-8"))
    listed, malformed = mapped_modules(section)
    assert not malformed, "rows of the module map that name no module as `tpflow/...`:\n" + "\n".join(malformed)
    actual = tree_modules(ROOT)
    assert len(actual) > 100 and "tpflow/__init__.py" in actual
    found = differences(listed, actual)
    assert not found, "docs/architecture.md's module map and tpflow/ disagree:\n" + "\n".join(found)


def test_a_missing_a_stale_and_a_malformed_row_are_each_caught(tmp_path):
    (tmp_path / "tpflow" / "optim").mkdir(parents=True)
    for name in ("__init__.py", "optim/__init__.py", "optim/loop.py", "optim/new_base.py"):
        (tmp_path / "tpflow" / name).write_text("")
    section = map_section(
        "# A\n## Modules\n\n| module | holds |\n|---|---|\n| `tpflow/` | root |\n| `tpflow/optim/` | pkg |\n"
        "| `tpflow/optim/loop.py` | the loop |\n| `tpflow/optim/gone.py` | deleted |\n| optim/typo.py | x |\n"
        "| `tpflow/optim/loop.py` |  |\n"
        "## Interfaces\n| `tpflow/optim/new_base.py` | a row under another heading does not count |\n"
    )
    listed, malformed = mapped_modules(section)
    assert malformed == ["| optim/typo.py | x |", "| `tpflow/optim/loop.py` |  |"]  # no module; nothing held
    assert differences(listed, tree_modules(tmp_path)) == [
        "tpflow/optim/new_base.py: not in docs/architecture.md's module map (add a row)",
        "tpflow/optim/gone.py: in the module map, but there is no such file",
    ]
