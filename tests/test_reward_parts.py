"""Multi-reward advantages: ``combine = "sum"`` (the weighted sum normalised in the group) against ``"zscore_sum"``
(each reward normalised in the group, then Σ w·z, DanceGRPO's and MixGRPO's), in float64 against hand computations,
on a constructed case where they disagree, and through a training epoch."""

from __future__ import annotations

import math

import pytest
import torch

from tpflow.distributed import Distributed
from tpflow.registry import build
from tpflow.train.reward_parts import zscore_sum_advantages, zscored_parts
from tpflow.train.scoring import score_rollout

GROUPS = ["a"] * 4 + ["b"] * 4
EPS, CLIP = 1e-4, 5.0


def _z(values: list[float]) -> list[float]:
    """The group z-score by hand: (r − mean) / (population std + eps), clipped at ±5."""
    mean = sum(values) / len(values)
    std = math.sqrt(sum((v - mean) ** 2 for v in values) / len(values))
    return [max(-CLIP, min(CLIP, (v - mean) / (std + EPS))) for v in values]


class _Scored:
    def __init__(self, parts: dict[str, list[float]]) -> None:  # final rewards only: outcome credit, W = 1
        self.part_traces = {k: torch.tensor([[math.nan, v] for v in vals], dtype=torch.float32) for k, vals in
                            parts.items()}  # fmt: skip


def test_both_combinations_against_float64_hand_computations():
    a = [0.125, 0.5, 0.25, 0.875, 3.0, 1.0, 2.0, 2.5]  # exact in float32, as traces are stored
    b = [10.0, 30.0, 20.0, 50.0, 5.0, 7.0, 6.0, 5.5]
    weights = {"a": 1.0, "b": 0.5}
    optimizer, credit = build("optimizer", "grpo"), build("credit", "outcome")
    got = zscore_sum_advantages(weights, credit, [_Scored({"a": a, "b": b})], optimizer, GROUPS, lambda t: t)
    za = _z(a[:4]) + _z(a[4:])
    zb = _z(b[:4]) + _z(b[4:])
    expected = torch.tensor([[1.0 * x + 0.5 * y] for x, y in zip(za, zb, strict=True)], dtype=torch.float64)
    assert got.dtype == torch.float64
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-12)
    summed = [1.0 * x + 0.5 * y for x, y in zip(a, b, strict=True)]  # "sum": the weighted sum, normalised once
    by_hand = torch.tensor([[v] for v in _z(summed[:4]) + _z(summed[4:])], dtype=torch.float64)
    torch.testing.assert_close(optimizer.advantages(torch.tensor([[v] for v in summed]), GROUPS), by_hand,
                               rtol=0, atol=1e-12)  # fmt: skip


def test_the_two_combinations_disagree_where_one_reward_has_the_larger_scale():
    """Images whose brightness reward rises while their low-saturation reward falls by less: the wider-spread
    brightness decides the summed reward's advantages, while the two z-scores, each linear in i, cancel exactly."""
    # image i: red 0.2 + 0.2·i, green and blue 0.1·i: brightness (0.2 + 0.4·i)/3 rises 0.133 a step, saturation
    # (max − min) = 0.2 + 0.1·i, so its "low saturation" reward 0.8 − 0.1·i falls 0.1 a step
    values = [(0.2 + 0.2 * i, 0.1 * i, 0.1 * i) for i in range(4)]
    images = torch.tensor(values, dtype=torch.float32)[:, :, None, None].expand(4, 3, 8, 8).clone()
    parts = [
        {"name": "image-stat", "label": "brightness"},
        {"name": "image-stat", "label": "saturation", "options": {"statistic": "saturation", "maximize": False}},
    ]
    summed = build("reward", "weighted", rewards=parts)
    zscored = build("reward", "weighted", rewards=parts, combine="zscore_sum")
    assert zscored_parts(summed) is None and zscored_parts(zscored) == {"brightness": 1.0, "saturation": 1.0}
    scored = score_rollout(lambda z: z, zscored, images, None, ["p"] * 4, [{}] * 4, window=1)
    assert bool((scored.part_traces["brightness"][:, -1].diff() > 0).all())
    assert bool((scored.part_traces["saturation"][:, -1].diff() < 0).all())
    optimizer, credit, groups = build("optimizer", "grpo"), build("credit", "outcome"), ["p"] * 4
    by_sum = optimizer.advantages(credit(scored.trace).step_rewards, groups)[:, 0]
    by_z = zscore_sum_advantages(zscored_parts(zscored), credit, [scored], optimizer, groups, lambda t: t)[:, 0]
    assert by_sum[-1] > 1.0 and by_sum[0] < -1.0  # the brighter images win under the sum
    assert by_z.abs().max() < 1e-3  # the z-scores cancel: neither reward wins


def test_a_zscore_sum_recipe_trains_and_logs_every_part(tmp_path, tiny_weights):
    from tests.test_train import tiny_recipe
    from tpflow.recipe import load_recipe
    from tpflow.train.trainer import Trainer

    reward = (
        'weighted"\ncombine = "zscore_sum"\nrewards = [{ name = "image-stat", label = "bright" }, '
        '{ name = "image-stat", label = "sat", weight = 0.5, options = { statistic = "saturation" } }]\n#"'
    )
    trainer = Trainer(
        load_recipe(tiny_recipe(tmp_path, tiny_weights, credit="outcome", reward=reward), ["train.epochs=1"])
    )
    before = [p.detach().clone() for p in trainer.backbone.trainable_parameters()]
    metrics = trainer.fit()
    assert metrics["optimizer_steps"] >= 1 and "reward_bright" in metrics and "reward_sat" in metrics
    assert any(not torch.equal(a, p) for a, p in zip(before, trainer.backbone.trainable_parameters(), strict=True))


def test_an_unknown_combination_is_refused():
    with pytest.raises(Exception, match="combine"):
        build("reward", "weighted", rewards=[{"name": "image-stat"}], combine="mean")


def test_a_single_process_gather_is_the_identity():
    assert Distributed(None).gather(torch.ones(2)).tolist() == [1.0, 1.0]


def test_two_processes_each_get_the_one_process_advantages():
    """zscore_sum over 2 processes: each holds half of the rows (a group split between them) and gathers every
    process's part rewards in process order before normalising, so both get the 1-process advantages [N, 1]."""
    a = [0.125, 0.5, 0.25, 0.875, 3.0, 1.0, 2.0, 2.5]
    b = [10.0, 30.0, 20.0, 50.0, 5.0, 7.0, 6.0, 5.5]
    weights = {"a": 1.0, "b": 0.5}
    optimizer, credit = build("optimizer", "grpo"), build("credit", "outcome")
    whole = zscore_sum_advantages(weights, credit, [_Scored({"a": a, "b": b})], optimizer, GROUPS, lambda t: t)
    halves = [_Scored({"a": a[:3], "b": b[:3]}), _Scored({"a": a[3:], "b": b[3:]})]  # group "a" split 3 | 1
    locals_ = {k: [credit(h.part_traces[k]).step_rewards.double() for h in halves] for k in weights}
    for rank, half in enumerate(halves):
        calls = iter(locals_[k] for k in weights)  # the parts in the order zscore_sum_advantages gathers them

        def gather(local, rank=rank, calls=calls):  # Distributed.gather: every process's rows, rank 0's first
            both = next(calls)
            torch.testing.assert_close(local, both[rank], rtol=0, atol=0)
            return torch.cat(both)

        got = zscore_sum_advantages(weights, credit, [half], optimizer, GROUPS, gather)
        torch.testing.assert_close(got, whole, rtol=0, atol=0)
