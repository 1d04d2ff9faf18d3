"""The continuous GenEval-style score (tpflow/rewards/geneval/soft.py) and ``shapes-geneval``'s ``score = "soft"``."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tpflow.rewards.geneval.scoring import relative_position
from tpflow.rewards.geneval.soft import direction_ratio, soft_score
from tpflow.rewards.shapes_geneval import ShapesGenevalOptions, ShapesGenevalReward
from tpflow.shapes.detect import Detection
from tpflow.shapes.prompts import prompts
from tpflow.shapes.render import render_batch

SIZE = (32, 32)


def det(cls: str, color: str, x: float, y: float, score: float = 1.0, side: float = 8.0) -> Detection:
    return Detection(cls, color, (x, y, x + side, y + side), score)


def test_every_distinct_prompt_rendered_correctly_scores_exactly_one():
    items = prompts("test")  # every distinct prompt of the world
    metadata = [it.metadata for it in items] * 2
    images = render_batch(metadata, np.random.default_rng(3))
    out = ShapesGenevalReward(ShapesGenevalOptions(score="soft"))(images, [m["prompt"] for m in metadata], metadata)
    assert torch.equal(out.scores, out.details["soft"])
    assert out.scores.min().item() == 1.0
    assert out.details["strict"].min().item() == 1.0


def test_soft_counts_colours_and_missing_objects_by_hand():
    counting = {"tag": "counting", "include": [{"class": "circle", "count": 2}]}
    # soft count 1 + 0.5 = 1.5 against 2: 1 - 0.5 / 2
    assert soft_score([det("circle", "red", 2, 2), det("circle", "red", 20, 2, 0.5)], counting, SIZE) == 0.75
    assert soft_score([], counting, SIZE) == 0.0
    three = [det("circle", "red", x, 2) for x in (0, 11, 22)]  # one too many: 1 - 1 / 2
    assert soft_score(three, counting, SIZE) == 0.5
    colors = {"tag": "colors", "include": [{"class": "square", "count": 1, "color": "blue"}]}
    # count term 1 (0.6 + 0.4), colour term 1 - |0.4 - 1| = 0.4: mean 0.7
    found = [det("square", "red", 2, 2, 0.6), det("square", "blue", 20, 20, 0.4)]
    assert soft_score(found, colors, SIZE) == pytest.approx(0.7)


def test_position_term_ramps_with_the_direction_ratio():
    meta = {
        "tag": "position",
        "include": [{"class": "square", "count": 1}, {"class": "circle", "count": 1, "position": ["left of", 0]}],
    }
    square = det("square", "red", 20, 12)
    far_left = soft_score([square, det("circle", "blue", 2, 12)], meta, SIZE)
    assert far_left == 1.0
    right = soft_score([square, det("circle", "blue", 22, 0)], meta, SIZE)  # above, not left: position term 0
    assert right == pytest.approx(2 / 3)
    # a circle that is left and somewhat above: ratio between the ramp's ends gives a credit strictly between
    ratio = direction_ratio((14, 2, 22, 10), square.box, "left of")
    assert 0.3 < ratio < 0.6
    mid = soft_score([square, det("circle", "blue", 14, 2)], meta, SIZE)
    assert mid == pytest.approx((2 + (ratio - 0.3) / 0.3) / 3)
    weak = soft_score([square, det("circle", "blue", 2, 12, 0.5)], meta, SIZE)  # the pair's confidence scales it
    assert weak == pytest.approx((1 + 0.5 + 0.5) / 3)


def test_direction_ratio_agrees_with_genevals_relation_rule():
    rng = np.random.default_rng(0)
    for _ in range(2000):
        a = rng.uniform(0, 24, 2)
        b = rng.uniform(0, 24, 2)
        box_a = (*a, *(a + rng.uniform(4, 10, 2)))
        box_b = (*b, *(b + rng.uniform(4, 10, 2)))
        relations = relative_position(box_a, box_b)
        for relation in ("left of", "right of", "above", "below"):
            assert (direction_ratio(box_a, box_b, relation) > 0.5) == (relation in relations), (box_a, box_b)


def test_the_soft_reward_ties_less_often_than_the_partial_credit_on_noisy_images():
    """Why the option exists: on perturbed renderings the partial credit takes few distinct values, the soft one
    many (a group of equal rewards gives no gradient)."""
    items = prompts("test")[:24]
    metadata = [it.metadata for it in items]
    images = render_batch(metadata, np.random.default_rng(1))
    noise = torch.randn(images.shape, generator=torch.Generator(device="cpu").manual_seed(0), device="cpu")
    images = (images + 0.35 * noise).clamp(0, 1)
    out = ShapesGenevalReward(ShapesGenevalOptions(score="soft"))(images, [m["prompt"] for m in metadata], metadata)
    assert len(set(out.details["soft"].tolist())) > len(set(out.details["partial"].tolist()))
