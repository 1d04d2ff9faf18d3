"""DiffusionNFT (``[optimizer] name = "nft"``, docs/nft.md): the loss and its gradient against a float64 hand
computation on real tiny backbones, the β limits, r = 1/2, the old policy and its checkpoint round trip, and the
rollout of final samples only."""

from __future__ import annotations

import io

import pytest
import torch

import tpflow
from tests.distributed_workers import nft_layout_gradient
from tpflow.interfaces import Optimizer
from tpflow.optim.final import old_decay
from tpflow.optim.nft import NFT
from tpflow.optim.nft_loss import implicit_velocities, nft_loss, optimality
from tpflow.rollout import Window, rollout

PROMPTS = ["a photo of a red circle", "a photo of a red circle", "a photo of two squares", "a photo of two squares"]


def build_backbone(name: str, weights) -> object:
    if name == "shapes-dit":
        return tpflow.build("backbone", "shapes-dit", weights=str(weights), lora_init="gaussian")
    return tpflow.build("backbone", "tiny-sd3", seed=0, resolution=16)


def final_samples(backbone, guidance: float = 1.0):
    """Final ODE samples of PROMPTS (a rollout that stores no transitions)."""
    cond = backbone.encode(PROMPTS)
    z0 = backbone.initial_noise(len(PROMPTS), torch.Generator().manual_seed(0))
    sampler = tpflow.build("sampler", "cps")
    return rollout(
        backbone, sampler, cond, z0, backbone.sigmas(3), Window(0, 1), 0.0, guidance, None, transitions=False
    )


def perturb(params, scale: float, seed: int) -> None:
    """Move every trainable tensor by a seeded random amount (so the adapter, its old copy and the base differ)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in params:
            p.add_(scale * torch.randn(p.shape, generator=gen).to(p.device, p.dtype))


@pytest.fixture(scope="module")
def sd3():
    return build_backbone("tiny-sd3", None)


@pytest.mark.parametrize("name", ["shapes-dit", "tiny-sd3"])
def test_loss_and_gradient_equal_a_float64_hand_computation(name, tiny_weights, sd3):
    backbone = sd3 if name == "tiny-sd3" else build_backbone(name, tiny_weights)
    beta, clip, kl_weight = 0.7, 2.0, 0.05
    optimizer = tpflow.build("optimizer", "nft", beta=beta, adv_clip_max=clip, kl_weight=kl_weight)
    optimizer.bind(backbone)
    params = optimizer.loop.params
    perturb(params, 0.05, seed=1)  # the adapter differs from the base (KL > 0)
    optimizer.lagged.old = [p.detach() + 0.05 * torch.randn_like(p) for p in params]  # and from the old policy
    batch = final_samples(backbone)
    n = len(batch)
    rows = torch.arange(n)
    advantages = torch.tensor([-3.0, -0.5, 0.7, 4.0])
    r = optimality(advantages, clip)
    torch.testing.assert_close(r, torch.tensor([0.0, 0.375, 0.675, 1.0]), rtol=0, atol=1e-7)
    t = backbone.sigmas(10)[torch.tensor([1, 3, 6, 9])]
    noise = torch.randn(batch.final.shape, generator=torch.Generator().manual_seed(2))

    for p in params:
        p.grad = None
    out = optimizer.loss(backbone, batch, rows, r, t, noise)
    out.rows.mean().backward()
    grads = [p.grad.detach().clone() for p in params]

    # The hand computation: x_t, the implicit policies, the x₀ errors, their weights and the gradient of the loss
    # with respect to v_θ, written out per sample in float64; the network's own backward maps that to the LoRA.
    x0, eps, t64, r64 = batch.final.double(), noise.double(), t.double(), r.double()
    x_t = torch.stack([(1 - t64[b]) * x0[b] + t64[b] * eps[b] for b in range(n)])
    cond = batch.cond
    with torch.no_grad():
        live = [p.detach().clone() for p in params]
        for p, o in zip(params, optimizer.lagged.old, strict=True):
            p.copy_(o)
        v_old = backbone.velocity(x_t.float(), t, cond, 1.0).double()
        for p, o in zip(params, live, strict=True):
            p.copy_(o)
        with backbone.reference():
            v_ref = backbone.velocity(x_t.float(), t, cond, 1.0).double()
    for p in params:
        p.grad = None
    v_net = backbone.velocity(x_t.float(), t, cond, 1.0)
    v = v_net.detach().double()
    size = x0[0].numel()
    loss, dloss_dv = 0.0, torch.zeros_like(v)
    for b in range(n):
        e_pos = x_t[b] - t64[b] * (beta * v[b] + (1 - beta) * v_old[b]) - x0[b]
        e_neg = x_t[b] - t64[b] * ((1 + beta) * v_old[b] - beta * v[b]) - x0[b]
        w_pos, w_neg = e_pos.abs().mean(), e_neg.abs().mean()
        pos, neg = (e_pos**2).mean() / w_pos, (e_neg**2).mean() / w_neg
        kl = ((v[b] - v_ref[b]) ** 2).mean()
        loss += (clip / beta) * (r64[b] * pos + (1 - r64[b]) * neg) / n + kl_weight * kl / n
        dloss_dv[b] = (clip / beta / n) * (
            r64[b] * 2 * e_pos * (-t64[b] * beta) / (size * w_pos)
            + (1 - r64[b]) * 2 * e_neg * (t64[b] * beta) / (size * w_neg)
        ) + kl_weight * 2 * (v[b] - v_ref[b]) / (size * n)
    expected = torch.autograd.grad(v_net, params, grad_outputs=dloss_dv.float())

    assert abs(float(out.rows.detach().mean()) - float(loss)) <= 1e-5 * abs(float(loss))
    assert float(out.kl_rows.mean()) > 0 and float(loss) > 0
    scale = max(float(g.abs().max()) for g in expected)
    assert scale > 0
    for got, want in zip(grads, expected, strict=True):
        assert float((got - want).abs().max()) <= 1e-5 * scale


def test_beta_limits():
    gen = torch.Generator().manual_seed(0)
    v, v_old = torch.randn(3, 4, 5, generator=gen), torch.randn(3, 4, 5, generator=gen)
    v_pos, v_neg = implicit_velocities(v, v_old, 1.0)
    assert torch.equal(v_pos, v) and torch.equal(v_neg, 2 * v_old - v)  # β = 1: v⁺ is the trained policy itself
    v_pos, v_neg = implicit_velocities(v, v_old, 1e-9)
    torch.testing.assert_close(v_pos, v_old, rtol=0, atol=1e-8)  # β → 0: both collapse onto the old policy
    torch.testing.assert_close(v_neg, v_old, rtol=0, atol=1e-8)
    # The 1/β scale keeps the gradient finite as β → 0: it tends to −2t·c·(2r − 1)·e_old / (w_old·B·D), where
    # e_old = x_t − t·v_old − x₀ is the old policy's x₀ error and w_old its mean absolute value.
    x0, x_t = torch.randn(3, 4, 5, generator=gen).double(), torch.randn(3, 4, 5, generator=gen).double()
    t, r = torch.tensor([0.2, 0.5, 0.9]).double(), torch.tensor([0.1, 0.5, 0.8]).double()
    v, v_old = v.double().requires_grad_(True), v_old.double()
    nft_loss(x0, x_t, t, v, v_old, r, 1e-7, 5.0).rows.mean().backward()
    e_old = x_t - t[:, None, None] * v_old - x0
    w_old = e_old.abs().mean(dim=(1, 2), keepdim=True)
    limit = -2 * t[:, None, None] * 5.0 * (2 * r[:, None, None] - 1) * e_old / (w_old * 3 * 20)
    torch.testing.assert_close(v.grad, limit, rtol=0, atol=1e-6)  # the O(β) remainder is ~1e-8


def test_half_optimality_carries_no_policy_signal():
    """r = 1/2: the loss is even in v_θ − v_old (v⁺ and v⁻ swap), so at v_θ = v_old its gradient is 0, and samples
    whose r are mirrored about 1/2 with mirrored deviations contribute the same loss."""
    gen = torch.Generator().manual_seed(3)
    x0, x_t = torch.randn(4, 2, 6, generator=gen).double(), torch.randn(4, 2, 6, generator=gen).double()
    v_old, delta = torch.randn(4, 2, 6, generator=gen).double(), torch.randn(4, 2, 6, generator=gen).double()
    t, half = torch.tensor([0.1, 0.4, 0.6, 0.95]).double(), torch.full((4,), 0.5, dtype=torch.float64)

    def loss(r: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return nft_loss(x0, x_t, t, v, v_old, r, 0.6, 5.0).rows.mean()

    torch.testing.assert_close(loss(half, v_old + delta), loss(half, v_old - delta), rtol=1e-12, atol=0)
    r = torch.tensor([0.0, 0.3, 0.9, 1.0]).double()
    torch.testing.assert_close(loss(r, v_old + delta), loss(1 - r, v_old - delta), rtol=1e-12, atol=0)
    v = v_old.clone().requires_grad_(True)
    loss(half, v).backward()
    assert float(v.grad.abs().max()) < 1e-12
    v = v_old.clone().requires_grad_(True)
    loss(torch.tensor([0.9, 0.9, 0.9, 0.9]).double(), v).backward()
    assert float(v.grad.abs().max()) > 1e-3  # the same test can see a signal where there is one


def test_old_decay_schedules():
    assert [old_decay(s, 0, 1e-3, 0.5) for s in (0, 10, 499, 500, 5000)] == [0.0, 0.01, 0.499, 0.5, 0.5]
    assert old_decay(74, 75, 0.0075, 0.999) == 0.0 and old_decay(75, 75, 0.0075, 0.999) == 0.0
    assert old_decay(77, 75, 0.0075, 0.999) == pytest.approx(0.015) and old_decay(10_000, 75, 0.0075, 0.999) == 0.999


def test_update_trains_the_adapter_and_soft_updates_the_old_policy(tiny_weights):
    backbone = build_backbone("shapes-dit", tiny_weights)
    batch = final_samples(backbone, guidance=2.0)
    assert batch.latents.shape[1] == 0 and batch.log_probs.shape == (4, 0) and batch.completions is None
    options = dict(learning_rate=1e-2, micro_batch_size=2, timesteps_per_sample=2, num_timesteps=4, seed=5)
    optimizer = tpflow.build("optimizer", "nft", old_decay_rate=0.25, **options)
    optimizer.bind(backbone)
    assert isinstance(optimizer, Optimizer) and optimizer.consumes == "final_samples"
    names = [n for n, _ in backbone.model.named_parameters()]
    before = {n: p.detach().clone() for n, p in backbone.model.named_parameters()}
    advantages = optimizer.advantages(torch.tensor([[0.0, 1.0], [0, 0.0], [0, 2.0], [0, 5.0]]), [0, 0, 1, 1])
    assert advantages.shape == (4, 1)  # the final reward's (last column) only
    steps = []
    metrics = optimizer.update(backbone, None, batch, advantages, on_step=steps.append)
    assert steps == [0, 1] and optimizer.global_step == 2 and metrics["optimizer_steps"] == 2
    assert all(torch.isfinite(torch.tensor(v)) for v in metrics.values())
    after = dict(backbone.model.named_parameters())
    for name in names:
        assert torch.equal(before[name], after[name]) == ("lora_" not in name), name
    # η after 2 steps = 0.5: the old policy moved half way from its start (the adapter before the update).
    assert metrics["old_decay"] == 0.5
    params = backbone.trainable_parameters()
    lora_before = [before[n] for n in names if "lora_" in n]
    for old, start, now in zip(optimizer.lagged.old, lora_before, params, strict=True):
        torch.testing.assert_close(old, 0.5 * start + 0.5 * now.detach(), rtol=0, atol=1e-7)
    # sampling_policy swaps the old values in and puts the live ones back exactly
    live = [p.detach().clone() for p in params]
    with optimizer.sampling_policy():
        assert all(torch.equal(p, o) for p, o in zip(params, optimizer.lagged.old, strict=True))
    assert all(torch.equal(p, q) for p, q in zip(params, live, strict=True))
    with pytest.raises(KeyboardInterrupt), optimizer.sampling_policy():  # Ctrl-C while sampling: the live values
        raise KeyboardInterrupt  # come back before the trainer saves them
    assert all(torch.equal(p, q) for p, q in zip(params, live, strict=True))
    assert not all(torch.equal(p, o) for p, o in zip(params, optimizer.lagged.old, strict=True))  # the swap is visible

    # Checkpoint round trip: a fresh optimizer on a copy of the adapter continues bitwise like this one.
    buffer = io.BytesIO()
    torch.save(optimizer.state_dict(), buffer)
    buffer.seek(0)
    twin_backbone = build_backbone("shapes-dit", tiny_weights)
    with torch.no_grad():
        for p, q in zip(twin_backbone.trainable_parameters(), params, strict=True):
            p.copy_(q)
    twin = tpflow.build("optimizer", "nft", old_decay_rate=0.25, **{**options, "seed": None})
    twin.bind(twin_backbone)
    twin.load_state_dict(torch.load(buffer, weights_only=True))
    assert (twin.global_step, twin.lagged.updates, twin.lagged.seed) == (2, 1, 5)
    assert all(torch.equal(a, b) for a, b in zip(twin.lagged.old, optimizer.lagged.old, strict=True))
    optimizer.update(backbone, None, batch, advantages)
    twin.update(twin_backbone, None, batch, advantages)
    for a, b in zip(params, twin_backbone.trainable_parameters(), strict=True):
        assert torch.equal(a, b)
    assert all(torch.equal(a, b) for a, b in zip(twin.lagged.old, optimizer.lagged.old, strict=True))


@pytest.mark.parametrize("micro,accumulation", [(4, 2), (2, 4), (3, 3)])
def test_a_steps_gradient_does_not_depend_on_its_micro_batches(tiny_weights, micro, accumulation):
    """One optimizer step over 8 samples as 8, 4 + 4, 2 + 2 + 2 + 2 and 3 + 3 + 2 gives one gradient: each sample's
    times and ε are drawn from its own index, not per micro-batch (which moved the gradient by as much as the
    gradient itself: max |Δ| 0.074 against max |g| 0.078 for 4×1 against 2×2)."""
    whole = nft_layout_gradient(str(tiny_weights), list(range(8)), 8, 1)
    split = nft_layout_gradient(str(tiny_weights), list(range(8)), micro, accumulation)
    assert whole.abs().max() > 0
    torch.testing.assert_close(split, whole, rtol=1e-5, atol=1e-7)


def test_a_state_of_the_other_optimizer_is_refused(tiny_weights):
    from tpflow.errors import UserError

    backbone = build_backbone("shapes-dit", tiny_weights)
    optimizer = NFT()
    optimizer.bind(backbone)
    with pytest.raises(UserError, match="not written by the nft optimizer"):
        optimizer.load_state_dict({"optimizer": {}, "global_step": 3})
    # and the other way round: an nft state does not continue as grpo
    grpo = tpflow.build("optimizer", "grpo")
    grpo.bind(backbone)
    with pytest.raises(UserError, match="written by the nft optimizer"):
        grpo.load_state_dict(optimizer.state_dict())


def test_final_samples_are_the_trajectory_that_transitions_store(tiny_weights):
    backbone = build_backbone("shapes-dit", tiny_weights)
    cond = backbone.encode(PROMPTS)
    z0 = backbone.initial_noise(4, torch.Generator().manual_seed(0))
    sampler = tpflow.build("sampler", "cps")
    args = (backbone, sampler, cond, z0, backbone.sigmas(4), Window(1, 2), 0.7, 2.0, None)
    full = rollout(*args, generator=torch.Generator().manual_seed(1))
    final = rollout(*args, generator=torch.Generator().manual_seed(1), transitions=False)
    assert torch.equal(full.final, final.final) and full.cost.nfe == final.cost.nfe
    assert full.latents.shape[1] == 2 and final.latents.shape[1] == 0
    with pytest.raises(ValueError, match="completions"):
        rollout(*args[:-1], "ode", transitions=False)
