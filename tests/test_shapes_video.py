"""The video shapes world: its prompts and splits, clips and detector reward (accuracy on rendered clips), the clip
DiT, its pretraining command, its backbone (a noise-0 rollout is the ODE) and a training epoch of its recipe."""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest
import torch

from tpflow.registry import build
from tpflow.shapes import video_world
from tpflow.shapes.video_model import ShapesVideoConfig, ShapesVideoDiT

ROOT = Path(__file__).resolve().parent.parent
OPPOSITE = {"left": "right", "right": "left", "up": "down", "down": "up"}


@pytest.fixture(scope="module")
def video_weights(tmp_path_factory) -> Path:
    """A clip DiT after 3 pretraining steps from scratch (random-ish weights whose clips score apart, the real file
    format)."""
    from tpflow.shapes.video_pretrain import video_pretrain

    out = tmp_path_factory.mktemp("video-weights")
    return video_pretrain(minutes=1, out=out, batch_size=2, max_steps=3, progress=False, threads=1, init="none")


def test_the_world_has_96_prompts_and_the_train_split_never_asks_for_a_held_out_triple():
    items = video_world.all_items()
    assert len(items) == 96 and len({it.prompt for it in items}) == 96
    dataset = build("dataset", "shapes-video")
    train, test = dataset.split("train"), dataset.split("test")
    assert len(test) == 96 and sum(it.metadata["held_out"] for it in test) == 2 * len(video_world.HELD_OUT)
    assert not any(it.metadata["held_out"] for it in train) and len(train) == video_world.TRAIN_SIZE
    tokens, mask = video_world.tokenize([it.prompt for it in items])
    assert not bool((tokens == 1).any()) and int(mask.sum(1).max()) <= video_world.MAX_TOKENS  # no <unk>


def test_the_detector_reward_is_exact_on_rendered_clips_of_the_held_out_prompts():
    """Each test prompt rendered 3 times: every clip strictly correct for its prompt; the same clips judged against
    the opposite direction fail the motion check, against another colour the colour check."""
    reward = build("reward", "shapes-video")
    items = [it for it in video_world.all_items() for _ in range(3)]
    rng = np.random.default_rng(7)
    clips = torch.stack([video_world.render_clip(it.metadata, rng) for it in items])
    assert clips.shape == (288, 8, 3, 32, 32)
    meta = [it.metadata for it in items]
    out = reward(clips, [m["prompt"] for m in meta], meta)
    assert float(out.details["strict"].mean()) == 1.0 and float(out.scores.mean()) == 1.0
    flipped = [dict(m, direction=OPPOSITE[m["direction"]]) for m in meta]
    wrong = reward(clips, [m["prompt"] for m in flipped], flipped)
    assert float(wrong.details["motion"].max()) == 0.0 and float(wrong.details["count"].min()) == 1.0
    recoloured = [dict(m, color="green" if m["color"] != "green" else "red") for m in meta]
    assert float(reward(clips, [m["prompt"] for m in meta], recoloured).details["color"].max()) == 0.0


def test_objects_move_the_prompts_way_and_stay_inside_the_frame():
    rng = np.random.default_rng(0)
    for direction, (dx, dy) in video_world.DIRECTIONS.items():
        meta = {"color": "red", "shape": "square", "count": 2, "direction": direction}
        clip = video_world.render_clip(meta, rng)
        ink = (clip < 0.9).any(dim=1)  # [F, H, W] pixels that are not background
        assert not bool(ink[:, 0, :].any() or ink[:, -1, :].any() or ink[:, :, 0].any() or ink[:, :, -1].any())
        ys, xs = ink[0].nonzero().float().mean(0), ink[-1].nonzero().float().mean(0)
        assert (float(xs[1] - ys[1]) * dx + float(xs[0] - ys[0]) * dy) > 10  # 14 px of travel


def test_the_clip_dit_starts_at_velocity_0_and_its_frames_see_each_other():
    torch.manual_seed(0)
    model = ShapesVideoDiT(ShapesVideoConfig(width=32, heads=2, depth=1, text_width=32))
    x = torch.randn(2, 8, 3, 32, 32)
    tokens, mask = video_world.tokenize(["a red circle moving left", "two blue squares moving up"])
    assert torch.equal(model(x, torch.rand(2), tokens, mask), torch.zeros_like(x))  # adaLN-zero output
    torch.nn.init.normal_(model.proj_out.weight)
    for block in [*model.blocks, *model.temporal]:  # out of adaLN-zero's identity: the tokens attend to each other
        torch.nn.init.normal_(block.adaln[-1].weight, std=0.1)
    sigma = torch.rand(2)
    v = model(x, sigma, tokens, mask)
    v.square().mean().backward()
    grads = [model.x_embed.weight.grad, model.temporal[0].frame_pos.grad, model.temporal[0].attn.to_q.weight.grad]
    assert v.shape == x.shape and all(g.abs().sum() > 0 for g in grads)
    later = x.clone()
    later[:, 4:] += 1.0  # the second half of the frames changes: the first half sees it (temporal attention)
    assert (model(later, sigma, tokens, mask)[:, :4] - v[:, :4]).abs().max() > 1e-4
    alone = model(x[:1], sigma[:1], tokens[:1], mask[:1])  # a clip's velocity never depends on another clip
    torch.testing.assert_close(alone, v[:1], rtol=1e-5, atol=1e-5)


def test_video_pretrain_writes_weights_the_backbone_loads(video_weights):
    backbone = build("backbone", "shapes-video-dit", weights=str(video_weights))
    z0 = backbone.initial_noise(2, torch.Generator().manual_seed(0))
    assert z0.shape == (2, 8, 3, 32, 32)
    from tpflow.rollout import Window, rollout, sample_ode
    from tpflow.samplers.cps import CpsSampler

    cond, sigmas = backbone.encode(["a red circle moving left", "two blue squares moving up"]), backbone.sigmas(4)
    with torch.no_grad():
        ode = sample_ode(backbone, cond, z0, sigmas, 3.0)
        out = rollout(backbone, CpsSampler(), cond, z0, sigmas, Window(0, 3), 0.0, 3.0, completions=None)
    torch.testing.assert_close(out.final, ode, rtol=0, atol=1e-6)  # noise level 0 is the ODE
    assert backbone.decode(ode).shape == (2, 8, 3, 32, 32)


def test_the_recipe_trains_an_epoch(tmp_path, video_weights):
    from tpflow.recipe import load_recipe
    from tpflow.train.trainer import Trainer

    sets = [f'backbone.weights="{video_weights}"', "train.epochs=1", "train.prompts_per_epoch=2", "train.group_size=4",
            "train.rollout_batch=8", "rollout.num_steps=4", "rollout.window_size=3", "rollout.window_range=[0, 3]",
            "eval.num_prompts=2", "eval.batch_size=2", "eval.num_steps=4", f'train.run_dir="{tmp_path}"']  # fmt: skip
    recipe = load_recipe(ROOT / "recipes" / "shapes_video_flowgrpo.toml", sets)
    trainer = Trainer(recipe)
    before = [p.detach().clone() for p in trainer.backbone.trainable_parameters()]
    metrics = trainer.fit()
    assert metrics["optimizer_steps"] >= 1 and "eval_reward" in metrics and "reward_motion" in metrics
    assert any(not torch.equal(a, p) for a, p in zip(before, trainer.backbone.trainable_parameters(), strict=True))
    assert list((tmp_path / "samples").glob("eval_*.webp"))


def test_bad_video_pretrain_arguments_exit_2():
    from tests.cli_run import tpflow

    out = tpflow("shapes", "video-pretrain", "--minutes", "0")
    assert out.returncode == 2 and "must be positive" in out.stderr


def test_random_items_of_the_train_split_are_never_held_out():
    rng = random.Random(0)
    assert not any(video_world.random_item(rng, "train").metadata["held_out"] for _ in range(500))


def test_inspect_trajectory_of_a_video_recipe_plays_its_completions(tmp_path, video_weights):
    """inspect-trajectory on clips: the completions' frame strips in completions.png and the clips playing in
    completions.webp (a row per trajectory, a column per j)."""
    from PIL import Image

    from tpflow.inspect import inspect_sampled
    from tpflow.recipe import load_recipe

    sets = [f'backbone.weights="{video_weights}"', "rollout.num_steps=4", "rollout.window_size=3",
            "rollout.window_range=[0, 3]", 'credit.name="consistent"']  # fmt: skip
    recipe = load_recipe(ROOT / "recipes" / "shapes_video_flowgrpo.toml", sets)
    result = inspect_sampled(recipe, "a red circle moving left", n=2, seed=0, out=tmp_path, warn=lambda _: None)
    assert result.trajectories.images.shape[:3] == (2, 4, 8)  # [n, W+1, F, ...]
    with Image.open(tmp_path / "completions.webp") as clips:
        assert clips.n_frames == 8
    assert (tmp_path / "completions.png").is_file()


def test_an_inflated_video_model_draws_each_frame_as_the_image_model():
    """Inflation (tpflow.shapes.video_init): the temporal blocks start as the identity, so every frame of any clip
    gets the image model's velocity for that frame: the video model starts from what the image model draws."""
    from tpflow.shapes.model import ShapesDiT, ShapesDiTConfig
    from tpflow.shapes.video_init import inflate

    torch.manual_seed(0)
    sizes = dict(width=32, heads=2, depth=2, text_width=32)
    image = ShapesDiT(ShapesDiTConfig(**sizes))
    for p in image.parameters():  # out of adaLN-zero's zeros: every layer matters
        torch.nn.init.normal_(p, std=0.2)
    video = inflate(ShapesVideoDiT(ShapesVideoConfig(frames=3, **sizes)), image)
    x = torch.randn(2, 3, 3, 32, 32, device="cpu")
    sigma = torch.rand(2, device="cpu")
    tokens, mask = video_world.tokenize(["a red circle left of a blue square", "two blue squares"])
    null = torch.tensor([False, True], device="cpu")
    with torch.no_grad():
        got = video(x, sigma, tokens, mask, null)
        for f in range(3):
            want = image(x[:, f], sigma, tokens, mask, null)
            torch.testing.assert_close(got[:, f], want, rtol=1e-5, atol=1e-5)
    assert want.abs().mean() > 0.1  # not two zeros
    for block in video.temporal:  # once the temporal blocks act, a frame sees the others
        torch.nn.init.normal_(block.adaln[-1].weight, std=0.2)
    later = x.clone()
    later[:, 2] += 1.0
    with torch.no_grad():
        assert (
            video(later, sigma, tokens, mask, null)[:, 0] - video(x, sigma, tokens, mask, null)[:, 0]
        ).abs().max() > 1e-4
    with pytest.raises(Exception, match="width"):  # sizes must match one to one
        inflate(ShapesVideoDiT(ShapesVideoConfig(width=64, heads=2, depth=2, text_width=64)), image)


def test_video_pretrain_continues_from_a_video_checkpoint_and_refuses_a_missing_one(tmp_path, video_weights):
    from safetensors.torch import load_file

    from tests.cli_run import tpflow
    from tpflow.shapes.video_init import start_model

    model = ShapesVideoDiT(ShapesVideoConfig())
    assert start_model(model, video_weights) == f"continued {video_weights.name}"
    saved = load_file(str(video_weights))
    assert all(torch.equal(saved[k], v) for k, v in model.state_dict().items())
    out = tpflow("shapes", "video-pretrain", "--init", str(tmp_path / "nothing.safetensors"), "--max-steps", "1")
    assert out.returncode == 2 and "no such file" in out.stderr and "Traceback" not in out.stderr
