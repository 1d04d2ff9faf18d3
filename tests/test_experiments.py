"""Experiments (tpflow/experiments): the file, pre-registration, the resumable sweep and the paired comparison."""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path

import pytest

from tests.cli_run import tpflow
from tests.test_train import tiny_recipe
from tpflow.errors import RecipeError, UserError
from tpflow.experiments import lock
from tpflow.experiments.compare import compare, detectable_effect, markdown
from tpflow.experiments.spec import load_experiment
from tpflow.experiments.sweep import DONE, commands, state, sweep


def _experiment(tmp_path, tiny_weights, arms: str | None = None, primary_arm: str = "consistent") -> object:
    recipe = tiny_recipe(tmp_path, tiny_weights)
    arms = arms or '[arms.outcome]\ncredit.name = "outcome"\n[arms.consistent]\ncredit.name = "consistent"\n'
    text = f"""
[experiment]
name = "tiny"
recipe = "{recipe.name}"
seeds = [0, 1]
out = "{tmp_path / "exp"}"
[task]
train.epochs = 1
train.save_every = 1
eval.every = 1
{arms}
[primary]
arm = "{primary_arm}"
baseline = "outcome"
statistic = "final"
"""
    path = tmp_path / "experiment.toml"
    path.write_text(text)
    return path


def _in_process(calls: list):
    def launch(args, env, log):
        calls.append(args)
        return tpflow(*args).returncode

    return launch


def test_validate_checks_the_file_and_every_arm(tmp_path, tiny_weights, plugin):
    path = _experiment(tmp_path, tiny_weights)
    out = tpflow("validate", str(path))
    assert out.returncode == 0 and "valid experiment, 4 runs" in " ".join(out.stdout.split()), out.stderr
    bad = _experiment(tmp_path, tiny_weights, arms='[arms.outcome]\ncredit.name = "outcome"\n'
                      '[arms.consistent]\ncredit.name = "consistnt"\n')  # fmt: skip
    out = tpflow("validate", str(bad))
    assert out.returncode == 2 and "arm 'consistent' (seed 0)" in out.stderr and "Traceback" not in out.stderr
    wrong = _experiment(tmp_path, tiny_weights, primary_arm="tp")
    out = tpflow("validate", str(wrong))
    assert out.returncode == 2 and "'tp' is not an arm" in out.stderr, out.stderr


def test_a_sweep_runs_skips_finished_runs_and_resumes_a_killed_one(tmp_path, tiny_weights, plugin):
    experiment = load_experiment(_experiment(tmp_path, tiny_weights))
    calls: list = []
    result = sweep(experiment, launch=_in_process(calls))
    assert sorted(result["done"]) == ["consistent/seed_0", "consistent/seed_1", "outcome/seed_0", "outcome/seed_1"]
    seeds = [next(a for a in c if a.startswith("train.seed=")) for c in calls]
    assert seeds == ["train.seed=0", "train.seed=0", "train.seed=1", "train.seed=1"]  # seed-major
    assert all(state(run) == "done" for run in experiment.runs()) and commands(experiment) == []
    again: list = []
    assert sweep(experiment, launch=_in_process(again))["skipped"] and again == []  # nothing left to run
    killed = experiment.runs()[1]
    (killed.run_dir / DONE).unlink()  # killed after its checkpoint, before the sweep marked it done
    (line,) = commands(experiment)
    assert str(killed.run_dir) in line and "--resume" in line
    resumed: list = []
    result = sweep(experiment, launch=_in_process(resumed))
    assert result["done"] == [f"{killed.arm}/seed_{killed.seed}"] and "--resume" in resumed[0]


def test_a_changed_file_is_refused_unless_amended(tmp_path, tiny_weights, plugin):
    path = _experiment(tmp_path, tiny_weights)
    out = tmp_path / "exp"
    lock.register(path, out, [])
    assert lock.register(path, out, ["outcome/seed_0"])["amendments"] == []  # unchanged: fine
    path.write_text(path.read_text().replace("seeds = [0, 1]", "seeds = [0, 1, 2]"))
    with pytest.raises(UserError, match="changed after its runs began"):
        lock.register(path, out, ["outcome/seed_0"])
    record = lock.register(path, out, ["outcome/seed_0"], amend="a third seed for power")
    (amendment,) = record["amendments"]
    assert amendment["reason"] == "a third seed for power" and amendment["runs_existing"] == ["outcome/seed_0"]
    cli = tpflow("sweep", str(path), "--amend", "again")
    assert cli.returncode == 2 and "nothing to amend" in cli.stderr
    report = markdown(compare(load_experiment(path, check_arms=False)))
    assert "**Amendment**" in report and "a third seed for power" in report and "outcome/seed_0" in report


def _fake_run(run_dir, values, epoch_s=2.0):
    run_dir.mkdir(parents=True)
    lines = [{"epoch": e, "last_eval_epoch": e, "eval_reward": v, "epoch_s": epoch_s, "nfe_per_traj": 10.0,
              "optimizer_steps": 1.0} for e, v in enumerate(values)]  # fmt: skip
    (run_dir / "metrics.jsonl").write_text("\n".join(json.dumps(line) for line in lines) + "\n")
    (run_dir / DONE).write_text("{}")


def test_compare_against_hand_computed_intervals(tmp_path, tiny_weights, plugin):
    """The primary's paired t interval, Holm over the secondaries and the detectable effect, by hand (scipy's t)."""
    from scipy import stats

    arms = (
        '[arms.outcome]\ncredit.name = "outcome"\n[arms.consistent]\ncredit.name = "consistent"\n'
        '[arms.incremental]\ncredit.name = "incremental"\n[secondary]\narms = ["consistent", "incremental"]\n'
        'endpoints = [{metric = "eval_reward", statistic = "auc"}, {metric = "eval_reward", statistic = "final"}]\n'
    )
    path = _experiment(tmp_path, tiny_weights, arms=arms)
    text = path.read_text().replace("seeds = [0, 1]", "seeds = [0, 1, 2]")
    text = text.replace('statistic = "final"\n', 'statistic = "auc"\n')  # the primary's (not the inline tables')
    path.write_text(text)
    experiment = load_experiment(path, check_arms=False)
    curves = {"outcome": [[0.5, 0.6, 0.7], [0.5, 0.55, 0.6], [0.5, 0.62, 0.64]],
              "consistent": [[0.5, 0.64, 0.75], [0.5, 0.6, 0.61], [0.5, 0.66, 0.7]],
              "incremental": [[0.5, 0.58, 0.69], [0.5, 0.57, 0.62], [0.5, 0.6, 0.66]]}  # fmt: skip
    seconds = {"outcome": [2.0, 4.0, 3.0], "consistent": [5.0, 8.0, 9.0], "incremental": [2.0, 2.0, 3.0]}
    for run in experiment.runs():
        _fake_run(run.run_dir, curves[run.arm][run.seed], seconds[run.arm][run.seed])

    def auc(c):  # trapezoid over epochs 0, 1, 2, divided by the span 2
        return ((c[0] + c[1]) / 2 + (c[1] + c[2]) / 2) / 2

    result = compare(experiment)
    diffs = [auc(curves["consistent"][s]) - auc(curves["outcome"][s]) for s in range(3)]
    mean = sum(diffs) / 3
    sd = math.sqrt(sum((d - mean) ** 2 for d in diffs) / 2)
    half = stats.t.ppf(0.975, 2) * sd / math.sqrt(3)
    p = result["primary"]
    assert p["differences"] == pytest.approx(diffs) and p["mean"] == pytest.approx(mean)
    assert (p["low"], p["high"]) == pytest.approx((mean - half, mean + half))
    assert p["p"] == pytest.approx(2 * stats.t.sf(abs(mean) / (sd / math.sqrt(3)), 2))
    crit, nc = stats.t.ppf(0.975, 2), p["detectable"] / (sd / math.sqrt(3))  # power at the detectable effect: 0.8
    assert 1 - stats.nct.cdf(crit, 2, nc) + stats.nct.cdf(-crit, 2, nc) == pytest.approx(0.8, abs=1e-6)
    assert detectable_effect(sd, 3) == pytest.approx(p["detectable"])
    names = {c["name"] for c in result["secondary"]}  # every (arm, endpoint) but the primary
    assert names == {"consistent − outcome: final of eval_reward", "incremental − outcome: auc of eval_reward",
                     "incremental − outcome: final of eval_reward"}  # fmt: skip
    raw = sorted((c["p"], c["name"]) for c in result["secondary"])
    holm, running = {}, 0.0
    for rank, (p_value, name) in enumerate(raw):  # Holm by hand: (m − rank)·p, running maximum, capped at 1
        running = max(running, min(1.0, (len(raw) - rank) * p_value))
        holm[name] = running
    assert {c["name"]: c["holm_p"] for c in result["secondary"]} == pytest.approx(holm)
    assert result["missing"] == [] and "every" not in result  # every seed is in the report
    own = [auc(c) for c in curves["consistent"]]  # the arm's summary over its seeds, by hand
    half = stats.t.ppf(0.975, 2) * statistics.stdev(own) / math.sqrt(3)
    summary = result["arms"]["consistent"]
    assert summary["seeds"] == 3 and summary["mean"] == pytest.approx(statistics.mean(own))
    assert (summary["low"], summary["high"]) == pytest.approx((summary["mean"] - half, summary["mean"] + half))
    assert summary["epoch_s"] == pytest.approx(22 / 3)  # (5 + 8 + 9) / 3
    assert summary["epoch_s_ratio"] == pytest.approx((5 / 2 + 8 / 4 + 9 / 3) / 3)  # paired by seed: 2.5
    assert result["arms"]["outcome"]["epoch_s_ratio"] == 1.0
    report = markdown(result)
    assert all(f"| {arm} | {seed} |" in report for arm in curves for seed in range(3))
    interval = f"{summary['mean']:.4f} [{summary['low']:.4f}, {summary['high']:.4f}]"
    assert f"| consistent | 3 | {interval} | 10.0 | 7.3 | 2.50 |" in report


def test_summaries_written_beside_a_report_reproduce_it_without_the_run_folders(tmp_path, tiny_weights, plugin):
    import shutil

    path = _experiment(tmp_path, tiny_weights)
    experiment = load_experiment(path, check_arms=False)
    curves = {"outcome": [[0.5, 0.6], [0.5, 0.58]], "consistent": [[0.5, 0.63], [0.5, 0.57]]}
    for run in experiment.runs():
        _fake_run(run.run_dir, curves[run.arm][run.seed])
    saved = tmp_path / "committed" / "runs.json"
    first = tpflow("compare", str(path), "--write-summaries", str(saved))
    assert first.returncode == 0, first.stderr
    assert "Summaries of the 4 finished runs" in " ".join(first.stdout.split())
    shutil.rmtree(experiment.out)  # run folders are not committed: the summaries are
    again = tpflow("compare", str(path), "--summaries", str(saved))
    assert again.returncode == 0, again.stderr
    table = lambda text: text.split("Summaries of")[0].split("Figure:")[0]  # noqa: E731
    assert table(again.stdout) == table(first.stdout)  # the same primary, secondaries and seeds
    bad = tpflow("compare", str(path), "--summaries", str(tmp_path / "none.json"))
    assert bad.returncode == 2 and "Cannot read the run summaries" in bad.stderr


def test_a_sweep_without_a_terminal_prints_a_line_per_finished_run(tmp_path, tiny_weights, plugin, monkeypatch):
    """In a log file (nohup, CI) the progress bar is off: the sweep printed nothing until its end."""

    def fake_sweep(experiment, jobs, devices, on_change):
        for done in range(3):
            on_change({"done": done, "running": 1, "left": 3 - done}, 60.0 * (3 - done))
            on_change({"done": done, "running": 1, "left": 3 - done}, 60.0 * (3 - done))  # no change: no line
        return {"done": ["a", "b", "c"], "skipped": [], "failed": []}

    monkeypatch.setattr("tpflow.experiments.sweep.sweep", fake_sweep)
    out = tpflow("sweep", str(_experiment(tmp_path, tiny_weights)))
    assert out.returncode == 0, out.stderr
    lines = [line for line in out.stdout.splitlines() if "runs:" in line and "done," in line]
    assert [line.split(" ", 1)[1] for line in lines] == [
        "runs: 0 done, 1 running, 3 left, ETA 3 min", "runs: 1 done, 1 running, 2 left, ETA 2 min",
        "runs: 2 done, 1 running, 1 left, ETA 1 min",
    ]  # fmt: skip


def test_the_worked_example_validates():
    """docs/experiments.md's example: the file and its 6 runs' recipes."""
    from pathlib import Path

    experiment = load_experiment(Path(__file__).resolve().parents[1] / "experiments" / "shapes_credit.toml")
    assert len(experiment.runs()) == 6 and experiment.spec.primary.statistic == "auc"


def test_compare_reproduces_evidence_ii_from_its_committed_summaries():
    """experiments/evidence_ii.toml over docs/results/evidence_runs.json gives docs/results.md §2.5's primary (mean,
    t interval, p, bootstrap, detectable effect) and its 15-comparison secondary table, digit for digit as printed."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    result = compare(load_experiment(root / "experiments" / "evidence_ii.toml", check_arms=False))
    doc = (root / "docs" / "results.md").read_text()
    section = doc[doc.index("**Primary endpoint** (consistent − outcome, paired AUC") :]
    section = section[: section.index("No secondary comparison survives Holm")]

    def signed(x: float) -> str:
        return f"{x:+.4f}".replace("-", "−")

    p = result["primary"]
    assert (f"**{signed(p['mean'])}, 95% t interval [{signed(p['low'])}, {signed(p['high'])}], p = {p['p']:.2f}"
            in section)  # fmt: skip
    assert f"Bootstrap cross-check [{signed(p['bootstrap_low'])}, {signed(p['bootstrap_high'])}]" in section
    assert f"detect an AUC\ndifference of {p['detectable']:.3f}" in doc
    columns = ["auc of eval_reward_tags", "final of eval_reward_tags", "auc of eval_strict_tags",
               "at_baseline_seconds of eval_reward_tags"]  # §2.5's column order  # fmt: skip
    rows = {c["name"]: c for c in result["secondary"]}
    assert len(rows) == 15
    for arm in ["consistent", "incremental", "consistent_x0", "consistent_k3"]:
        (line,) = [row for row in section.splitlines() if row.startswith(f"| {arm} |")]
        cells = [cell.strip() for cell in line.strip("|").split("|")][1:]
        for column, cell in zip(columns, cells, strict=True):
            c = rows.get(f"{arm} − outcome: {column}")
            expected = "(primary)" if c is None else f"{signed(c['mean'])} [{signed(c['low'])}, {signed(c['high'])}]"
            assert cell == expected, (arm, column)
    smallest = min(result["secondary"], key=lambda c: c["p"])  # §2.5's text names it, with both p values
    assert smallest["name"] == "consistent_x0 − outcome: final of eval_reward_tags"
    assert f"(p = {smallest['p']:.3f}," in doc and f"Holm-adjusted {smallest['holm_p']:.2f}" in doc


def test_a_sweep_of_an_uncommitted_experiment_file_warns(tmp_path, tiny_weights, plugin, monkeypatch):
    """registration.json held git_commit null without a word: the runs were tied to no code."""
    import json
    import shutil
    import subprocess

    monkeypatch.setattr("tpflow.experiments.sweep.sweep", lambda *a, **k: {"done": [], "skipped": [], "failed": []})
    (tmp_path / "loose").mkdir()
    loose = tpflow("sweep", str(_experiment(tmp_path / "loose", tiny_weights)))
    assert loose.returncode == 0 and "is not in a git repository" in " ".join(loose.stderr.split())
    repo = tmp_path / "repo"
    repo.mkdir()
    path = _experiment(repo, tiny_weights)
    git = ["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@example.org"]
    subprocess.run([*git, "init", "-q"], check=True)
    subprocess.run([*git, "add", path.name], check=True)
    untracked = tpflow("sweep", str(path))  # added, not committed: still no commit to record
    assert "is not committed" in " ".join(untracked.stderr.split())
    subprocess.run([*git, "commit", "-qm", "protocol"], check=True)
    shutil.rmtree(repo / "exp")  # a new out folder registers afresh, now with the commit
    committed = tpflow("sweep", str(path))
    assert committed.returncode == 0 and "git" not in committed.stderr
    assert json.loads((repo / "exp" / "registration.json").read_text())["git_commit"]


def test_auc_over_seconds_is_the_mean_level_over_the_baselines_training_seconds():
    """auc_seconds by hand: the baseline evaluated at 0, 10, 20 s (0.5, 0.6, 0.7) has area 12 over 20 s, 0.60; an
    arm twice as fast per second (0.5, 0.7, 0.8 at 0, 5, 10 s, then held) has (3 + 3.75 + 8) / 20 = 0.7375; an arm
    slower than the baseline is cut at 20 s by interpolation."""
    from tpflow.experiments.curves import auc_seconds, paired_statistic

    def run(points):
        return {"evals": [{"epoch": i, "seconds": s, "eval_reward": v} for i, (s, v) in enumerate(points)]}

    base = run([(0.0, 0.5), (10.0, 0.6), (20.0, 0.7)])
    fast = run([(0.0, 0.5), (5.0, 0.7), (10.0, 0.8)])
    slow = run([(0.0, 0.5), (20.0, 0.6), (40.0, 0.9)])
    assert auc_seconds(base, "eval_reward", 20.0) == pytest.approx(0.60, abs=1e-12)
    assert auc_seconds(fast, "eval_reward", 20.0) == pytest.approx(14.75 / 20, abs=1e-12)
    assert paired_statistic("auc_seconds", "eval_reward", fast, base) == pytest.approx(14.75 / 20 - 0.60, abs=1e-12)
    assert auc_seconds(slow, "eval_reward", 20.0) == pytest.approx(0.55, abs=1e-12)  # (0.5 + 0.6) / 2
    assert math.isnan(auc_seconds(run([(0.0, 0.5)]), "eval_reward", 20.0))


def test_secondary_baselines_join_the_holm_family_and_arms_may_replace_a_section(tmp_path):
    """``[secondary] baselines``: each arm against each further baseline (never itself), in one Holm family; an arm's
    ``replace = ["optimizer"]`` swaps the base recipe's whole section (another optimizer's options)."""
    from tpflow.recipe import load_recipe

    root = Path(__file__).resolve().parent.parent
    path = tmp_path / "e.toml"
    path.write_text(f"""[experiment]
name = "x"
recipe = "{root / "recipes" / "shapes_flowgrpo.toml"}"
seeds = [0, 1, 2]
[arms.a]
credit.name = "outcome"
[arms.b]
replace = ["optimizer"]
[arms.b.optimizer]
name = "nft"
learning_rate = 3e-3
[arms.c]
credit.name = "outcome"
[primary]
arm = "b"
baseline = "a"
[secondary]
arms = ["b", "c"]
baselines = ["b"]
""")
    experiment = load_experiment(path, check_arms=False)
    overrides = {run.arm: run.overrides for run in experiment.runs() if run.seed == 0}
    assert overrides["b"][0] == 'optimizer={"name" = "nft", "learning_rate" = 0.003}'
    recipe = load_recipe(experiment.recipe, list(overrides["b"]))
    assert recipe.optimizer.name == "nft" and recipe.optimizer.options.learning_rate == 3e-3

    def run(values):
        evals = [{"epoch": e, "seconds": 10.0 * e, "eval_reward": v} for e, v in zip((0, 1), values, strict=True)]
        return {"evals": evals, "train": {}}

    runs = {"a": {s: run([0.5, 0.5 + 0.01 * s]) for s in (0, 1, 2)}, "b": {s: run([0.5, 0.6 + 0.01 * s * s])
            for s in (0, 1, 2)}, "c": {s: run([0.5, 0.55 - 0.02 * s]) for s in (0, 1, 2)}}  # fmt: skip
    result = compare(experiment, (runs, []))
    names = [c["name"] for c in result["secondary"]]
    assert names == ["c − a: auc of eval_reward", "c − b: auc of eval_reward"]  # not b − a (the primary), not b − b
    c_minus_b = [(0.55 - 0.02 * s - 0.6 - 0.01 * s * s) / 2 for s in (0, 1, 2)]
    assert result["secondary"][1]["differences"] == pytest.approx(c_minus_b, abs=1e-12)
    bad = path.read_text().replace('baselines = ["b"]', 'baselines = ["z"]')
    path.write_text(bad)
    with pytest.raises(RecipeError, match="baselines"):
        load_experiment(path, check_arms=False)


def test_time_to_a_threshold_by_hand_and_censored():
    """seconds_to_threshold by hand: a baseline at 0.5, 0.6, 0.7 after 0, 10, 20 s reaches 0.65 at 15 s; an arm at
    0.5, 0.7 after 0, 4 s reaches it at 3 s: log speed-up ln(15 / 3). A run that never reaches it counts its total
    seconds (censored, a lower bound); epochs alike. The threshold is required by these statistics only."""
    from pydantic import ValidationError

    from tpflow.experiments.curves import paired_statistic, time_to
    from tpflow.experiments.spec import Endpoint

    def run(points):  # (epoch, seconds, value)
        return {"evals": [{"epoch": e, "seconds": s, "eval_reward": v} for e, s, v in points]}

    base = run([(0, 0.0, 0.5), (8, 10.0, 0.6), (16, 20.0, 0.7)])
    fast = run([(0, 0.0, 0.5), (2, 4.0, 0.7), (4, 8.0, 0.6)])
    never = run([(0, 0.0, 0.5), (8, 9.0, 0.64), (16, 18.0, 0.62)])
    assert time_to(base, "eval_reward", 0.65) == (pytest.approx(15.0), True)
    assert time_to(fast, "eval_reward", 0.65) == (pytest.approx(3.0), True)  # the first crossing, not the last
    assert time_to(never, "eval_reward", 0.65) == (18.0, False)
    assert time_to(base, "eval_reward", 0.65, "epoch") == (pytest.approx(12.0), True)
    got = paired_statistic("seconds_to_threshold", "eval_reward", fast, base, 0.65)
    assert got == pytest.approx(math.log(15.0 / 3.0), abs=1e-12)
    assert paired_statistic("epochs_to_threshold", "eval_reward", fast, base, 0.65) == pytest.approx(
        math.log(12.0 / 1.5), abs=1e-12
    )
    assert paired_statistic("seconds_to_threshold", "eval_reward", never, base, 0.65) == pytest.approx(
        math.log(15.0 / 18.0), abs=1e-12
    )
    with pytest.raises(ValidationError, match="set threshold"):
        Endpoint(arm="a", baseline="b", statistic="seconds_to_threshold")
    with pytest.raises(ValidationError, match="drop threshold"):
        Endpoint(arm="a", baseline="b", statistic="auc", threshold=0.6)


def _scored_experiment(tmp_path, arms: str, metric: str = "eval_reward", task: str = "") -> Path:
    """Two arms of the shapes recipe (no weights read) and a primary endpoint on ``metric``."""
    root = Path(__file__).resolve().parent.parent
    path = tmp_path / "scored.toml"
    path.write_text(f"""[experiment]
name = "scored"
recipe = "{root / "recipes" / "shapes_flowgrpo.toml"}"
seeds = [0, 1, 2]
out = "{tmp_path / "exp"}"
[task]
{task}
{arms}
[primary]
arm = "b"
baseline = "a"
metric = "{metric}"
statistic = "final"
""")
    return path


def test_compare_refuses_arms_scored_by_different_rewards_or_eval_settings(tmp_path):
    """Two reward functions never share a row: arms that differ in the reward (an option of it) or in an eval
    setting that changes the endpoint's metric, through a replaced section too, are refused in one paragraph naming
    each difference, by the sweep's check (load_experiment) and by compare alike."""
    reward = '[arms.a]\ncredit.name = "outcome"\n[arms.b]\nreward.score = "strict"\n'
    path = _scored_experiment(tmp_path, reward)
    with pytest.raises(RecipeError, match="not scored alike") as refused:
        load_experiment(path)  # what `tpflow sweep` and `tpflow validate` read: refused before any run
    assert "reward.score 'partial' (a) vs 'strict' (b)" in str(refused.value)
    assert "eval_watch_x" in str(refused.value)  # how arms that train on different rewards are compared
    with pytest.raises(RecipeError, match="reward.score"):
        compare(load_experiment(path, check_arms=False), ({}, []))
    replaced = ('[arms.a]\ncredit.name = "outcome"\n[arms.b]\nreplace = ["eval"]\n[arms.b.eval]\nnum_steps = 10\n'
                "guidance = 3.0\nnum_prompts = 24\nimages_per_prompt = 2\nevery = 5\n")  # fmt: skip
    with pytest.raises(RecipeError) as refused:
        load_experiment(_scored_experiment(tmp_path, replaced))
    message = " ".join(str(refused.value).split())
    assert "eval.num_prompts 192 (a) vs 24 (b)" in message and "eval.images_per_prompt 1 (a) vs 2 (b)" in message
    assert "eval.every" not in message and "batch_size" not in message  # these change no figure


def test_compare_of_arms_with_their_own_rewards_reads_a_shared_watched_reward(tmp_path):
    """Arms trained on different rewards, compared on a watched reward both are scored by: allowed, and the report
    says eval_reward is per arm by design; the hacking guard does not difference it across arms."""
    task = 'eval.rewards = [{name = "shapes-geneval", label = "g", options = {score = "strict"}}]'
    arms = '[arms.a]\ncredit.name = "outcome"\n[arms.b]\nreward.score = "soft"\n'
    experiment = load_experiment(_scored_experiment(tmp_path, arms, metric="eval_watch_g", task=task))

    def run(values):
        return {"evals": [{"epoch": e, "seconds": 10.0 * e, "eval_reward": v, "eval_reward_se": 0.01,
                           "eval_watch_g": v / 2, "eval_watch_g_se": 0.01} for e, v in enumerate(values)],
                "train": {}}  # fmt: skip

    runs = {"a": {s: run([0.5, 0.5 + 0.01 * s]) for s in (0, 1, 2)},
            "b": {s: run([0.5, 0.7 + 0.02 * s]) for s in (0, 1, 2)}}  # fmt: skip
    result = compare(experiment, (runs, []))
    assert result["primary"]["differences"] == pytest.approx([0.1, 0.105, 0.11], abs=1e-12)
    assert (
        list(result["per_arm"]) == ["eval_reward"]
        and "reward.score 'partial' (a) vs 'soft' (b)" in (result["per_arm"]["eval_reward"])
    )
    assert "eval_reward" not in result["watched"]["differences"]["b"]
    assert "eval_watch_g" in result["watched"]["differences"]["b"]
    assert "eval_reward is per arm by design" in " ".join(markdown(result).split())
