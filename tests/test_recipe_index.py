"""recipes/README.md, the recipe index, holds every shipped recipe and states each one as its file sets it.

The index is written by hand (its "follows" column is read from each recipe's header), so it is checked here
instead: one row per recipe file under ``recipes/`` (its path there, ``sd35/ocr_tp.toml``) and no row without a file;
each row's credit, optimizer and rollout plan, its backbone (and whether every weight trains, whether the model is
sharded) and its reward (with the rewards it wraps) as the recipe's TOML sets them; and every test a row names as an
offline check reads that recipe. A recipe added, renamed or changed without its row fails here, and so does one filed
in a folder its backbone does not belong to (the layout the index's "How they are grouped" describes).
"""

from __future__ import annotations

import re
from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[1]
INDEX = ROOT / "recipes" / "README.md"
ROW = re.compile(r"^\| \[([\w./-]+\.toml)\]\(([\w./-]+\.toml)\) \|(.*)\|\s*$")
TICKED = re.compile(r"`([^`]+)`")
TEST_FILE = re.compile(r"\b(test_\w+\.py)\b")
COLUMNS = ("method", "backbone", "reward", "follows", "checked")
RECIPES = ROOT / "recipes"
# The paper-scale recipes' folder per model family, by the backbone name's start; the CPU backbones' recipes sit at
# the top of recipes/, and so does geneval_tp.toml, the paper-scale path the commands' help cites.
FAMILIES = {"sd3.5-": "sd35", "flux.": "flux", "qwen-image": "qwen_image", "wan2.": "wan", "z-image": "z_image"}
CPU_BACKBONES = ("shapes-dit", "shapes-video-dit", "shapes-edit-dit", "tiny-sd3")
KEPT_AT_TOP = ("geneval_tp.toml",)


def index_rows(text: str) -> dict[str, dict[str, str]]:
    """The index's rows by recipe file name: each a dict of its cells after the first (COLUMNS)."""
    rows: dict[str, dict[str, str]] = {}
    for line in text.splitlines():
        match = ROW.match(line)
        if match is None:
            continue
        name, target, rest = match.groups()
        cells = [cell.strip() for cell in rest.split("|")]
        assert name == target, f"row {name!r} links to {target!r}"
        assert len(cells) == len(COLUMNS), f"row {name!r} has {len(cells)} cells after the recipe, not {len(COLUMNS)}"
        assert name not in rows, f"two rows for {name}"
        rows[name] = dict(zip(COLUMNS, cells, strict=True))
    return rows


def reward_names(reward: dict) -> list[str]:
    """The reward's name, then the names of the rewards it wraps (frames, weighted, pairwise, diversity-shaped)."""
    inner = []
    if reward["name"] == "frames":
        inner = [reward["reward"]]
    elif reward["name"] == "weighted":
        inner = [r["name"] if isinstance(r, dict) else r for r in reward["rewards"]]
    elif reward["name"] == "pairwise":
        judge = reward["judge"]
        inner = [judge["name"] if isinstance(judge, dict) else judge]
    elif reward["name"] == "diversity-shaped":
        inner = [reward["reward"]["name"]]
    return [reward["name"], *inner]


def mismatches(name: str, row: dict[str, str], data: dict) -> list[str]:
    """How a row differs from its recipe's TOML (empty when it states it right)."""
    found = []
    method = [data.get("credit", {}).get("name", "consistent"), data.get("optimizer", {}).get("name", "grpo")]
    method += [data["plan"]["name"]] if "plan" in data else []
    if TICKED.findall(row["method"]) != method:
        found.append(f"{name}: method {TICKED.findall(row['method'])} but the recipe sets {method}")
    backbone = data["backbone"]
    if TICKED.findall(row["backbone"])[:1] != [backbone["name"]]:
        found.append(f"{name}: backbone {row['backbone']!r} but the recipe names {backbone['name']!r}")
    if ("full fine-tuning" in row["backbone"]) != (backbone.get("finetune") == "full"):
        found.append(f"{name}: 'full fine-tuning' in its backbone cell, finetune = {backbone.get('finetune')!r}")
    if ("FSDP2" in row["backbone"]) != (data.get("train", {}).get("shard") == "fsdp"):
        found.append(f"{name}: 'FSDP2' in its backbone cell, shard = {data.get('train', {}).get('shard')!r}")
    rewards = reward_names(data["reward"])
    if TICKED.findall(row["reward"]) != rewards:
        found.append(f"{name}: reward {TICKED.findall(row['reward'])} but the recipe sets {rewards}")
    if not row["follows"]:
        found.append(f"{name}: no 'follows'")
    return found


def folder_for(name: str, backbone: str) -> str:
    """Where a recipe belongs under recipes/ ("" for its top), from its file name and its backbone's name."""
    if backbone in CPU_BACKBONES or name in KEPT_AT_TOP:
        return ""
    folders = [folder for start, folder in FAMILIES.items() if backbone.startswith(start)]
    assert folders, f"{name}: no folder for backbone {backbone!r}: add its family to FAMILIES and the index"
    return folders[0]


def test_every_recipe_has_one_row_and_every_row_a_recipe():
    rows = index_rows(INDEX.read_text(encoding="utf-8"))
    files = {p.relative_to(RECIPES).as_posix() for p in RECIPES.rglob("*.toml")}
    assert files, "no recipes found"
    assert not files - rows.keys(), f"recipes without a row in recipes/README.md: {sorted(files - rows.keys())}"
    assert not rows.keys() - files, f"rows of recipes/README.md without a file: {sorted(rows.keys() - files)}"


def test_each_recipe_sits_in_its_model_familys_folder():
    misplaced = []
    for path in sorted(RECIPES.rglob("*.toml")):
        backbone = tomllib.loads(path.read_text(encoding="utf-8"))["backbone"]["name"]
        where = "" if path.parent == RECIPES else path.parent.relative_to(RECIPES).as_posix()
        if where != folder_for(path.name, backbone):
            misplaced.append(
                f"{path.relative_to(RECIPES)} ({backbone}) belongs in recipes/{folder_for(path.name, backbone)}"
            )
    assert not misplaced, "\n".join(misplaced)
    assert folder_for("x.toml", "sd3.5-large") == "sd35" and folder_for("geneval_tp.toml", "sd3.5-medium") == ""


def test_each_row_states_its_recipes_method_backbone_and_reward():
    rows = index_rows(INDEX.read_text(encoding="utf-8"))
    found = []
    for name, row in rows.items():
        data = tomllib.loads((RECIPES / name).read_text(encoding="utf-8"))
        found += mismatches(name, row, data)
    assert not found, "recipes/README.md disagrees with the recipes:\n" + "\n".join(found)


def test_the_offline_checks_a_row_names_are_real():
    """'validated' is tests/test_recipe.py's loop over every recipe file; any other test a row names reads it."""
    shipped = (ROOT / "tests" / "test_recipe.py").read_text(encoding="utf-8")
    assert 'SHIPPED = sorted((ROOT / "recipes").rglob("*.toml"))' in shipped
    assert "def test_every_shipped_recipe_validates(path)" in shipped
    found = []
    for name, row in index_rows(INDEX.read_text(encoding="utf-8")).items():
        if not row["checked"].startswith("validated"):
            found.append(f"{name}: its offline check does not start with 'validated'")
        for test in TEST_FILE.findall(row["checked"]):
            path = ROOT / "tests" / test
            if not path.is_file() or Path(name).stem not in path.read_text(encoding="utf-8"):
                found.append(f"{name}: names tests/{test}, which does not read it")
    assert not found, "\n".join(found)


def test_a_row_that_misstates_its_recipe_is_caught():
    data = tomllib.loads(
        '[backbone]\nname = "flux.1-dev"\nfinetune = "full"\n[reward]\nname = "frames"\nreward = "ocr"\n'
        '[plan]\nname = "branch"\n[credit]\nname = "outcome"\n[train]\nshard = "fsdp"\n'
    )
    right = "| [x.toml](x.toml) | a: `outcome` + `grpo`, `branch` | `flux.1-dev`, full fine-tuning, FSDP2 | `frames` of `ocr` | y | validated |"  # noqa: E501
    (row,) = index_rows(right).values()
    assert mismatches("x.toml", row, data) == []
    wrong = {
        "method": "a: `outcome` + `grpo`",  # the plan left out
        "backbone": "`flux.1-dev`, FSDP2",  # full fine-tuning left out
        "reward": "`frames` of `pickscore`",
        "follows": "",
    }
    for column, cell in wrong.items():
        assert mismatches("x.toml", {**row, column: cell}, data), column
