"""The learning-curve sweep's arithmetic (benchmarks/_learning_stats.py) and the recipes it trains, at no training
cost: a wrong endpoint or a mis-built arm would make docs/results/first_attempt.md claim what the runs do not show."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import numpy as np
import pytest

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


@pytest.fixture(scope="module")
def bench():
    sys.path.insert(0, str(BENCHMARKS))
    try:
        yield importlib.import_module("learning_curves"), importlib.import_module("_learning_stats")
    finally:
        sys.path.remove(str(BENCHMARKS))


def _run(seed, rewards, seconds=None):
    epochs = [0, 2, 4, 6, 8]
    return {"seed": seed, "epochs": epochs, "eval_reward": rewards, "seconds": seconds or [0, 10, 20, 30, 40]}


def test_auc_is_the_mean_reward_over_training(bench):
    _, stats = bench
    assert stats.auc(_run(0, [0.5] * 5)) == pytest.approx(0.5)
    assert stats.auc(_run(0, [0.0, 0.2, 0.4, 0.6, 0.8])) == pytest.approx(0.4)  # linear: the midpoint


def test_reach_finds_the_first_evaluation_at_the_target(bench):
    _, stats = bench
    run = _run(0, [0.5, 0.55, 0.62, 0.6, 0.7])
    assert stats.reach(run, 0.6) == (4, 20)
    assert stats.reach(run, 0.71) is None


def test_bootstrap_interval_holds_the_mean_and_shrinks_with_agreement(bench):
    _, stats = bench
    mean, low, high = stats.bootstrap_ci([1.0, 2.0, 3.0, 4.0, 5.0])
    assert mean == 3.0 and 1.0 <= low < 3.0 < high <= 5.0
    assert stats.bootstrap_ci([2.0, 2.0, 2.0]) == (2.0, 2.0, 2.0)


def test_endpoints_are_paired_by_seed(bench):
    _, stats = bench
    diag = {"nfe_per_traj": 10, "epoch_s_mean": 1.0}
    runs = {
        "outcome": [{**_run(0, [0.5, 0.5, 0.5, 0.5, 0.6]), **diag}, {**_run(1, [0.4, 0.4, 0.4, 0.4, 0.4]), **diag}],
        "consistent": [{**_run(1, [0.4, 0.5, 0.5, 0.5, 0.5]), **diag}, {**_run(0, [0.5, 0.6, 0.6, 0.6, 0.6]), **diag}],
    }
    table = stats.endpoints(runs)
    assert table["consistent"]["final_diff"][0] == pytest.approx(0.05)  # (0.6-0.6 + 0.5-0.4) / 2, seed by seed
    assert table["consistent"]["reached"] == "2/2"
    assert table["consistent"]["reach_epochs"][0] == pytest.approx(1)  # seed 0 at epoch 2, seed 1 already at 0
    assert table["outcome"]["auc_diff"][:3] == (0.0, 0.0, 0.0)


def test_trace_diagnostics(bench):
    _, stats = bench
    nan = float("nan")
    traces = [  # W = 2; one prompt group of two in epoch 0
        {"epoch": 0, "group": 0, "trace": [0.0, 0.0, 1.0], "turning_points": [0, 1], "advantages": [0.0, 1.0]},
        {"epoch": 0, "group": 0, "trace": [0.0, 0.5, 0.5], "turning_points": [0, 0], "advantages": [0.0, 0.0]},
    ]
    d = stats.trace_diagnostics(traces)
    assert d["zero_increment_share"] == 0.5 and d["tp_per_traj"] == 0.5 and d["tp_positions"] == [0.0, 0.5]
    assert d["dropped_share"] == 0.5 and d["group_std"] == pytest.approx(0.25)
    outcome = [{**t, "trace": [nan, nan, t["trace"][-1]]} for t in traces]
    assert stats.trace_diagnostics(outcome)["zero_increment_share"] is None


@pytest.mark.parametrize("task", ["A", "B"])
def test_every_arm_of_the_protocol_is_a_valid_recipe_differing_only_as_stated(bench, task):
    lc, _ = bench
    from tpflow.recipe import validate_recipe

    datas = {arm: lc.recipe_data(task, arm, 3, 8, 2, 96, "cpu") for arm in lc.PROTOCOL["arms"]}
    for arm, data in datas.items():
        recipe = validate_recipe(data, where=arm)
        assert recipe.train.seed == 3 and recipe.train.epochs == 8 and recipe.eval.num_prompts == 96
        assert data["reward"]["name"] == lc.TASKS[task]["reward"]["name"]
        assert data["optimizer"]["beta"] == lc.TASKS[task]["beta"]
    assert {arm: d["credit"]["name"] for arm, d in datas.items()} == {
        "outcome": "outcome",
        "consistent": "consistent",
        "turning_point": "turning_point",
        "incremental": "incremental",
        "consistent_x0": "consistent",
    }
    assert datas["consistent_x0"]["rollout"]["completions"] == "x0"
    strip = [{k: v for k, v in d.items() if k != "credit"} for d in datas.values()]
    for d in strip[1:-1]:
        assert d == strip[0]  # outcome, consistent, turning_point, incremental: only [credit] differs
    assert np.isclose(datas["outcome"]["optimizer"]["learning_rate"], 1e-3)


@pytest.fixture(scope="module")
def audit():
    sys.path.insert(0, str(BENCHMARKS))
    try:
        yield importlib.import_module("credit_audit")
    finally:
        sys.path.remove(str(BENCHMARKS))


@pytest.mark.parametrize("kind", ["outcome", "incremental", "consistent", "turning_point"])
@pytest.mark.parametrize("balanced", [True, False])
def test_the_independent_audit_agrees_with_tpflow_credit(audit, kind, balanced):
    """benchmarks/credit_audit.py re-derives docs/algorithm.md §4 in NumPy without tpflow's code; on random traces with
    many ties and zeros (as a discrete reward gives) both must agree, or the sweep's audit would prove nothing."""
    import torch

    from tpflow import registry

    options = {} if kind in ("outcome", "incremental") else {"balanced": balanced}
    if kind in ("outcome", "incremental") and not balanced:
        pytest.skip("no balancing option")
    assigner = registry.build("credit", kind, **options)
    rng = np.random.default_rng(0)
    for _ in range(50):
        trace = rng.integers(0, 4, size=(16, 10)).astype(np.float64) / 3  # [B, W+1], coarse like GenEval's score
        credit = assigner(torch.from_numpy(trace))
        rewards, turning = audit.step_rewards(trace, kind, balanced)
        np.testing.assert_allclose(credit.step_rewards.numpy(), rewards, rtol=0, atol=1e-12)
        assert (credit.turning_points.numpy() == turning).all()
    if kind == "consistent":  # the audit can tell the two turning-point definitions apart
        differs = [
            not np.array_equal(audit.step_rewards(t, "consistent")[0], audit.step_rewards(t, "turning_point")[0])
            for t in (rng.integers(0, 4, size=(16, 10)) / 3 for _ in range(20))
        ]
        assert any(differs)


def test_the_audit_advantages_group_by_text(audit):
    from tpflow.optim.advantages import group_advantages

    rewards = np.random.default_rng(1).normal(size=(8, 3))
    texts = ["a", "b", "a", "a", "b", "b", "c", "c"]
    expected = group_advantages(__import__("torch").from_numpy(rewards), texts).numpy()
    np.testing.assert_allclose(audit.advantages(rewards, texts), expected, rtol=0, atol=1e-12)
