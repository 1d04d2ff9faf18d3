"""What a reward needs from its recipe, refused before anything loads (tpflow.rewards.needs): the metadata it reads
(a GenEval reward on bare prompt lines trained on reward 0 and reported strict accuracy 1.0), the kind of sample it
scores (an image reward watched on a video recipe failed at the first evaluation, a clip reward on an image recipe
at the first epoch); and the hacking guard's warning on a watched reward that falls on its own."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from tests.cli_run import tpflow
from tpflow import build
from tpflow.errors import RecipeError, RewardError, UserError
from tpflow.recipe import load_recipe
from tpflow.rewards.geneval import accuracy_by_tag
from tpflow.scoring.call import call_reward
from tpflow.scoring.watched import guard_lines, hacking_warnings

ROOT = Path(__file__).resolve().parent.parent
SHAPES = ROOT / "recipes" / "shapes_flowgrpo.toml"  # shapes-dit, shapes-geneval, dataset shapes
VIDEO = ROOT / "recipes" / "shapes_video_flowgrpo.toml"  # shapes-video-dit, shapes-video, dataset shapes-video
TEXT_FILE = ["dataset.name=text-file", "dataset.path=prompts.txt"]
CIRCLE = {"class": "circle", "count": 1}


# ------------------------------------------------------------------------------------- item 1: metadata


def test_a_geneval_reward_on_prompt_lines_is_refused_naming_the_datasets_that_would_do():
    with pytest.raises(RecipeError) as caught:
        load_recipe(SHAPES, TEXT_FILE)
    message = str(caught.value)
    assert "[reward] (shapes-geneval)" in message and "[dataset] (text-file)" in message
    assert '"tag", "include"' in message and "its prompts carry no metadata" in message
    carriers = 'carries them: geneval, shapes, edit-jsonl or jsonl whose every item holds "tag", "include"'
    assert carriers in message
    assert "\n" not in message  # one paragraph


def test_the_issue_command_exits_2_with_one_paragraph():
    out = tpflow(
        "validate", "recipes/sd35/geneval_flowgrpo.toml", "--no-machine",
        "--set", 'dataset={name = "text-file", path = "p.txt"}', cwd=ROOT,
    )  # fmt: skip
    assert out.returncode == 2, out.stdout + out.stderr
    assert "[reward] (geneval)" in out.stderr and "Traceback" not in out.stderr


def test_watched_rewards_and_the_parts_of_a_reward_are_held_to_the_same_rule():
    watched = ['eval.rewards=[{name = "shapes-geneval"}]', 'reward={name = "image-stat"}', *TEXT_FILE]
    with pytest.raises(RecipeError, match=r"\[eval\] rewards\[0\] \('shapes-geneval'\) judges each sample"):
        load_recipe(SHAPES, watched)
    part = 'reward={name = "weighted", rewards = [{name = "image-stat"}, {name = "shapes-geneval"}]}'
    with pytest.raises(RecipeError, match=r"\[reward\] \(weighted\) rewards\[1\] \('shapes-geneval'\)"):
        load_recipe(SHAPES, [part, *TEXT_FILE])
    judge = 'reward={name = "pairwise", judge = {name = "shapes-geneval"}}'
    with pytest.raises(RecipeError, match=r"\(pairwise\) judge \('shapes-geneval'\)"):
        load_recipe(SHAPES, [judge, *TEXT_FILE])
    load_recipe(SHAPES, ['reward={name = "image-stat"}', *TEXT_FILE])  # a reward that reads no metadata: fine
    load_recipe(SHAPES, ['dataset={name = "geneval"}'])  # GenEval's own metadata


def test_a_jsonl_file_without_the_metadata_is_refused_when_it_is_built(tmp_path):
    from tpflow.preflight import check_machine

    lines = tmp_path / "p.jsonl"
    lines.write_text('{"prompt": "a photo of a red circle", "tag": "single_object"}\n')
    recipe = load_recipe(SHAPES, ["dataset.name=jsonl", f"dataset.path={lines}"])  # only the file can tell
    with pytest.raises(RecipeError, match=r"item 1 of the train split \('a photo of a red circle'\) has no \"incl"):
        check_machine(recipe)
    lines.write_text('{"prompt": "a photo of a red circle", "tag": "single_object", "include": '
                     '[{"class": "circle", "count": 1, "color": "red"}]}\n')  # fmt: skip
    check_machine(recipe)


def test_metadata_that_asks_nothing_is_not_strictly_correct():
    """Before: partial credit 0 and strict 1.0 for every image (reward_strict 1.0, eval_strict 1.0). A check over
    nothing is not a number; an image with GenEval metadata beside it keeps its verdict."""
    images = torch.rand(3, 3, 32, 32, generator=torch.Generator(device="cpu").manual_seed(0), device="cpu")
    metadata = [{}, {"tag": "single_object", "include": []}, {"tag": "single_object", "include": [CIRCLE]}]
    out = call_reward(build("reward", "shapes-geneval"), images, ["a photo of a circle"] * 3, metadata)
    for key in ("strict", "correct"):
        assert math.isnan(out.details[key][0]) and math.isnan(out.details[key][1]), key
        assert out.details[key][2] == 0.0, key  # noise has no circle
    assert out.scores.tolist() == [0.0, 0.0, 0.0]
    assert math.isnan(accuracy_by_tag([], [])["overall"])  # no image, no check: not a number, never 0 or 1


# ------------------------------------------------------------------------------------- item 2: modality


def test_an_image_reward_watched_on_a_video_recipe_is_refused_with_the_frames_fix():
    with pytest.raises(RecipeError) as caught:
        load_recipe(VIDEO, ['eval.rewards=[{name = "image-stat", options = {statistic = "contrast"}}]'])
    message = str(caught.value)
    assert "(shapes-video-dit) samples clips [N, F, 3, H, W], and [eval] rewards[0] ('image-stat') scores" in message
    fix = '{ name = "frames", options = { reward = "image-stat", options = { statistic = "contrast" } } }'
    assert f"wrap it, {fix} in its place" in message
    framed = 'eval.rewards=[{name = "frames", options = {reward = "image-stat", options = {statistic = "contrast"}}}]'
    load_recipe(VIDEO, [framed])  # the fix it names validates


def test_the_trained_reward_of_a_video_recipe_keeps_its_message():
    with pytest.raises(RecipeError, match=r'images: wrap it, \[reward\] name = "frames", reward = "image-stat"'):
        load_recipe(VIDEO, ['reward={name = "image-stat"}'])


def test_a_clip_reward_on_an_image_recipe_is_refused_naming_the_video_backbones():
    """Before: KeyError 'shape' with a traceback at the first epoch."""
    with pytest.raises(RecipeError) as caught:
        load_recipe(SHAPES, ["reward.name=shapes-video"])
    message = str(caught.value)
    assert "[reward] (shapes-video) scores clips" in message and "samples images [N, 3, H, W]" in message
    assert "shapes-video-dit" in message and "wan2.1-t2v-1.3b" in message
    assert '[dataset] (shapes) cannot give "shape", "color", "count", "direction"' in message  # nor its metadata
    with pytest.raises(RecipeError, match=r"\('temporal-consistency'\) scores clips"):
        load_recipe(SHAPES, ['eval.rewards=[{name = "temporal-consistency"}]'])  # an image scores 1, always
    with pytest.raises(RecipeError, match=r"'frames' gives it single frames .*not inside 'frames'"):
        load_recipe(VIDEO, ['reward={name = "frames", reward = "shapes-video"}'])


def test_a_sum_of_clip_rewards_and_the_diversity_fit_a_video_recipe():
    """``weighted`` hands its parts the clips it gets: a sum of clip rewards is a clip reward (it was refused)."""
    parts = '[{name = "shapes-video"}, {name = "frames", options = {reward = "image-stat"}, weight = 0.5}]'
    diversity = ["eval.diversity=pixels", "eval.images_per_prompt=2"]  # a clip is embedded by its middle frame
    load_recipe(VIDEO, [f'reward={{name = "weighted", rewards = {parts}}}', *diversity])
    with pytest.raises(RecipeError, match=r"\(weighted\) rewards\[1\] \('image-stat'\) scores images"):
        load_recipe(VIDEO, ['reward={name = "weighted", rewards = [{name = "shapes-video"}, {name = "image-stat"}]}'])


def test_the_shapes_video_reward_refuses_metadata_it_cannot_read():
    clips = torch.zeros(1, 2, 3, 32, 32, device="cpu")
    with pytest.raises(UserError, match="use the shapes-video dataset"):
        build("reward", "shapes-video")(clips, ["a photo of a circle"], [{"tag": "single_object", "include": []}])


def test_a_stopped_reward_promises_no_checkpoint_it_does_not_know_of():
    def broken(images, prompts, metadata):
        raise RuntimeError("boom")

    with pytest.raises(RewardError) as caught:
        call_reward(broken, torch.zeros(1, 3, 8, 8, device="cpu"), ["p"], [{}])
    assert "which is intact" not in str(caught.value) and "if it wrote one" in str(caught.value)


# ------------------------------------------------------------------------------------- item 3: the guard


def test_a_watched_reward_that_collapses_warns_whatever_the_trained_reward_did():
    """A run that fell apart in silence: saturation trained at lr 1e-2 rose 0.091 -> 0.101 (within its noise)
    while the watched GenEval fell 0.639 -> 0.266 (SE ~0.05) and the grid showed blank tiles; nothing was said."""
    se = {"eval_reward_se": 0.006, "eval_watch_geneval_se": 0.05}
    before = {"eval_reward": 0.091, "eval_watch_geneval": 0.639, **se}
    after = {"eval_reward": 0.101, "eval_watch_geneval": 0.266, **se}
    (warning,) = hacking_warnings(before, after)
    assert "the watched reward geneval fell by -0.3730" in warning and "within its noise" in warning
    noisy = {**after, "eval_watch_geneval": 0.639 - 0.2}  # 0.2 < 3·√2·0.05: a fall this size alone is noise
    assert hacking_warnings(before, noisy) == []
    hacked = {**noisy, "eval_reward": 0.2}  # beside a rise of the trained reward, two standard errors suffice
    (warning,) = hacking_warnings(before, hacked)
    assert warning.startswith("possible reward hacking")


def test_the_diversity_collapsing_on_its_own_warns():
    before = {"eval_reward": 0.5, "eval_reward_se": 0.01, "eval_diversity": 0.30, "eval_diversity_se": 0.01}
    (warning,) = hacking_warnings(before, {**before, "eval_diversity": 0.10})
    assert "diversity within groups" in warning and "fell by -0.2000" in warning


def test_a_slow_slide_is_caught_against_the_first_evaluation():
    """0.639 -> 0.266 in four steps of about 0.09 (each within 3·√2·0.05 = 0.21 of the last): no single interval
    says anything; against the first evaluation the fall is 0.373 and the training run's guard says it once."""
    se = {"eval_reward_se": 0.006, "eval_watch_geneval_se": 0.05}
    evals = [{"eval_reward": 0.091, "eval_watch_geneval": g, **se, "last_eval_epoch": 10 * k} for k, g in
             enumerate([0.639, 0.546, 0.453, 0.360, 0.266])]  # fmt: skip
    assert all(hacking_warnings(a, b) == [] for a, b in zip(evals[:-1], evals[1:], strict=True))
    first = evals[0]
    assert guard_lines(first, evals[0], evals[1]) == []  # -0.093 since the first: within its noise
    (warning,) = guard_lines(first, evals[3], evals[4])
    assert "fell by -0.3730 since the evaluation at epoch 0" in warning
    assert guard_lines({}, evals[3], evals[4]) == []  # no first evaluation yet: the last one alone
