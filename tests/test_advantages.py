"""Tests of tpflow.optim.advantages: docs/algorithm.md §5 and §9 Example 4."""

from __future__ import annotations

import math
import statistics

import pytest
import torch

from tpflow.optim.advantages import group_advantages, informative_trajectories

EXAMPLE4_GROUPS = ["p", "p", "p", "p", "q", "q"]
EXAMPLE4_REWARDS = [15.0, -4.0, 2.0, 3.0, 7.0, 7.0]
EXAMPLE4_PER_PROMPT = [1.596025, -1.160745, -0.290186, -0.145093, 0.0, 0.0]
EXAMPLE4_GLOBAL_STD = [1.895768, -1.378740, -0.344685, -0.172343, 0.0, 0.0]


def _reference(rewards: list[list[float]], groups: list[str], global_std: bool = False) -> torch.Tensor:
    """Plain-Python per-prompt, per-column z-score (+1e-4), clamp ±5: the §5 recipe, one loop per column."""
    n, w = len(rewards), len(rewards[0])
    out = [[0.0] * w for _ in range(n)]
    for i in range(w):
        column = [rewards[b][i] for b in range(n)]
        for key in set(groups):
            members = [b for b in range(n) if groups[b] == key]
            values = [column[b] for b in members]
            mean = statistics.fmean(values)
            std = statistics.pstdev(column) if global_std else statistics.pstdev(values)
            for b in members:
                out[b][i] = max(-5.0, min(5.0, (column[b] - mean) / (std + 1e-4)))
    return torch.tensor(out, dtype=torch.float64)


def test_example4_per_prompt() -> None:
    adv = group_advantages(torch.tensor(EXAMPLE4_REWARDS)[:, None], EXAMPLE4_GROUPS)
    assert adv.shape == (6, 1)
    assert adv.dtype == torch.float64
    torch.testing.assert_close(adv[:, 0], torch.tensor(EXAMPLE4_PER_PROMPT, dtype=torch.float64), rtol=0, atol=1e-6)
    assert torch.equal(adv[4:], torch.zeros(2, 1, dtype=torch.float64))  # q is constant: exactly 0


def test_example4_global_std() -> None:
    adv = group_advantages(torch.tensor(EXAMPLE4_REWARDS)[:, None], EXAMPLE4_GROUPS, global_std=True)
    torch.testing.assert_close(adv[:, 0], torch.tensor(EXAMPLE4_GLOBAL_STD, dtype=torch.float64), rtol=0, atol=1e-6)
    assert torch.equal(adv[4:], torch.zeros(2, 1, dtype=torch.float64))


def test_columns_are_independent_and_groups_need_not_be_contiguous() -> None:
    columns = [
        EXAMPLE4_REWARDS,
        [1.0, 2.0, 3.0, 4.0, -1.0, 5.0],
        [0.0, 0.0, 0.0, 0.0, 3.0, 3.0],
    ]
    rewards = [list(row) for row in zip(*columns, strict=True)]  # [6, 3]
    expected = _reference(rewards, EXAMPLE4_GROUPS)
    adv = group_advantages(torch.tensor(rewards), EXAMPLE4_GROUPS)
    torch.testing.assert_close(adv, expected, rtol=0, atol=1e-12)
    torch.testing.assert_close(adv[:, 0], torch.tensor(EXAMPLE4_PER_PROMPT, dtype=torch.float64), rtol=0, atol=1e-6)
    assert adv[4, 1] < 0 < adv[5, 1]  # q's second column has spread, unlike its first
    assert torch.equal(adv[:, 2], torch.zeros(6, dtype=torch.float64))

    # Interleave the prompts: the same rows in another order give the same advantages in that order.
    order = torch.tensor([4, 0, 2, 5, 1, 3])
    shuffled_groups = [EXAMPLE4_GROUPS[k] for k in order.tolist()]
    shuffled = group_advantages(torch.tensor(rewards)[order], shuffled_groups)
    assert shuffled_groups == ["q", "p", "p", "q", "p", "p"]
    torch.testing.assert_close(shuffled, adv[order], rtol=0, atol=1e-12)
    torch.testing.assert_close(
        group_advantages(torch.tensor(rewards)[order], shuffled_groups, global_std=True),
        _reference(rewards, EXAMPLE4_GROUPS, global_std=True)[order],
        rtol=0,
        atol=1e-12,
    )


def test_clip_binds() -> None:
    adv = group_advantages(torch.tensor(EXAMPLE4_REWARDS)[:, None], EXAMPLE4_GROUPS, clip=1.0)
    expected = [1.0, -1.0, -0.290186, -0.145093, 0.0, 0.0]
    torch.testing.assert_close(adv[:, 0], torch.tensor(expected, dtype=torch.float64), rtol=0, atol=1e-6)

    # global_std with one wide prompt among constant ones: that prompt's z-score exceeds 5 and is clamped.
    rewards = torch.tensor([100.0, -100.0] + [0.0] * 98)[:, None]
    groups = ["wide", "wide"] + [f"flat{k // 2}" for k in range(98)]
    adv = group_advantages(rewards, groups, global_std=True)
    unclipped = 100.0 / (math.sqrt(20000.0 / 100) + 1e-4)
    assert unclipped > 5.0
    assert adv[0, 0].item() == 5.0 and adv[1, 0].item() == -5.0
    assert torch.equal(adv[2:], torch.zeros(98, 1, dtype=torch.float64))
    assert group_advantages(rewards, groups, global_std=True, clip=math.inf)[0, 0].item() == pytest.approx(unclipped)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.int64])
def test_result_is_float64(dtype: torch.dtype) -> None:
    adv = group_advantages(torch.tensor([[1, 2], [3, 5], [2, 2], [4, 7]], dtype=dtype), ["a", "b", "a", "b"])
    assert adv.dtype == torch.float64
    torch.testing.assert_close(adv[:, 1], torch.tensor([0.0, -1.0, 0.0, 1.0], dtype=torch.float64), atol=1e-4, rtol=0)


def test_singleton_groups_fall_back_to_a_global_z_score() -> None:
    rewards = torch.tensor([[1.0, 5.0], [2.0, 5.0], [3.0, 5.0], [4.0, 5.0]])
    adv = group_advantages(rewards, ["a", "b", "c", "d"])
    std = statistics.pstdev([1.0, 2.0, 3.0, 4.0])
    expected = torch.tensor([(r - 2.5) / (std + 1e-4) for r in (1.0, 2.0, 3.0, 4.0)], dtype=torch.float64)
    torch.testing.assert_close(adv[:, 0], expected, rtol=0, atol=1e-12)
    assert torch.equal(adv[:, 1], torch.zeros(4, dtype=torch.float64))  # a constant column is exactly 0

    # A singleton among real groups is normalised per prompt: it is its own mean, so 0.
    mixed = group_advantages(torch.tensor([[1.0], [3.0], [10.0]]), ["a", "a", "b"])
    assert mixed[2, 0].item() == 0.0 and mixed[0, 0].item() < 0 < mixed[1, 0].item()


def test_constant_groups_are_exactly_zero_even_with_rounding_and_eps_zero() -> None:
    rewards = torch.tensor([[0.1], [0.1], [0.1], [0.7], [0.3]], dtype=torch.float64)  # mean of 3×0.1 ≠ 0.1 in fp64
    groups = ["c", "c", "c", "d", "d"]
    for eps in (1e-4, 0.0):
        adv = group_advantages(rewards, groups, eps=eps)
        assert torch.isfinite(adv).all()
        assert torch.equal(adv[:3], torch.zeros(3, 1, dtype=torch.float64))
    torch.testing.assert_close(group_advantages(rewards, groups, eps=0.0)[3:, 0], torch.tensor([1.0, -1.0]).double())


def test_groups_may_be_a_tensor_of_ids() -> None:
    rewards = torch.tensor(EXAMPLE4_REWARDS)[:, None]
    adv = group_advantages(rewards, torch.tensor([0, 0, 0, 0, 1, 1]))
    torch.testing.assert_close(adv[:, 0], torch.tensor(EXAMPLE4_PER_PROMPT, dtype=torch.float64), rtol=0, atol=1e-6)


def test_empty_batch() -> None:
    assert group_advantages(torch.zeros(0, 3), []).shape == (0, 3)


@pytest.mark.parametrize(
    ("rewards", "groups", "kwargs", "match"),
    [
        (torch.zeros(4), ["a"] * 4, {}, "2-D"),
        (torch.zeros(4, 2), ["a"] * 3, {}, "one prompt key per trajectory"),
        (torch.tensor([[1.0], [math.nan]]), ["a", "a"], {}, "finite"),
        (torch.tensor([[1.0], [math.inf]]), ["a", "a"], {}, "finite"),
        (torch.zeros(2, 1), ["a", "a"], {"clip": 0.0}, "clip"),
        (torch.zeros(2, 1), ["a", "a"], {"clip": -1.0}, "clip"),
        (torch.zeros(2, 1), ["a", "a"], {"eps": -1e-4}, "eps"),
        (torch.zeros(2, 1), ["a", "a"], {"eps": math.nan}, "eps"),
    ],
)
def test_validation(rewards: torch.Tensor, groups: list[str], kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        group_advantages(rewards, groups, **kwargs)


def test_informative_trajectories_drops_all_zero_rows() -> None:
    # Example 4 at three window positions; q is constant at every one, so its rows carry no signal.
    rewards = torch.tensor(
        [
            [15.0, 1.0, 0.0],
            [-4.0, 1.0, 0.0],
            [2.0, 1.0, 0.0],
            [3.0, 1.0, 0.0],
            [7.0, 2.0, -1.0],
            [7.0, 2.0, -1.0],
        ]
    )
    adv = group_advantages(rewards, EXAMPLE4_GROUPS)
    keep = informative_trajectories(adv)
    assert keep.dtype == torch.bool
    assert keep.tolist() == [True, True, True, True, False, False]

    # Non-zero at a single step is enough to keep a row.
    mask = informative_trajectories(torch.tensor([[0.0, 0.0], [0.0, -1e-9], [2.0, 0.0]]))
    assert mask.tolist() == [False, True, True]
    with pytest.raises(ValueError, match="2-D"):
        informative_trajectories(torch.zeros(3))


def test_dancegrpos_sample_std_and_eps() -> None:
    """DanceGRPO: A = (r − mean) / (torch.std(r) + 1e-8), the std unbiased (N − 1): docs/algorithm.md §10.1."""
    rewards, groups = torch.tensor(EXAMPLE4_REWARDS)[:, None], EXAMPLE4_GROUPS
    adv = group_advantages(rewards, groups, eps=1e-8, correction=1)
    p = torch.tensor(EXAMPLE4_REWARDS[:4], dtype=torch.float64)
    expected = (p - p.mean()) / (statistics.stdev(p.tolist()) + 1e-8)  # statistics.stdev: the sample std
    torch.testing.assert_close(adv[:4, 0], expected, rtol=0, atol=1e-12)
    assert torch.equal(adv[4:], torch.zeros(2, 1, dtype=torch.float64))  # constant group: 0, no 0/0
    population = group_advantages(rewards, groups, eps=1e-8)
    torch.testing.assert_close(adv[:4], population[:4] * math.sqrt(3 / 4), rtol=1e-9, atol=0)  # √((N−1)/N)
    column = torch.tensor(EXAMPLE4_REWARDS, dtype=torch.float64)
    by_column = group_advantages(rewards, groups, global_std=True, eps=1e-8, correction=1)
    torch.testing.assert_close(by_column[:4, 0], (p - p.mean()) / (column.std() + 1e-8), rtol=0, atol=1e-12)
    assert torch.equal(group_advantages(torch.tensor([[1.0], [2.0]]), ["a", "b"], correction=1)[:, 0].sign(),
                       torch.tensor([-1.0, 1.0], dtype=torch.float64))  # singletons: one global group  # fmt: skip
    with pytest.raises(ValueError, match="correction"):
        group_advantages(rewards, groups, correction=2)


def test_grpo_passes_its_advantage_options_on() -> None:
    import tpflow

    rewards, groups = torch.tensor(EXAMPLE4_REWARDS)[:, None], EXAMPLE4_GROUPS
    dance = tpflow.build("optimizer", "grpo", advantage_std="sample", advantage_eps=1e-8)
    assert torch.equal(dance.advantages(rewards, groups), group_advantages(rewards, groups, eps=1e-8, correction=1))
    default = tpflow.build("optimizer", "grpo")
    assert torch.equal(default.advantages(rewards, groups), group_advantages(rewards, groups))
