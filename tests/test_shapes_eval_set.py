"""The shapes world's honest evaluation set: the ``distinct`` test split (every prompt once, ``held_out`` flags), the
default ``sampled`` split unchanged, the per-tag / tag-balanced / held-out figures of ``summarize``, and
``eval.images_per_prompt`` reaching the trainer's evaluation and ``tpflow eval``'s default."""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
from collections import Counter

import pytest
import torch
from rich.console import Console

import tpflow
from tests.test_train import tiny_recipe
from tpflow.distributed import Distributed
from tpflow.errors import UserError
from tpflow.evaluation.run import EvalOptions, evaluate_target
from tpflow.evaluation.targets import resolve_target
from tpflow.recipe import load_recipe
from tpflow.shapes import prompts as shape_prompts
from tpflow.train.evaluation import Scored, summarize
from tpflow.train.trainer import Trainer
from tpflow.types import PromptItem

# docs/shapes.md, "Splits": distinct prompts per tag, and how many name a held-out pair
DISTINCT = {"single_object": 3, "two_object": 6, "counting": 9, "colors": 12, "color_attr": 72, "position": 24}
HELD_OUT = {"colors": 3, "color_attr": 30}


def _sha(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def test_distinct_split_is_every_prompt_once_with_held_out_flags():
    items = tpflow.build("dataset", "shapes", test_prompts="distinct", test_size=5).split("test")  # size ignored
    assert len(items) == 126 and len({it.prompt for it in items}) == 126
    assert Counter(it.metadata["tag"] for it in items) == DISTINCT
    assert [it.metadata["tag"] for it in items] == sorted(
        (it.metadata["tag"] for it in items), key=shape_prompts.TAGS.index
    )  # tag by tag, in TAGS order
    assert [it.metadata["held_out"] for it in items] == [shape_prompts._held_out_item(it) for it in items]
    assert Counter(it.metadata["tag"] for it in items if it.metadata["held_out"]) == HELD_OUT
    assert not any(it.metadata["held_out"] for it in shape_prompts.prompts("train"))  # train never asks for them


def test_sampled_split_is_unchanged():
    """The default test split is the same 400 items as before ``held_out`` and ``test_prompts`` existed (texts and
    metadata pinned by hash, computed on the commit before), apart from the new key."""
    items = tpflow.build("dataset", "shapes").split("test")
    assert items == shape_prompts.prompts("test", 400, seed=1)
    assert _sha("\n".join(it.prompt for it in items)) == "108b35ada6566b10"
    before = [{k: v for k, v in it.metadata.items() if k != "held_out"} for it in items]
    assert _sha(json.dumps(before, sort_keys=True)) == "17fd1d0ca90048f1"
    assert sum(it.metadata["held_out"] for it in items) == 45  # docs/shapes.md, "Splits"


def test_unknown_test_prompts_is_refused():
    with pytest.raises(UserError, match="test_prompts"):
        tpflow.build("dataset", "shapes", test_prompts="all")


def _scored() -> tuple[Scored, list[PromptItem]]:
    """Three prompts (two colors, one position; one held out), four images: prompt 0 has two."""
    items = [
        PromptItem("a red circle", {"tag": "colors", "held_out": False}),
        PromptItem("a yellow circle", {"tag": "colors", "held_out": True}),
        PromptItem("a circle left of a square", {"tag": "position", "held_out": False}),
    ]
    scored = Scored(prompt_index=[0, 0, 1, 2], scores=[1.0, 0.5, 0.0, 0.25], details={"strict": [1.0, 0.0, 0.0, 1.0]})
    return scored, items


def test_summarize_reports_per_tag_tag_balanced_and_held_out_figures():
    scored, items = _scored()
    metrics = summarize(scored, items)
    want = {
        "eval_reward": 1.75 / 4,  # over images
        "eval_strict": 2 / 4,
        "eval_reward_colors": 1.5 / 3,
        "eval_reward_position": 0.25,
        "eval_reward_tags": (0.5 + 0.25) / 2,  # 0.375, not the image mean 0.4375: colors has 3 images, position 1
        "eval_acc_colors": 1 / 3,
        "eval_acc_position": 1.0,
        "eval_strict_tags": (1 / 3 + 1) / 2,
        "eval_reward_held_out": 0.0,
        "eval_reward_seen": 1.75 / 3,
        "eval_strict_held_out": 0.0,
        "eval_strict_seen": 2 / 3,
    }
    assert metrics.keys() == want.keys()
    assert metrics == pytest.approx(want)


def test_summarize_without_flags_strict_or_tags_leaves_their_figures_out():
    scored, items = _scored()
    plain = [PromptItem(it.prompt, {"tag": it.metadata["tag"]}) for it in items]  # no held_out
    assert not any("held_out" in k or "seen" in k for k in summarize(scored, plain))
    unscored = Scored(scored.prompt_index, scored.scores, {})  # a reward without a strict detail
    metrics = summarize(unscored, items)
    assert "eval_reward_held_out" in metrics and "eval_strict_held_out" not in metrics
    assert "eval_reward_tags" in metrics and "eval_strict_tags" not in metrics
    untagged = [items[0], items[1], PromptItem(items[2].prompt, {"held_out": False})]
    assert not any(k.startswith(("eval_reward_colors", "eval_reward_tags")) for k in summarize(scored, untagged))
    seen_only = summarize(Scored([0, 2], [1.0, 0.25], {}), items)
    assert "eval_reward_seen" in seen_only and "eval_reward_held_out" not in seen_only  # no images: no figure


class _Recorder:
    """Wraps a reward, keeping every prompt and image it scored."""

    def __init__(self, reward):
        self.reward, self.prompts, self.images = reward, [], []

    def __call__(self, images, prompts, metadata):
        self.prompts += list(prompts)
        self.images += list(images.detach().clone())
        return self.reward(images, prompts, metadata)


def test_trainer_and_tpflow_eval_sample_images_per_prompt(tmp_path, tiny_weights, plugin):
    """eval.images_per_prompt = 2: the trainer's eval scores two images of each of its 6 test prompts (prompt r // 2
    for image r), each from its own noise; ``tpflow eval`` of the recipe defaults to the same and gives the same
    figures."""
    recipe = load_recipe(tiny_recipe(tmp_path, tiny_weights), ["eval.every=0", "eval.images_per_prompt=2"])
    trainer = Trainer(recipe, console=Console(file=io.StringIO()))
    try:
        recorder = trainer.reward = _Recorder(trainer.reward)
        metrics = trainer.evaluate(0)
    finally:
        trainer.run_lock.release()
    texts = [it.prompt for it in trainer.test_items]
    assert len(texts) == 6 and recorder.prompts == [t for t in texts for _ in range(2)]
    assert not torch.equal(recorder.images[0], recorder.images[1])  # two images of one prompt: different noise
    scores = [float(s) for s in recorder.reward(torch.stack(recorder.images), recorder.prompts, [{}] * 12).scores]
    assert metrics["eval_reward"] == pytest.approx(sum(scores) / 12)
    assert "eval_reward_tags" in metrics and "eval_reward_seen" in metrics  # shapes prompts: tags and held_out
    grid = json.loads((tmp_path / "run" / "samples" / "eval_0000.png.json").read_text())
    assert {t["index"] for t in grid["tiles"]} <= set(range(12))

    target = resolve_target(tmp_path / "tiny.toml", overrides=["eval.images_per_prompt=2"])
    result = evaluate_target(target, EvalOptions(steps=3), Distributed(None), contextlib.nullcontext)
    assert result.settings["images_per_prompt"] == 2 and len(result.scored.scores) == 12
    assert summarize(result.scored, result.items) == metrics  # the trainer's evaluation, reproduced exactly


def test_eval_seed_fixes_the_evaluation_images_across_training_seeds(tmp_path, tiny_weights, plugin):
    """[eval] seed: two runs with different train.seed evaluate the same (base) model on the same noise, so their
    epoch-0 figures are equal; without it each training seed draws its own eval noise."""

    def images(*overrides: str) -> list[torch.Tensor]:
        recipe = load_recipe(tiny_recipe(tmp_path, tiny_weights), ["eval.every=0", *overrides])
        trainer = Trainer(recipe, console=Console(file=io.StringIO()))
        try:
            recorder = trainer.reward = _Recorder(trainer.reward)
            trainer.evaluate(0)
        finally:
            trainer.run_lock.release()
        return recorder.images

    fixed = [images(f"train.seed={seed}", "eval.seed=7") for seed in (1, 2)]
    assert all(torch.equal(a, b) for a, b in zip(*fixed, strict=True))
    own = [images(f"train.seed={seed}") for seed in (1, 2)]
    assert not all(torch.equal(a, b) for a, b in zip(*own, strict=True))


def test_min_per_tag_repeats_the_small_tags_whole_prompt_lists():
    """test_min_per_tag = 24: tags of 3, 6 and 9 prompts repeat their whole list 8, 4 and 3 times; colors (12)
    twice; color_attr (72) and position (24) stay once. Every repeat is the same prompt with its flags."""
    dataset = tpflow.build("dataset", "shapes", test_prompts="distinct", test_min_per_tag=24)
    items = dataset.split("test")
    counts = Counter(it.metadata["tag"] for it in items)
    assert counts == {"single_object": 24, "two_object": 24, "counting": 27, "colors": 24, "color_attr": 72,
                      "position": 24}  # fmt: skip
    texts = Counter(it.prompt for it in items)
    assert len(texts) == 126 and texts["a photo of a circle"] == 8
    held = {it.prompt for it in items if it.metadata["held_out"]}
    assert len(held) == 33
    plain = tpflow.build("dataset", "shapes", test_prompts="distinct").split("test")
    assert [it.prompt for it in plain] == [it.prompt for it in shape_prompts.prompts("test")]


def test_eval_at_start_off_skips_only_the_epoch_0_evaluation(tmp_path, tiny_weights, plugin):
    """[eval] at_start = false: no eval line at epoch 0, and everything else (every training figure, the later
    evaluations) equal to the run that evaluated at epoch 0: the eval draws no randomness training uses."""

    def run(name: str, *overrides: str) -> list[dict]:
        recipe = load_recipe(tiny_recipe(tmp_path, tiny_weights), ["train.epochs=2", "eval.every=1", *overrides])
        Trainer(recipe, run_dir=tmp_path / name, console=Console(file=io.StringIO())).fit()
        lines = [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
        return [{k: v for k, v in line.items() if not k.endswith("_s") and k != "time"} for line in lines]

    full, skipped = run("full"), run("skipped", "eval.at_start=false")
    assert "eval_reward" in full[0] and "eval_reward" not in skipped[0]
    assert {k: v for k, v in full[0].items() if not k.startswith("eval_") and k != "last_eval_epoch"} == skipped[0]
    assert full[1:] == skipped[1:]
