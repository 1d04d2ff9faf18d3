"""Training on clips: every credit assigner, rollout plan, sampler and optimizer of tpflow runs an epoch on tiny-wan
(latents [N, C, F', h, w], clips [N, F, 3, H, W]) through the ``frames`` reward; the reward's frame choice and
aggregate, and the frame strips that grids show clips as."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import tomllib
import torch
from PIL import Image

from tpflow.errors import RecipeError
from tpflow.recipe import validate_recipe
from tpflow.registry import build
from tpflow.rewards.frames import frame_indices
from tpflow.train.run_logger import read_jsonl
from tpflow.train.trainer import Trainer
from tpflow.video import frame_strip, strip_frames

ROOT = Path(__file__).resolve().parent.parent
# the shapes recipes of every method: together they use every credit assigner, plan, sampler and optimizer
RECIPES = ["shapes_flowgrpo", "shapes_tp", "shapes_incremental", "shapes_turning_point", "shapes_dancegrpo",
           "shapes_flowgrpo_fast", "shapes_grpo_guard", "shapes_mixgrpo", "shapes_mixgrpo_flash", "shapes_tempflow",
           "shapes_nft", "shapes_awm", "shapes_awm_sa", "shapes_dgpo_dpm", "shapes_egrpo"]  # fmt: skip


def video_recipe(name: str, run_dir: Path, backbone: str = "tiny-wan") -> dict:
    """``recipes/<name>.toml`` on a tiny video backbone with the frames reward, one small epoch and an eval."""
    data = tomllib.loads((ROOT / "recipes" / f"{name}.toml").read_text())
    data["backbone"] = {"name": backbone, "seed": 0, "lora_init": "gaussian"}
    data["reward"] = {"name": "frames", "reward": "image-stat", "frames": "every", "every": 2}
    data["dataset"] = {"name": "shapes", "test_size": 4}
    data.setdefault("train", {}).update(epochs=1, prompts_per_epoch=1, group_size=4, rollout_batch=4,
                                        run_dir=str(run_dir), mixed_precision="no")  # fmt: skip
    data.setdefault("eval", {}).update(every=1, num_prompts=1, images_per_prompt=1)
    data["optimizer"]["micro_batch_size"] = 4
    data["optimizer"].pop("gradient_accumulation_steps", None)
    return data


def test_every_method_trains_an_epoch_on_clips(tmp_path):
    """Each method's recipe on tiny-wan: the LoRA moves, the eval scores clips, its grid shows frame strips and an
    animated WebP beside it plays the clips."""
    seen = {kind: set() for kind in ("credit", "plan", "sampler", "optimizer")}
    for name in RECIPES:
        recipe = validate_recipe(video_recipe(name, tmp_path / name))
        for kind in seen:
            seen[kind].add(recipe.components[kind].name)
        trainer = Trainer(recipe)
        before = [p.detach().clone() for p in trainer.backbone.trainable_parameters()]
        metrics = trainer.fit()
        moved = [not torch.equal(a, p) for a, p in zip(before, trainer.backbone.trainable_parameters(), strict=True)]
        assert sum(moved) >= len(moved) // 2, f"{name}: the LoRA trains on clips"
        assert metrics["optimizer_steps"] >= 1 and math.isfinite(metrics["eval_reward"]), name
        traces = read_jsonl(tmp_path / name / "traces.jsonl")
        assert len(traces) == 4 and all(math.isfinite(r["trace"][-1]) for r in traces), name
        grids = sorted((tmp_path / name / "samples").glob("eval_*.png"))
        assert grids, name
        with Image.open(grids[-1].with_suffix(".webp")) as clips:  # beside each grid of strips, the clips playing
            assert clips.n_frames == 5 and clips.is_animated, name
        about = json.loads(grids[-1].with_suffix(".png.json").read_text())
        assert about["clips"] == grids[-1].with_suffix(".webp").name and about["strip"].endswith("0, 1, 3, 4"), name
    from tpflow import registry

    for kind, names in seen.items():  # the recipes above cover every one tpflow registers (not tests' plugins)
        own = {n for n in registry.names(kind) if registry.get(kind, n).factory.__module__.startswith("tpflow.")}
        assert names == own, (kind, own - names)


def test_wan22_trains_its_chosen_expert_only(tmp_path):
    """tiny-wan2.2, the low-noise expert trained: its LoRA moves, the high-noise expert is untouched."""
    data = video_recipe("shapes_tp", tmp_path / "run", backbone="tiny-wan2.2")
    data["backbone"]["train_expert"] = "low"
    trainer = Trainer(validate_recipe(data))
    other = [p.detach().clone() for p in trainer.backbone.other.parameters()]
    before = [p.detach().clone() for p in trainer.backbone.trainable_parameters()]
    trainer.fit()
    assert trainer.backbone.transformer is trainer.backbone.pipe.transformer_2
    assert any(not torch.equal(a, p) for a, p in zip(before, trainer.backbone.trainable_parameters(), strict=True))
    assert all(torch.equal(a, p) for a, p in zip(other, trainer.backbone.other.parameters(), strict=True))


def test_an_image_reward_on_a_video_backbone_is_refused_with_the_fix(tmp_path):
    data = video_recipe("shapes_flowgrpo", tmp_path)
    data["reward"] = {"name": "image-stat"}
    with pytest.raises(RecipeError, match='name = "frames", reward = "image-stat"'):
        validate_recipe(data)


def test_the_frames_reward_scores_the_chosen_frames_and_aggregates_per_clip():
    """Brightness of clips whose frame f has value (f + 1)/10 + clip/100: the scores are the chosen frames' mean or
    minimum; an image [N, 3, H, W] is a clip of one frame."""
    clips = torch.zeros(2, 5, 3, 4, 4)
    for f in range(5):
        for c in range(2):
            clips[c, f] = (f + 1) / 10 + c / 100
    prompts, meta = ["a", "b"], [{}, {}]
    cases = {("all", "mean"): [0.3, 0.31], ("every", "mean"): [0.3, 0.31], ("first", "mean"): [0.1, 0.11],
             ("middle", "mean"): [0.3, 0.31], ("last", "mean"): [0.5, 0.51], ("ends", "min"): [0.1, 0.11],
             ("all", "min"): [0.1, 0.11]}  # fmt: skip
    for (frames, aggregate), expected in cases.items():
        reward = build("reward", "frames", reward="image-stat", frames=frames, every=2, aggregate=aggregate)
        out = reward(clips, prompts, meta)
        torch.testing.assert_close(out.scores, torch.tensor(expected), rtol=0, atol=1e-6)
    assert frame_indices(5, "every", 2) == [0, 2, 4] and frame_indices(1, "ends") == [0]
    image = build("reward", "frames", reward="image-stat")(clips[:, 2], prompts, meta)
    torch.testing.assert_close(image.scores, torch.tensor([0.3, 0.31]), rtol=0, atol=1e-6)


def test_a_clip_is_shown_as_a_strip_of_its_frames():
    clips = torch.arange(2 * 9, dtype=torch.float32).view(2, 9, 1, 1, 1).expand(2, 9, 3, 2, 2)
    assert strip_frames(9) == [0, 3, 5, 8] and strip_frames(3) == [0, 1, 2]
    strip = frame_strip(clips)
    assert strip.shape == (2, 3, 2, 8)
    assert strip[0, 0, 0].tolist() == [0, 0, 3, 3, 5, 5, 8, 8]
    images = torch.rand(2, 3, 4, 4)
    assert frame_strip(images) is images


def test_a_wan22_window_its_trained_expert_never_runs_is_refused(tmp_path):
    """With shift 12, steps 8 and 9 of 10 run the low-noise expert: training the high-noise one there would train
    nothing, and the recipe says so before anything loads; sharding Wan2.2 is refused (not yet supported)."""
    data = video_recipe("shapes_flowgrpo", tmp_path, backbone="tiny-wan2.2")
    data["rollout"].update(num_steps=10, window_size=2, window_range=[8, 10])
    data["backbone"]["train_expert"] = "high"
    with pytest.raises(RecipeError, match="no step of rollout.window_range"):
        validate_recipe(data)
    data["backbone"]["train_expert"] = "low"
    validate_recipe(data)
    data["train"]["shard"] = "fsdp"
    with pytest.raises(RecipeError, match="not supported for Wan2.2"):
        validate_recipe(data)


def test_tpflow_sample_of_a_video_recipe_writes_strips_and_the_playing_clips(tmp_path):
    from tests.cli_run import tpflow
    from tests.test_train import tiny_recipe

    recipe = tiny_recipe(
        tmp_path, None, reward='frames"\nreward = "image-stat', backbone='name = "tiny-wan"\nseed = 0'
    )
    out = tpflow("sample", str(recipe), "--prompt", "a red circle", "--n", "2", "--steps", "3",
                 "--out", str(tmp_path / "sheet.png"))  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert "2 clips" in out.stdout and (tmp_path / "sheet.png").is_file()
    with Image.open(tmp_path / "sheet.webp") as clips:
        assert clips.n_frames == 5
