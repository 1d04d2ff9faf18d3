"""``[optimizer] recompute = "reweight"`` (tpflow.rollout.reweight): the rollout back-propagates each window step as it
samples it, with advantage 1, into a gradient per trajectory (or per trajectory and step); the update's first,
on-policy step weighs them by the advantages instead of recomputing anything.

The invariants: the per-row gradients are each row's own backward, on every shipped backbone (CFG copies, chunked
velocity calls); the stored rollout is the native one; the first step's gradient is native's up to float rounding
for outcome and step credits, CFG with either gradient, step weights, a cap on the steps, several optimizer steps,
mixed precision and the fp16 loss scale; recipes it cannot serve are refused before anything loads."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import tpflow
from tests.conftest import cuda_or_skip
from tests.test_recompute_retain import (
    ADVANTAGES,
    PROMPTS,
    WINDOW,
    first_step_gradient,
    model,
    moved_model,
    relative,
    sample,
    train_native_and,
)
from tests.test_recompute_retain import GUIDANCE as GUIDANCE_
from tpflow.errors import RecipeError
from tpflow.precision import Precision
from tpflow.recipe import load_recipe
from tpflow.rollout import Completions
from tpflow.rollout.per_row_grads import PerRowGradients
from tpflow.types import ReweightedSteps

__all__ = ["model"]  # the fixture, shared with the retain tests


def reweight_spec(options: dict, precision: Precision | None = None, same_every_step: bool = False):
    """The rollout's Reweight as a run builds it: from the optimizer bound at the run's precision."""
    optimizer = tpflow.build("optimizer", "grpo", recompute="reweight", **options)
    optimizer.precision = precision if precision is not None else optimizer.precision
    return optimizer.retain.for_credit(same_every_step)


@pytest.mark.parametrize(
    ("name", "guidance", "max_batch"),
    [("tiny-sd3", 4.5, 3), ("tiny-flux", 3.5, None), ("tiny-qwen-image", 4.0, 3), ("shapes-dit", 2.0, None)],
)
def test_per_row_gradients_are_each_rows_own_backward(name, guidance, max_batch):
    """One batched backward's per-row shares (module tpflow.rollout.per_row_grads) against one backward per row,
    through CFG's [unconditional; conditional] copies and a velocity call split into chunks of 3 + 1 rows."""
    from tpflow.rollout.parts import Branch, Velocity

    torch.manual_seed(0)
    options = {"resolution": 16} if name != "shapes-dit" else {"lora_init": "gaussian"}
    backbone = tpflow.build("backbone", name, seed=0, **options) if name != "shapes-dit" else tpflow.build(
        "backbone", name, **options)  # fmt: skip
    with torch.no_grad():
        for p in backbone.trainable_parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(1), dtype=p.dtype))
    n = len(PROMPTS)
    z = backbone.initial_noise(n, torch.Generator().manual_seed(2))
    sigmas = backbone.sigmas(4)
    engine = Velocity(backbone, backbone.encode(PROMPTS), sigmas, guidance, max_batch)
    weights = torch.randn((n, *z.shape[1:]), generator=torch.Generator().manual_seed(3))
    per_row = PerRowGradients.of(backbone)
    engine.on_chunk = per_row.chunk
    with per_row.recording(n):
        v = engine([Branch(z, torch.arange(n))], 1)[0]
    losses = (v.float() * weights).flatten(1).sum(1)  # [n]
    grads = per_row.gradients(losses, n)
    params = per_row.params
    reached = set()
    for i in range(n):
        with per_row.recording(n):
            v = engine([Branch(z, torch.arange(n))], 1)[0]
        own = torch.autograd.grad((v.float()[i] * weights[i]).sum(), params, allow_unused=True)
        for k, (g, ref) in enumerate(zip(grads, own, strict=True)):
            if ref is None:
                assert g is None or g[i].abs().max() == 0
                continue
            reached.add(k)
            torch.testing.assert_close(g[i], ref, rtol=1e-4, atol=1e-6, msg=f"{name}: row {i}, parameter {k}")
    assert reached == {k for k, g in enumerate(grads) if g is not None} and len(reached) > len(params) // 2


@pytest.mark.parametrize("completions", [None, Completions("ode")], ids=["flow-grpo", "tp-grpo"])
def test_a_reweighting_rollout_stores_the_native_transitions(model, completions):
    backbone, sampler = model
    native = sample(backbone, sampler, None, completions)
    kept = sample(backbone, sampler, reweight_spec({"beta": 0.0}), completions)
    assert isinstance(kept.retained, ReweightedSteps) and kept.retained.per_step
    params = list(backbone.trainable_parameters())
    assert [g.shape for g in kept.retained.grads] == [(len(PROMPTS), WINDOW.size, *p.shape) for p in params]
    assert all(p.grad is None for p in params)  # the rollout's backward touches no parameter's gradient
    names = ("latents", "next_latents", "log_probs", "final")
    if completions is None:
        for name in names:
            assert torch.equal(getattr(native, name), getattr(kept, name)), name
    else:  # the main trajectory leaves the completions' batched call: float32 rounding (as retain's)
        for name in (*names, "completions"):
            torch.testing.assert_close(getattr(kept, name), getattr(native, name), rtol=0, atol=1e-5)


@pytest.mark.parametrize(
    "options",
    [
        {},
        {"cfg_gradient": "conditional"},
        {"max_retained_steps": 2},
        {"step_weight": "noise-aware", "max_retained_steps": 1},
        {"micro_batch_size": 4, "gradient_accumulation_steps": 1},
    ],
    ids=["plain", "conditional-cfg", "two-kept", "weights-one-kept", "rollout-batch-layout"],
)
def test_the_reweighted_update_has_the_native_gradient(model, options):
    """Step credits (ADVANTAGES differ by step): per (trajectory, step) buffers, weighed at the first step."""
    backbone, sampler = model
    layout = {"micro_batch_size": 2, "gradient_accumulation_steps": 2, "clip_range": 1e-4, "beta": 0.0, **options}
    batch = sample(backbone, sampler, reweight_spec(layout))
    kept, _, kept_metrics = first_step_gradient(backbone, sampler, batch, ADVANTAGES, recompute="reweight", **layout)
    native, _, native_metrics = first_step_gradient(backbone, sampler, dataclasses.replace(batch, retained=None),
                                                    ADVANTAGES, **layout)  # fmt: skip
    assert native.norm() > 0
    # Not bitwise: the per-row shares are contracted in float32 in another order than autograd's weight gradient,
    # and a micro-batch smaller than the rollout batch rounds its forward differently (1.0e-6 to 1.5e-6 measured).
    assert relative(kept, native) < 1e-5, relative(kept, native)
    assert kept_metrics["rows_trained"] == native_metrics["rows_trained"] == len(PROMPTS) * WINDOW.size
    assert kept_metrics["retained_graphs_used"] == 1.0
    assert kept_metrics["loss"] == pytest.approx(native_metrics["loss"], rel=1e-4, abs=1e-6)


def test_outcome_credit_keeps_one_gradient_per_trajectory(model):
    """Every step of a trajectory with one advantage (outcome credit): the buffer sums its steps ([N, ...], W times
    smaller), and the step's gradient is still native's; an advantage that differs by step is refused."""
    backbone, sampler = model
    layout = {"micro_batch_size": 2, "gradient_accumulation_steps": 2, "beta": 0.0}
    batch = sample(backbone, sampler, reweight_spec(layout, same_every_step=True))
    assert not batch.retained.per_step
    params = list(backbone.trainable_parameters())
    assert [g.shape for g in batch.retained.grads] == [(len(PROMPTS), *p.shape) for p in params]
    outcome = ADVANTAGES[:, :1].expand(-1, WINDOW.size).contiguous()
    kept, _, _ = first_step_gradient(backbone, sampler, batch, outcome, recompute="reweight", **layout)
    native, _, _ = first_step_gradient(backbone, sampler, dataclasses.replace(batch, retained=None), outcome,
                                       **layout)  # fmt: skip
    assert relative(kept, native) < 1e-5, relative(kept, native)
    with pytest.raises(ValueError, match="differ by step"):
        first_step_gradient(backbone, sampler, batch, ADVANTAGES, recompute="reweight", **layout)


def test_only_the_first_optimizer_step_is_reweighted(model):
    """Two optimizer steps per update: the first from the buffers, the second recomputed at the moved weights."""
    backbone, sampler = model
    layout = {"micro_batch_size": 2, "gradient_accumulation_steps": 1, "clip_range": 0.2, "learning_rate": 1e-2,
              "beta": 0.0}  # fmt: skip
    batch = sample(backbone, sampler, reweight_spec(layout))
    _, kept, metrics = first_step_gradient(backbone, sampler, batch, ADVANTAGES, recompute="reweight", **layout)
    _, native, _ = first_step_gradient(backbone, sampler, dataclasses.replace(batch, retained=None), ADVANTAGES,
                                       **layout)  # fmt: skip
    assert len(kept) == len(native) == 2 and metrics["optimizer_steps"] == 2
    for step in range(2):
        a, b = (torch.cat([g.flatten() for g in grads[step]]) for grads in (kept, native))
        assert relative(a, b) < 1e-5, (step, relative(a, b))


@pytest.mark.parametrize("mode", ["bf16", "fp16"])
def test_under_mixed_precision_the_reweighted_gradient_points_where_natives_does(model, mode):
    """Rollout and update under the recipe's autocast; under fp16 the rollout's backward runs at the gradient
    scaler's scale, as the update's would (LeanGRPO reports a cosine of 0.9998 under bf16)."""
    backbone, sampler = model
    layout = {"micro_batch_size": 2, "gradient_accumulation_steps": 2, "beta": 0.0}
    batch = sample(backbone, sampler, reweight_spec(layout, Precision(mode, "cpu")), precision=Precision(mode, "cpu"))
    assert batch.retained.scale == (65536.0 if mode == "fp16" else 1.0)
    kept, _, _ = first_step_gradient(backbone, sampler, batch, ADVANTAGES, Precision(mode, "cpu"),
                                     recompute="reweight", **layout)  # fmt: skip
    native, _, _ = first_step_gradient(backbone, sampler, dataclasses.replace(batch, retained=None), ADVANTAGES,
                                       Precision(mode, "cpu"), **layout)  # fmt: skip
    cosine = float(torch.nn.functional.cosine_similarity(kept.double(), native.double(), dim=0))
    assert cosine >= 0.999, cosine


def test_reweight_is_refused_where_it_cannot_hold():
    """Before anything loads, in one paragraph: the KL and RatioNorm differentiate means the buffers do not hold;
    every plan's engine runs its trained steps with gradients for reweight."""
    assert load_recipe("recipes/shapes_tp.toml", ['optimizer.recompute="reweight"']) is not None
    with pytest.raises(RecipeError, match="beta = 0.01"):
        load_recipe("recipes/shapes_flowgrpo.toml", ['optimizer.recompute="reweight"', "optimizer.beta=0.01"])
    for allowed in ("shapes_mixgrpo", "shapes_mixgrpo_flash", "shapes_dancegrpo", "shapes_flowgrpo_fast"):
        assert load_recipe(f"recipes/{allowed}.toml", ['optimizer.recompute="reweight"']) is not None
    assert load_recipe("recipes/shapes_tempflow.toml", ['optimizer.recompute="reweight"']) is not None
    with pytest.raises(RecipeError, match="NFT has none to reuse"):
        load_recipe("recipes/shapes_nft.toml", ['optimizer.recompute="reweight"'])


def plan_overrides(plan: str) -> list[str]:
    """``name+after_window``: MixGRPO-Flash's window-schedule with the DPM-Solver tail (its recipe's post_ratio; a
    window of 2 starting before step 2 of K = 4, so that the solver has a step after every window)."""
    name, _, after = plan.partition("+")
    flash = [f'plan.after_window="{after}"', "plan.post_ratio=0.4", "rollout.window_size=2"]
    siblings = ["rollout.same_noise=true"] if name == "branch" else []  # the branch's copies share z_0
    return [f'plan.name="{name}"', *(flash + ["rollout.window_range=[0, 3]"] if after else []), *siblings]


@pytest.mark.parametrize(
    ("credit", "per_step", "plan"),
    [
        ("consistent", True, "window"),
        ("outcome", False, "window"),
        ("outcome", False, "window-schedule"),
        ("outcome", False, "window-schedule+dpm-solver++"),
        ("outcome", False, "trained-fraction"),
        ("outcome", False, "window-per-image"),
        ("branch", True, "branch"),
    ],  # fmt: skip
)
def test_a_run_with_reweight_trains_as_the_native_run_does(tmp_path, tiny_weights, monkeypatch, credit, per_step,
                                                           plan):  # fmt: skip
    """Through the trainer (2 epochs, 2 optimizer steps each: the first reweighted, the second native): the adapter
    moves, and ends where the native run's does up to float rounding; TP-GRPO's step credit keeps a gradient per
    (trajectory, step), outcome credit one per trajectory; MixGRPO's moving window (Euler or MixGRPO-Flash's
    DPM-Solver after it), DanceGRPO's trained subset of steps, Flow-GRPO-Fast's per-image windows and
    TempFlow-GRPO's branches (credit 'branch') alike."""
    from tpflow.rollout.reweight import ReweightLog

    kept, keep = [], ReweightLog.keep
    monkeypatch.setattr(ReweightLog, "keep", lambda self, *args: (kept.append(self.spec.per_step), keep(self, *args)))
    metrics = train_native_and("reweight", tmp_path, tiny_weights, credit, ["optimizer.beta=0", *plan_overrides(plan)])
    assert metrics["reweight"]["optimizer_steps"] == metrics["native"]["optimizer_steps"] == 2
    # steps back-propagated in each of the 2 epochs' rollouts: the 3 window steps (trained-fraction: those any row
    # trains; per-image windows: every step some row's window holds)
    assert kept == [per_step] * len(kept) and len(kept) >= 2


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["no", "bf16", "fp16"])
def test_on_cuda_the_reweighted_gradient_is_the_native_one(mode):
    """The CPU comparison on a GPU: the first step's gradient from the rollout's per-row buffers against native's on
    the same rollout (cosine; LeanGRPO reports 0.9998 under bf16)."""
    device = cuda_or_skip()
    backbone, sampler = moved_model(device)
    # clip_range 0.2, as the retain test's (tests/test_recompute_retain.py): at ε = 1e-5 native's own bf16 ratio
    # leaves the clip on CUDA and drops most rows (cosine 0.33 measured on an H200)
    layout = {"micro_batch_size": 2, "gradient_accumulation_steps": 2, "beta": 0.0, "clip_range": 0.2}
    precision = None if mode == "no" else Precision(mode, device)
    batch = sample(backbone, sampler, reweight_spec(layout, precision), precision=precision)
    fresh = None if mode == "no" else Precision(mode, device)
    kept, _, _ = first_step_gradient(backbone, sampler, batch, ADVANTAGES, precision, recompute="reweight", **layout)
    native, _, _ = first_step_gradient(backbone, sampler, dataclasses.replace(batch, retained=None), ADVANTAGES,
                                       fresh, **layout)  # fmt: skip
    cosine = float(torch.nn.functional.cosine_similarity(kept.double(), native.double(), dim=0))
    assert cosine >= (0.9999 if mode == "no" else 0.999), cosine


def test_rows_past_the_buffers_recompute_natively(model):
    """The epoch's batches past the first optimizer step's rows keep no buffers (``Reweight.for_batch``): a
    micro-batch with such a row is recomputed natively, the others weighed, and the step's gradient is native's."""
    from tpflow.types import Rollout

    backbone, sampler = model
    # clip_range 0.2, as the retain test's (tests/test_recompute_retain.py): at ε = 1e-5 native's own bf16 ratio
    # leaves the clip on CUDA and drops most rows (cosine 0.33 measured on an H200)
    layout = {"micro_batch_size": 2, "gradient_accumulation_steps": 2, "beta": 0.0, "clip_range": 0.2}
    spec = reweight_spec(layout)
    assert spec.rows == 4 and spec.for_batch(0) is spec and spec.for_batch(4) is None
    full = sample(backbone, sampler, spec)
    batch = Rollout.cat([full.index(torch.arange(2)), dataclasses.replace(full.index(torch.arange(2, 4)),
                                                                          retained=None)])  # fmt: skip
    assert len(batch.retained) == 2 and batch.retained.index(torch.tensor([1, 2])) is None
    calls, real = [], sampler.log_prob
    sampler.log_prob = lambda *args: (calls.append(1), real(*args))[1]
    try:
        kept, _, _ = first_step_gradient(backbone, sampler, batch, ADVANTAGES, recompute="reweight", **layout)
    finally:
        del sampler.log_prob
    assert len(calls) == WINDOW.size  # the second micro-batch only, at each window step
    native, _, _ = first_step_gradient(backbone, sampler, dataclasses.replace(batch, retained=None), ADVANTAGES,
                                       **layout)  # fmt: skip
    assert relative(kept, native) < 1e-5, relative(kept, native)


@pytest.mark.parametrize("same_every_step", [True, False], ids=["outcome", "step-credit"])
def test_a_trained_subset_back_propagates_its_pairs_only(model, same_every_step):
    """DanceGRPO's trained-fraction: each row trains its own steps, so at each step the rows that train run with
    gradients in a call of their own (a step no row trains runs none), and the first step's gradient is native's
    packed update's."""
    from tpflow.rollout import RolloutInputs, WindowEngine

    backbone, sampler = model
    trained = torch.tensor([[1, 0, 1], [0, 0, 1], [1, 0, 0], [0, 0, 1]], dtype=torch.bool)  # step 1: no row
    layout = {"micro_batch_size": 2, "gradient_accumulation_steps": 2, "beta": 0.0, "clip_range": 1e-4}
    spec = reweight_spec(layout, same_every_step=same_every_step)
    z0 = backbone.initial_noise(len(PROMPTS), torch.Generator().manual_seed(2))

    def run(retain, mask):
        inputs = RolloutInputs(backbone, backbone.encode(PROMPTS), z0, backbone.sigmas(5), GUIDANCE_, None,
                               torch.Generator().manual_seed(3), None)  # fmt: skip
        out = WindowEngine(sampler, WINDOW, 0.8, None, False, retain, mask).run(inputs)
        return dataclasses.replace(out, trained=trained)

    native_batch, batch = run(None, None), run(spec, trained)
    assert batch.retained.live.equal(trained)
    for name in ("latents", "next_latents", "log_probs", "final"):  # the trained rows leave the batched call
        torch.testing.assert_close(getattr(batch, name), getattr(native_batch, name), rtol=0, atol=1e-5)
    advantages = ADVANTAGES[:, :1].expand(-1, WINDOW.size).contiguous() if same_every_step else ADVANTAGES
    kept, _, metrics = first_step_gradient(backbone, sampler, batch, advantages, recompute="reweight", **layout)
    native, _, native_metrics = first_step_gradient(backbone, sampler, dataclasses.replace(batch, retained=None),
                                                    advantages, **layout)  # fmt: skip
    assert native.norm() > 0 and metrics["rows_trained"] == native_metrics["rows_trained"] == int(trained.sum())
    assert relative(kept, native) < 1e-5, relative(kept, native)


def test_per_row_windows_back_propagate_each_rows_own_steps(model):
    """Flow-GRPO-Fast's window-per-image: row n's window starts at s_n, so at step k the rows inside their window
    (and within max_retained_steps) run with gradients and fill their own window position; the first step's gradient
    is native's."""
    from tpflow.rollout import RolloutInputs, RowWindowsEngine

    backbone, sampler = model
    starts = (0, 1, 1, 0)
    z0 = backbone.initial_noise(len(PROMPTS), torch.Generator().manual_seed(2))
    for options in ({}, {"max_retained_steps": 2}):
        layout = {"micro_batch_size": 2, "gradient_accumulation_steps": 2, "beta": 0.0, "clip_range": 1e-4, **options}

        def run(retain):
            inputs = RolloutInputs(backbone, backbone.encode(PROMPTS), z0, backbone.sigmas(5), GUIDANCE_, None,
                                   torch.Generator().manual_seed(3), None)  # fmt: skip
            return RowWindowsEngine(sampler, starts, WINDOW.size, 0.8, retain=retain).run(inputs)

        native_batch, batch = run(None), run(reweight_spec(layout))
        assert batch.retained.live.all() and batch.retained.steps == options.get("max_retained_steps", WINDOW.size)
        for name in ("latents", "next_latents", "log_probs", "final"):
            torch.testing.assert_close(getattr(batch, name), getattr(native_batch, name), rtol=0, atol=1e-5)
        kept, _, _ = first_step_gradient(backbone, sampler, batch, ADVANTAGES, recompute="reweight", **layout)
        native, _, _ = first_step_gradient(backbone, sampler, dataclasses.replace(batch, retained=None), ADVANTAGES,
                                           **layout)  # fmt: skip
        assert native.norm() > 0 and relative(kept, native) < 1e-5, (options, relative(kept, native))


@pytest.mark.parametrize("mode", ["retain", "reweight"])
def test_the_branch_back_propagates_each_trajectorys_step(model, mode):
    """TempFlow-GRPO's branch: at each window step every trajectory takes one SDE step from its noise row's ODE
    state; copies of a noise row (same_noise) are separate rows of the call with gradients, so each keeps its own
    gradient; the first step's gradient is native's (step credits)."""
    from tpflow.rollout import BranchEngine, RolloutInputs

    backbone, sampler = model
    layout = {"micro_batch_size": 2, "gradient_accumulation_steps": 2, "beta": 0.0, "clip_range": 1e-4}
    spec = (
        reweight_spec(layout) if mode == "reweight" else tpflow.build("optimizer", "grpo", recompute="retain").retain
    )
    z0 = backbone.initial_noise(3, torch.Generator().manual_seed(2))  # rows 0 and 2 are one prompt's two copies

    def run(retain):
        inputs = RolloutInputs(backbone, backbone.encode(PROMPTS), z0, backbone.sigmas(5), GUIDANCE_,
                               torch.tensor([0, 1, 0, 2]), torch.Generator().manual_seed(3), None)  # fmt: skip
        return BranchEngine(sampler, WINDOW, 0.8, None, False, retain).run(inputs)

    native_batch, batch = run(None), run(spec)
    for name in ("latents", "next_latents", "log_probs", "final", "completions"):
        torch.testing.assert_close(getattr(batch, name), getattr(native_batch, name), rtol=0, atol=1e-5)
    kept, _, _ = first_step_gradient(backbone, sampler, batch, ADVANTAGES, recompute=mode, **layout)
    native, _, _ = first_step_gradient(backbone, sampler, dataclasses.replace(batch, retained=None), ADVANTAGES,
                                       **layout)  # fmt: skip
    assert native.norm() > 0 and relative(kept, native) < 1e-5, relative(kept, native)


def _per_row_of(backbone, guidance: float = 2.0):
    """One recorded velocity call of ``backbone`` over the test's prompts and per-row losses of it ([n])."""
    from tpflow.rollout.parts import Branch, Velocity

    n = len(PROMPTS)
    z = backbone.initial_noise(n, torch.Generator().manual_seed(2))
    engine = Velocity(backbone, backbone.encode(PROMPTS), backbone.sigmas(4), guidance, None)
    per_row = PerRowGradients.of(backbone)
    engine.on_chunk = per_row.chunk
    with per_row.recording(n):
        v = engine([Branch(z, torch.arange(n))], 1)[0]
    weights = torch.randn(v.shape, generator=torch.Generator().manual_seed(3))
    return per_row, (v.float() * weights).flatten(1).sum(1)  # [n]


def test_reweight_is_refused_where_the_layers_batch_is_not_the_rows():
    """Before anything loads: a backbone that folds frames into its layers' batch (shapes-video-dit runs its blocks
    on [N·F, T, width]: the rule would credit frames to other trajectories, cosine 0.002 to native measured), and
    compiled blocks (autograd gives the hooked outputs no gradient: the step would be zero)."""
    with pytest.raises(RecipeError, match="folds more than the trajectories"):
        load_recipe("recipes/shapes_video_flowgrpo.toml", ['optimizer.recompute="reweight"'])
    with pytest.raises(RecipeError, match="compile_blocks"):
        overrides = ['optimizer.recompute="reweight"', "optimizer.beta=0", "backbone.compile_blocks=true"]
        load_recipe("recipes/shapes_flowgrpo.toml", overrides)
    assert load_recipe("recipes/shapes_video_flowgrpo.toml", ['optimizer.recompute="retain"']) is not None


def test_the_row_rule_is_checked_where_it_runs(monkeypatch):
    """The same assumptions checked at the first back-propagated step, for a backbone no recipe check knows: one
    row's loss alone must reach only the layer rows credited to it. shapes-video-dit's folded frames are caught
    there; shapes-dit's rows pass (and the check runs once per parameter set)."""
    from tpflow.errors import UserError
    from tpflow.rollout import per_row_grads

    monkeypatch.setattr(per_row_grads, "_CHECKED", {})
    torch.manual_seed(0)
    video = tpflow.build("backbone", "shapes-video-dit", lora_init="gaussian")
    per_row, losses = _per_row_of(video)
    with pytest.raises(UserError, match="reached rows credited to another"):
        per_row.gradients(losses, len(PROMPTS))
    image = tpflow.build("backbone", "shapes-dit", lora_init="gaussian")
    per_row, losses = _per_row_of(image)
    assert all(g is not None for g in per_row.gradients(losses, len(PROMPTS)))
    assert per_row_grads._checked(per_row.params[0])


def test_compiled_blocks_are_refused_at_the_first_step(tiny_weights, monkeypatch):
    """Inside blocks compiled through AOTAutograd the forward hooks fire, but autograd returns no gradient for the
    tensors they recorded: every per-row gradient would be missing and the step zero, so the run stops instead."""
    from tpflow.errors import UserError
    from tpflow.rollout import per_row_grads

    monkeypatch.setattr(per_row_grads, "_CHECKED", {})
    torch._dynamo.reset()
    backbone = tpflow.build("backbone", "shapes-dit", weights=str(tiny_weights), lora_init="gaussian")
    for block in backbone.model.blocks:
        block.compile(backend="aot_eager")  # what compile_blocks does, without inductor's minutes of codegen
    per_row, losses = _per_row_of(backbone)
    with pytest.raises(UserError, match="autograd returned no gradient"):
        per_row.gradients(losses, len(PROMPTS))
