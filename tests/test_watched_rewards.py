"""``[eval] rewards``: rewards the run watches but does not train on, scored on the evaluation's images, their
standard errors, and the warning when the trained reward rises while a watched one falls beyond the noise."""

from __future__ import annotations

import pytest

from tests.test_train import tiny_recipe
from tpflow.errors import RecipeError
from tpflow.recipe import load_recipe
from tpflow.scoring.watched import hacking_warnings, standard_errors

WATCH = ['eval.rewards=[{name = "image-stat", label = "contrast", options = {statistic = "contrast"}}]']


def test_the_warning_needs_both_moves_beyond_twice_their_standard_error():
    before = {"eval_reward": 0.50, "eval_reward_se": 0.01, "eval_watch_x": 0.60, "eval_watch_x_se": 0.01}
    hacked = {"eval_reward": 0.60, "eval_reward_se": 0.01, "eval_watch_x": 0.50, "eval_watch_x_se": 0.01}
    (warning,) = hacking_warnings(before, hacked)
    assert "watched reward x fell by -0.1000" in warning and "rose by +0.1000" in warning
    noisy = {**hacked, "eval_watch_x": 0.58}  # a fall of 0.02 < 2·√2·0.01
    assert hacking_warnings(before, noisy) == []
    both_up = {**hacked, "eval_watch_x": 0.70}
    assert hacking_warnings(before, both_up) == [] and hacking_warnings({}, hacked) == []


def test_standard_errors_only_with_a_watched_reward():
    assert standard_errors({"strict": [1.0, 0.0]}, [0.1, 0.2]) == {}
    se = standard_errors({"watch_a": [1.0, 3.0]}, [0.0, 2.0])
    assert se == {"eval_reward_se": 1.0, "eval_watch_a_se": 1.0}  # sample std √2, over √2


def test_a_run_evaluates_the_watched_rewards_beside_the_trained_one(tmp_path, tiny_weights):
    from tpflow.train.trainer import Trainer

    recipe = load_recipe(tiny_recipe(tmp_path, tiny_weights, reward="image-stat"), ["train.epochs=1", *WATCH])
    metrics = Trainer(recipe).fit()
    assert 0 <= metrics["eval_watch_contrast"] <= 1 and metrics["eval_watch_contrast_se"] > 0
    assert metrics["eval_reward_se"] > 0


def test_an_unknown_watched_reward_is_refused_before_anything_loads(tmp_path, tiny_weights):
    path = tiny_recipe(tmp_path, tiny_weights, reward="image-stat")
    with pytest.raises(RecipeError, match=r"\[eval\] rewards\[0\] \('no-such'\)"):
        load_recipe(path, ['eval.rewards=[{name = "no-such"}]'])
    with pytest.raises(RecipeError, match="labels must be unique"):
        load_recipe(path, ['eval.rewards=[{name = "image-stat"}, {name = "image-stat"}]'])
