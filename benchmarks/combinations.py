"""The combination matrix, whole: every pair of option levels judged (tests/combinations.py), the table written
into docs/testing.md ("The combination matrix").

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/combinations.py                 # the matrix, table into the docs
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/combinations.py --suite-rows --seed 6  # rewrite tests' SUITE_ROWS

A combination is refused by the recipe check in one paragraph, or accepted: its first optimizer step's gradient is
the reference configuration's (recompute native, fp32, blocks not compiled) within its precision's tolerance, and
its weights stay finite through an update with one non-finite trajectory. The rows are a pairwise covering design
over ``FACTORS`` (every pair of levels in an accepted row where one can hold it, else in a refused one). Exit status 1
when a combination fails. Compiled blocks run through AOTAutograd (``aot_eager``), not inductor.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

BEGIN, END = "<!-- combinations:begin -->", "<!-- combinations:end -->"


def accepted_by_check(recipe: Path, weights: Path):
    from tests.combinations import overrides
    from tpflow.errors import RecipeError
    from tpflow.recipe import load_recipe

    seen: dict[tuple, bool] = {}

    def accepted(row: dict[str, str]) -> bool:
        key = tuple(sorted(row.items()))
        if key not in seen:
            try:
                load_recipe(recipe, overrides({"compile": "off", **row}, weights))
                seen[key] = True
            except RecipeError:
                seen[key] = False
        return seen[key]

    return accepted


def _row_lines(values: list[str], width: int = 119) -> str:
    """One row of SUITE_ROWS as source lines within the line length: ``    (a, b, ...),`` wrapped after a comma."""
    lines, line = [], "    ("
    for k, value in enumerate(values):
        item = value + ("), " if k == len(values) - 1 else ", ")
        if len(line) + len(item.rstrip()) > width:
            lines.append(line.rstrip())
            line = "     "
        line += item
    return "\n".join([*lines, line.rstrip()]) + "\n"


def table(outcomes, names: list[str], seconds: float) -> str:
    from tests.combinations import TOLERANCE

    counts = {s: sum(o.status == s for o in outcomes) for s in ("accepted", "refused", "FAILED")}
    lines = [
        f"{len(outcomes)} combinations (a pairwise covering design over {', '.join(names)}): "
        f"{counts['accepted']} accepted and within tolerance, {counts['refused']} refused in one paragraph, "
        f"{counts['FAILED']} failed; {seconds:.0f} s on the CPU. Tolerance on 1 − cos of the first step's gradient "
        f"to the reference's: " + ", ".join(f"{k} {v:g}" for k, v in TOLERANCE.items()) + ".",
        "",
        "| " + " | ".join(names) + " | verdict | 1 − cos | finite after a NaN trajectory | why refused |",
        "|" + "---|" * (len(names) + 4),
    ]
    for o in outcomes:
        why = ""
        if o.status != "accepted":
            why = re.sub(r"^\S*\.toml:?\s*", "", o.detail)
            why = (why[:110] + "…") if len(why) > 110 else why
            why = why.replace("|", "\\|")
        distance = "" if o.distance is None else f"{max(o.distance, 0.0):.1e}"
        finite = "" if o.finite is None else ("yes" if o.finite else "**no**")
        lines.append("| " + " | ".join(o.combo[n] for n in names) + f" | {o.status} | {distance} | {finite} | {why} |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--suite-rows", action="store_true", help="rewrite tests/combinations.py's SUITE_ROWS only")
    parser.add_argument("--docs", type=Path, default=ROOT / "docs" / "testing.md")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    from tests.combinations import FACTORS, MUST_TRAIN, SUITE_FACTORS, covering, judge, recipe_text
    from tests.conftest import write_tiny_weights

    folder = Path(tempfile.mkdtemp(prefix="tpflow-matrix-"))
    recipe = folder / "tiny.toml"
    recipe.write_text(recipe_text(folder / "run"))
    weights = write_tiny_weights(folder)
    if args.suite_rows:
        rows = covering(SUITE_FACTORS, accepted_by_check(recipe, weights), seed=args.seed, first=MUST_TRAIN)
        text = "SUITE_ROWS: list[tuple[str, ...]] = [  # in SUITE_FACTORS' order\n"
        text += "".join(_row_lines([json.dumps(row[n]) for n in SUITE_FACTORS]) for row in rows) + "]"
        path = ROOT / "tests" / "combinations.py"
        source = path.read_text()
        source = re.sub(r"SUITE_ROWS: list\[tuple\[str, \.\.\.\]\] = \[(?:\]|.*?\n\])[^\n]*", lambda _: text,
                        source, count=1, flags=re.S)  # fmt: skip
        path.write_text(source)
        print(f"{len(rows)} rows written to {path}")
        return 0
    rows = covering(FACTORS, accepted_by_check(recipe, weights), seed=args.seed, first=MUST_TRAIN)
    cache: dict = {}
    outcomes, start = [], time.perf_counter()
    for k, row in enumerate(rows):
        t = time.perf_counter()
        outcomes.append(judge(row, recipe, weights, cache))
        o = outcomes[-1]
        print(f"[{k + 1}/{len(rows)}] {time.perf_counter() - t:5.1f} s {o.status:8s} {row} {o.detail[:100]}",
              file=sys.stderr, flush=True)  # fmt: skip
    text = table(outcomes, list(FACTORS), time.perf_counter() - start)
    print(text)
    docs = args.docs.read_text()
    if BEGIN in docs and END in docs:
        head, rest = docs.split(BEGIN, 1)
        docs = head + BEGIN + "\n" + text + "\n" + END + rest.split(END, 1)[1]
        args.docs.write_text(docs)
    return int(any(o.status == "FAILED" for o in outcomes))


if __name__ == "__main__":
    raise SystemExit(main())
