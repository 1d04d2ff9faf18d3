"""AWM (``[optimizer] name = "awm"``, docs/algorithm.md "AWM"): the loss and its gradient against float64 hand
computations for every weighting, the inert on-policy ratio, the stratified times against the public code's strata,
the update (the adapter trains, the KL-EMA copy lags by min(0.001·n, 0.3)), one step's gradient whatever its
micro-batches, and under CPU bf16 autocast and fp16 with a gradient scaler. 2 processes and kill -9 resume:
tests/test_distributed.py and tests/test_nft_train.py."""

from __future__ import annotations

import pytest
import torch

import tpflow
from tests.distributed_workers import nft_layout_gradient
from tpflow.optim.awm_loss import EPS, awm_loss, matching_value, stratified_indices

WEIGHTINGS = ["ghuber", "huber", "uniform", "t", "t2"]


def _hand_value(m: float, t: float, weighting: str, p: float) -> float:
    return {"ghuber": -t * ((m + EPS) ** p - EPS**p) / p, "huber": -t * ((m + EPS) ** 0.5 - 1e-5), "uniform": -m,
            "t": -t * m, "t2": -t * t * m}[weighting]  # fmt: skip


@pytest.mark.parametrize("weighting", WEIGHTINGS)
def test_loss_and_gradient_equal_a_float64_hand_computation(weighting):
    """Rows L = −A'·exp(ℓ − sg ℓ) + β·mean(v − v_ref)² + γ·mean(v − v_ema)²: its value −A' + the KLs, its gradient
    −A'·∂ℓ/∂v + 2β(v − v_ref)/D + 2γ(v − v_ema)/D, by hand in float64 (ℓ's derivative by a central difference)."""
    g = torch.Generator().manual_seed(0)
    n, d = 3, 5
    v = torch.randn(n, d, generator=g, dtype=torch.float64, requires_grad=True)
    u, v_ref, v_ema = (torch.randn(n, d, generator=g, dtype=torch.float64) for _ in range(3))
    t = torch.tensor([0.9, 0.5, 0.2], dtype=torch.float64)
    a = torch.tensor([0.7, -1.0, 0.2], dtype=torch.float64)
    beta, gamma, p = 0.01, 0.5, 0.25
    out = awm_loss(v, u, t, a, 1.0, weighting, p, v_ref, beta, v_ema, gamma)
    out.rows.sum().backward()
    for i in range(n):
        m = float(((v[i].detach() - u[i]) ** 2).mean())
        vi = v[i].detach()
        kl, ema = float(((vi - v_ref[i]) ** 2).mean()), float(((vi - v_ema[i]) ** 2).mean())
        assert abs(float(out.rows[i].detach()) - (-float(a[i]) + beta * kl + gamma * ema)) < 1e-12
        assert abs(float(out.policy_rows[i]) + float(a[i])) < 1e-15  # the ratio is 1 on policy
        h = 1e-6  # dℓ/dm by a central difference, then the chain rule through m = mean((v − u)²)
        dl_dm = (_hand_value(m + h, float(t[i]), weighting, p) - _hand_value(m - h, float(t[i]), weighting, p)) / 2 / h
        grad = (-float(a[i]) * dl_dm * 2 * (v[i] - u[i]) / d + 2 * beta * (v[i] - v_ref[i]) / d
                + 2 * gamma * (v[i] - v_ema[i]) / d).detach()  # fmt: skip
        torch.testing.assert_close(v.grad[i], grad, rtol=1e-6, atol=1e-9)
    assert torch.equal(out.mse, ((v.detach() - u) ** 2).mean(1))
    assert float(matching_value(torch.zeros(1, dtype=torch.float64), torch.ones(1), "ghuber", p)) == 0.0


def test_the_clip_is_inert_on_policy_and_the_loss_refuses_bad_shapes():
    v = torch.randn(2, 3, dtype=torch.float64, requires_grad=True)
    for clip in (1e-6, 1.0):
        out = awm_loss(v, torch.zeros(2, 3), torch.full((2,), 0.5), torch.tensor([1.0, -1.0]), clip)
        assert out.policy_rows.tolist() == [-1.0, 1.0]
    with pytest.raises(ValueError, match="shape of v"):
        awm_loss(v, torch.zeros(2, 4), torch.full((2,), 0.5), torch.ones(2), 1.0)


def test_the_stratified_times_are_the_public_codes_strata():
    """K = 14, fraction 0.9: discrete_wo_init bounds [1, 2, 4, 6, 8, 10, 12] (strata {1}, {2, 3}, ..., {10, 11});
    discrete from 0 (strata {0, 1}, ..., {10, 11}); u → 0 and u → 1 reach each stratum's ends."""
    for lower, strata in ((1, [[1], [2, 3], [4, 5], [6, 7], [8, 9], [10, 11]]),
                          (0, [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9], [10, 11]])):  # fmt: skip
        low = stratified_indices(torch.zeros(1, 6), lower, 12, 6)[0].tolist()
        high = stratified_indices(torch.full((1, 6), 1 - 1e-9, dtype=torch.float64), lower, 12, 6)[0].tolist()
        assert low == [s[0] for s in strata] and high == [s[-1] for s in strata]
    drawn = stratified_indices(torch.rand(1000, 6, generator=torch.Generator().manual_seed(1)), 1, 12, 6)
    assert {tuple(sorted(set(drawn[:, k].tolist()))) for k in range(6)} == {(1,), (2, 3), (4, 5), (6, 7), (8, 9),
                                                                             (10, 11)}  # fmt: skip
    with pytest.raises(Exception, match="strata do not fit"):
        tpflow.build("optimizer", "awm", num_timesteps=6, train_timesteps=6)


def test_update_trains_the_adapter_and_the_kl_ema_copy_lags(tiny_weights):
    from tests.test_nft import build_backbone, final_samples

    backbone = build_backbone("shapes-dit", tiny_weights)
    optimizer = tpflow.build("optimizer", "awm", num_timesteps=4, train_timesteps=2, timestep_fraction=1.0,
                             micro_batch_size=4, learning_rate=1e-2, seed=3)  # fmt: skip
    optimizer.bind(backbone)
    before = [p.detach().clone() for p in optimizer.loop.params]
    advantages = torch.tensor([[1.0], [-1.0], [0.5], [-0.5]], dtype=torch.float64)
    with optimizer.sampling_policy():  # the live adapter samples: no swap
        assert all(p is q for p, q in zip(optimizer.loop.params, backbone.trainable_parameters(), strict=True))
    metrics = optimizer.update(backbone, None, final_samples(backbone), advantages)
    after = [p.detach() for p in optimizer.loop.params]
    assert metrics["optimizer_steps"] == 1 and metrics["ema_decay"] == pytest.approx(1e-3)
    assert any(not torch.equal(a, b) for a, b in zip(before, after, strict=True))
    for old, b, a in zip(
        optimizer.lagged.old, before, after, strict=True
    ):  # θ_ema ← d·θ_ema + (1 − d)·θ, θ_ema was θ_0
        torch.testing.assert_close(old, 1e-3 * b + (1 - 1e-3) * a, rtol=0, atol=1e-7)


@pytest.mark.parametrize("micro,accumulation", [(4, 2), (2, 4), (3, 3)])
def test_a_steps_gradient_does_not_depend_on_its_micro_batches(tiny_weights, micro, accumulation):
    whole = nft_layout_gradient(str(tiny_weights), list(range(8)), 8, 1, name="awm")
    split = nft_layout_gradient(str(tiny_weights), list(range(8)), micro, accumulation, name="awm")
    assert whole.abs().max() > 0
    torch.testing.assert_close(split, whole, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("mode", ["bf16", "fp16"])
def test_the_step_under_mixed_precision_points_where_fp32_does(tiny_weights, mode):
    """CPU bf16 autocast, and fp16 with the gradient scaler: the step's gradient has cosine ≥ 0.999 to fp32's."""
    exact = nft_layout_gradient(str(tiny_weights), list(range(8)), 4, 2, name="awm")
    mixed = nft_layout_gradient(str(tiny_weights), list(range(8)), 4, 2, name="awm", mode=mode)
    cosine = float(torch.nn.functional.cosine_similarity(mixed.double(), exact.double(), dim=0))
    assert torch.isfinite(mixed).all() and cosine >= 0.999, cosine


def _recorded_guidance(backbone) -> list[float]:
    """Every velocity call's guidance from now on (the backbone's method wrapped in place)."""
    seen, velocity = [], backbone.velocity

    def recording(x, t, cond, guidance):
        seen.append(float(guidance))
        return velocity(x, t, cond, guidance)

    backbone.velocity = recording
    return seen


@pytest.mark.parametrize("train_guidance,want", [(1.0, 1.0), (None, 3.0), (2.0, 2.0)])
def test_the_update_runs_every_velocity_at_train_guidance(tiny_weights, train_guidance, want):
    """Final samples rolled out at CFG 3: v_θ, the KL-EMA copy's and the reference's velocities all run at
    ``train_guidance`` (the code's train.cfg = False: 1), or at the rollout's 3 when it is None."""
    from tests.test_nft import build_backbone, final_samples

    backbone = build_backbone("shapes-dit", tiny_weights)
    batch = final_samples(backbone, guidance=3.0)
    optimizer = tpflow.build("optimizer", "awm", num_timesteps=4, train_timesteps=2, timestep_fraction=1.0,
                             micro_batch_size=4, kl_weight=1e-3, train_guidance=train_guidance, seed=3)  # fmt: skip
    optimizer.bind(backbone)
    seen = _recorded_guidance(backbone)
    optimizer.update(backbone, None, batch, torch.tensor([[1.0], [-1.0], [0.5], [-0.5]], dtype=torch.float64))
    assert len(seen) == 2 * 3  # one micro-batch at 2 times: v_ema, v_ref, v_θ
    assert set(seen) == {want}
    assert batch.guidance == 3.0  # the rollout is not changed


def test_the_loss_without_cfg_equals_a_hand_computation_at_guidance_one(tiny_weights):
    """``AWM.loss`` with ``train_guidance = 1`` on samples rolled out at CFG 3: m = mean (v_θ(x_t, t; CFG 1) − (ε −
    x₀))², the row −A' + β·mean (v_θ − v_ref)² + γ·mean (v_θ − v_ema)² (v_ema = v_θ at bind), all by hand from
    conditional velocities; the CFG-3 matching error differs."""
    from tests.test_nft import build_backbone, final_samples

    backbone = build_backbone("shapes-dit", tiny_weights)
    batch = final_samples(backbone, guidance=3.0)
    beta = 0.1
    optimizer = tpflow.build("optimizer", "awm", kl_weight=beta, train_guidance=1.0, seed=3)
    optimizer.bind(backbone)
    rows, t = torch.tensor([0, 2, 3]), torch.tensor([0.3, 0.6, 0.9])
    noise = torch.randn(batch.final[rows].shape, generator=torch.Generator().manual_seed(4))
    a = torch.tensor([1.0, -0.5, 0.25])
    out = optimizer.loss(backbone, batch, rows, a, t, noise)
    x0, cond = batch.final[rows].double(), batch.cond.index(rows)
    tt = t.double().reshape(-1, *([1] * (x0.dim() - 1)))
    x_t = ((1 - tt) * x0 + tt * noise.double()).float()
    with torch.no_grad():
        v = backbone.velocity(x_t, t, cond, 1.0).double()
        v3 = backbone.velocity(x_t, t, cond, 3.0).double()
        with backbone.reference():
            v_ref = backbone.velocity(x_t, t, cond, 1.0).double()
    target = noise.double() - x0
    m = ((v - target) ** 2).flatten(1).mean(1)
    kl = ((v - v_ref) ** 2).flatten(1).mean(1)
    torch.testing.assert_close(out.mse, m, rtol=1e-5, atol=1e-8)
    torch.testing.assert_close(out.kl_rows, kl, rtol=1e-4, atol=1e-9)
    torch.testing.assert_close(out.rows.detach().double(), -a.double() + beta * kl, rtol=1e-5, atol=1e-7)
    assert out.ema_rows.abs().max() < 1e-10  # the KL-EMA copy is θ at bind
    assert (((v3 - target) ** 2).flatten(1).mean(1) - m).abs().min() > 1e-4  # CFG 3 would be another loss


@pytest.mark.parametrize("unit,decays", [("epoch", [0.1, 0.2, 0.3]), ("step", [0.4, 0.8, 0.9])])
def test_the_kl_ema_decay_counts_epochs_or_optimizer_steps(tiny_weights, unit, decays):
    """Three updates of 4 optimizer steps each (rate 0.1, cap 0.9): with ``old_decay_unit = "epoch"`` d is 0.1·e
    after epoch e (the code's count at its one step per epoch), with "step" 0.1·(steps so far), capped; the copy
    moves once per update either way, θ_ema ← d·θ_ema + (1 − d)·θ, by hand."""
    from tests.test_nft import build_backbone, final_samples

    backbone = build_backbone("shapes-dit", tiny_weights)
    optimizer = tpflow.build("optimizer", "awm", num_timesteps=4, train_timesteps=2, timestep_fraction=1.0,
                             micro_batch_size=1, learning_rate=1e-2, old_decay_rate=0.1, old_decay_max=0.9,
                             old_decay_unit=unit, seed=3)  # fmt: skip
    optimizer.bind(backbone)
    batch, advantages = final_samples(backbone), torch.tensor([[1.0], [-1.0], [0.5], [-0.5]], dtype=torch.float64)
    ema = [p.detach().clone() for p in optimizer.loop.params]  # the copy starts as θ
    for d in decays:
        metrics = optimizer.update(backbone, None, batch, advantages)
        assert metrics["optimizer_steps"] == 4 and metrics["ema_decay"] == pytest.approx(d, abs=1e-12)
        ema = [d * e + (1 - d) * p.detach() for e, p in zip(ema, optimizer.loop.params, strict=True)]
        for old, want in zip(optimizer.lagged.old, ema, strict=True):
            torch.testing.assert_close(old, want, rtol=0, atol=1e-7)
    assert optimizer.global_step == 12 and optimizer.lagged.updates == 3
