"""A dataset without a test split (a prompt file without ``test_path``) is evaluated on its train prompts, and says
so where the figures are read: a warning when training starts, ``eval_on_train_split`` in the eval metrics, and the
split in ``tpflow eval``'s table, its warnings and eval.json."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
from rich.console import Console

from tests.test_train import tiny_recipe
from tpflow.cli import main
from tpflow.recipe import load_recipe
from tpflow.train.trainer import Trainer

TRAIN, HELD_OUT = ["a red circle", "a blue square"], ["a green triangle"]


def _recipe(tmp_path: Path, weights: Path, held_out: bool) -> Path:
    """The tiny recipe on a text-file dataset, with or without a held-out test file."""
    (tmp_path / "train.txt").write_text("\n".join(TRAIN) + "\n")
    (tmp_path / "test.txt").write_text("\n".join(HELD_OUT) + "\n")
    dataset = f'[dataset]\nname = "text-file"\npath = "{tmp_path / "train.txt"}"\n'
    if held_out:
        dataset += f'test_path = "{tmp_path / "test.txt"}"\n'
    text = tiny_recipe(tmp_path, weights).read_text().replace('[dataset]\nname = "shapes"\ntest_size = 6\n', "")
    path = tmp_path / "recipe.toml"
    path.write_text(text + dataset)
    return path


@pytest.mark.parametrize("held_out", [False, True])
def test_training_says_when_it_evaluates_on_the_train_split(tmp_path, tiny_weights, plugin, held_out):
    console = Console(file=io.StringIO(), width=200)
    trainer = Trainer(load_recipe(_recipe(tmp_path, tiny_weights, held_out), ["eval.every=0"]), console=console)
    try:
        metrics = trainer.evaluate(0)
    finally:
        trainer.run_lock.release()
    said = console.file.getvalue()
    assert [item.prompt for item in trainer.test_items] == (HELD_OUT if held_out else TRAIN)
    if held_out:
        assert "eval_on_train_split" not in metrics and "no test split" not in said
    else:
        assert metrics["eval_on_train_split"] == 1.0  # beside eval_reward in metrics.jsonl and the trackers
        assert "warning:" in said and "'text-file' has no test split" in said


@pytest.mark.parametrize("held_out", [False, True])
def test_tpflow_eval_says_which_split_it_sampled(tmp_path, tiny_weights, plugin, capsys, held_out):
    capsys.readouterr()
    with pytest.raises(SystemExit) as exc:
        main(["eval", str(_recipe(tmp_path, tiny_weights, held_out)), "--steps", "2", "--out", str(tmp_path / "e")])
    out, err = capsys.readouterr()
    assert exc.value.code in (0, None), err
    target = json.loads((tmp_path / "e" / "eval.json").read_text())["target"]
    assert [image["prompt"] for image in target["images"]] == (HELD_OUT if held_out else TRAIN)
    settings = target["settings"]
    assert settings["prompts"] == "test" and settings["split"] == ("test" if held_out else "train")
    if held_out:
        assert settings["warnings"] == [] and "no test split" not in out + err
    else:
        assert len(settings["warnings"]) == 1 and "'text-file' has no test split" in settings["warnings"][0]
        assert "trainsplit,notestsplit" in "".join(out.split())  # the table's title, wrapped to the table's width
        assert "warning:" in err and "'text-file' has no test split" in err
