"""``tpflow eval`` / ``tpflow sample`` on the shapes world, and the trackers (TensorBoard, offline W&B) of a run.

One short run of the shipped shapes model (module fixture, ~20 s): 1 epoch, 12 test prompts, EMA on, both trackers.
``tpflow eval`` must give exactly the eval figures training logged for the same weights, prompts, steps and seed:
the base model (the recipe alone) equals the epoch-0 eval, the run's checkpoint (its EMA) equals the final eval.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from rich.console import Console

from tests.wandb_records import config as wandb_config
from tests.wandb_records import history as wandb_history
from tpflow.cli import main
from tpflow.evaluation.commands import _eval_tables
from tpflow.evaluation.run import EvalResult, difference
from tpflow.evaluation.targets import Target
from tpflow.grids import FAIL, FRAME, PASS, shown_images
from tpflow.recipe import load_recipe
from tpflow.train.evaluation import Scored, summarize
from tpflow.train.run_logger import read_jsonl
from tpflow.types import PromptItem

RECIPE = Path(__file__).resolve().parent.parent / "recipes" / "shapes_tp.toml"
SMALL = [
    "train.epochs=1", "train.prompts_per_epoch=2", "train.group_size=4", "train.rollout_batch=8",
    "train.ema=true", "train.ema_every=1", "eval.every=1", "eval.num_prompts=12", "eval.batch_size=12",
    "optimizer.micro_batch_size=8", 'log.trackers=["tensorboard", "wandb"]',
    # training's rollouts of 4 steps, windows of 3 (the recipe's 10 and 9: 55 velocity calls a trajectory); the
    # evaluations keep the recipe's 10 steps
    "rollout.num_steps=4", "rollout.window_size=3", "rollout.window_range=[0, 3]",
]  # fmt: skip
EVAL_STEPS = "10"  # the recipe's eval.num_steps: what training evaluated with


def cli(capsys: pytest.CaptureFixture, *args: str) -> tuple[int, str, str]:
    """Run the tpflow CLI in-process: (exit status, stdout, stderr)."""
    with pytest.raises(SystemExit) as exc:
        main(list(args))
    out, err = capsys.readouterr()
    return exc.value.code, out, err


def _sets(items: list[str]) -> list[str]:
    return [a for item in items for a in ("--set", item)]


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The shipped shapes model trained for one epoch, logging to TensorBoard and to an offline W&B run."""
    root = tmp_path_factory.mktemp("eval")
    with pytest.MonkeyPatch.context() as mp:
        for key, value in {"WANDB_MODE": "offline", "WANDB_SILENT": "true", "WANDB_CONSOLE": "off"}.items():
            mp.setenv(key, value)
        with pytest.raises(SystemExit) as exc:
            main(["train", str(RECIPE), "--run-dir", str(root / "run"), *_sets(SMALL)])
    assert exc.value.code in (0, None)
    return root / "run"


def _eval_json(folder: Path) -> dict:
    return json.loads((folder / "eval.json").read_text())


def _eval_fields(record: dict) -> dict:
    return {k: v for k, v in record.items() if k.startswith("eval_")}


def _read_grid(png: Path, images: list[dict], baseline: list[dict] | None = None) -> dict:
    """The grid's tile map, checked against the PNG and the evaluation's ``images`` (eval.json's lines; a tile whose
    source is "baseline" is a line of ``baseline``): each tile an enlarged image, framed green or red as its image is
    strictly correct or not, its prompt written under it."""
    layout = json.loads(png.with_suffix(".png.json").read_text())
    pixels = np.asarray(Image.open(png).convert("RGB"))
    assert tuple(layout["size"]) == (pixels.shape[1], pixels.shape[0])
    assert "green frame" in layout["marks"]
    for tile in layout["tiles"]:
        image = (baseline if tile.get("source") == "baseline" else images)[tile["index"]]
        assert tile["prompt"] == image["prompt"] and tile["strict"] == image["strict"]
        left, top, right, bottom = tile["box"]
        assert right - left >= 160 and pixels[top:bottom, left:right].std() > 1  # an enlarged image
        assert tuple(pixels[top - 1, (left + right) // 2]) == (PASS if image["strict"] == 1 else FAIL)
        assert tile["mark"] == ("pass" if image["strict"] == 1 else "fail")
        note = pixels[bottom + FRAME : bottom + FRAME + 14, left:right].astype(int)
        assert (note[..., 2] - note[..., 0] > 60).sum() > 5  # the image's score, in the note's blue
        assert tile["score"] == image["score"]
        caption = pixels[bottom + FRAME + 14 : bottom + FRAME + 30, left:right]
        assert (caption.max(axis=-1) < 100).any()  # the prompt's dark text under it
    return layout


def test_eval_of_a_run_reproduces_the_logged_final_eval(run, capsys, tmp_path):
    """A plain ``tpflow eval RUN`` (no --steps): the recipe's eval settings, said in the table's header."""
    code, out, _ = cli(capsys, "eval", str(run), "--out", str(tmp_path / "e"))
    assert code in (0, None)
    assert f"{EVAL_STEPS} steps as the recipe's [eval]" in " ".join(out.split())
    logged = read_jsonl(run / "metrics.jsonl")[-1]  # the final eval, with the weights the checkpoint holds
    result = _eval_json(tmp_path / "e")["target"]
    assert result["ema"] is True and result["step"] == logged["step"]
    assert result["metrics"] == _eval_fields(logged)  # exactly, every figure
    assert len(result["images"]) == 12
    categories = result["categories"]
    tags = [c for c in categories if c != "overall"]
    assert set(tags) <= {"single_object", "two_object", "counting", "colors", "position", "color_attr"}
    # GenEval's overall score: the mean of the per-tag accuracies; overall strict: the mean over images, as logged
    assert categories["overall"]["strict_tags"] == logged["eval_strict_tags"]
    assert categories["overall"]["strict_tags"] == pytest.approx(
        sum(categories[t]["strict"] for t in tags) / len(tags)
    )
    assert categories["overall"]["strict"] == logged["eval_strict"]
    for tag in tags:
        assert categories[tag]["strict"] == logged[f"eval_acc_{tag}"]
    assert "overall" in out and "strict" in out
    layout = _read_grid(tmp_path / "e" / "grid.png", result["images"])
    assert [t["index"] for t in layout["tiles"]] == list(range(12)) and layout["shows"] == "all 12 images"
    assert {t["mark"] for t in layout["tiles"]} == {"pass", "fail"}  # both marks drawn and checked


def test_eval_of_the_shipped_model_reproduces_the_epoch_0_eval(run, capsys, tmp_path):
    out_dir = tmp_path / "base"
    code, _, _ = cli(capsys, "eval", str(RECIPE), "--steps", EVAL_STEPS, "--out", str(out_dir), *_sets(SMALL))
    assert code in (0, None)
    first = read_jsonl(run / "metrics.jsonl")[0]
    assert first["epoch"] == 0
    assert _eval_json(out_dir)["target"]["metrics"] == _eval_fields(first)
    assert _eval_json(out_dir)["target"]["kind"] == "recipe"
    # the trainer's epoch-0 grid has the same tiles, marks and tile map as the command's
    layout = _read_grid(run / "samples" / "eval_0000.png", _eval_json(out_dir)["target"]["images"])
    assert len(layout["tiles"]) == 12 and layout["shows"] == "all 12 images"


def test_baseline_prints_and_records_the_differences(run, capsys, tmp_path):
    """The shipped recipe as baseline, but with another reward option and other eval settings (6 prompts, seed 7):
    scored as the run is (its reward, its 12 prompts, its seed), so it reproduces the run's own epoch-0 evaluation
    of the same base model exactly and pairs with it prompt by prompt; the screen says what scored both and what of
    the baseline's recipe went unused. Then the table, the intervals and the comparison image."""
    text = RECIPE.read_text().replace('name = "shapes-geneval"', 'name = "shapes-geneval"\nscore = "strict"', 1)
    text = text.replace("num_prompts = 192", "num_prompts = 6\nseed = 7")
    assert text.count("score = ") == 1 and "seed = 7" in text
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / RECIPE.name).write_text(text)
    args = ["eval", str(run), "--baseline", str(tmp_path / "b" / RECIPE.name), "--out", str(tmp_path / "vs")]
    code, out, err = cli(capsys, *args)
    assert code in (0, None), err
    data = _eval_json(tmp_path / "vs")
    for key in ("reward", "num_prompts", "images_per_prompt", "seed", "steps", "guidance"):
        assert data["baseline"]["settings"][key] == data["target"]["settings"][key], key
    assert data["baseline"]["scored_as"] == f"{run}@{data['target']['step']}" and data["baseline"]["kind"] == "recipe"
    assert data["baseline"]["metrics"] == _eval_fields(read_jsonl(run / "metrics.jsonl")[0])  # the base model
    flat = " ".join(out.split())
    assert "target and baseline both scored by the target's reward 'shapes-geneval'" in flat
    assert "the baseline gives only its model (shapes-dit, its base weights)" in flat
    assert "not used from its own recipe: reward.score = 'strict', eval.num_prompts = 6, eval.seed = 7" in flat
    mine, theirs = data["target"]["categories"], data["baseline"]["categories"]
    for category, delta in data["difference"].items():
        assert delta["reward"] == pytest.approx(mine[category]["reward"] - theirs[category]["reward"])
    assert "Δ reward [95% t]" in out and "not training's seed-to-seed spread" in flat
    overall = data["difference"]["overall"]["reward"]
    span = data["difference_interval"]["categories"]["overall"]["reward"]
    assert span["prompts"] == 12 and span["mean"] == pytest.approx(overall)  # 1 image per prompt: the same mean
    assert span["low"] < overall < span["high"]
    assert f"{overall:+.4f} [{span['low']:+.3f}, {span['high']:+.3f}]" in out
    # one comparison image: per prompt the baseline's image, then the trained one, from the same noise row
    layout = _read_grid(tmp_path / "vs" / "comparison.png", data["target"]["images"], data["baseline"]["images"])
    tiles = layout["tiles"]
    assert len(tiles) == 24 and layout["columns"] == ["shapes_tp (base)", f"run@{data['target']['step']}"] * 4
    assert layout["headers"] == {"baseline": "shapes_tp (base)", "target": f"run@{data['target']['step']}"}
    assert [t["source"] for t in tiles] == ["baseline", "trained"] * 12
    for before, after in zip(tiles[::2], tiles[1::2], strict=True):
        assert before["index"] == after["index"] and before["prompt"] == after["prompt"]
        assert before["box"][1] == after["box"][1] and before["box"][2] < after["box"][0]  # side by side
    assert not (tmp_path / "vs" / "baseline_grid.png").exists()


def test_more_images_per_prompt_and_a_prompt_file(run, capsys, tmp_path):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a photo of a red circle\n\na photo of two blue squares\n")
    args = ["eval", str(run), "--prompts", str(prompts), "--images-per-prompt", "3", "--steps", "4"]
    code, out, err = cli(capsys, *args, "--out", str(tmp_path / "f"))
    assert code in (0, None)
    flat = " ".join(err.split())  # plain prompts carry none of the GenEval metadata the run's reward reads: said so
    assert "warning:" in flat and 'has no "tag", "include"' in flat and "reward 0" in flat, err
    data = _eval_json(tmp_path / "f")["target"]
    red, blue = "a photo of a red circle", "a photo of two blue squares"
    assert [i["prompt"] for i in data["images"]] == [red] * 3 + [blue] * 3
    assert list(data["categories"]) == ["all", "overall"]  # plain prompts carry no tag
    assert data["settings"]["steps"] == 4 and data["settings"]["images_per_prompt"] == 3
    scores = [i["score"] for i in data["images"]]
    assert data["categories"]["overall"]["reward"] == pytest.approx(sum(scores) / 6)


def test_a_large_eval_grid_shows_the_images_its_rule_states(capsys, tmp_path):
    out = tmp_path / "big"
    code, stdout, _ = cli(capsys, "eval", str(RECIPE), "--num-prompts", "70", "--steps", "1", "--out", str(out))
    assert code in (0, None)
    images = _eval_json(out)["target"]["images"]
    layout = _read_grid(out / "grid.png", images)
    texts = [image["prompt"] for image in images]  # one image per prompt
    rows, rule = shown_images(70, 1, texts=texts)  # 64 of the 70 prompts, covering the distinct texts
    flat = " ".join(stdout.split())  # the console wraps at its width, which the environment decides
    assert layout["shows"] == rule and "64 of 70 images" in rule and f"the grids show {rule}" in flat
    assert [t["index"] for t in layout["tiles"]] == rows and rows[-1] == 68


def test_sample_writes_a_grid_with_one_tile_per_image(run, capsys, tmp_path):
    out = tmp_path / "grid.png"
    code, stdout, _ = cli(
        capsys, "sample", str(run), "--prompt", "a photo of a red circle", "--prompt", "two blue squares",
        "--n", "3", "--steps", "4", "--out", str(out),
    )  # fmt: skip
    assert code in (0, None)
    image = Image.open(out)
    image.verify()  # a valid PNG
    layout = json.loads(out.with_suffix(".png.json").read_text())
    assert len(layout["tiles"]) == 6 and [t["prompt"] for t in layout["tiles"]][2:4] == [
        "a photo of a red circle",
        "two blue squares",
    ]
    pixels = np.asarray(Image.open(out).convert("RGB"))
    assert tuple(layout["size"]) == (pixels.shape[1], pixels.shape[0])
    lefts = {t["box"][0] for t in layout["tiles"]}
    tops = {t["box"][1] for t in layout["tiles"]}
    assert len(lefts) == 3 and len(tops) == 2  # 3 columns, 2 rows
    for tile in layout["tiles"]:
        left, top, right, bottom = tile["box"]
        assert pixels[top:bottom, left:right].std() > 1  # an image, not the white background
        caption = pixels[bottom : bottom + 12, left:right]
        assert (caption < 128).any()  # dark text under each tile
    assert "6 images" in stdout


def test_sample_and_eval_warn_about_words_outside_the_vocabulary(run, capsys, tmp_path):
    from tpflow.shapes.vocab import prompt_warnings

    code, _, stderr = cli(
        capsys, "sample", str(run), "--prompt", "a photo of a red circle", "--n", "1", "--steps", "2",
        "--out", str(tmp_path / "known.png"),
    )  # fmt: skip
    assert code in (0, None) and "vocabulary" not in stderr
    unknown = ["a photo of a purple hexagon", "a photo of a red circle " + "and a blue square " * 3]  # 21 words
    (vocabulary, cut) = prompt_warnings(unknown)
    assert "'purple', 'hexagon' are not" in vocabulary and "circle, square, triangle" in vocabulary
    assert "1 prompt(s) have more than 16 words" in cut
    code, _, stderr = cli(
        capsys, "sample", str(run), "--prompt", unknown[0], "--prompt", unknown[1], "--n", "1", "--steps", "2",
        "--out", str(tmp_path / "unknown.png"),
    )  # fmt: skip
    assert code in (0, None)
    flat = " ".join(stderr.split())
    assert vocabulary in flat and cut in flat
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join(unknown) + "\n")
    code, _, stderr = cli(
        capsys, "eval", str(run), "--prompts", str(prompts), "--steps", "2", "--images-per-prompt", "1",
        "--out", str(tmp_path / "eval"),
    )  # fmt: skip
    assert code in (0, None) and vocabulary in " ".join(stderr.split())


def test_tensorboard_holds_the_logged_scalars_and_the_eval_grid(run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    (events,) = [p for p in (run / "tensorboard" / "tpflow").iterdir() if p.name.startswith("events.out")]
    acc = EventAccumulator(str(events), size_guidance={"images": 0, "scalars": 0})
    acc.Reload()
    logged = read_jsonl(run / "metrics.jsonl")
    assert [e.value for e in acc.Scalars("reward_mean")] == pytest.approx([logged[0]["reward_mean"]])
    # each eval at the step of the weights it evaluated: before the first update, and at the end
    assert [e.step for e in acc.Scalars("eval_reward")] == [0, logged[-1]["step"]]
    assert [e.value for e in acc.Scalars("eval_reward")] == pytest.approx([r["eval_reward"] for r in logged])
    assert "turning_points_per_traj" in acc.Tags()["scalars"]
    assert len(acc.Images("eval_samples")) == 2  # epoch 0 and the end


def test_offline_wandb_run_holds_the_scalars_images_and_recipe(run):
    (run_file,) = (run / "wandb").glob("offline-run-*/run-*.wandb")
    rows = wandb_history(run_file)
    logged = read_jsonl(run / "metrics.jsonl")
    rewards = [row["reward_mean"] for row in rows if "reward_mean" in row]
    assert rewards == pytest.approx([logged[0]["reward_mean"]])
    evals = [row["eval_reward"] for row in rows if "eval_reward" in row]
    assert evals == pytest.approx([r["eval_reward"] for r in logged])
    images = [row for row in rows if any(k.startswith("eval_samples") for k in row)]
    assert len(images) == 2
    media = list((run_file.parent / "files" / "media" / "images").glob("eval_samples_*.png"))
    assert len(media) == 2
    recipe = wandb_config(run_file)
    assert recipe["backbone.name"] == "shapes-dit" and recipe["credit.name"] == "consistent"
    assert (run / "wandb_run_id").read_text().strip() in run_file.name


# ---- bad input: exit 2, one paragraph, no traceback ----------------------------------------------------------------


def _one_paragraph(err: str) -> str:
    assert "Traceback" not in err and err.startswith("error:"), err
    return " ".join(err.split())


def test_unknown_target_exits_2(capsys, tmp_path):
    code, _, err = cli(capsys, "eval", str(tmp_path / "no-such-run"))
    assert code == 2 and "Unknown target" in _one_paragraph(err)
    (tmp_path / "empty").mkdir()
    code, _, err = cli(capsys, "eval", str(tmp_path / "empty"))
    assert code == 2 and "neither a run dir" in _one_paragraph(err)
    code, _, err = cli(capsys, "sample", str(tmp_path / "no-such-run"), "--prompt", "x")
    assert code == 2 and "Unknown target" in _one_paragraph(err)


def test_missing_prompt_file_exits_2(run, capsys, tmp_path):
    code, _, err = cli(capsys, "eval", str(run), "--prompts", str(tmp_path / "missing.txt"))
    assert code == 2 and "missing.txt" in _one_paragraph(err)


def test_missing_checkpoint_name_exits_2(run, capsys):
    code, _, err = cli(capsys, "eval", str(run), "--checkpoint", "999")
    assert code == 2 and "No checkpoint '999'" in _one_paragraph(err)


def test_an_adapter_of_another_backbone_exits_2(run, capsys, tmp_path):
    """A shapes-dit adapter given a tiny-sd3 recipe: refused by the export's record, or (the adapter files alone,
    saved in peft's format) as no diffusers LoRA file."""
    tiny = str(Path(__file__).resolve().parent.parent / "recipes" / "tiny_smoke.toml")
    code, _, _ = cli(capsys, "export", str(run), "--out", str(tmp_path / "lora"))
    assert code in (0, None)
    code, _, err = cli(capsys, "eval", str(tmp_path / "lora"), "--recipe", tiny)
    assert code == 2 and "exported from a 'shapes-dit' backbone" in _one_paragraph(err)
    bare = tmp_path / "bare"  # the adapter files alone: no record of where they came from
    shutil.copytree(tmp_path / "lora", bare)
    (bare / "tpflow_export.json").unlink()
    (bare / "recipe.json").unlink()
    code, _, err = cli(capsys, "eval", str(bare))
    assert code == 2 and "--recipe" in _one_paragraph(err)
    code, _, err = cli(capsys, "eval", str(bare), "--recipe", tiny, "--steps", "2")
    # shapes-dit saves a peft adapter (adapter_model.safetensors); tiny-sd3 reads diffusers' pytorch_lora_weights
    assert code == 2 and "No LoRA adapter" in _one_paragraph(err)


def test_resolution_of_a_fixed_size_backbone_exits_2(capsys):
    code, _, err = cli(capsys, "eval", str(RECIPE), "--resolution", "64")
    assert code == 2 and "fixed image size" in _one_paragraph(err)


def test_an_adapter_that_does_not_fit_exits_2_and_a_bug_keeps_its_traceback(tmp_path, tiny_weights, monkeypatch):
    """Loading an adapter: wrong shapes are one paragraph; a bug in the backbone's loading is its own exception."""
    import safetensors.torch
    import torch

    from tests.test_train import tiny_recipe
    from tpflow.backbones.shapes import ShapesBackbone
    from tpflow.errors import UserError
    from tpflow.evaluation.targets import Target, load_model
    from tpflow.recipe import load_recipe

    recipe = load_recipe(tiny_recipe(tmp_path, tiny_weights, reward="image-stat"))
    recipe.build("backbone").save_adapter(tmp_path / "lora")
    target = Target("export", tmp_path / "lora", recipe, adapter_dir=tmp_path / "lora")
    assert load_model(target) is not None
    monkeypatch.setattr(ShapesBackbone, "load_adapter", lambda self, directory: {}["lora_scale"])
    with pytest.raises(KeyError) as err:
        load_model(target)
    assert any("a bug, not an adapter that does not fit" in note for note in getattr(err.value, "__notes__", []))
    monkeypatch.undo()
    (file,) = (tmp_path / "lora").glob("*.safetensors")
    tensors = safetensors.torch.load_file(file)
    safetensors.torch.save_file({k: torch.zeros(v.shape[0] + 1, *v.shape[1:]) for k, v in tensors.items()}, file)
    with pytest.raises(UserError, match="does not fit the 'shapes-dit' backbone"):
        load_model(target)


def _result(strict: list[float], scores: list[float], label: str) -> EvalResult:
    """An evaluation of three tagged prompts (two single_object, one color_attr) with the given per-image figures."""
    items = [PromptItem("a cat", {"tag": "single_object"}), PromptItem("a dog", {"tag": "single_object"}),
             PromptItem("a red cat", {"tag": "color_attr"})]  # fmt: skip
    scored = Scored(prompt_index=[0, 1, 2], scores=scores, details={"strict": strict})
    target = Target(kind="export", path=Path(label), recipe=load_recipe(RECIPE))
    return EvalResult(target, items, scored, {"prompts": "test", "split": "test", "num_prompts": 3, "steps": 10})


def test_strict_means_one_thing_in_training_logs_and_in_tpflow_eval():
    """Training logged eval_strict = the mean over images; tpflow eval's "overall strict" was the mean over tags.
    Now strict is the mean over images everywhere and the mean over tags (GenEval's) is strict_tags."""
    result = _result([1.0, 1.0, 0.0], [0.9, 0.8, 0.1], "lora")
    logged = summarize(result.scored, result.items)  # what the trainer logs
    overall = result.categories()["overall"]
    assert logged["eval_strict"] == overall["strict"] == pytest.approx(2 / 3)
    assert logged["eval_strict_tags"] == overall["strict_tags"] == pytest.approx(0.5)
    assert result.to_json(ema=True)["metrics"] == logged
    console = Console(width=100, record=True)
    for table in _eval_tables(result, None):
        console.print(table)
    text = console.export_text()
    assert re.search(r"overall \(images\) .* 0\.6667", text) and re.search(r"overall \(tags\) .* 0\.5000", text)


def test_baseline_tables_fit_80_columns_without_cutting_a_number():
    """At 80 columns the one wide baseline table cut GenEval's differences short (+0.30…)."""
    mine = _result([1.0, 1.0, 0.0], [0.9, 0.8, 0.1], "runs/geneval_tp/checkpoints/00000040")
    base = _result([0.0, 1.0, 0.0], [0.5, 0.6, 0.2], "recipes/geneval_tp.toml")
    console = Console(width=80, record=True)
    for table in _eval_tables(mine, base):
        console.print(table)
    text = console.export_text()
    assert "…" not in text and max(len(line) for line in text.splitlines()) <= 80
    for category, figures in difference(mine, base).items():
        for value in figures.values():
            assert f"{value:+.4f}" in text, (category, value, text)
    assert "+0.3333" in text  # overall strict: 2/3 - 1/3


def test_an_exported_adapter_is_evaluated_into_runs_eval_not_into_its_own_folder():
    """`tpflow eval EXPORT_DIR` wrote eval_test_T10/ inside the folder meant for load_lora_weights."""
    from tpflow.evaluation.run import EvalOptions, default_out

    lora = _result([1.0, 1.0, 0.0], [0.9, 0.8, 0.1], "exports/shapes_lora").target
    out = default_out(lora, EvalOptions(prompts="test", steps=10))
    assert out == Path("runs/eval/shapes_lora_export_test_T10")
    assert Path("exports/shapes_lora").resolve() not in out.resolve().parents


def test_the_difference_has_a_paired_interval_over_prompts():
    """Δ +0.020 had no uncertainty; it gets a 95% t interval over the prompts, paired by prompt, by hand here."""
    from scipy import stats

    from tpflow.evaluation.paired import paired_intervals

    mine = _result([1.0, 1.0, 0.0], [0.9, 0.8, 0.1], "runs/a")
    base = _result([0.0, 1.0, 0.0], [0.5, 0.6, 0.2], "runs/b")
    spans = paired_intervals(mine, base)
    d = np.array([0.4, 0.2, -0.1])  # per prompt (one image each)
    half = stats.t.ppf(0.975, 2) * d.std(ddof=1) / np.sqrt(3)
    overall = spans["overall"]["reward"]
    assert overall["prompts"] == 3 and overall["mean"] == pytest.approx(d.mean())
    assert (overall["low"], overall["high"]) == pytest.approx((d.mean() - half, d.mean() + half))
    single = spans["single_object"]["reward"]  # two prompts: 0.4, 0.2
    assert single["prompts"] == 2 and single["low"] == pytest.approx(0.3 - stats.t.ppf(0.975, 1) * 0.1)
    assert np.isnan(spans["color_attr"]["reward"]["low"])  # one prompt: no interval
    assert spans["overall"]["strict"]["mean"] == pytest.approx(1 / 3)
    console = Console(width=80, record=True)
    for table in _eval_tables(mine, base):
        console.print(table)
    text = console.export_text()
    assert f"+0.1667 [{d.mean() - half:+.3f}, {d.mean() + half:+.3f}]" in text
    assert "…" not in text and max(len(line) for line in text.splitlines()) <= 80
    other = _result([1.0, 1.0, 0.0], [0.9, 0.8, 0.1], "runs/c")
    other.items[0] = PromptItem("a bird", {"tag": "single_object"})
    assert paired_intervals(other, base) == {}  # other prompts: no pairs, and the table says so


# ---- a comparison is of models: one reward, one eval set (tpflow.evaluation.scorer) --------------------------------


def test_a_baseline_of_another_backbone_is_refused_before_anything_loads(capsys, monkeypatch):
    """The target's eval settings belong to its backbone: a baseline whose images differ in kind is no pair."""
    import tpflow.evaluation.run as run_module

    monkeypatch.setattr(run_module, "load_model", lambda *a, **k: pytest.fail("a model was loaded"))
    tiny = str(Path(__file__).resolve().parent.parent / "recipes" / "tiny_smoke.toml")
    code, _, err = cli(capsys, "eval", str(RECIPE), "--baseline", tiny)
    message = _one_paragraph(err)
    assert code == 2 and "their images differ in kind" in message
    assert "backbone.name 'shapes-dit' (target) vs 'tiny-sd3' (baseline)" in message
    assert "backbone.resolution 'fixed' (target) vs" in message  # every difference named


def test_a_run_stopped_before_its_first_checkpoint_is_named_as_such(capsys, tmp_path, recwarn):
    """eval, sample and export of a run dir with logs but no checkpoints/: one paragraph saying so, and what to do;
    export of a folder that is not there: one paragraph, no raw UserWarning before it."""
    started = tmp_path / "started"
    started.mkdir()
    (started / "metrics.jsonl").write_text('{"epoch": 0, "eval_reward": 0.5}\n')
    for args in (["eval", str(started)], ["sample", str(started), "--prompt", "x"],
                 ["export", str(started), "--out", str(tmp_path / "out")]):  # fmt: skip
        code, _, err = cli(capsys, *args)
        message = _one_paragraph(err)
        assert code == 2 and "is a run dir with nothing saved yet" in message and "neither" not in message, args
        assert "tpflow train RECIPE --run-dir" in message and "metrics.jsonl" in message
    code, _, err = cli(capsys, "export", str(tmp_path / "nope"), "--out", str(tmp_path / "out"))
    assert code == 2 and "no such folder" in _one_paragraph(err)
    assert not [w for w in recwarn if "checkpoint" in str(w.message)]  # once printed raw, with its source line


def test_sample_writes_into_the_runs_samples_folder_by_default(run, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code, out, err = cli(capsys, "sample", str(run), "--prompt", "a red circle", "--n", "1", "--steps", "2")
    assert code in (0, None), err
    step = _newest_step(run)
    written = run / "samples" / f"sample_step{step}.png"
    assert written.is_file() and written.with_suffix(".png.json").is_file()
    assert not (tmp_path / "samples.png").exists()
    assert f"wrote {written}" in " ".join(out.split())


def _newest_step(run: Path) -> int:
    """The step of the run's newest checkpoint (what `tpflow sample RUN` loads)."""
    from tpflow.train.checkpoints.format import find_checkpoint, load_checkpoint

    return load_checkpoint(find_checkpoint(run)[0]).step
