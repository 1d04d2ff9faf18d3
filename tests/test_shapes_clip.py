"""shapes-clip: the shipped model ranks correct renderings above their hard negatives; the reward's interface; the
model's save/load; a tiny clip-pretrain run; the recipes. Offline, CPU, a few seconds."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

import tpflow
from tpflow.errors import UserError
from tpflow.recipe import load_recipe
from tpflow.rewards.shapes_clip import WEIGHTS_DIR, WEIGHTS_FILE, ShapesClipReward
from tpflow.shapes import prompts, render
from tpflow.shapes.clip import ShapesClip, ShapesClipConfig, load_clip, save_clip
from tpflow.shapes.clip_accuracy import pairwise_accuracy
from tpflow.shapes.negatives import hard_negatives, satisfies

ROOT = Path(__file__).resolve().parent.parent
SHIPPED = WEIGHTS_DIR / WEIGHTS_FILE
TINY = ShapesClipConfig(channels=(8, 8, 16), image_layers=1, embed_dim=16, text_width=16, text_layers=1, heads=2)
PER_TAG = 48  # held-out test prompts per tag in the accuracy test
MIN_ACCURACY = 0.9


def test_hard_negatives_break_the_prompt_and_say_what_they_show():
    """Every hard negative fails its prompt; the include it claims (when one) holds for its objects."""
    rng = np.random.default_rng(0)
    kinds = set()
    for item in prompts.prompts("test", 120, seed=0):
        objects = render.scene(item.metadata, rng)
        assert satisfies(item.metadata["include"], objects), item.prompt
        for negative in hard_negatives(item.metadata, objects, rng):
            kinds.add((item.metadata["tag"], negative.kind))
            assert not satisfies(item.metadata["include"], negative.objects), (item.prompt, negative)
            assert negative.include is None or satisfies(negative.include, negative.objects), negative
    assert {tag for tag, _ in kinds} == set(prompts.TAGS)


def test_shipped_model_ranks_the_correct_rendering_above_each_hard_negative():
    """Pairwise accuracy ≥ 90% per tag on held-out test prompts (held-out colour-shape pairs included)."""
    model = load_clip(SHIPPED)
    acc = pairwise_accuracy(model, prompts.prompts("test", PER_TAG * len(prompts.TAGS), seed=0), seed=0)
    figures = ", ".join(f"{tag} {acc['by_tag'][tag]:.3f} ({acc['pairs'][tag]} pairs)" for tag in prompts.TAGS)
    assert all(acc["by_tag"][tag] >= MIN_ACCURACY for tag in prompts.TAGS), f"pairwise accuracy: {figures}"


def test_reward_interface_and_determinism():
    reward = tpflow.build("reward", "shapes-clip", device="cpu")
    items = prompts.prompts("test", 12, seed=3)
    images = render.render_batch([item.metadata for item in items], np.random.default_rng(0))  # [12, 3, 32, 32]
    texts = [item.prompt for item in items]
    out = reward(images, texts, [item.metadata for item in items])
    assert out.scores.shape == (12,) and out.scores.dtype == torch.float32 and out.scores.device.type == "cpu"
    assert out.details["cosine"].shape == (12,) and torch.isfinite(out.scores).all()
    assert torch.equal(out.scores, reward(images, texts, [{}] * 12).scores)  # deterministic, metadata unused
    half = reward(images.half(), texts, [{}] * 12).scores  # any float dtype; quantised to uint8 the same way
    torch.testing.assert_close(half, out.scores, atol=1e-5, rtol=0)
    alone = reward(images[:3], texts[:3], [{}] * 3).scores  # a score does not depend on the rest of the batch
    torch.testing.assert_close(alone, out.scores[:3], atol=1e-5, rtol=0)
    wrong = reward(images.flip(0), texts, [{}] * 12).scores  # matching images score higher on average
    assert out.scores.mean() > wrong.mean() + 0.1


def test_reward_builds_from_the_recipe_without_the_backbone():
    reward = load_recipe(ROOT / "recipes" / "shapes_clip_tp.toml", ["reward.device=cpu"]).build("reward")
    assert isinstance(reward, ShapesClipReward)
    image = render.render({"include": [{"class": "circle", "count": 1, "color": "red"}]}, np.random.default_rng(0))
    score = reward(image[None], ["a photo of a red circle"], [{}]).scores
    assert 0.5 < float(score) < 1.2  # the usual range of a match is near 1 (SCORE_SCALE)


def test_bad_weights_are_user_errors(tmp_path):
    with pytest.raises(UserError, match="shapes-clip.*missing.*clip-pretrain"):
        tpflow.build("reward", "shapes-clip", weights=str(tmp_path / "nope.safetensors"))
    broken = tmp_path / WEIGHTS_FILE
    broken.write_bytes(b"not a safetensors file")
    with pytest.raises(UserError, match="could not be loaded"):
        tpflow.build("reward", "shapes-clip", weights=str(tmp_path))  # a folder holding a broken file


def test_save_load_round_trip(tmp_path):
    torch.manual_seed(0)
    model = ShapesClip(TINY).eval()
    path = save_clip(model, tmp_path / WEIGHTS_FILE, {"note": "test"})
    loaded = load_clip(path)
    assert loaded.config == TINY and not any(p.requires_grad for p in loaded.parameters())
    images = torch.rand(2, 3, 32, 32)
    with torch.no_grad():
        torch.testing.assert_close(loaded.encode_image(images), model.encode_image(images), atol=0, rtol=0)
        torch.testing.assert_close(loaded.encode_prompts(["a red circle"]), model.encode_prompts(["a red circle"]))
    path.with_suffix(".json").unlink()  # the safetensors metadata alone rebuilds the model
    assert load_clip(path).config == TINY


def test_text_encoder_sees_word_order():
    """Order is visible to the text encoder: swapped attributes or relations are different prompts."""
    model = load_clip(SHIPPED)
    pairs = [
        ("a photo of a red circle and a blue square", "a photo of a blue circle and a red square"),
        ("a photo of a circle left of a square", "a photo of a square left of a circle"),
    ]
    for a, b in pairs:
        emb = model.encode_prompts([a, b])
        assert float(emb[0] @ emb[1]) < 0.99, (a, b)


def test_tiny_clip_pretrain_writes_loadable_weights(tmp_path):
    from tpflow.shapes.clip_pretrain import clip_pretrain

    path = clip_pretrain(minutes=1, out=tmp_path, batch_size=4, max_steps=3, progress=False, config=TINY)
    model = load_clip(path)
    assert model.config == TINY
    stats = json.loads(path.with_suffix(".json").read_text())["stats"]
    assert stats["iterations"] == 3 and set(stats["pairwise_accuracy_test240"]) == set(prompts.TAGS)
    reward = tpflow.build("reward", "shapes-clip", weights=str(path), device="cpu")
    assert reward(torch.rand(2, 3, 32, 32), ["a red circle", "two squares"], [{}, {}]).scores.shape == (2,)


@pytest.mark.parametrize("name", ["shapes_clip_tp.toml", "shapes_clip_flowgrpo.toml"])
def test_recipes_validate_and_differ_from_shapes_tp_only_in_reward_and_credit(name):
    recipe = load_recipe(ROOT / "recipes" / name)
    base = load_recipe(ROOT / "recipes" / "shapes_tp.toml")
    assert recipe.components["reward"].name == "shapes-clip"
    assert recipe.components["optimizer"].options.beta == 0.0  # KL-free
    assert recipe.components["credit"].name == ("consistent" if name.endswith("_tp.toml") else "outcome")
    for kind in ("backbone", "dataset", "sampler", "optimizer"):
        assert recipe.components[kind] == base.components[kind], kind
    assert recipe.settings == base.settings


def test_scoring_path_states_every_device():
    """The reward runs on the training path (the scoring worker): no tensor factory without ``device=``."""
    from .test_device_rules import FactoryWatch

    reward = tpflow.build("reward", "shapes-clip", device="cpu")
    with FactoryWatch() as watch:
        reward(torch.rand(2, 3, 32, 32), ["a red circle", "two squares"], [{}, {}])
        reward(torch.rand(1, 3, 64, 64), ["a circle left of a square"], [{}])  # the resize path
    assert not watch.calls, watch.calls
