"""The ``pairwise`` reward (Pref-GRPO): win rates within a group, both orders averaged, its cap, the whole-group
scoring calls it needs, and the advantages it gives, which no increasing transform of the judge's score can move."""

from __future__ import annotations

import math

import pytest
import torch
from pydantic import BaseModel, ConfigDict

from tests.test_train import tiny_recipe
from tpflow import registry
from tpflow.errors import RecipeError, UserError
from tpflow.recipe import load_recipe
from tpflow.rewards.pairwise import PairwiseJudge, PairwiseReward, win_rates
from tpflow.train.epoch import prompt_groups
from tpflow.train.scoring import score_rollout
from tpflow.types import RewardOutput

SCORE, JUDGE = "tpflow-test-pairwise-score", "tpflow-test-pairwise-judge"
TRANSFORMS = {"identity": lambda s: s, "exp": torch.exp, "cube": lambda s: s**3 + 7}


class ScoreOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    transform: str = "identity"


class Score:
    """Stub scalar reward: a transform of each image's mean pixel value s (the test's underlying score)."""

    def __init__(self, options: ScoreOptions):
        self.transform = TRANSFORMS[options.transform]
        self.calls: list[int] = []  # rows of each call

    def __call__(self, images, prompts, metadata):
        self.calls.append(len(images))
        s = images.double().mean(dim=(1, 2, 3))  # [N]
        return RewardOutput(scores=self.transform(s).float(), details={"s": s.float()})


class Judge:
    """Stub PairwiseJudge with a bias for whichever image it sees first: P(a better) = ½ + (s_a − s_b) + bias."""

    def __init__(self, options):
        self.pairs = 0  # ordered pairs judged
        self.seen: set[tuple[float, float]] = set()  # (s_a, s_b) of each judgement

    def __call__(self, images, prompts, metadata):
        return RewardOutput(scores=images.mean(dim=(1, 2, 3)).float())

    def compare(self, images_a, images_b, prompts, metadata):
        s_a, s_b = images_a.double().mean(dim=(1, 2, 3)), images_b.double().mean(dim=(1, 2, 3))  # [P] each
        self.pairs += len(s_a)
        self.seen.update(zip(s_a.tolist(), s_b.tolist(), strict=True))
        return (0.5 + (s_a - s_b) + 0.2).clamp(0, 1)


@pytest.fixture(autouse=True)
def stubs():
    registry.register("reward", SCORE, options=ScoreOptions)(Score)
    registry.register("reward", JUDGE)(Judge)
    yield
    for name in (SCORE, JUDGE):
        registry._entries["reward"].pop(name, None)


def flat(values: list[float]) -> torch.Tensor:
    """Images [N, 3, 2, 2] whose mean pixel value is each of ``values``."""
    return torch.tensor(values, dtype=torch.float32, device="cpu")[:, None, None, None].expand(-1, 3, 2, 2).clone()


def pairwise(judge: str = SCORE, **options) -> PairwiseReward:
    judge_options = options.pop("judge_options", {})
    return registry.build("reward", "pairwise", judge={"name": judge, "options": judge_options}, **options)


def test_win_rates_by_hand_with_a_tie():
    """A group of 4 with a tie (s = 0.2, 0.5, 0.5, 0.9) and a group of 2, in one call, float64 by hand."""
    values = [0.5, 0.2, 0.9, 0.3, 0.5, 0.7]
    prompts = ["two circles", "Two  circles", "two circles", "a square", "two circles", "A square"]
    reward = pairwise()
    out = reward(flat(values), prompts, [{}] * 6)
    # group "two circles": rows 0, 1, 2, 4 with s = 0.5, 0.2, 0.9, 0.5
    expected = torch.tensor(
        [(1 + 0 + 0.5) / 3, 0 / 3, 3 / 3, 0.0, (1 + 0 + 0.5) / 3, 1.0], dtype=torch.float64, device="cpu"
    )
    torch.testing.assert_close(out.scores, expected.float())
    assert out.scores.dtype == torch.float32 and out.scores.device.type == "cpu"
    assert out.details["pairs"].tolist() == [3, 3, 3, 1, 3, 1]
    torch.testing.assert_close(out.details[SCORE], torch.tensor(values))  # the judge's own scores, to watch
    # the same arithmetic in float64, through the function the reward uses
    first, second = reward.pairs(prompts)
    s = torch.tensor(values, dtype=torch.float64, device="cpu")
    hard = ((torch.sign(s[first] - s[second]) + 1) / 2, (torch.sign(s[second] - s[first]) + 1) / 2)
    rates, count = win_rates(*hard, first, second, 6)
    assert rates.dtype == torch.float64
    torch.testing.assert_close(rates, expected, rtol=0, atol=1e-15)
    assert pairwise()(flat([0.4]), ["alone"], [{}]).scores.tolist() == [0.5]  # no sibling: even


def test_soft_scalar_judge():
    out = pairwise(temperature=0.5)(flat([0.2, 0.6]), ["p", "p"], [{}, {}])
    p = 1 / (1 + math.exp(-(0.2 - 0.6) / 0.5))
    torch.testing.assert_close(out.scores, torch.tensor([p, 1 - p]))


def test_both_orders_averaged_cancel_a_judge_that_prefers_the_first_image():
    """G = 4: G(G−1) = 12 ordered judgements; the first-shown bias of 0.2 cancels: R_i = mean_j ½ + s_i − s_j."""
    values = [0.1, 0.3, 0.2, 0.35]
    reward = pairwise(JUDGE, judge_batch=5)  # pairs split over several compare calls
    assert isinstance(reward.judge, PairwiseJudge)
    out = reward(flat(values), ["p"] * 4, [{}] * 4)
    s = torch.tensor(values, dtype=torch.float64, device="cpu")
    expected = torch.stack([(0.5 + s[i] - s[torch.arange(4) != i]).mean() for i in range(4)])
    torch.testing.assert_close(out.scores.double(), expected, rtol=0, atol=1e-7)
    assert reward.judge.pairs == 4 * 3
    assert len(reward.judge.seen) == 12, "every ordered pair judged once: both orders"
    # two groups of G = 5 and 3: Σ G(G−1) judgements
    reward = pairwise(JUDGE)
    reward(flat([0.1 * k for k in range(8)]), ["a"] * 5 + ["b"] * 3, [{}] * 8)
    assert reward.judge.pairs == 5 * 4 + 3 * 2


def test_the_cap_counts_pairs_and_is_seeded():
    g, cap = 9, 4
    values = [0.05 * k for k in range(g)]
    reward = pairwise(JUDGE, max_pairs_per_image=cap, seed=3)
    out = reward(flat(values), ["p"] * g, [{}] * g)
    assert reward.judge.pairs == g * cap, "G · cap ordered judgements instead of G(G−1)"
    assert out.details["pairs"].tolist() == [cap] * g, "every image meets as many siblings"
    again = pairwise(JUDGE, max_pairs_per_image=cap, seed=3)
    torch.testing.assert_close(again(flat(values), ["p"] * g, [{}] * g).scores, out.scores)
    assert reward.judge.seen == again.judge.seen, "the same seed draws the same pairs"
    other = pairwise(JUDGE, max_pairs_per_image=cap, seed=4)
    other(flat(values), ["p"] * g, [{}] * g)
    assert other.judge.seen != reward.judge.seen
    odd = pairwise(JUDGE, max_pairs_per_image=3)  # G·cap odd: one image meets cap − 1
    assert sorted(odd(flat(values), ["p"] * g, [{}] * g).details["pairs"].tolist()) == [2] + [3] * (g - 1)
    full = pairwise(JUDGE, max_pairs_per_image=g - 1)
    full(flat(values), ["p"] * g, [{}] * g)
    assert full.judge.pairs == g * (g - 1)


def test_a_judge_out_of_range_is_a_clear_error():
    reward = pairwise(JUDGE)
    reward.judge.compare = lambda a, b, p, m: torch.full((len(a),), 2.0)
    with pytest.raises(UserError, match="compare returns P\\(a better\\)"):
        reward(flat([0.1, 0.2]), ["p", "p"], [{}, {}])


def trajectories(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """values [n, W+1] -> final images [n, 3, 2, 2] of mean values[:, W] and completions [n, W, 3, 2, 2] of mean
    values[:, j] + 10·(j+1): a call that mixed columns would rank every completion above every final image."""
    width = values.shape[1] - 1
    offsets = 10.0 * torch.arange(1, width + 1, dtype=torch.float32, device="cpu")  # [W]
    completions = torch.stack([flat((values[:, j] + offsets[j]).tolist()) for j in range(width)], dim=1)
    return flat(values[:, width].tolist()), completions


def advantages_of(transform: str, values: torch.Tensor, prompts: list[str], pairwise_reward: bool):
    """The trainer's path: score_rollout's trace [n, W+1] -> the credit's step rewards -> GRPO's advantages."""
    judge = registry.build("reward", SCORE, transform=transform)
    reward = pairwise(judge_options={"transform": transform}) if pairwise_reward else judge
    final, completions = trajectories(values)  # values [n, W+1]
    width = values.shape[1] - 1
    scored = score_rollout(lambda z: z, reward, final, completions, prompts, [{}] * len(prompts), width, chunk=3)
    credit, optimizer = registry.build("credit", "consistent"), registry.build("optimizer", "grpo")
    return scored.trace, optimizer.advantages(credit(scored.trace).step_rewards, prompt_groups(prompts))


def test_advantages_do_not_move_under_any_increasing_transform_of_the_score():
    """The acceptance test: s, exp(s) and s³ + 7 give the judge different scales, the same advantages."""
    generator = torch.Generator(device="cpu").manual_seed(0)
    values = torch.rand(12, 4, generator=generator, device="cpu")  # [n, W+1]: two groups of 6, W = 3
    prompts = ["a red circle"] * 6 + ["two squares"] * 6
    prompts = [prompts[k] for k in torch.randperm(12, generator=generator).tolist()]  # groups interleaved
    reference_trace, reference = advantages_of("identity", values, prompts, pairwise_reward=True)
    for transform in ("exp", "cube"):
        trace, advantages = advantages_of(transform, values, prompts, pairwise_reward=True)
        assert torch.equal(trace, reference_trace) and torch.equal(advantages, reference)
    assert reference.abs().sum() > 0
    # the scalar reward itself is not scale-free: the transforms move its advantages
    _, raw = advantages_of("identity", values, prompts, pairwise_reward=False)
    _, cubed = advantages_of("cube", values, prompts, pairwise_reward=False)
    assert not torch.allclose(raw, cubed)
    # column j is a win rate among the group's images at column j (the offsets 10·(j+1) cancel)
    groups = torch.tensor(prompt_groups(prompts), device="cpu")
    for k in range(12):
        siblings = (groups == groups[k]) & (torch.arange(12, device="cpu") != k)  # [n]
        wins = ((torch.sign(values[k] - values[siblings]) + 1) / 2).mean(0)  # [W+1]
        torch.testing.assert_close(reference_trace[k], wins)


def test_scoring_calls_a_whole_group_reward_once_per_column_with_every_row():
    reward = pairwise()
    values = torch.linspace(0, 1, 24, device="cpu").view(8, 3)  # [n, W+1]
    final, completions = trajectories(values)
    score_rollout(lambda z: z, reward, final, completions, ["p"] * 8, [{}] * 8, 2, chunk=3)
    assert reward.judge.calls == [8, 8, 8], "W + 1 calls of n rows, not chunks of 3"
    plain = registry.build("reward", SCORE)
    score_rollout(lambda z: z, plain, final, completions, ["p"] * 8, [{}] * 8, 2, chunk=3)
    assert plain.calls == [3] * 8, "other rewards keep their chunks"


PAIRWISE = """[reward]
name = "pairwise"
judge = { name = "image-stat", options = { statistic = "brightness" } }
"""


def test_a_recipe_whose_batches_cut_groups_is_refused(tmp_path, tiny_weights):
    path = tiny_recipe(tmp_path, tiny_weights, reward="pairwise")
    text = path.read_text().replace('[reward]\nname = "pairwise"\n', PAIRWISE)
    path.write_text(text)
    with pytest.raises(RecipeError, match=r"2 prompts x 4 copies = 8 trajectories into rollout batches of 4") as err:
        load_recipe(path)
    assert "train.rollout_batch = 8" in str(err.value)
    load_recipe(path, ["train.rollout_batch=8"])
    load_recipe(path, ["train.prompts_per_round=1"])  # a round of 1 prompt x 4 copies is one batch of 4
    part = '{ name = "pairwise", options = { judge = { name = "image-stat" } } }'
    path.write_text(text.replace(PAIRWISE, f'[reward]\nname = "weighted"\nrewards = [{part}]\n'))
    with pytest.raises(RecipeError, match=r"must be the recipe's \[reward\] itself"):
        load_recipe(path, ["train.rollout_batch=8"])
    path.write_text(text.replace("image-stat", "no-such"))
    with pytest.raises(UserError, match="judge \\(.no-such.\\)"):
        load_recipe(path, ["train.rollout_batch=8"])


def test_one_shapes_epoch_trains_on_pairwise_win_rates(tmp_path, tiny_weights):
    from tpflow.train.trainer import Trainer

    path = tiny_recipe(tmp_path, tiny_weights, reward="pairwise")
    path.write_text(path.read_text().replace('[reward]\nname = "pairwise"\n', PAIRWISE))
    recipe = load_recipe(path, ["train.epochs=1", "train.rollout_batch=8", "eval.at_start=false"])
    metrics = Trainer(recipe).fit()
    assert metrics["reward_mean"] == pytest.approx(0.5), "win rates of whole groups average ½"
    assert 0 < metrics["reward_std"] < 1
    assert 0 < metrics["eval_image-stat"] < 1, "eval logs the judge's own score beside the win rate"
