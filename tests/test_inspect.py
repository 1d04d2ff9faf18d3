"""``tpflow inspect-trajectory`` on the tiny shapes world: the files, their numbers, the run mode, bad input."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from PIL import Image

import tpflow
from tests.cli_run import tpflow as run_cli
from tests.test_train import tiny_recipe
from tpflow.inspect import inspect_run, inspect_sampled
from tpflow.recipe import load_recipe
from tpflow.train.trainer import Trainer

ASSIGNERS = ("consistent", "outcome", "incremental", "turning_point")


def _prompt() -> str:
    return tpflow.build("dataset", "shapes").split("test")[0].prompt


def _check_png(path: Path) -> None:
    with Image.open(path) as image:
        image.verify()
    with Image.open(path) as image:
        width, height = image.size
    assert 400 <= width <= 4000 and 200 <= height <= 4000, (path.name, image.size)


def test_cli_writes_the_plots_and_the_numbers_behind_them(tmp_path, tiny_weights, plugin):
    recipe = tiny_recipe(tmp_path, tiny_weights)  # K = 4, W = 3, window start drawn from 0..1
    out = tmp_path / "inspect"
    done = run_cli(
        "inspect-trajectory", str(recipe), "--prompt", _prompt(), "--n", "3", "--seed", "5", "--out", str(out)
    )
    assert done.returncode == 0, done.stderr
    assert "turning points of" in done.stdout and "R_0" in done.stdout and "Traceback" not in done.stderr
    assert "vocabulary" not in done.stderr  # every word of a dataset prompt is the world's
    for name in ("trajectories.png", "completions.png", "credit.png"):
        _check_png(out / name)
    data = json.loads((out / "trace.json").read_text())
    trace = torch.tensor(data["trace"], dtype=torch.float64)
    assert trace.shape == (3, 4) and data["window_size"] == 3 and data["window_start"] in (0, 1)
    assert data["paper_t_of_j"] == [4 - data["window_start"] - j for j in range(4)]
    assert len(data["sigmas"]) == 5 and data["metadata"]  # the prompt's metadata was found in the dataset
    assert list(data["credit"]) == list(ASSIGNERS)  # the recipe's assigner first, then the other built-ins
    for name, credit in data["credit"].items():
        expected = tpflow.build("credit", name)(trace)
        assert torch.allclose(torch.tensor(credit["step_rewards"], dtype=torch.float64), expected.step_rewards)
        assert credit["turning_points"] == expected.turning_points.int().tolist()
    d = trace[:, 1:] - trace[:, :-1]
    assert torch.allclose(torch.tensor(data["d"], dtype=torch.float64), d)
    assert data["delta"] == pytest.approx((trace[:, -1] - trace[:, 0]).tolist())


def test_words_outside_the_vocabulary_get_the_warning_tpflow_sample_prints(tmp_path, tiny_weights, plugin):
    from tpflow.shapes.vocab import prompt_warnings

    prompt = "a photo of a purple hexagon"
    done = run_cli(
        "inspect-trajectory", str(tiny_recipe(tmp_path, tiny_weights)), "--prompt", prompt, "--n", "1",
        "--out", str(tmp_path / "o"),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    (expected,) = prompt_warnings([prompt])  # the one rule: tests/test_eval_cli.py checks sample and eval print it
    assert "'purple', 'hexagon' are not in the shapes world's vocabulary" in expected
    assert expected in " ".join(done.stderr.split())


def test_library_names_the_assigners_and_warns_about_unknown_prompts(tmp_path, tiny_weights, plugin):
    recipe = load_recipe(tiny_recipe(tmp_path, tiny_weights, credit="turning_point"), ["credit.balanced=false"])
    warnings: list[str] = []
    result = inspect_sampled(
        recipe, "a photo of a unicorn", n=2, seed=0, credit=["turning_point", "outcome"], out=tmp_path / "o",
        warn=warnings.append,
    )  # fmt: skip
    assert warnings and "not in the recipe's dataset" in warnings[0]
    assert set(result.trajectories.credits) == {"turning_point", "outcome"}
    expected = tpflow.build("credit", "turning_point", balanced=False)(result.trajectories.trace)  # recipe's options
    assert torch.equal(result.trajectories.credits["turning_point"].step_rewards, expected.step_rewards)
    assert result.trajectories.images.shape[:2] == (2, 4)
    assert torch.allclose(
        result.trajectories.images[:, -1].mean(dim=(1, 2, 3)).double(), result.trajectories.trace[:, -1]
    )


def test_run_mode_plots_a_training_run(tmp_path, tiny_weights, plugin):
    Trainer(load_recipe(tiny_recipe(tmp_path, tiny_weights), ["eval.every=0"])).fit()  # 2 epochs
    out = tmp_path / "inspect"
    result = inspect_run(tmp_path / "run", n=4, out=out)
    names = sorted(p.name for p in result.files)
    assert names == ["credit.png", "trace.json", "trajectories.png", "turning_points.png"]
    for name in ("trajectories.png", "credit.png", "turning_points.png"):
        _check_png(out / name)
    data = json.loads((out / "trace.json").read_text())
    assert data["turning_points_over_training"]["epoch"] == [0, 1]
    assert "consistent (as trained)" in data["credit"] and len(data["trace"]) == 4
    done = run_cli("inspect-trajectory", "--run", str(tmp_path / "run"), "--epoch", "0", "--out", str(tmp_path / "o2"))
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "o2" / "turning_points.png").is_file()
    # without --out the two modes write to folders of their own (run mode used to land beside the sampled mode's
    # completions.png in runs/inspect)
    by_run = run_cli("inspect-trajectory", "--run", str(tmp_path / "run"), "--n", "2", cwd=tmp_path)
    sampled = run_cli("inspect-trajectory", str(tmp_path / "tiny.toml"), "--prompt", _prompt(), "--n", "2",
                      cwd=tmp_path)  # fmt: skip
    assert by_run.returncode == 0 and sampled.returncode == 0, by_run.stderr + sampled.stderr
    assert (tmp_path / "runs" / "inspect" / "run" / "turning_points.png").is_file()
    assert (tmp_path / "runs" / "inspect" / "sampled" / "completions.png").is_file()
    assert not (tmp_path / "runs" / "inspect" / "run" / "completions.png").exists()


def test_run_mode_on_an_outcome_run_plots_the_final_rewards_and_says_why(tmp_path, tiny_weights, plugin):
    Trainer(load_recipe(tiny_recipe(tmp_path, tiny_weights, credit="outcome"), ["eval.every=0"])).fit()
    out = tmp_path / "inspect"
    (out / "turning_points.png").parent.mkdir(parents=True)
    (out / "turning_points.png").write_bytes(b"from an earlier inspection")  # stale: must not stay beside
    done = run_cli("inspect-trajectory", "--run", str(tmp_path / "run"), "--n", "3", "--out", str(out))
    assert done.returncode == 0, done.stderr
    assert "nan" not in done.stdout  # R_0 and Δ were never logged: shown as unknown, not as nan
    assert "takes no ODE completions" in done.stdout and "final_rewards.png" in done.stdout
    assert "--checkpoint" in done.stdout  # the command that shows the reward along denoising
    assert sorted(p.name for p in out.iterdir()) == ["credit.png", "final_rewards.png", "trace.json"]
    _check_png(out / "final_rewards.png")
    data = json.loads((out / "trace.json").read_text())
    assert all(row[-1] is not None for row in data["trace"])  # R_W of every trajectory is there


@pytest.mark.parametrize(
    "args, message",
    [
        ((), "exactly one of RECIPE"),
        (("recipes/shapes_tp.toml", "--run", "runs/x"), "exactly one of RECIPE"),
        (("recipes/shapes_tp.toml", "--prompt", "a photo of a circle", "--credit", "nope"), "consistent"),
        (("--run", "no/such/run"), "Run dir not found"),
    ],
)
def test_bad_input_exits_2_with_a_clear_message(args, message):
    done = run_cli("inspect-trajectory", *args, cwd=Path(__file__).resolve().parent.parent)
    assert done.returncode == 2, done.stdout + done.stderr
    assert message in done.stderr and "Traceback" not in done.stderr + done.stdout


def test_inspect_scores_through_the_training_path(tmp_path, tiny_weights, plugin, monkeypatch):
    """inspect-trajectory uses the trainer's scoring function: a reward that keeps returning NaN is an error with the
    trainer's message (it was once plotted as a NaN trace), after the same single retry."""
    from tpflow.errors import RewardError
    from tpflow.inspect.traces import sample_trajectories
    from tpflow.recipe import Recipe
    from tpflow.types import RewardOutput

    calls = []

    def nan_reward(images, prompts, metadata):
        calls.append(len(images))
        return RewardOutput(scores=torch.full((len(images),), float("nan")))

    real_build = Recipe.build
    monkeypatch.setattr(Recipe, "build", lambda self, kind: nan_reward if kind == "reward" else real_build(self, kind))
    recipe = load_recipe(tiny_recipe(tmp_path, tiny_weights))
    with pytest.raises(RewardError, match="failed twice.*non-finite"):
        sample_trajectories(recipe, _prompt(), n=2, seed=0)
    assert len(calls) == 2 * -(-8 // recipe.train.score_batch)  # every chunk scored twice: one retry


def test_the_credit_a_run_trained_with_is_named_once_as_trained():
    """credit.png's panel of the logged credit: ``consistent (as trained)`` when a checkpoint names the assigner,
    ``as trained`` alone when none does (it read "as trained (as trained)")."""
    from tpflow.inspect.traces import RunTraces, run_trajectories

    records = [{"epoch": 0, "prompt": "a red circle", "trace": [0.1, 0.2, 0.4], "step_rewards": [0.1, 0.2],
                "turning_points": [False, True]}]  # fmt: skip
    unknown = run_trajectories(RunTraces(records, [0], None, "as trained"), None, n=1)
    assert list(unknown.credits) == ["as trained"]
    recipe = load_recipe(Path(tpflow.__file__).resolve().parent.parent / "recipes" / "shapes_tp.toml")
    known = run_trajectories(RunTraces(records, [0], recipe, recipe.credit.name), None, n=1)
    assert list(known.credits) == ["consistent (as trained)"]


def test_a_clips_completion_strip_sets_its_frames_apart(tmp_path, monkeypatch):
    """inspect-trajectory's completions of a video model: each strip of 4 of a clip's 5 frames has a grey line
    between neighbouring frames (3 per strip, at the frames' edges), as the eval grids' strips do."""
    from tpflow.inspect import plots
    from tpflow.inspect.traces import Trajectories

    figures = []
    monkeypatch.setattr(plots, "_save", lambda fig, path: figures.append(fig) or path)
    clips = torch.rand(2, 3, 5, 3, 8, 8)  # [n, W+1, F, 3, H, W]
    t = Trajectories("a red circle moving left", torch.zeros(2, 3, dtype=torch.float64), None, None, images=clips)
    plots.plot_completions(t, "outcome", tmp_path / "completions.png")
    (fig,) = figures
    strips = [ax for ax in fig.axes if ax.images]
    assert len(strips) == 6
    for ax in strips:
        assert sorted(line.get_xdata()[0] for line in ax.lines) == [7.5, 15.5, 23.5]
