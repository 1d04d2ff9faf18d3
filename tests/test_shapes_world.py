"""The data side of the shapes world: renderer, prompts, detector, GenEval scorer and the shapes-geneval reward."""

from __future__ import annotations

import random
from collections import Counter, defaultdict
from typing import NamedTuple

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import tpflow
from tpflow.interfaces import PromptDataset, RewardModel
from tpflow.rewards.geneval import GenevalResult, accuracy_by_tag, relative_position, score
from tpflow.shapes import prompts as shape_prompts
from tpflow.shapes.detect import detect, detect_batch
from tpflow.shapes.render import SceneObject, draw_scene, render, render_batch, scene
from tpflow.shapes.vocab import COLORS, SHAPES, WORDS, words

TAGS = shape_prompts.TAGS


def _items_per_tag(n_per_tag: int, seed: int) -> list:
    """n_per_tag items of every tag, half from each split."""
    half = n_per_tag // 2 * len(TAGS)
    return shape_prompts.prompts("train", half, seed=seed) + shape_prompts.prompts("test", half, seed=seed + 1)


def _strict_by_tag(images: torch.Tensor, items: list) -> dict[str, float]:
    reward = tpflow.build("reward", "shapes-geneval")
    out = reward(images, [it.prompt for it in items], [it.metadata for it in items])
    hits = defaultdict(list)
    for strict, item in zip(out.details["strict"].tolist(), items, strict=True):
        hits[item.metadata["tag"]].append(strict)
    return {tag: float(np.mean(v)) for tag, v in hits.items()}


@pytest.fixture(scope="module")
def rendered() -> tuple[torch.Tensor, list]:
    items = _items_per_tag(300, seed=11)
    return render_batch([it.metadata for it in items], np.random.default_rng(0)), items


# ------------------------------------------------------------------------------------------------- acceptance


def test_detector_scores_ground_truth_renderings(rendered):
    images, items = rendered
    assert Counter(it.metadata["tag"] for it in items) == {tag: 300 for tag in TAGS}
    accuracy = _strict_by_tag(images, items)
    assert all(acc >= 0.99 for acc in accuracy.values()), accuracy


def test_detector_is_robust_to_noise_and_blur(rendered):
    images, items = rendered[0][::3], rendered[1][::3]
    kernel = torch.tensor([1.0, 2.0, 1.0])
    kernel = (kernel[:, None] * kernel[None, :] / 16).expand(3, 1, 3, 3)
    blurred = F.conv2d(F.pad(images, (1, 1, 1, 1), mode="replicate"), kernel, groups=3)
    noisy = blurred + 0.03 * torch.randn(images.shape, generator=torch.Generator().manual_seed(0))
    accuracy = _strict_by_tag(noisy.clamp(0, 1), items)
    assert all(acc >= 0.98 for acc in accuracy.values()), accuracy


def test_reward_protocol_and_options(rendered):
    images, items = rendered[0][:12], rendered[1][:12]
    prompts, metadata = [it.prompt for it in items], [it.metadata for it in items]
    partial = tpflow.build("reward", "shapes-geneval")
    strict = tpflow.build("reward", "shapes-geneval", score="strict")
    assert isinstance(partial, RewardModel)
    out = partial(images, prompts, metadata)
    assert out.scores.shape == (12,) and out.scores.dtype == torch.float32
    assert torch.equal(out.scores, torch.ones(12)) and torch.equal(out.details["correct"], torch.ones(12))
    blank = torch.ones_like(images)
    assert torch.equal(strict(blank, prompts, metadata).scores, torch.zeros(12))
    with pytest.raises(tpflow.errors.UserError):
        tpflow.build("reward", "shapes-geneval", scores="strict")


# ----------------------------------------------------------------------------------------- renderer, detector


def test_render_round_trip():
    rng = np.random.default_rng(3)
    for item in _items_per_tag(20, seed=5):
        objects = scene(item.metadata, rng)
        image = draw_scene(objects)
        assert image.shape == (3, 32, 32) and image.dtype == torch.float32
        assert 0 <= image.min() and image.max() <= 1 and torch.all(image[:, 0, :] == 1)  # white border row
        found = detect(image)
        assert sorted((d.cls, d.color) for d in found) == sorted((o.cls, o.color) for o in objects)
        for obj in objects:
            near = min(found, key=lambda d: sum(abs(a - b) for a, b in zip(d.box, obj.box, strict=True)))
            assert (near.cls, near.color) == (obj.cls, obj.color)
            assert max(abs(a - b) for a, b in zip(near.box, obj.box, strict=True)) < 0.75
            assert near.score > 0.9


def test_render_satisfies_metadata_exactly():
    rng = np.random.default_rng(4)
    for item in shape_prompts.prompts("test"):  # every distinct prompt
        objects = scene(item.metadata, rng)
        include = item.metadata["include"]
        assert Counter(o.cls for o in objects) == Counter({c["class"]: c["count"] for c in include})
        for clause in include:
            if "color" in clause:
                assert all(o.color == clause["color"] for o in objects if o.cls == clause["class"])
            if "position" in clause:
                relation, target = clause["position"]
                (a,) = [o for o in objects if o.cls == clause["class"]]
                (b,) = [o for o in objects if o.cls == include[target]["class"]]
                assert relation in relative_position(a.box, b.box)
        for i, a in enumerate(objects):  # boxes at least a pixel apart and inside the image
            assert 1 <= a.box[0] and a.box[2] <= 31 and 1 <= a.box[1] and a.box[3] <= 31
            for b in objects[i + 1 :]:
                assert (
                    a.box[0] >= b.box[2] + 1
                    or b.box[0] >= a.box[2] + 1
                    or a.box[1] >= b.box[3] + 1
                    or (b.box[1] >= a.box[3] + 1)
                )


def test_render_is_seeded_and_sized():
    metadata = {"tag": "counting", "include": [{"class": "circle", "count": 4}], "exclude": []}
    a = render(metadata, np.random.default_rng(7))
    assert torch.equal(a, render(metadata, np.random.default_rng(7)))
    assert render(metadata, np.random.default_rng(7), size=64).shape == (3, 64, 64)
    assert render_batch([metadata] * 3, np.random.default_rng(0)).shape == (3, 3, 32, 32)
    assert len(detect(render(metadata, np.random.default_rng(1), size=64))) == 4


def test_detector_ignores_background_noise_and_specks():
    noise = (1 - 0.03 * torch.randn(3, 32, 32, generator=torch.Generator().manual_seed(0)).abs()).clamp(0, 1)
    assert detect(noise) == []
    assert detect(draw_scene([SceneObject("circle", "red", (4, 4, 6, 6))])) == []  # a 2-px speck
    assert detect_batch(torch.ones(2, 3, 32, 32)) == [[], []]


# ----------------------------------------------------------------------------------------------------- scorer


class Det(NamedTuple):
    cls: str
    color: str | None
    box: tuple[float, float, float, float]
    score: float = 1.0


def _box(x: float, y: float, side: float = 8) -> tuple[float, float, float, float]:
    return (x, y, x + side, y + side)


def _score(dets, include, tag="t", exclude=()):
    return score(dets, {"tag": tag, "include": include, "exclude": list(exclude)}, (32, 32))


def test_scorer_counts_exact_versus_at_least():
    include = [{"class": "circle", "count": 2}]
    two = [Det("circle", "red", _box(1, 1)), Det("circle", "red", _box(20, 1))]
    three = [*two, Det("circle", "blue", _box(1, 20))]
    assert _score(two, include) == GenevalResult(True, True, 1.0, "")
    r = _score(three, include)
    assert r.correct and not r.strict_correct and r.score == pytest.approx(0.5)
    r = _score(two[:1], include)
    assert not r.correct and not r.strict_correct and r.score == pytest.approx(0.5)
    r = _score(three + [Det("circle", "red", _box(20, 20)), Det("circle", "red", _box(10, 10))], include)
    assert r.score == pytest.approx(-0.5)  # 1 − |2 − 5| / 2 can be negative


def test_scorer_exclude_clauses():
    include, exclude = [{"class": "circle", "count": 2}], [{"class": "circle", "count": 3}]
    three = [Det("circle", "red", _box(x, 1)) for x in (1, 11, 21)]
    r = _score(three, include, exclude=exclude)
    assert not r.correct and not r.strict_correct and r.score == pytest.approx(0.5)  # the score ignores excludes
    r = _score(three[:2] + [Det("square", "red", _box(1, 20))], include, exclude=[{"class": "square", "count": 1}])
    assert not r.correct and not r.strict_correct and r.score == 1.0


def test_scorer_colors():
    include = [{"class": "circle", "count": 2, "color": "red"}]
    r = _score([Det("circle", "red", _box(1, 1)), Det("circle", "blue", _box(20, 1))], include)
    assert not r.correct and not r.strict_correct and r.score == pytest.approx((1 + 0.5) / 2)
    r = _score([Det("circle", "red", _box(1, 1))], include)  # wrong count: credit 0.5, then 0 for the colour
    assert r.score == pytest.approx(0.25)
    r = _score([Det("circle", "red", _box(x, 1)) for x in (1, 11, 21)], include)
    assert r.correct and not r.strict_correct and r.score == pytest.approx(0.5 / 2)


def test_scorer_position_without_the_upstream_bug():
    include = [{"class": "square", "count": 1}, {"class": "circle", "count": 1, "position": ["left of", 0]}]
    square = Det("square", "red", _box(20, 12))
    r = _score([square, Det("circle", "blue", _box(2, 12))], include)
    assert r.correct and r.strict_correct and r.score == 1.0
    r = _score([square, Det("circle", "blue", _box(22, 1))], include)  # above, not left of
    assert not r.correct and not r.strict_correct
    assert r.score == pytest.approx((1 + 1 + 0) / 3)  # upstream would give (1 + 1 + 0 + 1) / 4
    r = _score([Det("circle", "blue", _box(2, 12))], include)  # no target: 0 for the count, the position skipped
    assert not r.correct and r.score == pytest.approx((0 + 1 + 0) / 3)


def test_relative_position_margin():
    a, b = _box(0, 0, 10), _box(11, 0, 10)
    assert relative_position(a, b) == {"left of"} and relative_position(b, a) == {"right of"}
    assert relative_position(_box(0, 0, 10), _box(1.5, 0, 10)) == set()  # within the 0.1 margin
    assert relative_position(_box(0, 0, 10), _box(12, 12, 10)) == {"left of", "above"}


def test_the_renderer_places_with_a_wider_margin_than_the_scorer_checks():
    """The renderer's rule is GenEval's (tpflow.boxes) at margin 0.2 / threshold 0.6 instead of 0.1 / 0.5: a pair it
    accepts is one GenEval accepts, and a pair GenEval barely accepts the renderer refuses (room for a pixel)."""
    from tpflow.boxes import relation_holds
    from tpflow.shapes.render import _relation_holds

    near, far = (_box(0, 0, 10), _box(5, 0, 10)), (_box(0, 0, 10), _box(20, 0, 10))
    assert relative_position(*near) == {"left of"} and not _relation_holds(*near, "left of")  # dx -0.6 vs -0.2
    assert relative_position(*far) == {"left of"} and _relation_holds(*far, "left of")  # dx -0.9 vs -0.8
    assert _relation_holds(far[1], far[0], "right of") and not _relation_holds(*far, "above")
    assert relation_holds(*near, "left of", margin=0.1, threshold=0.5)  # GenEval's own values: the scorer's verdict


def test_scorer_confidence_thresholds_and_cap():
    include = [{"class": "circle", "count": 1}]
    sure, unsure = Det("circle", "red", _box(1, 1), 0.95), Det("circle", "red", _box(20, 1), 0.5)
    assert _score([sure, unsure], include, tag="single_object").score == pytest.approx(0.0)  # two kept
    assert _score([sure, unsure], include, tag="counting").strict_correct  # 0.5 ≤ 0.9: dropped
    assert not _score([Det("circle", "red", _box(1, 1), 0.3)], include).correct  # kept only above 0.3
    many = [Det("circle", "red", _box(1, 1), 0.5 + i / 100) for i in range(20)]
    r = _score(many, [{"class": "circle", "count": 17}])
    assert not r.correct and r.score == pytest.approx(1 - 1 / 17)  # at most 16 kept per class
    best = [Det("circle", "blue", _box(1, 1), 0.9), *[Det("circle", "red", _box(9, 9), 0.5)] * 2]
    assert _score(best, [{"class": "circle", "count": 1, "color": "blue"}]).correct  # colour of the best one


def test_accuracy_by_tag():
    results = [_score([], [{"class": "circle", "count": 1}]), _score([Det("circle", "red", _box(1, 1))], [])]
    assert accuracy_by_tag(results, ["a", "b"]) == {"a": 0.0, "b": 1.0, "overall": 0.5}


# ---------------------------------------------------------------------------------------------------- prompts


def test_prompts_are_well_formed():
    for split in ("train", "test"):
        for item in shape_prompts.prompts(split):
            meta = item.metadata
            assert all(w in WORDS for w in words(item.prompt)), item.prompt
            assert meta["prompt"] == item.prompt and meta["tag"] in TAGS and isinstance(meta["exclude"], list)
            classes = [c["class"] for c in meta["include"]]
            assert len(set(classes)) == len(classes) and set(classes) <= set(SHAPES)
            colors = [c["color"] for c in meta["include"] if "color" in c]
            assert len(set(colors)) == len(colors) and set(colors) <= set(COLORS)
            if meta["tag"] == "counting":
                (clause,) = meta["include"]
                assert 2 <= clause["count"] <= 4 and meta["exclude"] == [
                    {"class": clause["class"], "count": clause["count"] + 1}
                ]
            if meta["tag"] == "position":
                assert meta["include"][1]["position"][1] == 0 and meta["include"][1]["position"][0] in item.prompt
    assert shape_prompts.prompts("test")[0].prompt == "a photo of a circle"


def test_held_out_pairs():
    held = shape_prompts.HELD_OUT
    assert len(held) == 3 and len({s for _, s in held}) == 3

    def pairs(items):
        return {(c["color"], c["class"]) for it in items for c in it.metadata["include"] if "color" in c}

    assert not pairs(shape_prompts.prompts("train")) & held
    assert pairs(shape_prompts.prompts("test")) >= held
    rng = random.Random(0)
    assert not pairs([shape_prompts.random_item(rng) for _ in range(2000)]) & held


def test_prompts_are_deterministic_and_balanced():
    a, b = shape_prompts.prompts("train", 100, seed=3), shape_prompts.prompts("train", 100, seed=3)
    assert a == b and a != shape_prompts.prompts("train", 100, seed=4)
    counts = Counter(it.metadata["tag"] for it in a)
    assert set(counts) == set(TAGS) and max(counts.values()) - min(counts.values()) <= 1
    rng = random.Random(0)
    assert set(Counter(shape_prompts.random_item(rng).metadata["tag"] for _ in range(600))) == set(TAGS)


def test_registered_dataset():
    dataset = tpflow.build("dataset", "shapes")
    assert isinstance(dataset, PromptDataset) and dataset.splits == ("train", "test")
    test = dataset.split("test")
    assert len(test) == 400
    counts = Counter(it.metadata["tag"] for it in test)
    assert set(counts) == set(TAGS) and max(counts.values()) - min(counts.values()) <= 1
    assert test == tpflow.build("dataset", "shapes").split("test")
    assert len(tpflow.build("dataset", "shapes", test_size=12).split("test")) == 12
    with pytest.raises(tpflow.errors.UserError):
        dataset.split("val")
