"""DGPO (``[optimizer] name = "dgpo"``, docs/algorithm.md "DGPO"): the loss, its trust region and its gradient
against float64 hand computations, the group weight over rows split anywhere, σ(0) = ½ at the base model, the
update (the adapter trains, the lagged copy moves after the step, the rollouts switch to it after switch_ema_ref
steps), one step's gradient whatever its micro-batches, and under CPU bf16 autocast and fp16 with a gradient scaler.
2 processes and kill -9 resume: tests/test_distributed.py and tests/test_nft_train.py."""

from __future__ import annotations

import contextlib
import dataclasses
import math

import pytest
import torch

import tpflow
from tests.distributed_workers import nft_layout_gradient
from tpflow.errors import UserError
from tpflow.optim.dgpo_loss import dgpo_loss, group_scores, group_weights, matching_mse


def test_loss_trust_region_and_gradient_equal_a_float64_hand_computation():
    """Rows w·A·L̃_θ + β·mean(v − v_ref)²: L̃ = L_θ unless the row is clipped ((A > 0 and exp(L_old − L_θ) > 1 + c)
    or (A ≤ 0 and exp(L_old − L_θ) < 1 − c)), where its policy gradient is 0."""
    g = torch.Generator().manual_seed(0)
    n, d, c, beta = 4, 6, 0.05, 0.1
    v = torch.randn(n, d, generator=g, dtype=torch.float64, requires_grad=True)
    u, v_ref = (torch.randn(n, d, generator=g, dtype=torch.float64) for _ in range(2))
    l_theta = ((v.detach() - u) ** 2).mean(1)
    # rows 0, 1: A > 0 with ratio 1.2 (clipped) and 1.01 (kept); rows 2, 3: A ≤ 0 with ratio 0.8 (clipped), 0.99
    l_old = l_theta + torch.log(torch.tensor([1.2, 1.01, 0.8, 0.99], dtype=torch.float64))
    a = torch.tensor([1.5, 0.7, -0.4, 0.0], dtype=torch.float64)
    w = torch.tensor([0.3, 0.3, 0.9, 0.9], dtype=torch.float64)
    out = dgpo_loss(v, u, a, w, l_old, c, v_ref, beta)
    out.rows.sum().backward()
    assert out.clipped.tolist() == [1.0, 0.0, 1.0, 0.0]
    for i in range(n):
        kl = float(((v[i].detach() - v_ref[i]) ** 2).mean())
        want = float(w[i] * a[i] * l_theta[i]) + beta * kl
        assert abs(float(out.rows[i].detach()) - want) < 1e-12
        policy_grad = 0.0 if i in (0, 2) else float(w[i] * a[i])
        grad = (policy_grad * 2 * (v[i] - u[i]) / d + 2 * beta * (v[i] - v_ref[i]) / d).detach()
        torch.testing.assert_close(v.grad[i], grad, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(out.mse, l_theta, rtol=0, atol=1e-15)
    with pytest.raises(ValueError, match="shape of v"):
        dgpo_loss(v, torch.zeros(n, d + 1), a, w, l_old, c)


def test_the_group_weight_is_the_sigmoid_of_the_groups_mean_score_wherever_its_rows_lie():
    """s_g = Σ_{i∈g} A_i·β_dpo·(L_θ,i − L_ref,i)/G_g by hand; partial sums over any split of the rows add up to it."""
    g = torch.Generator().manual_seed(1)
    a, lt, lr = (torch.randn(6, generator=g, dtype=torch.float64) for _ in range(3))
    groups = torch.tensor([0, 1, 0, 2, 1, 0])
    sums, counts = group_scores(a, lt, lr, groups, 10.0, 3)
    for k in range(3):
        rows = [i for i in range(6) if int(groups[i]) == k]
        s = sum(float(a[i]) * 10.0 * (float(lt[i]) - float(lr[i])) for i in rows) / len(rows)
        assert abs(float(group_weights(sums, counts)[k]) - 1 / (1 + math.exp(-s))) < 1e-14
    first = group_scores(a[:4], lt[:4], lr[:4], groups[:4], 10.0, 3)
    second = group_scores(a[4:], lt[4:], lr[4:], groups[4:], 10.0, 3)
    torch.testing.assert_close(first[0] + second[0], sums, rtol=0, atol=1e-14)
    assert torch.equal(first[1] + second[1], counts)
    assert torch.equal(matching_mse(torch.ones(2, 3), torch.zeros(2, 3)), torch.ones(2, dtype=torch.float64))


def _optimizer(**options):
    base = dict(num_timesteps=4, train_timesteps=2, trunc_steps=3, micro_batch_size=4, learning_rate=1e-2, seed=3)
    return tpflow.build("optimizer", "dgpo", **{**base, **options})


def test_update_at_the_base_model_weighs_every_group_a_half_and_the_lagged_copy_follows(tiny_weights):
    """With a zero-initialised LoRA, θ = base: L_θ = L_ref, s_g = 0 and w_g = σ(0) = ½ exactly; after the step the
    copy moves with d = min(0.001·0, 0.3) = 0, i.e. it copies θ; the rollouts switch to it after switch_ema_ref."""
    from tests.test_nft import build_backbone, final_samples

    backbone = build_backbone("shapes-dit", tiny_weights)
    optimizer = _optimizer(switch_ema_ref=0)
    optimizer.bind(backbone)
    before = [p.detach().clone() for p in optimizer.loop.params]
    advantages = torch.tensor([[1.0], [-1.0], [0.5], [-0.5]], dtype=torch.float64)
    batch = final_samples(backbone)
    with pytest.raises(UserError, match="group ids"):
        optimizer.update(backbone, None, batch, advantages)
    batch = dataclasses.replace(batch, groups=torch.tensor([0, 0, 1, 1]))
    with optimizer.sampling_policy():  # step 0: the live adapter samples
        assert all(
            p.data_ptr() != o.data_ptr() for p, o in zip(optimizer.loop.params, optimizer.lagged.old, strict=True)
        )
    metrics = optimizer.update(backbone, None, batch, advantages)
    assert metrics["optimizer_steps"] == 1 and metrics["group_weight"] == 0.5 and metrics["old_decay"] == 0.0
    after = [p.detach() for p in optimizer.loop.params]
    assert any(not torch.equal(a, b) for a, b in zip(before, after, strict=True))
    assert all(torch.equal(old, a) for old, a in zip(optimizer.lagged.old, after, strict=True))
    with optimizer.sampling_policy():  # past switch_ema_ref = 0 steps: the copy's values sample
        assert all(torch.equal(p, o) for p, o in zip(optimizer.loop.params, optimizer.lagged.old, strict=True))


def test_the_one_batch_loss_is_half_the_advantage_times_the_matching_error_at_the_base_model(tiny_weights):
    """``DGPO.loss`` (what the memory estimate runs): at θ = base and with the lagged copy equal to θ the ratio is 1
    (nothing clipped) and each row is ½·A·mean(v_θ(x_t) − (ε − x₀))², by hand; its gradient reaches the adapter."""
    from tests.test_nft import build_backbone, final_samples

    backbone = build_backbone("shapes-dit", tiny_weights)
    optimizer = _optimizer()
    optimizer.bind(backbone)
    batch = final_samples(backbone)
    rows, g = torch.tensor([0, 2, 3]), torch.Generator().manual_seed(5)
    t = torch.tensor([0.2, 0.5, 0.9])
    noise = torch.randn(batch.final[rows].shape, generator=g)
    a = torch.tensor([1.0, -0.5, 0.25])
    out = optimizer.loss(backbone, batch, rows, a, t, noise)
    x0 = batch.final[rows].double()
    tt = t.double().reshape(-1, *([1] * (x0.dim() - 1)))
    x_t = (1 - tt) * x0 + tt * noise.double()
    with torch.no_grad():
        v = backbone.velocity(x_t.float(), t, batch.cond.index(rows), 1.0).double()
    want = 0.5 * a.double() * ((v - (noise.double() - x0)) ** 2).flatten(1).mean(1)
    torch.testing.assert_close(out.rows.detach().double(), want, rtol=1e-5, atol=1e-7)
    assert out.clipped.sum() == 0
    out.rows.sum().backward()
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in optimizer.loop.params)


@pytest.mark.parametrize("grid", ["schedule", "flow-sigmas"])
def test_the_training_times_are_nodes_of_the_chosen_grid(tiny_weights, grid):
    """Every velocity call of an update runs at M = 2 distinct nodes among the first trunc_steps + 1 of the chosen
    grid: the backbone's own K-step schedule, or diffusers' flow-sigmas grid (t = 0.99967, ... at shift 3), which the
    code's DPM-Solver rollout runs on and reads its training times from."""
    from tests.test_nft import build_backbone, final_samples
    from tpflow.samplers.schedules import flow_sigmas

    backbone = build_backbone("shapes-dit", tiny_weights)
    optimizer = _optimizer(time_grid=grid, kl_weight=0.0, use_ema_ref=True)
    optimizer.bind(backbone)
    batch = dataclasses.replace(final_samples(backbone), groups=torch.tensor([0, 0, 1, 1]))
    nodes = flow_sigmas(4, 3.0) if grid == "flow-sigmas" else backbone.sigmas(4)
    seen, velocity = set(), backbone.velocity

    def recording(x, t, cond, guidance):
        seen.update(round(float(v), 6) for v in t.flatten())
        return velocity(x, t, cond, guidance)

    backbone.velocity = recording
    optimizer.update(backbone, None, batch, torch.tensor([[1.0], [-1.0], [0.5], [-0.5]], dtype=torch.float64))
    allowed = {round(float(v), 6) for v in nodes[:4]}
    assert len(seen) == 2 and seen <= allowed
    other = {round(float(v), 6) for v in (backbone.sigmas(4) if grid == "flow-sigmas" else flow_sigmas(4, 3.0))[:4]}
    assert not seen & other  # the two grids share no node here: the times are the chosen grid's


def test_recipe_checks_refuse_step_credit_and_sharding():
    from types import SimpleNamespace

    from tpflow.optim.dgpo import DGPO, DGPOOptions

    problems = DGPO.check_recipe(DGPOOptions(), {"credit": SimpleNamespace(name="turning-point"),
                                                 "train": SimpleNamespace(shard="fsdp")})  # fmt: skip
    assert len(problems) == 2 and "outcome" in problems[0] and "fsdp" in problems[1]
    with pytest.raises(ValueError, match="trunc_steps"):
        DGPOOptions(train_timesteps=6, trunc_steps=4)


@pytest.mark.parametrize("micro,accumulation", [(4, 2), (3, 3)])
def test_a_steps_gradient_does_not_depend_on_its_micro_batches(tiny_weights, micro, accumulation):
    """The group weights add the rows of every micro-batch of the step (the two groups' rows are interleaved)."""
    whole = nft_layout_gradient(str(tiny_weights), list(range(8)), 8, 1, name="dgpo")
    split = nft_layout_gradient(str(tiny_weights), list(range(8)), micro, accumulation, name="dgpo")
    assert whole.abs().max() > 0
    torch.testing.assert_close(split, whole, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("mode", ["bf16", "fp16"])
def test_the_step_under_mixed_precision_points_where_fp32_does(tiny_weights, mode):
    """CPU bf16 autocast, and fp16 with the gradient scaler: the step's gradient has cosine ≥ 0.999 to fp32's."""
    exact = nft_layout_gradient(str(tiny_weights), list(range(8)), 4, 2, name="dgpo")
    mixed = nft_layout_gradient(str(tiny_weights), list(range(8)), 4, 2, name="dgpo", mode=mode)
    cosine = float(torch.nn.functional.cosine_similarity(mixed.double(), exact.double(), dim=0))
    assert torch.isfinite(mixed).all() and cosine >= 0.999, cosine


@pytest.mark.parametrize("unit", ["epoch", "step"])
def test_the_lagged_copy_moves_per_epoch_or_per_step_and_the_switch_counts_the_same(tiny_weights, unit):
    """Three updates of 2 optimizer steps (one group each; rate 0.1, cap 0.9, switch_ema_ref 1). ``"epoch"``: the
    copy stays put through an update's steps, then moves once, d = 0.1·(updates before): 0, 0.1, 0.2 (the code's
    count at its one step per epoch); the rollouts switch to the copy after 2 updates. ``"step"``: it moves after
    every step, d = 0.1·(steps before): 0, 0.1, ..., 0.5, and the switch comes after the first update's 2 steps."""
    from tests.test_nft import build_backbone, final_samples

    backbone = build_backbone("shapes-dit", tiny_weights)
    optimizer = _optimizer(micro_batch_size=2, old_decay_rate=0.1, old_decay_max=0.9, old_decay_unit=unit,
                           switch_ema_ref=1)  # fmt: skip
    optimizer.bind(backbone)
    batch = dataclasses.replace(final_samples(backbone), groups=torch.tensor([0, 0, 1, 1]))
    advantages = torch.tensor([[1.0], [-1.0], [0.5], [-0.5]], dtype=torch.float64)
    ema = [p.detach().clone() for p in optimizer.loop.params]
    step = 0

    def on_step(k: int) -> None:  # after each step: the hand copy follows "step"; "epoch" keeps the copy put
        nonlocal ema, step
        assert k == step
        if unit == "step":
            d = min(0.1 * k, 0.9)
            ema = [d * e + (1 - d) * p.detach() for e, p in zip(ema, optimizer.loop.params, strict=True)]
        for old, want in zip(optimizer.lagged.old, ema, strict=True):
            torch.testing.assert_close(old, want, rtol=0, atol=1e-7)
        step += 1

    switched = []
    for e in range(3):
        switched.append(not isinstance(optimizer.sampling_policy(), contextlib.nullcontext))  # the copy swapped in
        metrics = optimizer.update(backbone, None, batch, advantages, on_step=on_step)
        assert metrics["optimizer_steps"] == 2
        if unit == "epoch":
            d = 0.1 * e
            ema = [d * o + (1 - d) * p.detach() for o, p in zip(ema, optimizer.loop.params, strict=True)]
        assert metrics["old_decay"] == pytest.approx(0.1 * e if unit == "epoch" else 0.1 * (2 * e + 1), abs=1e-12)
        for old, want in zip(optimizer.lagged.old, ema, strict=True):
            torch.testing.assert_close(old, want, rtol=0, atol=1e-7)
    assert switched == ([False, False, True] if unit == "epoch" else [False, True, True])


def test_the_update_logs_the_group_scores_and_the_spread_of_the_group_weights(tiny_weights):
    """At the base model every s_g is 0 (w_g = ½, no spread); with the adapter moved off the base the logged s_g
    are non-zero, σ of their min and max are the weights' min and max, and the rows' mean weight lies between."""
    from tests.test_nft import build_backbone, final_samples, perturb
    from tpflow.optim.dgpo_loss import score_metrics

    s = [torch.tensor([0.5, -2.0]), torch.tensor([1.0])]
    w = torch.sigmoid(torch.tensor([0.5, -2.0, 1.0], dtype=torch.float64))
    assert score_metrics(s) == pytest.approx({
        "group_score_mean": -0.5 / 3, "group_score_abs_mean": 3.5 / 3, "group_score_min": -2.0,
        "group_score_max": 1.0, "group_weight_std": float(w.std(correction=0)), "group_weight_min": float(w.min()),
        "group_weight_max": float(w.max())}, abs=1e-12)  # fmt: skip
    assert score_metrics([]) == {}
    backbone = build_backbone("shapes-dit", tiny_weights)
    batch = dataclasses.replace(final_samples(backbone), groups=torch.tensor([0, 0, 1, 1]))
    advantages = torch.tensor([[1.0], [-1.0], [0.5], [-0.5]], dtype=torch.float64)
    optimizer = _optimizer()
    optimizer.bind(backbone)
    base = optimizer.update(backbone, None, batch, advantages)
    assert base["group_score_mean"] == base["group_score_abs_mean"] == base["group_weight_std"] == 0.0
    assert base["group_weight_min"] == base["group_weight_max"] == 0.5
    optimizer = _optimizer(learning_rate=1e-12)  # a step too small to move anything measurable
    optimizer.bind(backbone)
    perturb(optimizer.loop.params, 0.05, seed=7)
    moved = optimizer.update(backbone, None, batch, advantages)
    assert moved["group_score_abs_mean"] > 1e-6 and moved["group_weight_std"] > 0
    assert moved["group_weight_min"] == pytest.approx(1 / (1 + math.exp(-moved["group_score_min"])), abs=1e-12)
    assert moved["group_weight_max"] == pytest.approx(1 / (1 + math.exp(-moved["group_score_max"])), abs=1e-12)
    assert moved["group_weight_min"] - 1e-9 <= moved["group_weight"] <= moved["group_weight_max"] + 1e-9
