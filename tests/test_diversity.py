"""``[eval] diversity``: the mean pairwise embedding distance within a prompt's images, its standard error over the
prompts, its warning, and the hacking guard in ``tpflow eval --baseline`` and ``tpflow compare``.

One tiny run (watched reward + diversity) is trained once per module and shared by the run, eval and compare tests.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
from typer.testing import CliRunner

from tests.test_train import tiny_recipe
from tpflow.errors import RecipeError
from tpflow.recipe import load_recipe
from tpflow.scoring.watched import hacking_warnings
from tpflow.train.diversity import (
    build_embedder,
    diversity_se,
    mean_pairwise_distance,
    per_group,
    pixel_embeddings,
    sibling_distances,
)

GUARD = """
rewards = [{name = "image-stat", label = "contrast", options = {statistic = "contrast"}}]
diversity = "pixels"
images_per_prompt = 2
"""  # the tiny recipe's [eval]: a watched reward and the pixel diversity of 2 images per prompt


def test_the_measure_against_a_hand_computation_in_float64():
    e = torch.tensor([[1.0, 0.0], [0.0, 2.0], [3.0, 3.0]], dtype=torch.float64, device="cpu")  # [3, 2], not unit
    c = 1 / math.sqrt(2)  # cos(e0, e2) = cos(e1, e2); cos(e0, e1) = 0
    hand = ((1 - 0) + (1 - c) + (1 - c)) / 3
    assert mean_pairwise_distance(e) == pytest.approx(hand, abs=1e-15)
    groups = [7, 7, 7, 9, 9]  # two groups: the three above, and a pair at right angles
    both = torch.cat([e, torch.tensor([[1.0, 0.0], [0.0, 1.0]], dtype=torch.float64, device="cpu")])  # [5, 2]
    per_image = sibling_distances(both, groups)
    assert per_image[0] == pytest.approx(((1 - 0) + (1 - c)) / 2, abs=1e-15)  # image 0 to its two siblings
    assert per_group(per_image, groups) == pytest.approx({7: hand, 9: 1.0}, abs=1e-15)
    assert diversity_se(per_image, groups) == pytest.approx(abs(hand - 1.0) / 2, abs=1e-15)  # sd/√2 of 2 groups
    assert math.isnan(mean_pairwise_distance(e[:1])) and math.isnan(sibling_distances(e[:1], [0])[0])


def test_a_collapsed_group_has_no_diversity():
    g = torch.Generator(device="cpu").manual_seed(0)
    image = torch.rand(1, 3, 32, 32, generator=g, device="cpu")
    same = image.expand(4, -1, -1, -1)  # [4, 3, 32, 32]: one image four times
    others = torch.rand(4, 3, 32, 32, generator=g, device="cpu")
    for embed in (pixel_embeddings, build_embedder("shapes-clip", device="cpu")):
        assert mean_pairwise_distance(embed(same)) == pytest.approx(0.0, abs=1e-6)
        assert mean_pairwise_distance(embed(others)) > 0.01


def test_diversity_falling_while_the_reward_rises_warns():
    before = {"eval_reward": 0.5, "eval_reward_se": 0.01, "eval_diversity": 0.30, "eval_diversity_se": 0.01}
    collapsed = {**before, "eval_reward": 0.6, "eval_diversity": 0.10}
    (warning,) = hacking_warnings(before, collapsed)
    assert "diversity within groups" in warning and "fell by -0.2000" in warning
    assert hacking_warnings(before, {**collapsed, "eval_diversity": 0.29}) == []


def test_a_diversity_without_groups_or_embedding_is_refused(tmp_path, tiny_weights):
    path = tiny_recipe(tmp_path, tiny_weights, reward="image-stat")
    with pytest.raises(RecipeError, match="images_per_prompt to 2 or more"):
        load_recipe(path, ['eval.diversity="pixels"'])
    with pytest.raises(RecipeError, match="names no embedding"):
        load_recipe(path, ['eval.diversity="sift"', "eval.images_per_prompt=2"])


@pytest.fixture(scope="module")
def guarded_run(tmp_path_factory, tiny_weights):
    """A finished tiny run with a watched reward and the pixel diversity, its recipe file and its metrics."""
    from tpflow.train.trainer import Trainer

    tmp = tmp_path_factory.mktemp("guarded")
    path = tiny_recipe(tmp, tiny_weights, reward="image-stat", extra=GUARD)
    run = tmp / "run"
    return run, path, Trainer(load_recipe(path, ["train.epochs=1"]), run_dir=run).fit()


def test_a_run_logs_the_diversity_with_its_standard_error(guarded_run):
    run, _, metrics = guarded_run
    assert 0 < metrics["eval_diversity"] <= 2 and metrics["eval_diversity_se"] > 0
    lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert sum("eval_diversity" in line for line in lines) == 2  # epoch 0 and the final one: its trend


def test_eval_baseline_reports_the_watched_figures_with_intervals(guarded_run, tmp_path):
    from tpflow.cli import app

    run, recipe, _ = guarded_run
    out = tmp_path / "eval"
    result = CliRunner().invoke(app, ["eval", str(run), "--baseline", str(recipe), "--out", str(out)])
    assert result.exit_code == 0, result.output
    text = " ".join(result.output.split())
    assert "watched contrast vs baseline" in text and "watched diversity vs baseline" in text
    data = json.loads((out / "eval.json").read_text())
    assert {"watch_contrast", "diversity"} <= set(data["difference_interval"]["categories"]["overall"])
    one = CliRunner().invoke(app, ["eval", str(run), "--images-per-prompt", "1", "--out", str(tmp_path / "one")])
    assert one.exit_code == 0 and "diversity is not measured" in " ".join(one.output.split()), one.output


def test_compare_reports_the_watched_figures_and_warns(tmp_path):
    from tpflow.experiments.compare import markdown, watched_report
    from tpflow.experiments.spec import Endpoint

    def run(reward: float, watched: float, diversity: float) -> dict:
        first = {"epoch": 0, "eval_reward": 0.5, "eval_watch_x": 0.5, "eval_diversity": 0.3}
        last = {"epoch": 2, "eval_reward": reward, "eval_watch_x": watched, "eval_diversity": diversity}
        return {"evals": [first, last]}

    runs = {
        "base": {0: run(0.50, 0.50, 0.30), 1: run(0.52, 0.50, 0.31), 2: run(0.51, 0.51, 0.30)},
        "hack": {0: run(0.70, 0.30, 0.30), 1: run(0.73, 0.31, 0.32), 2: run(0.71, 0.29, 0.30)},
    }
    endpoint = Endpoint(arm="hack", baseline="base", metric="eval_reward", statistic="final")
    guard = watched_report(runs, [0, 1, 2], endpoint, ["base", "hack"])
    assert guard["metrics"] == ["eval_reward", "eval_diversity", "eval_watch_x"]
    assert guard["differences"]["hack"]["eval_watch_x"]["mean"] == pytest.approx(-0.2033333, abs=1e-6)
    assert guard["arms"]["hack"]["eval_reward"]["mean"] == pytest.approx(0.7133333, abs=1e-6)
    assert any("in hack over base" in w and "watched reward x" in w for w in guard["warnings"])
    assert not any("diversity" in w for w in guard["warnings"])  # the diversity did not move
    result = {"experiment": "e", "endpoint": endpoint.model_dump(), "source": "x.json", "primary": None,
              "secondary": [], "arms": {}, "runs": {}, "missing": [], "amendments": [], "watched": guard}  # fmt: skip
    text = markdown(result)
    assert "| eval_watch_x | 0.5033 [" in text and "**Warning**: possible reward hacking" in text


def test_an_experiment_may_set_a_list_of_tables():
    """``eval.rewards = [{...}]`` in an experiment's [task] reaches the recipe as TOML's inline tables."""
    from tpflow.experiments.spec import _sets

    table = {"eval": {"rewards": [{"name": "image-stat", "options": {"statistic": "contrast"}}], "every": 1}}
    assert _sets(table) == ['eval.rewards=[{"name" = "image-stat", "options" = {"statistic" = "contrast"}}]',
                            "eval.every=1"]  # fmt: skip
