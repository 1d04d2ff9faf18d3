"""The example method of docs/adding_an_optimizer.md (tests/rwr_optimizer.py, ``rwr-example``): its loss and gradient
against a float64 hand computation, its options checked where a recipe is validated, and one update on the shapes
model that trains the adapter and keeps a checkpoint state that resumes."""

from __future__ import annotations

import pytest
import torch

import tpflow
from tests.rwr_optimizer import rwr_loss  # importing it registers rwr-example
from tpflow.interfaces import Optimizer


def test_the_loss_and_its_gradient_are_the_hand_computation():
    g = torch.Generator().manual_seed(0)
    v = torch.randn(3, 2, 4, generator=g, requires_grad=True)
    target, v_ref = torch.randn(3, 2, 4, generator=g), torch.randn(3, 2, 4, generator=g)
    weight = torch.tensor([0.5, 1.0, 2.0])
    out = rwr_loss(v, target, weight, v_ref, kl=0.1)
    v64, t64, r64 = v.detach().double(), target.double(), v_ref.double()
    mse = ((v64 - t64) ** 2).mean(dim=(1, 2))
    kl = ((v64 - r64) ** 2).mean(dim=(1, 2))
    torch.testing.assert_close(out.rows.double(), weight.double() * mse + 0.1 * kl, rtol=1e-6, atol=0)
    out.rows.sum().backward()  # d/dv of w·mean (v − u)² + β·mean (v − v_ref)²: (2/E)·(w·(v − u) + β·(v − v_ref))
    hand = 2 / 8 * (weight.double()[:, None, None] * (v64 - t64) + 0.1 * (v64 - r64))
    torch.testing.assert_close(v.grad.double(), hand, rtol=1e-5, atol=1e-7)


def test_its_options_are_checked_where_a_recipe_is():
    with pytest.raises(Exception, match="timesteps_per_sample"):
        tpflow.build("optimizer", "rwr-example", num_timesteps=2, timesteps_per_sample=3)
    with pytest.raises(Exception, match="temperature"):
        tpflow.build("optimizer", "rwr-example", temperature=0)


def test_one_update_trains_the_adapter_and_resumes(tiny_weights):
    from tests.test_nft import build_backbone, final_samples

    backbone = build_backbone("shapes-dit", tiny_weights)
    options = {"num_timesteps": 4, "timesteps_per_sample": 2, "micro_batch_size": 2, "gradient_accumulation_steps": 2}
    optimizer = tpflow.build("optimizer", "rwr-example", learning_rate=1e-2, seed=3, **options)
    assert isinstance(optimizer, Optimizer)
    optimizer.bind(backbone)
    before = [p.detach().clone() for p in optimizer.loop.params]
    advantages = torch.tensor([[1.0], [-1.0], [0.5], [-0.5]], dtype=torch.float64)
    metrics = optimizer.update(backbone, None, final_samples(backbone), advantages)
    assert metrics["optimizer_steps"] == 1 and metrics["rows_trained"] == 8  # 4 samples × 2 times, one step
    assert metrics["weight_mean"] == pytest.approx(float(torch.exp(advantages).mean()))
    assert any(not torch.equal(a, b) for a, b in zip(before, optimizer.loop.params, strict=True))
    state = optimizer.state_dict()
    assert (state["optimizer_name"], state["global_step"], state["updates"], state["seed"]) == ("rwr-example", 1, 1, 3)
    twin = tpflow.build("optimizer", "rwr-example", num_timesteps=4, timesteps_per_sample=2)
    twin.bind(backbone)
    twin.load_state_dict(state)
    assert (twin.global_step, twin.lagged.updates, twin.lagged.seed) == (1, 1, 3)
