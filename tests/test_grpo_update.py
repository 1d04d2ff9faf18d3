"""The GRPO update on a real (tiny) shapes-dit rollout: on-policy ratio exactly 1, LoRA trained, base frozen."""

from __future__ import annotations

import pytest
import torch

import tpflow
from tests.distributed_workers import layout_gradient, two_window_batch
from tpflow.optim.advantages import group_advantages
from tpflow.rollout import Window, rollout


class EditedLogProb:
    """A sampler whose re-scored log-prob is ``edit(out, sigma)`` of the real one's output ``out``; its steps are the
    real sampler's."""

    def __init__(self, sampler, edit) -> None:
        self.sampler, self.edit = sampler, edit

    def step(self, *args, **kwargs):
        return self.sampler.step(*args, **kwargs)

    def log_prob(self, z_next, z, v, sigma, sigma_next, noise_level):
        out = self.sampler.log_prob(z_next, z, v, sigma, sigma_next, noise_level)
        return type(out)(out.prev, out.mean, out.std, self.edit(out, sigma), out.std_dev_t)


@pytest.fixture
def backbone(tiny_weights):
    return tpflow.build("backbone", "shapes-dit", weights=str(tiny_weights), lora_init="gaussian")


@pytest.mark.parametrize("sampler_name,beta", [("cps", 0.0), ("flow-sde", 1e-2)])
def test_update_trains_lora_only_and_starts_on_policy(backbone, sampler_name, beta):
    sampler = tpflow.build("sampler", sampler_name)
    prompts = ["a photo of a red circle"] * 3 + ["a photo of two squares"] * 3
    cond = backbone.encode(prompts)
    z0 = backbone.initial_noise(6, torch.Generator().manual_seed(0))
    gen = torch.Generator().manual_seed(1)
    batch = rollout(backbone, sampler, cond, z0, backbone.sigmas(5), Window(0, 5), 0.7, 2.0, None, generator=gen)
    rewards = torch.randn(6, 5, generator=torch.Generator().manual_seed(2))
    advantages = group_advantages(rewards, prompts)
    optimizer = tpflow.build(
        "optimizer", "grpo", learning_rate=1e-2, beta=beta, micro_batch_size=2, gradient_accumulation_steps=2
    )
    optimizer.bind(backbone)
    lora = {n: p.detach().clone() for n, p in backbone.model.named_parameters() if "lora_" in n}
    frozen = {n: p.detach().clone() for n, p in backbone.model.named_parameters() if "lora_" not in n}
    metrics = optimizer.update(backbone, sampler, batch, advantages)
    assert metrics["first_ratio_max_deviation"] == 0.0  # exactly on policy before the first step
    assert metrics["optimizer_steps"] == 2 and optimizer.global_step == 2  # 3 micro-batches, accumulation 2
    assert all(torch.isfinite(torch.tensor(v)) for v in metrics.values())
    # cps at σ⁺ = 0 (the last step) has zero std and is never trained: 4 trained steps of each of the 6 trajectories;
    # flow-sde trains all 5.
    assert metrics["rows_trained"] == 6 * (4 if sampler_name == "cps" else 5)
    assert (metrics["kl"] > 0) == (beta > 0)
    for name, before in lora.items():
        assert not torch.equal(before, dict(backbone.model.named_parameters())[name]), name
    for name, before in frozen.items():
        assert torch.equal(before, dict(backbone.model.named_parameters())[name]), name


def test_all_zero_advantages_train_nothing(backbone):
    sampler = tpflow.build("sampler", "cps")
    cond = backbone.encode(["a photo of a circle"] * 4)
    z0 = backbone.initial_noise(4, torch.Generator().manual_seed(0))
    batch = rollout(backbone, sampler, cond, z0, backbone.sigmas(4), Window(0, 3), 0.7, 1.0, None)
    optimizer = tpflow.build("optimizer", "grpo")
    metrics = optimizer.update(backbone, sampler, batch, torch.zeros(4, 3, dtype=torch.float64))
    assert metrics["trajectories_trained"] == 0 and metrics["optimizer_steps"] == 0


def test_non_finite_losses_are_skipped_and_counted(backbone):
    sampler = tpflow.build("sampler", "cps")

    def nan_on_first_step(out, sigma):  # re-scoring the first window step yields NaN
        return out.log_prob * float("nan") if bool((sigma == 1).all()) else out.log_prob

    prompts = ["a photo of a red circle"] * 2 + ["a photo of two squares"] * 2
    cond = backbone.encode(prompts)
    z0 = backbone.initial_noise(4, torch.Generator().manual_seed(0))
    batch = rollout(backbone, sampler, cond, z0, backbone.sigmas(4), Window(0, 3), 0.7, 2.0, None)
    advantages = group_advantages(torch.randn(4, 3, generator=torch.Generator().manual_seed(3)), prompts)
    optimizer = tpflow.build("optimizer", "grpo", micro_batch_size=4, learning_rate=1e-2)
    metrics = optimizer.update(backbone, EditedLogProb(sampler, nan_on_first_step), batch, advantages)
    # the first window step's loss of the one micro-batch: its 4 rows (the unit of rows_trained) skipped
    assert metrics["nonfinite_losses"] == 4 and metrics["optimizer_steps"] == 1
    assert all(torch.isfinite(p).all() for p in backbone.trainable_parameters())


def test_non_finite_losses_count_rows_under_native_and_reweight_alike():
    """One NaN row in z₀, in a micro-batch of 2, 3 window steps: native skips that micro-batch's loss at each window
    step, reweight the one loss it forms for the micro-batch's 3 steps; both count the 2 × 3 rows skipped (they
    counted 3 and 1: losses, which the two modes bundle differently), and both step on the other micro-batch."""
    import dataclasses

    from tests.test_recompute_retain import ADVANTAGES, GUIDANCE, PROMPTS, WINDOW, first_step_gradient, moved_model
    from tests.test_recompute_reweight import reweight_spec
    from tpflow.rollout import RolloutInputs, WindowEngine

    backbone, sampler = moved_model()
    layout = {"micro_batch_size": 2, "gradient_accumulation_steps": 2, "beta": 0.0}
    z0 = backbone.initial_noise(len(PROMPTS), torch.Generator().manual_seed(2))
    z0[3] = float("nan")
    inputs = RolloutInputs(backbone, backbone.encode(PROMPTS), z0, backbone.sigmas(5), GUIDANCE, None,
                           torch.Generator().manual_seed(3), None)  # fmt: skip
    batch = WindowEngine(sampler, WINDOW, 0.8, None, False, reweight_spec(layout)).run(inputs)
    kept, _, reweighted = first_step_gradient(backbone, sampler, batch, ADVANTAGES, recompute="reweight", **layout)
    native, _, recomputed = first_step_gradient(backbone, sampler, dataclasses.replace(batch, retained=None),
                                                ADVANTAGES, **layout)  # fmt: skip
    assert torch.isfinite(kept).all() and torch.isfinite(native).all() and native.norm() > 0
    assert reweighted["nonfinite_losses"] == recomputed["nonfinite_losses"] == 2 * WINDOW.size
    assert reweighted["rows_trained"] == recomputed["rows_trained"] == 2 * WINDOW.size


def test_a_non_finite_value_in_a_masked_row_does_not_drop_the_trained_rows(backbone):
    """Rows with std 0 (cps at σ⁺ = 0) are masked out of the loss; a NaN in such a row (its placeholder log-prob) must
    not turn the loss of the rows that train into NaN, which the update would then skip whole (it multiplied the
    rows by the 0/1 mask, and NaN · 0 is NaN)."""
    sampler = tpflow.build("sampler", "cps")

    def nan_where_std_is_zero(out, sigma):  # the placeholder log-prob of a std-0 row is NaN
        return out.log_prob + torch.where(out.std == 0, float("nan"), 0.0)

    batch = two_window_batch(backbone, sampler)  # window position 2: rows 4-7 step to σ = 0, rows 0-3 do not
    advantages = torch.randn(8, 3, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    losses = {}
    for name, used in (("plain", sampler), ("nan", EditedLogProb(sampler, nan_where_std_is_zero))):
        optimizer = tpflow.build("optimizer", "grpo", micro_batch_size=8, learning_rate=1e-12, beta=1e-2)
        losses[name] = optimizer.update(backbone, used, batch, advantages)
    assert losses["nan"]["nonfinite_losses"] == 0, losses["nan"]
    assert losses["nan"]["rows_trained"] == losses["plain"]["rows_trained"] == 8 * 3 - 4
    assert losses["nan"]["loss"] == losses["plain"]["loss"]
    assert all(torch.isfinite(p).all() for p in backbone.trainable_parameters())


def test_the_update_takes_the_advantages_as_given(backbone):
    """The optimizer's ``advantages`` clips once at adv_clip_max; the update must not clamp again (a second clamp at
    5 once made adv_clip_max > 5 ineffective). On policy the ratio is 1, so the policy loss is −mean(A)."""
    sampler = tpflow.build("sampler", "cps")
    cond = backbone.encode(["a photo of a circle"] * 4)
    z0 = backbone.initial_noise(4, torch.Generator().manual_seed(0))
    batch = rollout(backbone, sampler, cond, z0, backbone.sigmas(4), Window(0, 3), 0.7, 1.0, None)
    optimizer = tpflow.build("optimizer", "grpo", adv_clip_max=10.0, learning_rate=1e-12, micro_batch_size=4)
    metrics = optimizer.update(backbone, sampler, batch, torch.full((4, 3), 12.0, dtype=torch.float64))
    assert metrics["policy_loss"] == pytest.approx(-12.0, rel=1e-3)


@pytest.mark.parametrize("beta", [0.0, 1e-2])
def test_zero_std_rows_are_masked_per_row(backbone, beta):
    """A micro-batch may mix rollout batches whose windows start differently: at window position 2, the rows of a
    window [1, 4) step to σ = 0 (cps: std 0, no likelihood ratio) while the rows of a window [0, 3) do not. The
    zero-std rows must enter neither the surrogate nor its mean: the loss equals that of the live rows alone."""
    sampler = tpflow.build("sampler", "cps")
    cond = backbone.encode(["a photo of a red circle"] * 2)
    sigmas = backbone.sigmas(4)
    early, late = (
        rollout(backbone, sampler, cond, backbone.initial_noise(2, torch.Generator().manual_seed(s)), sigmas,
                Window(s, 3), 0.7, 1.0, None, generator=torch.Generator().manual_seed(10 + s))
        for s in (0, 1)
    )  # fmt: skip
    assert bool((late.sigmas[:, -1] == 0).all()) and bool((early.sigmas[:, -1] > 0).all())
    mixed = tpflow.types.Rollout.cat([early, late])  # rows 0-1: live at i = 2; rows 2-3: std 0 at i = 2
    optimizer = tpflow.build("optimizer", "grpo", beta=beta)
    adv = torch.tensor([1.5, -0.5, 3.0, 2.0])  # mean over all rows 1.5, over the live rows 0.5
    mixed_loss = optimizer._step_loss(backbone, sampler, mixed, adv, 2)
    live_loss = optimizer._step_loss(backbone, sampler, early, adv[:2], 2)
    assert mixed_loss.rows.item() == live_loss.rows.item() == 2  # only rows 0-1 train at i = 2
    assert mixed_loss.total.item() == pytest.approx(live_loss.total.item(), rel=1e-6, abs=1e-9)
    # on policy the surrogate's row sum is −ΣA over rows 0-1 only: −1.0, mean −0.5
    assert mixed_loss.sums["policy_loss"].item() == pytest.approx(-1.0, rel=1e-5)
    assert mixed_loss.sums["kl"].item() == pytest.approx(live_loss.sums["kl"].item(), rel=1e-6, abs=1e-12)
    mixed_loss.total.backward()  # the masked rows contribute a finite, zero gradient
    assert all(p.grad is None or torch.isfinite(p.grad).all() for p in backbone.trainable_parameters())
    # all rows at std 0: nothing to train, so the loop back-propagates nothing
    assert optimizer._step_loss(backbone, sampler, late, adv[2:], 2).rows.item() == 0


@pytest.mark.parametrize("micro,accumulation", [(2, 4), (3, 3)])
def test_a_steps_gradient_does_not_depend_on_its_micro_batches(tiny_weights, micro, accumulation):
    """Every trained (trajectory, window step) row of an optimizer step weighs the same (docs/algorithm.md §8 D10):
    8 rows as one micro-batch of 8, as 2 + 2 + 2 + 2 and as 3 + 3 + 2 give one gradient, although the micro-batches
    train different numbers of rows (ragged, and rows masked at std 0). With a mean per micro-batch, the last
    micro-batch of 3 + 3 + 2 weighed its rows 3/2 as much as the others."""
    whole = layout_gradient(str(tiny_weights), list(range(8)), 8, 1)
    split = layout_gradient(str(tiny_weights), list(range(8)), micro, accumulation)
    assert whole.abs().max() > 0
    torch.testing.assert_close(split, whole, rtol=1e-5, atol=1e-7)


def test_a_step_the_fp16_scaler_skips_is_not_counted(backbone):
    """Under fp16 the gradient scaler skips a step whose gradients hold inf/NaN; that step must not count as an
    optimizer step (global_step names checkpoints and drives the EMA) nor reach ``on_step``. tpflow's own fp16
    precision (torch's CPU autocast and GradScaler) runs here exactly as on a GPU."""
    from tpflow.precision import Precision

    sampler = tpflow.build("sampler", "cps")
    prompts = ["a photo of a red circle"] * 4 + ["a photo of two squares"] * 4
    cond = backbone.encode(prompts)
    z0 = backbone.initial_noise(8, torch.Generator().manual_seed(0))
    gen = torch.Generator().manual_seed(1)
    batch = rollout(backbone, sampler, cond, z0, backbone.sigmas(4), Window(0, 3), 0.7, 2.0, None, generator=gen)
    advantages = group_advantages(torch.randn(8, 3, generator=torch.Generator().manual_seed(2)), prompts)
    optimizer = tpflow.build(
        "optimizer", "grpo", learning_rate=1e-2, micro_batch_size=4, gradient_accumulation_steps=1
    )  # 2 optimizer steps
    precision = Precision("fp16", "cpu")
    optimizer.bind(backbone, precision=precision)
    first_param = backbone.trainable_parameters()[0]
    poison = {"on": True}  # inf gradients until the first optimizer step has been attempted
    first_param.register_hook(lambda g: g * float("inf") if poison["on"] else g)
    attempted = []
    scaler_step = precision.scaler.step

    def counted_step(opt, *args, **kwargs):
        attempted.append(not all(torch.isfinite(p.grad).all() for p in backbone.trainable_parameters()))
        poison["on"] = False
        return scaler_step(opt, *args, **kwargs)

    precision.scaler.step = counted_step
    before = {id(p): p.detach().clone() for p in backbone.trainable_parameters()}
    taken = []
    metrics = optimizer.update(backbone, sampler, batch, advantages, on_step=taken.append)
    assert attempted == [True, False]  # inf gradients at the first step (skipped), finite at the second
    assert optimizer.global_step == 1 and metrics["optimizer_steps"] == 1 and metrics["skipped_steps"] == 1
    assert taken == [0]  # the EMA hook saw one step, index 0
    assert precision.scaler.get_scale() == 2.0**15  # backed off once from 2**16
    assert all(torch.isfinite(p).all() for p in backbone.trainable_parameters())
    assert any(not torch.equal(before[id(p)], p) for p in backbone.trainable_parameters())


def test_a_trained_subset_is_computed_alone_and_weighs_as_before(backbone):
    """A plan's subset of (trajectory, step) pairs (DanceGRPO's trained fraction) is packed into full velocity calls
    of trained pairs only: the update's forward rows equal the trained pairs (an earlier release computed the whole
    micro-batch at every step any of its rows trained, weighing the others 0), and the step's gradient is still the
    mean over the trained pairs, equal to the masked computation's."""
    import dataclasses

    sampler = tpflow.build("sampler", "flow-sde")
    prompts = ["a photo of a red circle"] * 3 + ["a photo of two squares"] * 3
    z0 = backbone.initial_noise(6, torch.Generator().manual_seed(0))
    batch = rollout(backbone, sampler, backbone.encode(prompts), z0, backbone.sigmas(5), Window(0, 4), 0.7, 2.0,
                    None, generator=torch.Generator().manual_seed(1))  # fmt: skip
    trained = torch.rand(6, 4, generator=torch.Generator().manual_seed(5)) < 0.4  # [6, 4]: a random subset
    trained[0, 0] = True
    batch = dataclasses.replace(batch, trained=trained)
    advantages = group_advantages(torch.randn(6, 4, generator=torch.Generator().manual_seed(2)), prompts)
    optimizer = tpflow.build("optimizer", "grpo", beta=0.0, micro_batch_size=3, max_grad_norm=1e9)
    optimizer.bind(backbone)
    params = backbone.trainable_parameters()

    rows, velocity = [], backbone.velocity
    backbone.velocity = lambda z, *a: rows.append(z.shape[0] if torch.is_grad_enabled() else 0) or velocity(z, *a)
    gradients = []
    optimizer.loop.optimizer.step = lambda *a, **k: gradients.append([p.grad.clone() for p in params])
    try:
        metrics = optimizer.update(backbone, sampler, batch, advantages)
    finally:
        del backbone.velocity
    assert metrics["rows_trained"] == trained.sum() and sum(rows) == trained.sum()  # nothing untrained computed
    assert metrics["first_ratio_max_deviation"] <= 1e-6  # on policy, to rounding: the calls mix steps
    (packed,) = gradients

    # The masked computation: every step of the whole batch, the untrained rows weighing 0, divided by the pairs.
    adv = advantages.float()
    for p in params:
        p.grad = None
    total = sum(
        (optimizer._step_loss(backbone, sampler, batch, adv[:, i], i, None, trained[:, i].float()).total
         for i in range(4)),
        torch.zeros(()),
    )  # fmt: skip
    (total / trained.sum()).backward()
    for got, want in zip(packed, (p.grad for p in params), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-8)
