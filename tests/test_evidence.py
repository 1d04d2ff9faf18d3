"""Evidence II's sweep code (benchmarks/evidence.py, _evidence_stats.py) at toy size: the recipes it trains, the
run-and-resume loop, the summaries and the pre-registered statistics. A wrong interval or a mis-built arm would
make docs/results.md §2 claim what the runs do not show."""

from __future__ import annotations

import importlib
import math
import sys
from pathlib import Path

import numpy as np
import pytest
from scipy import stats as scipy_stats

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


@pytest.fixture(scope="module")
def bench():
    sys.path.insert(0, str(BENCHMARKS))
    try:
        yield importlib.import_module("evidence"), importlib.import_module("_evidence_stats")
    finally:
        sys.path.remove(str(BENCHMARKS))


def _run(seed: int, values: list[float], seconds: list[float] | None = None, strict: list[float] | None = None):
    epochs = [0, 8, 16][: len(values)]
    seconds = seconds or [0.0, 100.0, 200.0][: len(values)]
    strict = strict or values
    evals = [
        {"epoch": e, "seconds": s, "eval_reward_tags": v, "eval_strict_tags": t}
        for e, s, v, t in zip(epochs, seconds, values, strict, strict=True)
    ]
    return {"seed": seed, "evals": evals}


def test_t_interval_matches_the_textbook_formula(bench):
    _, st = bench
    values = [0.01, 0.03, -0.02, 0.05, 0.02, 0.0, 0.04, 0.01]
    mean, low, high, p = st.t_interval(values)
    sem = np.std(values, ddof=1) / math.sqrt(len(values))
    half = scipy_stats.t.ppf(0.975, len(values) - 1) * sem
    assert mean == pytest.approx(np.mean(values))
    assert (low, high) == pytest.approx((mean - half, mean + half))
    assert p == pytest.approx(scipy_stats.ttest_1samp(values, 0).pvalue)
    boot_low, boot_high = st.bootstrap(values)
    assert high - low > boot_high - boot_low  # the bootstrap is the narrower one at small n: why t is primary


def test_holm_adjusts_step_down_and_stays_monotone(bench):
    _, st = bench
    adjusted = st.holm({"a": 0.01, "b": 0.04, "c": 0.03, "d": 0.5})
    assert adjusted == pytest.approx({"a": 0.04, "c": 0.09, "b": 0.09, "d": 0.5})


def test_seeds_needed_grows_as_the_effect_shrinks(bench):
    _, st = bench
    # a paired t test at alpha 0.05, power 0.8, effect = 1 sd needs 10 pairs (the standard table value)
    assert st.seeds_needed(sd=1.0, effect=1.0) == 10
    assert st.seeds_needed(sd=1.0, effect=0.5) > st.seeds_needed(sd=1.0, effect=1.0)


def test_auc_gain_and_seconds_interpolation(bench):
    _, st = bench
    run = _run(0, [0.5, 0.6, 0.8])
    assert st.auc(run) == pytest.approx((0.55 * 8 + 0.7 * 8) / 16)
    assert st.gain(run) == pytest.approx(0.3)
    assert st.at_seconds(run, 150.0) == pytest.approx(0.7)


def test_the_analysis_pairs_by_seed_and_holm_corrects_only_the_secondary(bench):
    _, st = bench
    runs = {
        "outcome": [_run(1, [0.5, 0.5, 0.5]), _run(0, [0.4, 0.5, 0.6]), _run(2, [0.5, 0.55, 0.6])],
        "consistent": [_run(0, [0.4, 0.55, 0.7]), _run(1, [0.5, 0.52, 0.56]), _run(2, [0.5, 0.6, 0.62])],
        "incremental": [_run(0, [0.4, 0.5, 0.6]), _run(2, [0.5, 0.5, 0.5])],  # seed 1 unfinished: pairs 0 and 2
    }
    analysis = st.sweep_analysis(runs, "consistent")
    primary = analysis["rows"][("consistent", "AUC")]
    expected = [st.auc(runs["consistent"][0]) - st.auc(runs["outcome"][1]),  # seed 0
                st.auc(runs["consistent"][1]) - st.auc(runs["outcome"][0]),  # seed 1
                st.auc(runs["consistent"][2]) - st.auc(runs["outcome"][2])]  # fmt: skip
    assert primary["values"] == pytest.approx(expected)
    assert "p_holm" not in primary
    assert analysis["rows"][("incremental", "final")]["values"] == pytest.approx([0.0, -0.1])
    secondary = [row for key, row in analysis["rows"].items() if key != ("consistent", "AUC")]
    assert all(row["p_holm"] >= row["p"] for row in secondary)
    table = st.comparison_table(analysis)
    assert table.splitlines()[2].startswith("| consistent **(primary)** | AUC | 3 |")


def test_the_figure_draws_every_seed_and_the_mean_of_each_arm(bench, tmp_path):
    _, st = bench
    plot = importlib.import_module("_evidence_plot")
    runs = {
        "outcome": [_run(0, [0.4, 0.5, 0.6], [0.0, 100.0, 210.0]), _run(1, [0.5, 0.5, 0.5], [0.0, 90.0, 190.0])],
        "nft": [_run(0, [0.4, 0.6, 0.7]), _run(1, [0.5, 0.6])],  # seed 1 evaluated only twice so far
    }
    lines = plot.plot_sweep(runs, tmp_path / "fig.png", "eval_reward_tags")
    assert lines["outcome"] == ([0, 8, 16], pytest.approx([0.0, 95.0, 200.0]), pytest.approx([0.45, 0.5, 0.55]))
    assert lines["nft"] == ([0, 8], pytest.approx([0.0, 100.0]), pytest.approx([0.45, 0.6]))
    assert (tmp_path / "fig.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_runs_wall_time_counts_epochs_and_evaluations_but_not_the_time_it_lay_killed(bench, tmp_path):
    import json

    cost = importlib.import_module("_evidence_cost")
    run = tmp_path / "sweep" / "consistent_s3"
    run.mkdir(parents=True)
    lines = [  # epoch 0 took 50 s; epoch 1 60 s plus an 80 s evaluation; killed, resumed 5 hours later: epoch 2
        {"epoch": 0, "time": 1000.0, "epoch_s": 50.0},
        {"epoch": 1, "time": 1140.0, "epoch_s": 60.0},
        {"epoch": 2, "time": 1140.0 + 5 * 3600, "epoch_s": 55.0},
        {"epoch": 3, "time": 1140.0 + 5 * 3600 + 70.0},  # the final evaluation: no epoch_s
    ]
    (run / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    assert cost.run_wall_s(run) == pytest.approx(50 + 140 + 55 + 70)
    assert cost.run_wall_s(tmp_path / "nowhere") is None
    text = cost.cost_lines(tmp_path / "sweep", {"consistent": [{"seed": 3}], "outcome": [{"seed": 3}]}, jobs=2)
    assert "consistent 315 s (1 run)" in text and "outcome" not in text  # outcome_s3 has no metrics here
    assert f"{315 / 2 / 3600:.2f} h of sweep at --jobs 2" in text


def test_phase_seconds_and_per_seed_lines(bench, tmp_path):
    import json

    _, st = bench
    cost = importlib.import_module("_evidence_cost")
    run = tmp_path / "outcome_s0"
    run.mkdir()
    lines = [
        {"epoch": e, "time": 10.0 * e, "sample_s": s, "update_s": u}
        for e, (s, u) in enumerate([(5, 9), (7, 11), (6, 30)])
    ]
    (run / "metrics.jsonl").write_text(
        "".join(json.dumps(line) + "\n" for line in [*lines, {"epoch": 3, "time": 40.0}])
    )
    assert cost.phase_seconds(run) == (6, 11)  # medians over the epochs; the final eval line has neither
    assert (
        cost.phase_line(tmp_path, {"outcome": [{"seed": 0}]})
        == "Seconds per epoch, sampling + update (medians): outcome 6.0 + 11.0."
    )
    runs = {
        "outcome": [_run(0, [0.5, 0.5, 0.5]), _run(1, [0.5, 0.6, 0.6])],
        "consistent": [_run(1, [0.5, 0.6, 0.7]), _run(0, [0.5, 0.4, 0.5])],
    }
    assert st.per_seed_lines(runs) == (
        "- AUC per seed, consistent / outcome: s0 0.4500 / 0.5000, s1 0.6000 / 0.5750 (1 of 2 favour consistent)."
    )


def test_every_arm_is_a_valid_recipe_differing_only_in_credit_and_completions(bench):
    ev, _ = bench
    from tpflow.recipe import validate_recipe

    base = ev.recipe_data(ev.arm_overrides("outcome"), 3, "cpu")
    assert base["reward"] == {"name": "shapes-geneval", "score": "soft"}
    assert base["dataset"]["test_prompts"] == "distinct" and base["eval"]["images_per_prompt"] == 4
    for arm in ev.ARMS:
        data = ev.recipe_data(ev.arm_overrides(arm), 3, "cpu")
        recipe = validate_recipe(data, where=arm, path=ev.BASE_RECIPE)
        assert recipe.train.seed == 3
        for section in data:
            if section not in ("credit", "rollout"):
                assert data[section] == base[section], (arm, section)
        changed = {k for k in data["rollout"] if data["rollout"][k] != base["rollout"].get(k)}
        assert changed <= {"completions", "completion_steps"}, (arm, changed)


def test_a_toy_pilot_runs_resumes_and_reports(bench, tmp_path, monkeypatch):
    ev, st = bench
    toy = {"train.epochs": 2, "eval.every": 1, "train.prompts_per_epoch": 2, "train.group_size": 2,
           "train.rollout_batch": 4, "eval.num_prompts": 3, "eval.images_per_prompt": 2, "eval.batch_size": 6,
           "rollout.num_steps": 3, "rollout.window_size": 2, "rollout.window_range": [0, 2], "eval.num_steps": 3,
           "optimizer.micro_batch_size": 2}  # fmt: skip
    monkeypatch.setitem(ev.PILOTS, "toy", toy)
    args = ev.parse(["pilot", "toy", "--seeds", "0", "--jobs", "1", "--out", str(tmp_path), "--docs",
                     str(tmp_path / "docs")])  # fmt: skip
    shared = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    base = ev.base_eval(toy, shared)  # the shared epoch-0 evaluation (eval.at_start = false in every run)
    result = ev.run_one("pilots", "toy", toy, 0, shared)
    assert result["evals"][0] == base
    assert [e["epoch"] for e in result["evals"]] == [0, 1, 2]
    assert result["audit"]["ok"], result["audit"]
    assert all(0 <= e["eval_reward_tags"] <= 1 and "eval_reward_seen" in e for e in result["evals"])
    assert result["train"]["optimizer_steps"] and len(result["train"]["reward_mean"]) == 2
    # a finished run is read back, not retrained
    (tmp_path / "pilots" / "toy_s0" / "metrics.jsonl").unlink()
    assert ev.run_one("pilots", "toy", toy, 0, shared) == result
    st.report(tmp_path, ev.PILOTS, ev.PROTOCOL, tmp_path / "docs")  # the toy ran in group "pilots"
    table = (tmp_path / "docs" / "evidence_pilots.md").read_text()
    assert "| toy | 0 |" in table


def test_the_nft_arm_is_its_pilot_on_the_same_task_and_budget(bench, monkeypatch):
    ev, _ = bench
    from tpflow.recipe import validate_recipe

    for pilot in ev.NFT_PILOTS:
        monkeypatch.setitem(ev.NFT_PROTOCOL, "pilot", pilot)
        data = ev.recipe_data(ev.arm_overrides("nft"), 11, "cpu")
        recipe = validate_recipe(data, where=pilot, path=ev.BASE_RECIPE)
        assert recipe.optimizer.name == "nft" and recipe.credit.name == "outcome"
        outcome = ev.recipe_data(ev.arm_overrides("outcome"), 11, "cpu")
        for section in ("reward", "dataset", "eval", "train"):  # the same task, eval set and budget as every arm
            assert data[section] == outcome[section], (pilot, section)


def test_detectable_effect_inverts_the_seed_count(bench):
    """The smallest effect 8 seeds detect at 80% is the effect for which the seed count comes out at 8."""
    _, st = bench
    effect = st.detectable_effect(0.01, 8)
    assert st.t_test_power(0.01, effect, 8) == pytest.approx(0.8, abs=1e-6)
    assert st.seeds_needed(0.01, effect * 1.001) == 8
    assert st.seeds_needed(0.01, effect * 0.99) == 9
    assert st.detectable_effect(0.02, 8) == pytest.approx(2 * effect, rel=1e-6)  # linear in the spread


def test_spread_line_states_the_planned_and_the_observed_spread(bench):
    _, st = bench
    runs = {
        "outcome": [_run(s, [0.5, 0.5 + d, 0.5 + d]) for s, d in enumerate([0.00, 0.02, 0.04])],
        "consistent": [_run(s, [0.5, 0.5 + d, 0.5 + d]) for s, d in enumerate([0.02, 0.02, 0.08])],
    }
    pilots = [{**_run(0, [0.5, 0.5, 0.5]), "name": "p"}, {**_run(1, [0.5, 0.52, 0.52]), "name": "p"}]
    line = st.spread_line(runs, st.sweep_analysis(runs, "consistent"), pilots)
    # AUC = 0.5 + 0.75 d; paired differences 0.015, 0, 0.03: sd 0.015; the pilots' run sd 0.015 / sqrt(2)
    assert "sd of 0.0150 (√2 × the pilots' 0.0106 per run, 1 degrees of freedom)" in line
    assert "outcome 0.0150, consistent 0.0260" in line
    assert "of the primary's paired differences: 0.0150" in line
    assert f"detect an AUC difference of {st.detectable_effect(0.015, 3):.4f}" in line
