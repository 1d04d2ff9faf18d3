"""The counting loophole: an extra object of the asked class found below GenEval's 0.9 counting threshold.

GenEval drops it, so "three triangles" with four drawn passes; the shapes-geneval reward counts it by default
(``strict_count``), the generic scorer and the ``geneval`` reward keep GenEval's rule (docs/shapes.md, "The counting
threshold").
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import pytest
import torch

import tpflow
from tpflow.rewards.geneval import score
from tpflow.shapes.negatives import hard_negatives
from tpflow.shapes.prompts import distinct_items
from tpflow.shapes.render import draw_scene, scene

COUNTING = {
    "tag": "counting",
    "include": [{"class": "triangle", "count": 3}],
    "exclude": [{"class": "triangle", "count": 4}],
}


class Det(NamedTuple):
    cls: str
    color: str
    box: tuple[float, float, float, float]
    score: float


def _three_and_a_faint_one(faint: float = 0.33) -> list[Det]:
    """Three triangles above 0.9 and a fourth at ``faint``, as the detector scores a malformed extra one."""
    sure = [Det("triangle", "red", (x, 2.0, x + 8.0, 10.0), 0.99) for x in (1.0, 12.0, 23.0)]
    return [*sure, Det("triangle", "green", (12.0, 20.0, 20.0, 28.0), faint)]


def test_a_faint_extra_object_fails_a_counting_prompt_with_strict_count():
    dets = _three_and_a_faint_one()
    geneval = score(dets, COUNTING, (32, 32))
    assert geneval.correct and geneval.strict_correct and geneval.score == 1.0  # GenEval's rule: the loophole
    strict = score(dets, COUNTING, (32, 32), strict_count=True)
    assert not strict.correct and not strict.strict_correct
    assert strict.score == pytest.approx(1 - 1 / 3)  # counted as four: 1 − |3 − 4| / 3
    assert "found 4 (1 of them at confidence 0.3 to 0.9)" in strict.reason


def test_strict_count_leaves_what_it_should_alone():
    dets = _three_and_a_faint_one(0.3)  # not above 0.3: not a detection GenEval keeps at all
    assert score(dets, COUNTING, (32, 32), strict_count=True).strict_correct
    other = [*_three_and_a_faint_one()[:3], Det("square", "red", (12.0, 20.0, 20.0, 28.0), 0.5)]
    assert score(other, COUNTING, (32, 32), strict_count=True).strict_correct  # another class does not count
    two = _three_and_a_faint_one()[1:]  # two sure ones and a faint one: still too few above 0.9
    result = score(two, COUNTING, (32, 32), strict_count=True)
    assert not result.correct and result.score == pytest.approx(1 - 1 / 3)
    single = {"tag": "single_object", "include": [{"class": "triangle", "count": 1}], "exclude": []}
    dets = [Det("triangle", "red", (1.0, 1.0, 9.0, 9.0), 0.99), Det("triangle", "red", (20, 1, 28, 9), 0.5)]
    assert score(dets, single, (32, 32), strict_count=True) == score(dets, single, (32, 32))  # one threshold there


def test_the_shapes_reward_counts_it_by_default_and_geneval_does_not():
    from tpflow.rewards.geneval.verdicts import verdicts

    dets = [_three_and_a_faint_one()]
    assert verdicts(dets, [COUNTING], (32, 32), "strict").scores.tolist() == [1.0]  # the geneval reward's rule
    assert verdicts(dets, [COUNTING], (32, 32), "strict", strict_count=True).scores.tolist() == [0.0]
    assert tpflow.build("reward", "shapes-geneval").options.strict_count is True
    assert tpflow.build("reward", "shapes-geneval", strict_count=False).options.strict_count is False


def test_strict_count_agrees_with_the_renderers_truth():
    """On ground-truth scenes of every counting prompt and their n ± 1 negatives, clean and under the blur and
    noise the detector is tested with, the reward's verdict is right with strict_count as without it."""
    rng = np.random.default_rng(3)
    images, truths, metadata = [], [], []
    for item in (it for it in distinct_items() if it.metadata["tag"] == "counting"):
        for _ in range(4):
            objects = scene(item.metadata, rng)
            negatives = [neg.objects for neg in hard_negatives(item.metadata, objects, rng)]
            for drawn, true in [(objects, True), *((neg, False) for neg in negatives)]:
                images.append(draw_scene(drawn))
                truths.append(float(true))
                metadata.append(item.metadata)
    images = torch.stack(images)
    kernel = torch.tensor([1.0, 2.0, 1.0])
    kernel = (kernel[:, None] * kernel[None, :] / 16).expand(3, 1, 3, 3)
    blurred = torch.nn.functional.conv2d(torch.nn.functional.pad(images, (1,) * 4, mode="replicate"), kernel, groups=3)
    noisy = (blurred + 0.03 * torch.randn(images.shape, generator=torch.Generator().manual_seed(0))).clamp(0, 1)
    prompts = [m["prompt"] for m in metadata]
    for strict_count in (False, True):
        reward = tpflow.build("reward", "shapes-geneval", strict_count=strict_count)
        for batch in (images, noisy):
            assert reward(batch, prompts, metadata).details["correct"].tolist() == truths
