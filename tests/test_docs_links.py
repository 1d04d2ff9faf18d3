"""Every relative link in the user-facing markdown resolves: README.md, recipes/README.md and every page under docs/.

A link names a file that exists (relative to the page), and a ``#fragment`` names a heading of the page it points
to, as GitHub makes its anchors. Links to other sites (``https:``, ``mailto:``) are not followed: the suite is
offline. Code blocks and inline code are skipped, where brackets are code, not links.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")  # [text](target) and ![alt](target)
FENCE = re.compile(r"^(```|~~~).*?^\1", re.M | re.S)
INLINE_CODE = re.compile(r"`[^`\n]*`")
SCHEME = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")


def pages() -> list[Path]:
    return [ROOT / "README.md", ROOT / "recipes" / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def prose(text: str) -> str:
    """The text without fenced code blocks and inline code."""
    return INLINE_CODE.sub("", FENCE.sub("", text))


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, inline markup and punctuation dropped, spaces to hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """The anchors of a page's headings; a repeated heading gets -1, -2, ... as on GitHub."""
    seen: dict[str, int] = {}
    found = set()
    for line in FENCE.sub("", path.read_text(encoding="utf-8")).splitlines():
        match = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if match is None:
            continue
        base = slug(match.group(1))
        count = seen.get(base, 0)
        seen[base] = count + 1
        found.add(base if count == 0 else f"{base}-{count}")
    return found


def broken_links(page: Path) -> list[str]:
    """Each relative link of ``page`` whose file, or whose heading, is not there."""
    found = []
    for target in LINK.findall(prose(page.read_text(encoding="utf-8"))):
        if SCHEME.match(target):
            continue
        file, _, fragment = target.partition("#")
        resolved = (page.parent / file).resolve() if file else page
        where = f"{page.relative_to(ROOT)}: ({target})"
        if not resolved.exists():
            found.append(f"{where}: no such file")
        elif fragment and resolved.suffix == ".md" and fragment not in anchors(resolved):
            found.append(f"{where}: no heading with anchor #{fragment} in {resolved.name}")
    return found


def test_every_relative_link_in_readme_recipes_and_docs_resolves():
    checked = [p for p in pages() if p.is_file()]
    assert ROOT / "README.md" in checked and len(checked) > 10
    found = [line for page in checked for line in broken_links(page)]
    assert not found, "links that do not resolve:\n" + "\n".join(found)


def test_a_broken_link_or_anchor_is_reported_and_code_is_not_read(tmp_path, monkeypatch):
    monkeypatch.setattr(f"{__name__}.ROOT", tmp_path)
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "other.md").write_text("# Other page\n\n## Will it fit?\n\n## Will it fit?\n")
    page = tmp_path / "docs" / "page.md"
    page.write_text(
        "[ok](other.md#will-it-fit) [again](other.md#will-it-fit-1) [web](https://example.com/x.md) [self](#a-title)\n"
        "# A title\n"
        "[gone](missing.md) [bad anchor](other.md#nowhere)\n"
        "`[code](not-a-link.md)`\n```\n[block](nor-this.md)\n```\n"
    )
    assert broken_links(page) == [
        "docs/page.md: (missing.md): no such file",
        "docs/page.md: (other.md#nowhere): no heading with anchor #nowhere in other.md",
    ]


def test_anchors_follow_githubs_rule():
    assert slug("4. SD3.5-Medium scale on a GPU (`benchmarks/gpu_smoke.py`): one epoch measured") == (
        "4-sd35-medium-scale-on-a-gpu-benchmarksgpu_smokepy-one-epoch-measured"
    )
    assert slug("Sharding (FSDP2)") == "sharding-fsdp2"
    assert slug("`tpflow inspect-trajectory`") == "tpflow-inspect-trajectory"
