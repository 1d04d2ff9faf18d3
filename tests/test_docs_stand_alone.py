"""The user-facing text stands on its own: README.md, docs/, recipes/ and tpflow/ cite nothing a clone lacks (no
``../shared`` path, no notes kept outside the repository) and carry no history of how the work was scheduled
(sessions, numbered stops, tracker issues). The rival methods are cited by docs/algorithm.md §10, their papers and
their public repositories; results read as a lab report (protocols, runs, dates, commits, machines, amendments)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# (pattern, why it is refused). Each is unambiguous in this project's text: none has a legitimate use there.
FORBIDDEN = [
    (re.compile(r"\.\./shared"), "a path outside the repository"),
    (re.compile(r"RIVALS\.md"), "a file outside the repository (cite docs/algorithm.md §10 and the papers)"),
    (re.compile(r"\.whl/run\.sh|gpu/prepare\.sh"), "an internal workflow (docs/testing.md says how to run on a GPU)"),
    (re.compile(r"\b(?:this|that|next|previous) session\b|\bsession's\b|\bsessions\b", re.I), "work scheduling"),
    (re.compile(r"(?<![\"'])\bsittings?\b(?![\"'])", re.I), "work scheduling"),  # not the string "sitting"
    (re.compile(r"\bstop \d+\b(?!:)", re.I), "a numbered stop of the work log"),  # not a time: stop 21:41
    (re.compile(r"\bissues? #?\d+\b", re.I), "a tracker issue a clone cannot read"),
    (re.compile(r"\bthe issue's\b", re.I), "a tracker issue a clone cannot read"),
]


def user_text_files() -> list[Path]:
    files = [ROOT / "README.md"]
    files += sorted((ROOT / "docs").rglob("*.md"))
    files += sorted((ROOT / "recipes").rglob("*.toml"))
    files += sorted(p for ext in ("py", "md", "toml", "txt") for p in (ROOT / "tpflow").rglob(f"*.{ext}"))
    # this file holds the patterns and their examples as test data
    files += sorted(p for p in (ROOT / "tests").glob("*.py") if p.name != Path(__file__).name)
    files += sorted((ROOT / "benchmarks").rglob("*.py"))
    files += sorted(p for ext in ("py", "md", "toml") for p in (ROOT / "plugins").rglob(f"*.{ext}"))
    # experiments/rivals_learning.toml is a pre-registered protocol whose text is recorded by hash: it must stay as
    # registered, so it is not held to this vocabulary
    files += sorted(p for p in (ROOT / "experiments").glob("*.toml") if p.name != "rivals_learning.toml")
    return [p for p in files if p.is_file()]


def offences(path: Path) -> list[str]:
    found = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        for pattern, why in FORBIDDEN:
            for match in pattern.finditer(line):
                found.append(f"{path.relative_to(ROOT)}:{number}: {match.group(0)!r} ({why})")
    return found


def test_user_docs_recipes_and_code_cite_nothing_outside_the_repository_nor_the_work_log():
    files = user_text_files()
    assert any(p.name == "algorithm.md" for p in files) and any(p.suffix == ".toml" for p in files)
    assert any(p.suffix == ".py" for p in files)
    found = [line for path in files for line in offences(path)]
    assert not found, "user-facing text that a clone cannot follow:\n" + "\n".join(found)


@pytest.mark.parametrize(
    "text",
    [
        "transcribed in ../shared/RIVALS.md §6(a)",
        "(RIVALS.md §3(b))",
        "`bash .whl/run.sh python3 benchmarks/gpu_smoke.py`",
        "beyond this session's budget",
        "The previous session had finished 45 runs",
        "2026-12-01, fifth sitting",
        "resumed after stop 12",
        "recorded by the audit of issue 36",
        "over the issue's 5-hour limit",
    ],
)
def test_the_vocabulary_catches_what_it_is_meant_to(text):
    assert any(pattern.search(text) for pattern, _ in FORBIDDEN)


def test_offences_name_file_and_line(tmp_path, monkeypatch):
    monkeypatch.setattr(f"{__name__}.ROOT", tmp_path)
    path = tmp_path / "docs" / "page.md"
    path.parent.mkdir()
    path.write_text("a clean line\nsee ../shared/RIVALS.md §2\n")
    found = offences(path)
    assert found and all(line.startswith("docs/page.md:2: ") for line in found)


@pytest.mark.parametrize(
    "text",
    [
        "the sweep stops at epoch 16",  # "stop" without a number
        "then a stop 21:41:18-21:52:18 (tempflow/seed_20 resumed)",  # a time
        "time_shift = 3.0  # docs/algorithm.md §10",
        "`tpflow compare experiments/rivals_learning.toml`",  # rivals_learning is not RIVALS.md
        "git worktree add ../wt-sweep ed2b450",
    ],
)
def test_the_vocabulary_spares_ordinary_text(text):
    assert not any(pattern.search(text) for pattern, _ in FORBIDDEN)


def test_readme_lists_every_page_of_docs():
    """README linked no distributed.md nor experiments.md, and there was no start-here page."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    listed = set(re.findall(r"\(docs/([\w.-]+\.md)\)", readme))
    pages = {p.name for p in (ROOT / "docs").glob("*.md")}
    assert "start-here.md" in pages and pages <= listed, f"not in README's list: {sorted(pages - listed)}"
