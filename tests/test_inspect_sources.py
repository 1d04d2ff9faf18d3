"""inspect-trajectory on an editing recipe without ``--image`` edits the dataset's own item: its sources come from
the dataset (``tpflow.inspect.traces.dataset_sources``); a prompt the dataset lacks, or a dataset that cannot be read,
gives none, and the command then asks for ``--image`` (tests/test_edit_cli.py)."""

from __future__ import annotations

from pathlib import Path

from tpflow.inspect.traces import dataset_sources
from tpflow.recipe import load_recipe
from tpflow.sources import load

RECIPES = Path(__file__).resolve().parents[1] / "recipes"


def test_an_editing_datasets_prompt_brings_its_source() -> None:
    recipe = load_recipe(RECIPES / "shapes_edit_tp.toml")
    item = next(iter(recipe.build("dataset").split("train")))
    refs = dataset_sources(recipe, item.prompt)
    assert refs and refs == list(item.metadata["sources"])[: len(refs)]
    assert load(refs[0]).shape[0] == 3  # a reference the sources module renders: [3, H, W]
    assert dataset_sources(recipe, "no such instruction") == []


def test_an_unreadable_dataset_gives_no_source(tmp_path) -> None:
    recipe = load_recipe(RECIPES / "shapes_edit_tp.toml", ["dataset.name=edit-jsonl", f"dataset.path={tmp_path}/x"])
    assert dataset_sources(recipe, "make the circle red") == []
