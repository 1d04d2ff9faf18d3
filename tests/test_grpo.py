"""Tests of tpflow.optim.grpo: the clipped surrogate, the KL to the reference and the optimizer options."""

from __future__ import annotations

import math

import pytest
import torch
from pydantic import ValidationError

import tpflow
from tpflow.errors import UserError
from tpflow.interfaces import Optimizer
from tpflow.optim.grpo import GRPO, GRPOOptions
from tpflow.optim.grpo_loss import PolicyLoss, clipped_surrogate, kl_to_reference


def _policy_log_probs(seed: int = 0, n: int = 6) -> tuple[torch.nn.Linear, torch.Tensor]:
    """A tiny categorical policy: log π(action | x) from a Linear layer, one action per row."""
    torch.manual_seed(seed)
    policy = torch.nn.Linear(4, 3)
    x = torch.randn(n, 4)
    actions = torch.randint(0, 3, (n,))
    log_prob = torch.log_softmax(policy(x), dim=-1)[torch.arange(n), actions]
    return policy, log_prob


def _grads(policy: torch.nn.Module, loss: torch.Tensor) -> list[torch.Tensor]:
    return list(torch.autograd.grad(loss, list(policy.parameters()), retain_graph=True))


def test_on_policy_ratio_is_one_and_gradient_is_policy_gradient() -> None:
    policy, log_prob = _policy_log_probs()
    advantages = torch.tensor([1.5, -0.5, 0.0, 2.0, -3.0, 0.25], dtype=torch.float64)
    out = clipped_surrogate(log_prob, log_prob.detach(), advantages, clip_range=1e-5)

    assert isinstance(out, PolicyLoss)
    assert torch.equal(out.ratio, torch.ones(6))
    assert not out.ratio.requires_grad
    loss = out.row_losses.mean()
    assert out.row_losses.shape == (6,) and loss.dtype == torch.float32 and loss.requires_grad
    torch.testing.assert_close(loss, -advantages.float().mean(), rtol=0, atol=1e-7)
    assert not out.log_ratio.requires_grad and torch.equal(out.log_ratio, torch.zeros(6))

    expected = _grads(policy, -(advantages.float() * log_prob).mean())
    for got, want in zip(_grads(policy, loss), expected, strict=True):
        assert want.abs().max() > 0  # a real gradient
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-8)


def test_off_policy_clipping_gradients_and_diagnostics() -> None:
    eps = 0.1
    log_ratio = torch.tensor([0.5, -0.5, 0.05, 0.5, -0.5])
    advantages = torch.tensor([1.0, 1.0, 1.0, -1.0, -1.0])
    log_prob = torch.tensor([-1.0, -2.0, -0.5, -3.0, -1.5], requires_grad=True)
    old_log_prob = log_prob.detach() - log_ratio
    out = clipped_surrogate(log_prob, old_log_prob, advantages, clip_range=eps)

    kappa = log_ratio.exp()
    torch.testing.assert_close(out.ratio, kappa)
    # Per sample: max(−Aκ, −A·clip(κ)).
    chosen = [-(1 + eps), -kappa[1], -kappa[2], kappa[3], 1 - eps]
    torch.testing.assert_close(out.row_losses, torch.stack([torch.as_tensor(c) for c in chosen]))

    (grad,) = torch.autograd.grad(out.row_losses.mean(), log_prob)
    # κ > 1+ε with A > 0 and κ < 1−ε with A < 0: the clipped side wins, no gradient.
    assert grad[0].item() == 0.0 and grad[4].item() == 0.0
    # κ < 1−ε with A > 0 and κ > 1+ε with A < 0: the unclipped side wins, gradient −A·κ/N.
    expected = -advantages * kappa / 5
    torch.testing.assert_close(grad[[1, 2, 3]], expected[[1, 2, 3]])
    assert (grad[[1, 2, 3]] != 0).all()

    torch.testing.assert_close(out.log_ratio, log_ratio)
    assert ((out.ratio - 1).abs() > eps).float().mean().item() == pytest.approx(4 / 5)  # the update's clip fraction


def test_old_log_prob_is_a_constant() -> None:
    log_prob = torch.tensor([-1.0, -2.0], requires_grad=True)
    old = torch.tensor([-1.1, -1.9], requires_grad=True)
    out = clipped_surrogate(log_prob, old, torch.tensor([1.0, -1.0]), clip_range=0.2)
    out.row_losses.sum().backward()
    assert old.grad is None and log_prob.grad is not None


@pytest.mark.parametrize(
    ("shapes", "clip_range", "match"),
    [
        (((3, 1), (3, 1), (3, 1)), 0.1, "1-D"),
        (((3,), (4,), (3,)), 0.1, "old_log_prob"),
        (((3,), (3,), (3, 2)), 0.1, "advantages"),
        (((3,), (3,), (3,)), 0.0, "clip_range"),
        (((3,), (3,), (3,)), -0.1, "clip_range"),
    ],
)
def test_clipped_surrogate_validation(shapes: tuple, clip_range: float, match: str) -> None:
    log_prob, old, adv = (torch.zeros(s) for s in shapes)
    with pytest.raises(ValueError, match=match):
        clipped_surrogate(log_prob, old, adv, clip_range)


def test_kl_to_reference_value_by_hand() -> None:
    ref_mean = torch.zeros(3, 2, 2)
    mean = torch.stack(
        [
            torch.tensor([[1.0, 2.0], [3.0, 4.0]]),  # mean sq (1+4+9+16)/4 = 7.5, /(2·0.5²) = 15
            torch.full((2, 2), 2.0),  # mean sq 4, /(2·2²) = 0.5
            torch.full((2, 2), 1.0),  # std 0: never trained, KL 0
        ]
    ).requires_grad_()
    std = torch.tensor([0.5, 2.0, 0.0])
    kl = kl_to_reference(mean, ref_mean, std)
    assert kl.shape == (3,)
    torch.testing.assert_close(kl, torch.tensor([15.0, 0.5, 0.0]))


def test_kl_to_reference_zero_std_has_no_nan_and_gradient_flows_through_mean_only() -> None:
    torch.manual_seed(0)
    mean = torch.randn(4, 3, 2, requires_grad=True)
    ref_mean = mean.detach().clone()
    ref_mean[0] += 0.3
    ref_mean.requires_grad_()
    std = torch.tensor([0.7, 0.0, 1.3, 0.0], requires_grad=True)
    kl = kl_to_reference(mean, ref_mean, std)
    assert torch.isfinite(kl).all()
    assert kl[1].item() == 0.0 and kl[3].item() == 0.0  # 0/0 in the reference code
    kl.sum().backward()

    assert ref_mean.grad is None and std.grad is None
    assert torch.isfinite(mean.grad).all()
    assert torch.equal(mean.grad[[1, 3]], torch.zeros(2, 3, 2))
    # d/dμ of mean((μ − μ_ref)²) / (2σ²) = (μ − μ_ref) / (numel · σ²)
    expected = (mean - ref_mean).detach() / (6 * std.detach()[:, None, None] ** 2)
    torch.testing.assert_close(mean.grad[[0, 2]], expected[[0, 2]])
    assert mean.grad[0].abs().max() > 0


def test_kl_to_reference_validation() -> None:
    with pytest.raises(ValueError, match="same shape"):
        kl_to_reference(torch.zeros(2, 3), torch.zeros(2, 4), torch.ones(2))
    with pytest.raises(ValueError, match="std"):
        kl_to_reference(torch.zeros(2, 3), torch.zeros(2, 3), torch.ones(3))


def test_options_defaults_are_the_paper_settings() -> None:
    options = GRPOOptions()
    assert options.learning_rate == 3e-4
    assert options.adam_betas == (0.9, 0.999)
    assert options.weight_decay == 1e-4 and options.adam_eps == 1e-8
    assert options.clip_range == 1e-5 and options.adv_clip_max == 5.0
    assert options.beta == 1e-4 and options.max_grad_norm == 1.0
    assert options.global_std is False and options.filter_zero_advantage is True
    assert options.gradient_accumulation_steps == 2 and options.micro_batch_size == 9
    assert options.num_inner_epochs == 1
    for name, field in GRPOOptions.model_fields.items():
        assert field.description, f"{name} has no description"


@pytest.mark.parametrize(
    "bad",
    [
        {"learning_rat": 1e-4},
        {"learning_rate": 0.0},
        {"learning_rate": -1e-4},
        {"learning_rate": math.nan},
        {"clip_range": 0.0},
        {"clip_range": 1.0},
        {"beta": -1e-4},
        {"adv_clip_max": 0.0},
        {"max_grad_norm": 0.0},
        {"max_grad_norm": math.inf},
        {"adam_betas": (0.9, 1.0)},
        {"adam_betas": (-0.1, 0.999)},
        {"adam_eps": 0.0},
        {"weight_decay": -1.0},
        {"gradient_accumulation_steps": 0},
        {"micro_batch_size": 0},
        {"num_inner_epochs": 0},
    ],
)
def test_options_reject_nonsense(bad: dict) -> None:
    with pytest.raises(ValidationError):
        GRPOOptions(**bad)


def test_betas_message_says_how_to_fix() -> None:
    with pytest.raises(ValidationError, match=r"\[0, 1\)"):
        GRPOOptions(adam_betas=(0.9, 1.5))


def test_build_through_the_registry() -> None:
    optimizer = tpflow.build("optimizer", "grpo", learning_rate=1e-4)
    assert isinstance(optimizer, GRPO)
    assert isinstance(optimizer, Optimizer)
    assert optimizer.options.learning_rate == 1e-4 and optimizer.options.clip_range == 1e-5
    assert GRPO().options == GRPOOptions()
    with pytest.raises(UserError, match="learning_rate"):
        tpflow.build("optimizer", "grpo", learning_rat=1e-4)


def test_advantage_options_have_one_owner_that_applies_them_once() -> None:
    """adv_clip_max above 5 must let advantages above 5 through: the trainer once clipped at 5 on its own before the
    optimizer clipped at adv_clip_max, so any larger value had no effect. global_std is applied by the same owner."""
    rewards = torch.zeros(30, 2, dtype=torch.float64)
    rewards[0] = 1.0  # one outlier among 30: z = √29 ≈ 5.39
    groups = ["a photo of a circle"] * 30
    wide = tpflow.build("optimizer", "grpo", adv_clip_max=10.0).advantages(rewards, groups)
    assert wide.max().item() == pytest.approx(29**0.5, rel=1e-3)
    assert GRPO().advantages(rewards, groups).max().item() == 5.0
    mixed = torch.tensor([[0.0], [1.0], [0.0], [3.0]], dtype=torch.float64)
    keys = ["a", "a", "b", "b"]
    local = GRPO().advantages(mixed, keys)
    pooled = tpflow.build("optimizer", "grpo", global_std=True).advantages(mixed, keys)
    assert local[1].item() == pytest.approx(1.0, abs=1e-3) and pooled[1].item() < local[1].item()
