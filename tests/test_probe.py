"""The probe's core (tpflow/probe): the first-step gradient an optimizer takes, and the count-sketch projection.

A probe that measured a re-implementation, or a gradient from a step that was not on policy, would rank credit
methods on something training never does; these tests pin the measured gradient to a hand computation."""

from __future__ import annotations

import contextlib
import math

import pytest
import torch

import tpflow
from tpflow.optim.advantages import group_advantages
from tpflow.probe.gradient import first_step_gradient
from tpflow.probe.projection import CountSketch, measured_distortion
from tpflow.rollout import Window, rollout
from tpflow.types import Conditioning


class LinearPolicy:
    """v(z) = W·z + c (one trainable matrix, float64): small enough to differentiate by hand."""

    def __init__(self, dim: int = 3) -> None:
        generator = torch.Generator().manual_seed(0)
        self.weight = torch.nn.Parameter(0.3 * torch.randn(dim, dim, generator=generator, dtype=torch.float64))
        self.offset = torch.randn(dim, generator=generator, dtype=torch.float64)

    def velocity(self, z, sigma, cond, guidance):
        return z @ self.weight.T + self.offset

    def trainable_parameters(self):
        return [self.weight]

    def reference(self):
        return contextlib.nullcontext()


def linear_batch(policy: LinearPolicy, n: int = 2):
    sampler = tpflow.build("sampler", "flow-sde")
    cond = Conditioning({"rows": torch.arange(n)})
    z0 = torch.randn(n, 3, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    sigmas = torch.tensor([1.0, 0.7, 0.4, 0.0])
    batch = rollout(policy, sampler, cond, z0, sigmas, Window(0, 2), 0.7, 1.0, None,
                    generator=torch.Generator().manual_seed(2))  # fmt: skip
    return sampler, batch


def test_the_first_step_gradient_is_minus_the_mean_of_a_grad_log_pi():
    """On policy (ratio 1, inside the clip range) the GRPO gradient is −(1/rows) Σ_b Σ_i A_bi ∇ log π(x_{i+1} | x_i),
    rows = trajectories × trained steps: here 2 × 2, computed by autograd on the formula in float64."""
    policy = LinearPolicy()
    sampler, batch = linear_batch(policy)
    advantages = torch.tensor([[1.5, -0.5], [-1.0, 2.0]], dtype=torch.float64)
    grpo = tpflow.build("optimizer", "grpo", beta=0.0, micro_batch_size=1, adv_clip_max=10.0)
    grpo.bind(policy)
    before = policy.weight.detach().clone()
    measured = first_step_gradient(grpo, policy, sampler, batch, advantages)
    assert torch.equal(policy.weight.detach(), before) and grpo.global_step == 0  # no step taken
    total = 0
    for i in range(2):
        sigma, sigma_next = batch.sigmas[:, i], batch.sigmas[:, i + 1]
        v = policy.velocity(batch.latents[:, i], sigma, None, 1.0)
        log_prob = sampler.log_prob(batch.next_latents[:, i], batch.latents[:, i], v, sigma, sigma_next, 0.7).log_prob
        total = total + (advantages[:, i] * log_prob).sum()
    (expected,) = torch.autograd.grad(-total / 4, [policy.weight])
    assert expected.abs().max() > 0
    torch.testing.assert_close(measured, expected.reshape(-1).float(), rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("filter_zero_advantage", [True, False])
def test_zero_advantages_give_a_zero_gradient(filter_zero_advantage):
    policy = LinearPolicy()
    sampler, batch = linear_batch(policy)
    grpo = tpflow.build("optimizer", "grpo", beta=0.0, filter_zero_advantage=filter_zero_advantage)
    grpo.bind(policy)
    gradient = first_step_gradient(grpo, policy, sampler, batch, torch.zeros(2, 2, dtype=torch.float64))
    assert gradient.shape == (9,) and torch.equal(gradient, torch.zeros(9))


def test_the_optimizers_state_is_left_as_it_was(tiny_weights):
    """A probe between training steps must not move the run: weights, AdamW moments, step count, NFT's old policy and
    update count are as before."""
    backbone = tpflow.build("backbone", "shapes-dit", weights=str(tiny_weights), lora_init="gaussian")
    prompts = ["a photo of a red circle"] * 2 + ["a photo of two squares"] * 2
    z0 = backbone.initial_noise(4, torch.Generator().manual_seed(0))
    batch = rollout(backbone, tpflow.build("sampler", "flow-sde"), backbone.encode(prompts), z0, backbone.sigmas(4),
                    Window(0, 3), 0.7, 2.0, None, transitions=False)  # fmt: skip
    nft = tpflow.build("optimizer", "nft", micro_batch_size=2, num_timesteps=4, timesteps_per_sample=2, seed=3)
    nft.bind(backbone)
    adv = group_advantages(torch.randn(4, 1, generator=torch.Generator().manual_seed(1)), prompts)
    nft.update(backbone, None, batch, adv)  # a real step first: moments and an old policy that lags
    state = nft.state_dict()
    weights = [p.detach().clone() for p in backbone.trainable_parameters()]
    gradient = first_step_gradient(nft, backbone, None, batch, adv)
    assert gradient.abs().max() > 0
    after = nft.state_dict()
    assert after["global_step"] == state["global_step"] and after["updates"] == state["updates"]
    assert all(torch.equal(a, b) for a, b in zip(after["old"], state["old"], strict=True))
    assert all(torch.equal(p, w) for p, w in zip(backbone.trainable_parameters(), weights, strict=True))
    moments = [s["exp_avg"] for s in nft.loop.optimizer.state.values()]
    assert moments and all(torch.equal(m, state["optimizer"]["state"][k]["exp_avg"]) for k, m in enumerate(moments))
    # the same draws again: the measured gradient does not depend on having been measured before
    assert torch.equal(first_step_gradient(nft, backbone, None, batch, adv), gradient)


def test_the_sketch_keeps_inner_products_within_its_bound():
    """E⟨Sx, Sy⟩ = ⟨x, y⟩ with a standard deviation of at most ‖x‖‖y‖·√(2/d): measured over 8 random vectors of
    10⁴ coordinates sketched to d = 512, the largest distortion stays within 4 of those standard deviations."""
    vectors = torch.randn(8, 10_000, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    vectors[1] = vectors[0] + 0.1 * vectors[1]  # a nearly parallel pair, as gradients of two arms are
    sketch = CountSketch(10_000, 512, seed=7)
    distortion = measured_distortion(sketch, vectors)
    assert 0 < distortion <= 4 * (2 / 512) ** 0.5, distortion
    assert torch.equal(CountSketch(10_000, 512, seed=7)(vectors), sketch(vectors))  # fixed by its seed
    exact = CountSketch(10_000, 10_000, seed=7)  # d = P: still a sketch, distortion from collisions only
    assert measured_distortion(exact, vectors) < distortion


def test_leave_one_out_advantages_by_hand():
    from tpflow.probe.reference import leave_one_out_advantages

    rewards = torch.tensor([1.0, 2.0, 6.0, 5.0, 3.0])
    advantages = leave_one_out_advantages(rewards, ["a", "a", "a", "b", "b"], width=2)
    expected = torch.tensor([1 - 4.0, 2 - 3.5, 6 - 1.5, 5 - 3.0, 3 - 5.0], dtype=torch.float64)
    assert advantages.shape == (5, 2) and torch.equal(advantages, expected[:, None].expand(5, 2))
    with pytest.raises(ValueError, match="at least 2"):
        leave_one_out_advantages(torch.tensor([1.0, 2.0, 3.0]), ["a", "a", "b"], width=1)


def test_the_reference_gradient_is_the_loo_reinforce_estimate():
    """Through the GRPO loss code, the leave-one-out advantages give −(1/rows)·Σ A ∇log π exactly: the reference
    gradient is the same code path as every arm's, differing only in its advantages."""
    from tpflow.probe.reference import leave_one_out_advantages

    policy = LinearPolicy()
    sampler, batch = linear_batch(policy, n=4)
    rewards = torch.tensor([0.2, 0.9, 0.4, 0.1])
    advantages = leave_one_out_advantages(rewards, ["p", "p", "q", "q"], width=2)
    grpo = tpflow.build("optimizer", "grpo", beta=0.0, micro_batch_size=3, adv_clip_max=10.0)
    grpo.bind(policy)
    measured = first_step_gradient(grpo, policy, sampler, batch, advantages)
    score = 0
    for i in range(2):
        sigma, sigma_next = batch.sigmas[:, i], batch.sigmas[:, i + 1]
        v = policy.velocity(batch.latents[:, i], sigma, None, 1.0)
        score = score + sampler.log_prob(batch.next_latents[:, i], batch.latents[:, i], v, sigma, sigma_next,
                                         0.7).log_prob  # fmt: skip
    a = torch.tensor([0.2 - 0.9, 0.9 - 0.2, 0.4 - 0.1, 0.1 - 0.4], dtype=torch.float64)
    (expected,) = torch.autograd.grad(-(a * score).sum() / 8, [policy.weight])
    torch.testing.assert_close(measured, expected.reshape(-1).float(), rtol=1e-5, atol=1e-7)


def test_paired_arms_share_their_main_trajectories_bitwise(tmp_path, tiny_weights):
    """Blocks sampled from one seed hold the same main trajectories (final latents and the stored window, bit for
    bit) although one computes ODE completions and the other none; each is charged its own NFE, and each gradient
    is its own credit's."""
    from tests.test_train import tiny_recipe
    from tpflow.precision import Precision
    from tpflow.probe.arms import arm_gradient, draw_arm, parse_arm, sample_block

    recipe = tiny_recipe(tmp_path, tiny_weights, reward="image-stat")
    outcome = parse_arm("outcome:credit.name=outcome", recipe)
    consistent = parse_arm("tp:credit.name=consistent", recipe)
    assert outcome.sampling != consistent.sampling  # the two need different rollouts
    torch.manual_seed(0)
    backbone = outcome.recipe.build("backbone")
    sampler, reward = outcome.recipe.build("sampler"), outcome.recipe.build("reward")
    items = list(outcome.recipe.build("dataset").split("train"))[:2] * 4  # 2 prompts x 4 copies
    prompts = [item.prompt for item in items]
    blocks = {
        arm.name: sample_block(arm, backbone, sampler, reward, items, 11, Precision()) for arm in (outcome, consistent)
    }
    a, b = blocks["outcome"].rollout, blocks["tp"].rollout
    for field in ("final", "latents", "next_latents", "log_probs", "sigmas"):
        assert torch.equal(getattr(a, field), getattr(b, field)), field
    assert torch.equal(blocks["outcome"].trace[:, -1], blocks["tp"].trace[:, -1])  # the same final rewards
    assert blocks["tp"].nfe > blocks["outcome"].nfe  # completions cost TP-GRPO its own evaluations
    draws = {arm.name: arm_gradient(arm, backbone, sampler, [blocks[arm.name]], prompts, Precision())
             for arm in (outcome, consistent)}  # fmt: skip
    assert draws["outcome"].gradient.abs().max() > 0 and draws["tp"].gradient.abs().max() > 0
    assert not torch.equal(draws["outcome"].gradient, draws["tp"].gradient)
    again = draw_arm(outcome, backbone, sampler, reward, items, 11, Precision())
    assert torch.equal(again.gradient, draws["outcome"].gradient)  # a draw is a function of its seed


def test_a_rival_arm_samples_with_its_own_sampler_and_plan(tmp_path, tiny_weights):
    """An arm may change how it samples (sampler, plan, window: DanceGRPO's here, its array value's commas kept):
    it gets a rollout of its own, in a pairing class of its own, and its gradient is its plan's subset's."""
    from tests.test_train import tiny_recipe
    from tpflow.precision import Precision
    from tpflow.probe.arms import arm_gradient, parse_arm, sample_block

    recipe = tiny_recipe(tmp_path, tiny_weights, reward="image-stat")
    outcome = parse_arm("outcome:credit.name=outcome", recipe)
    consistent = parse_arm("tp:credit.name=consistent", recipe)
    dance = parse_arm("dance:credit.name=outcome,sampler.name=dance-sde,plan.name=trained-fraction,"
                      "rollout.window_size=4,rollout.window_range=[0, 4],rollout.noise_level=0.3", recipe)  # fmt: skip
    assert dance.recipe.rollout.window_range == (0, 4) and dance.sampler().registered_name == "dance-sde"
    assert outcome.pairing == consistent.pairing != dance.pairing and dance.sampling != outcome.sampling
    torch.manual_seed(0)
    backbone, reward = dance.recipe.build("backbone"), dance.recipe.build("reward")
    items = list(dance.recipe.build("dataset").split("train"))[:2] * 4
    block = sample_block(dance, backbone, dance.sampler(), reward, items, 11, Precision())
    assert block.rollout.trained is not None and (block.rollout.trained.sum(dim=1) == 1).all()  # int(3 · 0.6)
    drawn = arm_gradient(dance, backbone, dance.sampler(), [block], [i.prompt for i in items], Precision())
    assert drawn.gradient.abs().max() > 0 and drawn.nfe == 4


def test_the_cfg_gradient_modes_are_paired_arms(tmp_path, tiny_weights):
    """``optimizer.cfg_gradient`` as arms: both sample the same rollout (one block serves both, bit for bit), and
    their first-step gradients differ by the unconditional branch's share (the recipe's CFG scale is 2)."""
    from tests.test_train import tiny_recipe
    from tpflow.precision import Precision
    from tpflow.probe.arms import arm_gradient, parse_arm, sample_block

    recipe = tiny_recipe(tmp_path, tiny_weights, reward="image-stat")
    both = parse_arm("both:credit.name=outcome,optimizer.cfg_gradient=both", recipe)
    conditional = parse_arm("conditional:credit.name=outcome,optimizer.cfg_gradient=conditional", recipe)
    assert both.sampling == conditional.sampling and both.pairing == conditional.pairing
    torch.manual_seed(0)
    backbone, reward = both.recipe.build("backbone"), both.recipe.build("reward")
    items = list(both.recipe.build("dataset").split("train"))[:2] * 4
    block = sample_block(both, backbone, both.sampler(), reward, items, 11, Precision())
    prompts = [i.prompt for i in items]
    a = arm_gradient(both, backbone, both.sampler(), [block], prompts, Precision()).gradient
    b = arm_gradient(conditional, backbone, both.sampler(), [block], prompts, Precision()).gradient
    assert a.abs().max() > 0 and b.abs().max() > 0 and not torch.allclose(a, b)


def test_a_same_noise_group_spanning_blocks_starts_from_one_z0(tmp_path, tiny_weights):
    """A group of G copies that spans G / block blocks is one group of the advantages: under same_noise its copies
    must share one z_0 (TempFlow's siblings one ODE state), so the blocks of a repeat draw each prompt's z_0 from the
    repeat's seed, not each block its own."""
    from tests.test_train import tiny_recipe
    from tpflow.precision import Precision
    from tpflow.probe.arms import parse_arm, sample_block

    recipe = tiny_recipe(tmp_path, tiny_weights, reward="image-stat")
    arm = parse_arm("mix:credit.name=outcome,rollout.same_noise=true,rollout.window_range=[0, 3]", recipe)
    torch.manual_seed(0)
    backbone, reward = arm.recipe.build("backbone"), arm.recipe.build("reward")
    items = list(arm.recipe.build("dataset").split("train"))[:2] * 2  # prompts a, b, a, b
    assert items[0].prompt != items[1].prompt

    def z0(block_seed, repeat_seed):  # the window starts at 0, so its first stored state is z_0: [4, ...]
        return sample_block(
            arm, backbone, arm.sampler(), reward, items, block_seed, Precision(), repeat_seed
        ).rollout.latents[:, 0]

    first, second = z0(11, 7), z0(12, 7)
    assert torch.equal(first, second)  # the two blocks of the repeat: one z_0 per prompt
    assert torch.equal(first[0], first[2]) and not torch.equal(first[0], first[1])  # per prompt, not per block
    assert not torch.equal(z0(11, None), z0(12, None))  # without the repeat's seed each block draws its own


def test_an_arm_may_change_how_it_samples_and_trains_only(tmp_path, tiny_weights):
    from tests.test_train import tiny_recipe
    from tpflow.errors import UserError
    from tpflow.probe.arms import parse_arm

    recipe = tiny_recipe(tmp_path, tiny_weights, reward="image-stat")
    arm = parse_arm("k2:credit.name=consistent, rollout.completion_steps=2", recipe)
    assert arm.name == "k2" and arm.recipe.rollout.completion_steps == 2 and arm.recipe.credit.name == "consistent"
    with pytest.raises(UserError, match="shared by every arm"):
        parse_arm("big:reward.name=brightness", recipe)
    with pytest.raises(UserError, match="NAME:KEY=VALUE"):
        parse_arm("credit.name=outcome", recipe)


def test_the_noise_free_figures_on_a_toy_whose_answer_is_known():
    """Draws g = m + noise with ‖m‖² = 1 and noise of total variance 16 (SNR 1/16 per draw). The plain cosine of a
    mean of 64 draws to the true mean is far below 1; the bias ceiling of an unbiased estimator is ≈ 1 whatever its
    noise, and ≈ cos(m, m') for a biased one; the SNR estimate recovers 1/16."""
    from tpflow.probe.stats import bias_ceiling, cosine, mean_of, signal_to_noise, split_half_reliability

    generator = torch.Generator().manual_seed(5)
    d = 400
    m = torch.zeros(d, dtype=torch.float64)
    m[0] = 1.0
    tilted = torch.zeros(d, dtype=torch.float64)
    tilted[0], tilted[1] = 0.6, 0.8  # cos(m, tilted) = 0.6

    def draws(mean, n):
        return [mean + 4.0 * torch.randn(d, generator=generator, dtype=torch.float64) / d**0.5 for _ in range(n)]

    unbiased_a, unbiased_b = mean_of(draws(m, 2000)), mean_of(draws(m, 2000))
    ref_a, ref_b = mean_of(draws(m, 2000)), mean_of(draws(m, 2000))
    biased_a, biased_b = mean_of(draws(tilted, 2000)), mean_of(draws(tilted, 2000))
    assert cosine(mean_of(draws(m, 64)), m) < 0.95  # the plain cosine carries the estimate's noise
    assert bias_ceiling(unbiased_a, unbiased_b, ref_a, ref_b) == pytest.approx(1.0, abs=0.05)
    assert bias_ceiling(biased_a, biased_b, ref_a, ref_b) == pytest.approx(0.6, abs=0.05)
    assert signal_to_noise(torch.stack(draws(m, 4000))) == pytest.approx(1 / 16, rel=0.25)
    r, whole = split_half_reliability(ref_a, ref_b)
    assert 0.9 < r < 1 and r < whole < 1
    assert cosine(torch.zeros(3), torch.ones(3)) == 0.0


def test_the_all_pairs_noise_free_cosine_and_its_jackknife_on_the_toy():
    """The all-pairs form of the bias ceiling: ≈ 1 for an unbiased estimator however noisy, ≈ cos(m, m') = 0.6 for a
    biased one; its jackknife interval covers the true value; a delete-one jackknife of a mean is the t interval."""
    from tpflow.intervals import t_interval
    from tpflow.probe.stats import jackknife, noise_free_cosine

    generator = torch.Generator().manual_seed(6)
    d = 400
    m = torch.zeros(d, dtype=torch.float64)
    m[0] = 1.0
    tilted = torch.zeros(d, dtype=torch.float64)
    tilted[0], tilted[1] = 0.6, 0.8

    def draws(mean, n):
        return mean + 4.0 * torch.randn(n, d, generator=generator, dtype=torch.float64) / d**0.5

    reference = draws(m, 400)
    assert noise_free_cosine(draws(m, 400), reference) == pytest.approx(1.0, abs=0.06)
    estimate, low, high = jackknife(lambda x: noise_free_cosine(x, reference), draws(tilted, 400))
    assert estimate == pytest.approx(0.6, abs=0.06) and low < 0.6 < high and high - low < 0.3
    values = torch.randn(12, generator=generator, dtype=torch.float64)
    mean, lo, hi = jackknife(lambda x: float(x.mean()), values)
    expected = t_interval(values.tolist())
    assert mean == pytest.approx(expected[0]) and lo == pytest.approx(expected[1]) and hi == pytest.approx(expected[2])


def _probe_result(repeats=12, ceiling=0.8, split_half=0.9, draws=8, snr=1e-3):
    arm = {"key": "tp@4", "repeats": repeats, "bias_ceiling": (ceiling, 0.7, 0.9),
           "bias_ceiling_normalised": (0.7, 0.6, 0.8), "snr_per_trajectory": (snr, snr / 2, snr * 2)}  # fmt: skip
    return {"arms": [arm, {**arm, "key": "outcome@4"}],
            "reference": {"draws": draws, "split_half": (split_half, 2 * split_half / (1 + split_half))}}  # fmt: skip


def test_the_report_says_which_figures_this_size_cannot_show():
    """A 2-repeat probe printed 'bias ceiling 6.265', nan and split-half 0.000 as results; each is now named, with
    the size that would make it meaningful (Spearman-Brown for the reference draws)."""
    from tpflow.probe.caveats import caveats

    assert caveats(_probe_result()) == []  # a probe of the documented size: nothing to say
    (small,) = caveats(_probe_result(repeats=2))
    assert "At 2 repeats" in small and "--repeats 8" in small
    (ceiling,) = caveats(_probe_result(ceiling=6.265))
    assert "tp@4, outcome@4" in ceiling and "outside [−1, 1]" in ceiling
    assert "is undefined" in caveats(_probe_result(snr=math.nan))[0]
    (noise,) = caveats(_probe_result(split_half=0.0))
    assert "split-half cosine is 0.000" in noise
    (weak,) = caveats(_probe_result(split_half=0.3, draws=8))
    # halves of 4 draws at r = 0.3; reliability 0.8 needs k = 0.8·0.7 / (0.3·0.2) = 9.33 halves: 38 draws
    assert "--reference-draws 38" in weak
