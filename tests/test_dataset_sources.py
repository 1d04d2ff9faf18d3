"""Where a command's editing prompts find their sources without ``--image``: inspect-trajectory on an editing recipe
edits the dataset's own item (``tpflow.inspect.traces.dataset_sources``; a prompt the dataset lacks, or a dataset that
cannot be read, gives none, and the command then asks for ``--image``: tests/test_edit_cli.py); ``tpflow eval
--prompts FILE.jsonl`` reads an editing recipe's file as edit-jsonl, each line's source beside its instruction."""

from __future__ import annotations

import json
from pathlib import Path

from PIL import Image

from tpflow.evaluation.prompt_sets import prompt_set
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


def test_an_eval_prompt_file_of_an_editing_recipe_carries_its_sources(tmp_path) -> None:
    Image.new("RGB", (32, 32), (0, 0, 255)).save(tmp_path / "blue.png")
    lines = [
        {"prompt": "make it red", "source": "blue.png", "tag": "recolor"},
        {"prompt": "keep it", "source": "blue.png"},
    ]
    file = tmp_path / "edits.jsonl"
    file.write_text("".join(json.dumps(line) + "\n" for line in lines))
    items, split = prompt_set(str(file), load_recipe(RECIPES / "shapes_edit_tp.toml"))
    assert split is None and [it.prompt for it in items] == ["make it red", "keep it"]
    assert items[0].metadata["sources"] == [str(tmp_path / "blue.png")] and items[0].metadata["tag"] == "recolor"
    text_only, _ = prompt_set(str(file), load_recipe(RECIPES / "shapes_tp.toml"))  # a text-to-image recipe: jsonl
    assert "sources" not in text_only[0].metadata
