"""Rollout plans (tpflow.plans) against the rival methods' public code (docs/algorithm.md §10.1, §10.4, §10.5).

The rollout structure is checked in float64 against a sequential re-implementation written out here (which steps
are SDE, where ξ comes from), and bitwise against the one-window engine; the schedules and subsets against the
reference's rules, over 100 iterations where the rule moves with training.
"""

from __future__ import annotations

import math
import random

import pytest
import torch

import tpflow
from tpflow.devices import cpu_generator, randn
from tpflow.plans import BatchPlan
from tpflow.plans.schedule import WindowScheduleOptions, schedule_start
from tpflow.plans.trained_fraction import TrainedFractionOptions
from tpflow.rollout import (
    BranchEngine,
    RolloutInputs,
    RowWindowsEngine,
    Window,
    baseline_generator,
    draw_window,
    engine_for,
    rollout,
    rollout_from_settings,
)
from tpflow.settings import RolloutSettings
from tpflow.types import Conditioning


class LinearFlow:
    """A float64 toy backbone: v = a·z + b·σ (per row), enough to tell an SDE step from an ODE step."""

    def __init__(self, dim: int = 6):
        g = cpu_generator(7)
        self.a = torch.randn(dim, dim, generator=g, dtype=torch.float64) * 0.3
        self.b = torch.randn(dim, generator=g, dtype=torch.float64)
        self.dim = dim

    def velocity(self, z, sigma, cond, guidance):
        return z @ self.a.T + sigma.to(z.dtype)[:, None] * self.b

    def initial_noise(self, n, generator=None):
        return randn((n, self.dim), generator, "cpu").double()

    def sigmas(self, num_steps):
        return torch.linspace(1, 0, num_steps + 1, dtype=torch.float64)


def flow_sde_formula(z, v, s, s_next, alpha, xi):
    """Flow-GRPO's flow-sde step (docs/algorithm.md §1.4): σ^sde = α·sqrt(σ/(1−σ)) (σ = 1: sqrt(1/(1−σ_1))), μ and
    std = σ^sde·sqrt(Δσ)."""
    h = s - s_next
    sde = alpha * math.sqrt(s / (1 - (s_next if s == 1 else s)))
    mean = z * (1 - sde**2 * h / (2 * s)) - v * (1 + sde**2 * (1 - s) / (2 * s)) * h
    return mean + sde * math.sqrt(h) * xi


def test_per_row_windows_match_the_sequential_formula_in_float64():
    """Flow-GRPO-Fast's layout: each trajectory SDE on its own window, Euler ODE elsewhere, ξ_k the engine's k-th
    draw after the baseline seed's (docs/algorithm.md §1.6), every row's stored steps its own."""
    backbone, sampler = LinearFlow(), tpflow.build("sampler", "flow-sde")
    n, num_steps, width, alpha = 4, 6, 2, 0.7
    starts = (1, 3, 0, 3)
    sigmas = backbone.sigmas(num_steps)
    z0 = backbone.initial_noise(n, cpu_generator(0))
    cond = Conditioning({"row": torch.arange(n)})
    inputs = RolloutInputs(backbone, cond, z0, sigmas, 1.0, generator=cpu_generator(5))
    out = RowWindowsEngine(sampler, starts, width, alpha).run(inputs)
    gen = cpu_generator(5)
    baseline_generator(gen)  # the engine's first draw
    xis = [randn((n, backbone.dim), gen, "cpu").double() for _ in range(num_steps)]
    for row, a in enumerate(starts):
        z = z0[row : row + 1]
        seen = []
        for k in range(num_steps):
            v = backbone.velocity(z, sigmas[k : k + 1], cond, 1.0)
            s, s_next = float(sigmas[k]), float(sigmas[k + 1])
            if a <= k < a + width:
                nxt = flow_sde_formula(z, v, s, s_next, alpha, xis[k][row : row + 1])
                seen.append((z, nxt))
            else:
                nxt = z - (s - s_next) * v
            z = nxt
        torch.testing.assert_close(out.final[row], z[0], atol=1e-5, rtol=1e-5)
        for i, (before, after) in enumerate(seen):
            torch.testing.assert_close(out.latents[row, i], before[0], atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(out.next_latents[row, i], after[0], atol=1e-5, rtol=1e-5)
        assert torch.equal(out.sigmas[row], sigmas[a : a + width + 1].float())
    assert out.cost.nfe == num_steps  # K per image: no completions


def test_per_row_windows_equal_one_window_rollouts_bitwise(tiny_weights):
    """On the shapes model, a row of a per-row-window rollout is bit for bit that row of a one-window rollout with
    its start: the same velocity calls (all N rows each), the same ξ."""
    backbone = tpflow.build("backbone", "shapes-dit", weights=str(tiny_weights))
    sampler = tpflow.build("sampler", "cps")
    prompts = ["a photo of a red circle", "a photo of two squares"] * 2
    cond, sigmas = backbone.encode(prompts), backbone.sigmas(5)
    z0 = backbone.initial_noise(4, cpu_generator(0))
    starts = (2, 0, 1, 2)
    mixed = RowWindowsEngine(sampler, starts, 2, 0.7).run(RolloutInputs(backbone, cond, z0, sigmas, 2.0,
                                                                        generator=cpu_generator(3)))  # fmt: skip
    for a in set(starts):
        one = rollout(backbone, sampler, cond, z0, sigmas, Window(a, 2), 0.7, 2.0, None, generator=cpu_generator(3))
        for row in (r for r, s in enumerate(starts) if s == a):
            for name in ("latents", "next_latents", "log_probs", "sigmas", "final"):
                assert torch.equal(getattr(mixed, name)[row], getattr(one, name)[row]), (name, row)


def test_per_row_windows_refuse_completions_and_bad_starts():
    """Per-row windows have no completions to ask for (the engine takes none; a plan that asks is refused where the
    engine is chosen), and starts that are not one per row or whose windows overrun K are refused."""
    backbone, sampler = LinearFlow(), tpflow.build("sampler", "flow-sde")
    z0, cond = backbone.initial_noise(2, cpu_generator(0)), Conditioning({"row": torch.arange(2)})
    inputs = RolloutInputs(backbone, cond, z0, backbone.sigmas(4), 1.0)
    settings = RolloutSettings(num_steps=4, window_size=2, window_range=(0, 4))
    with pytest.raises(ValueError, match="completions need one window"):
        engine_for(backbone, sampler, BatchPlan((0, 1), 2), settings, "ode")
    with pytest.raises(ValueError, match="N = 2 window starts"):
        RowWindowsEngine(sampler, (0, 1, 2), 2, 0.7).run(inputs)
    with pytest.raises(ValueError, match="fit in 4"):
        RowWindowsEngine(sampler, (0, 3), 2, 0.7).run(inputs)


def test_the_window_plan_draws_what_tpflow_always_drew():
    """Recipes without a [plan] section keep their windows: the start of draw_window with the batch seed."""
    plan = tpflow.build("plan", "window")
    settings = RolloutSettings(num_steps=10, window_size=3, window_range=(0, 8))
    for seed in range(50):
        expected = draw_window(10, 3, (0, 8), random.Random(seed)).start
        got = plan.plan(settings, 5, epoch=seed % 3, batch_seed=seed, run_seed=1)
        assert got.starts == (expected,) * 5 and got.size == 3 and got.trained is None


def test_window_per_image_draws_a_start_per_row_from_the_range():
    """Flow-GRPO-Fast's current code (docs/algorithm.md §10.1, `window-per-image`): a = randint(lo, hi − w) per
    image, both ends included."""
    plan = tpflow.build("plan", "window-per-image")
    settings = RolloutSettings(num_steps=10, window_size=3, window_range=(0, 5))
    starts = [a for seed in range(40) for a in plan.plan(settings, 6, 0, seed, 0).starts]
    assert set(starts) == {0, 1, 2}  # lo .. hi − w = 0 .. 2, every one reached
    assert plan.plan(settings, 6, 0, 11, 0) == plan.plan(settings, 6, 3, 11, 99)  # the batch seed's, nothing else
    assert not all(plan.plan(settings, 6, 0, seed, 0).uniform for seed in range(5))


def test_window_schedule_follows_mixgrpo_over_100_iterations():
    """MixGRPO's GRPOTrainingStates (docs/algorithm.md §10.1, `window-schedule`): l moves by the stride every
    iters_per_group iterations and rolls back to the first start past the last (or stays there without roll_back);
    random: seeded per epoch."""
    progressive = WindowScheduleOptions(strategy="progressive", iters_per_group=5, stride=2, roll_back=True)
    assert [schedule_start(progressive, 0, 7, e, 0) for e in range(100)] == [2 * ((e // 5) % 4) for e in range(100)]
    clipped = progressive.model_copy(update={"roll_back": False})
    assert [schedule_start(clipped, 0, 7, e, 0) for e in range(100)] == [min(2 * (e // 5), 7) for e in range(100)]
    script = WindowScheduleOptions()  # the script's 25 iterations per group, stride 1: l = 0..11 over 300 steps
    assert [schedule_start(script, 0, 19, e, 0) for e in range(300)] == [e // 25 for e in range(300)]
    rand = WindowScheduleOptions(strategy="random")
    draws = [schedule_start(rand, 1, 6, e, 42) for e in range(100)]
    assert set(draws) == set(range(1, 7)) and draws == [schedule_start(rand, 1, 6, e, 42) for e in range(100)]
    assert draws != [schedule_start(rand, 1, 6, e, 43) for e in range(100)]
    plan = tpflow.build("plan", "window-schedule", iters_per_group=5, stride=2)
    settings = RolloutSettings(num_steps=10, window_size=3, window_range=(0, 10))
    assert [plan.plan(settings, 2, e, e * 7, 0).starts for e in (0, 5, 10, 15, 20)] == [
        (0, 0), (2, 2), (4, 4), (6, 6), (0, 0)]  # fmt: skip


def test_a_truncated_window_schedule_follows_mixgrpos_code_over_100_iterations():
    """MixGRPO's code (docs/algorithm.md §10.1, `window-schedule`): l grows by the stride every iters_per_group
    iterations, rolls back to 0 past max_timesteps, and the SDE window is [l, min(l + w, max_timesteps)): cut short
    near the end, not moved back."""
    plan = tpflow.build("plan", "window-schedule", iters_per_group=3, stride=1, truncate=True)
    settings = RolloutSettings(num_steps=10, window_size=4, window_range=(0, 8))  # max_timesteps = K − 2 = 8
    start, want = 0, []
    for e in range(100):  # GRPOTrainingStates: get the window, then update_iteration()
        want.append((start, min(start + 4, 8) - start))
        if (e + 1) % 3 == 0:
            start += 1
            if start > 7:  # an empty window [8, 8) is not a start here (docs/algorithm.md §10.1)
                start = 0
    got = [plan.plan(settings, 2, e, e, 0) for e in range(100)]
    assert [(p.starts[0], p.size) for p in got] == want and {p.size for p in got} == {1, 2, 3, 4}
    untruncated = tpflow.build("plan", "window-schedule", iters_per_group=3, stride=1)
    assert {untruncated.plan(settings, 2, e, e, 0).size for e in range(100)} == {4}


@pytest.mark.parametrize("steps,fraction,count", [(16, 0.6, 9), (10, 0.6, 5), (12, 1.0, 11)])
def test_trained_fraction_draws_dancegrpo_subsets(steps, fraction, count):
    """DanceGRPO (docs/algorithm.md §10.1, `trained-fraction`): the last step dropped, int((K − 1)·f) of the others
    trained per trajectory, a uniform subset that differs between trajectories (FLUX K = 16, f = 0.6: 9 steps)."""
    plan = tpflow.build("plan", "trained-fraction", fraction=fraction)
    settings = RolloutSettings(num_steps=steps, window_size=steps, window_range=(0, steps))
    got = plan.plan(settings, 64, 0, 3, 0)
    assert got.starts == (0,) * 64 and got.trained.shape == (64, steps)
    assert (got.trained.sum(dim=1) == count).all() and not got.trained[:, -1].any()
    if count < steps - 1:
        assert len({tuple(r.tolist()) for r in got.trained}) > 1
        frequency = got.trained[:, :-1].float().mean(dim=0)  # uniform: every eligible step near count / (K − 1)
        assert (frequency - count / (steps - 1)).abs().max() < 0.25
    assert torch.equal(plan.plan(settings, 64, 5, 3, 9).trained, got.trained)  # the batch seed's alone


def test_a_plans_trained_steps_reach_the_rollout(tiny_weights):
    backbone = tpflow.build("backbone", "shapes-dit", weights=str(tiny_weights))
    sampler = tpflow.build("sampler", "dance-sde")
    settings = RolloutSettings(num_steps=4, window_size=4, window_range=(0, 4), noise_level=0.3, same_noise=True)
    batch_plan = tpflow.build("plan", "trained-fraction").plan(settings, 4, 0, 1, 0)
    prompts = ["a photo of a red circle"] * 2 + ["a photo of two squares"] * 2
    out = rollout_from_settings(backbone, sampler, backbone.encode(prompts), [0, 0, 1, 1], batch_plan, settings,
                                None, cpu_generator(1))  # fmt: skip
    assert torch.equal(out.trained.cpu(), batch_plan.trained)
    assert torch.equal(out.latents[0, 0], out.latents[1, 0])  # DanceGRPO's shared z_0 per group
    assert not torch.equal(out.final[0], out.final[1])  # the SDE noise alone tells them apart


def test_batch_plan_checks_its_shape():
    with pytest.raises(ValueError, match=r"\[N, W\] = \[2, 3\]"):
        BatchPlan((0, 0), 3, torch.ones(2, 2, dtype=torch.bool))
    assert TrainedFractionOptions().fraction == 0.6


def test_train_names_no_method():
    """Every method is components a recipe selects: train/ holds no component's name as a string, nor a method's."""
    import re
    from pathlib import Path

    from tpflow import registry

    train = Path(tpflow.__file__).parent / "train"
    source = "\n".join(path.read_text() for path in sorted(train.glob("*.py")))
    for kind in ("sampler", "plan", "credit", "optimizer"):
        for name in registry.names(kind):
            assert not re.search(rf"[\"']{re.escape(name)}[\"']", source), (kind, name)
    for method in ("tempflow", "dancegrpo", "dance-sde", "mixgrpo", "grpo-guard", "grpo_guard", "ratio_norm", "fast"):
        assert method not in source.lower(), method


METHOD_RECIPES = [
    "shapes_dancegrpo.toml",
    "shapes_flowgrpo_fast.toml",
    "shapes_mixgrpo.toml",
    "shapes_grpo_guard.toml",
]


def _method_run(recipe: str, tmp_path, tiny_weights, epochs: int, extra=(), resume=False):
    from pathlib import Path

    from tpflow.recipe import load_recipe
    from tpflow.train.trainer import Trainer

    path = Path(__file__).resolve().parents[1] / "recipes" / recipe
    overrides = [
        f"backbone.weights={tiny_weights}", "backbone.lora_init=gaussian", "reward.name=brightness",
        "dataset.test_size=4", "train.prompts_per_epoch=1", "train.group_size=4", "train.rollout_batch=4",
        f"train.epochs={epochs}", "train.save_every=1", f"train.run_dir={tmp_path / 'run'}", "eval.every=100",
        "eval.num_prompts=4", "eval.batch_size=4", "optimizer.micro_batch_size=4", *extra,
    ]  # fmt: skip
    return Trainer(load_recipe(path, overrides), resume=resume)


@pytest.mark.parametrize("recipe", METHOD_RECIPES)
def test_each_methods_shapes_recipe_trains(recipe, tmp_path, tiny_weights, plugin):
    """Each rival's shapes recipe (its plan, sampler and loss options) runs the trainer and moves the adapter."""
    trainer = _method_run(recipe, tmp_path, tiny_weights, epochs=1)
    before = {n: p.detach().clone() for n, p in trainer.backbone.model.named_parameters() if "lora_" in n}
    metrics = trainer.fit()
    after = dict(trainer.backbone.model.named_parameters())
    assert metrics["optimizer_steps"] >= 1 and metrics["first_ratio_max_deviation"] == 0.0, metrics
    assert any(not torch.equal(before[n], after[n]) for n in before), recipe
    assert all(math.isfinite(v) for v in metrics.values() if isinstance(v, float)), metrics


@pytest.mark.parametrize("recipe", ["shapes_mixgrpo.toml", "shapes_mixgrpo_flash.toml"])
def test_a_truncated_window_trains_fewer_steps_that_epoch(recipe, tmp_path, tiny_weights, plugin):
    """With truncate the window of epoch 1 starts at 6 and is cut at hi = 8: two SDE steps, scored and trained as
    two (traces [n, 3]), after an epoch of four; MixGRPO-Flash's solver then starts after step 7."""
    from tpflow.train.run_logger import read_jsonl

    cut = ["plan.iters_per_group=1", "plan.stride=6", "plan.truncate=true"]
    trainer = _method_run(recipe, tmp_path, tiny_weights, 2, cut)
    before = {n: p.detach().clone() for n, p in trainer.backbone.model.named_parameters() if "lora_" in n}
    metrics = trainer.fit()
    widths = {(r["epoch"], len(r["step_rewards"])) for r in read_jsonl(trainer.run_dir / "traces.jsonl")}
    assert widths == {(0, 4), (1, 2)}, widths
    after = dict(trainer.backbone.model.named_parameters())
    assert any(not torch.equal(before[n], after[n]) for n in before)
    assert metrics["first_ratio_max_deviation"] == 0.0 and all(
        math.isfinite(v) for v in metrics.values() if isinstance(v, float)
    ), metrics


def test_a_window_schedule_resumes_exactly(tmp_path, tiny_weights, plugin):
    """MixGRPO's moving window is part of the run's state: 2 epochs straight equal 1 + a resumed 1, bitwise, with
    the window moving between them."""
    moving = ["plan.iters_per_group=1"]
    (tmp_path / "a").mkdir(), (tmp_path / "b").mkdir()
    straight = _method_run("shapes_mixgrpo.toml", tmp_path / "a", tiny_weights, 2, moving)
    straight.fit()
    first = _method_run("shapes_mixgrpo.toml", tmp_path / "b", tiny_weights, 1, moving)
    first.fit()
    second = _method_run("shapes_mixgrpo.toml", tmp_path / "b", tiny_weights, 2, moving, resume=True)
    assert second.epoch == 1
    second.fit()
    a = {n: p for n, p in straight.backbone.model.named_parameters() if "lora_" in n}
    b = dict(second.backbone.model.named_parameters())
    assert all(torch.equal(a[n], b[n]) for n in a)


def test_branching_matches_tempflows_rollout_in_float64():
    """TempFlow-GRPO's rollout (docs/algorithm.md §10.4): each noise row's path is pure ODE; at every window step
    each of its C copies takes one flow-sde step from that ODE state with its own ξ_k, and the child is
    ODE-completed; the stored transition is (ODE state -> child), the final latent the ODE image; NFE K·P + Σ
    children's steps."""
    backbone, sampler = LinearFlow(), tpflow.build("sampler", "flow-sde")
    p, c, num_steps, width, alpha = 2, 3, 5, 4, 0.7
    n = p * c
    sigmas = backbone.sigmas(num_steps)
    z0 = backbone.initial_noise(p, cpu_generator(0))
    source = torch.arange(p).repeat_interleave(c)  # rows 0..2 share z0[0], rows 3..5 z0[1]
    cond = Conditioning({"row": torch.arange(n)})
    inputs = RolloutInputs(backbone, cond, z0, sigmas, 1.0, source=source, generator=cpu_generator(5))
    out = BranchEngine(sampler, Window(0, width), alpha).run(inputs)
    gen = cpu_generator(5)
    baseline_generator(gen)
    xis = [randn((n, backbone.dim), gen, "cpu").double() for _ in range(num_steps)]

    def ode(z, start):
        for k in range(start, num_steps):
            z = z - (float(sigmas[k]) - float(sigmas[k + 1])) * backbone.velocity(z, sigmas[k : k + 1], cond, 1.0)
        return z

    for row in range(n):
        x = z0[source[row] : source[row] + 1]
        for k in range(num_steps):
            v = backbone.velocity(x, sigmas[k : k + 1], cond, 1.0)
            s, s_next = float(sigmas[k]), float(sigmas[k + 1])
            if k < width:
                child = flow_sde_formula(x, v, s, s_next, alpha, xis[k][row : row + 1])
                torch.testing.assert_close(out.latents[row, k], x[0], atol=1e-5, rtol=1e-5)
                torch.testing.assert_close(out.next_latents[row, k], child[0], atol=1e-5, rtol=1e-5)
                torch.testing.assert_close(out.completions[row, k], ode(child, k + 1)[0], atol=1e-5, rtol=1e-5)
            x = x - (s - s_next) * v
        torch.testing.assert_close(out.final[row], x[0], atol=1e-5, rtol=1e-5)
    children_steps = sum(num_steps - k - 1 for k in range(width))
    assert out.cost.nfe == round((p * num_steps + n * children_steps) / n, 2)
    assert torch.equal(out.latents[0], out.latents[1]) and not torch.equal(out.next_latents[0], out.next_latents[1])


def test_every_rollout_batch_of_an_epoch_branches_at_the_same_start():
    """Siblings are the copies of a prompt, spread over several rollout batches: the branch plan's start is one per
    epoch (from the run seed and the epoch), not one per batch. With one per batch, pickscore_tempflow's layout at
    window_size = 4, window_range = [0, 9] put children branched at different steps in all 48 of 48 groups."""
    plan = tpflow.build("plan", "branch")
    settings = RolloutSettings(num_steps=10, window_size=4, window_range=(0, 9), same_noise=True)
    per_epoch = []
    for epoch in range(12):
        starts = {plan.plan(settings, 6, epoch, batch_seed, run_seed=3).start for batch_seed in range(40)}
        assert len(starts) == 1, f"epoch {epoch}: batches branch at {sorted(starts)}"
        per_epoch.append(starts.pop())
    assert len(set(per_epoch)) > 1  # a wide window_range still varies the start between epochs
    assert all(0 <= s <= 5 for s in per_epoch)


def test_branch_credit_gives_tempflows_sibling_advantages():
    """TempFlow-GRPO (docs/algorithm.md §10.4): A^b_k = (R^b_k − mean_b R_k) / (std_b R_k + 1e-4) per step over the
    siblings (population std), with R^b_k the reward of child b's completion at step k: branch credit, then GRPO's
    group advantages."""
    rows = [[0.2, 0.5, 0.9, 0.7], [0.4, 0.1, 0.6, 0.7], [0.9, 0.3, 0.2, 0.7],
            [0.1, 0.2, 0.3, 0.1], [0.6, 0.2, 0.1, 0.1], [0.3, 0.8, 0.4, 0.1]]  # fmt: skip
    trace = torch.tensor(rows, dtype=torch.float64)
    credit = tpflow.build("credit", "branch")(trace)
    assert torch.equal(credit.step_rewards, trace[:, :3]) and not credit.turning_points.any()
    got = tpflow.build("optimizer", "grpo").advantages(credit.step_rewards, ["a"] * 3 + ["b"] * 3)
    for lo in (0, 3):
        r = trace[lo : lo + 3, :3]
        want = (r - r.mean(dim=0)) / (r.std(dim=0, unbiased=False) + 1e-4)
        torch.testing.assert_close(got[lo : lo + 3], want)


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # diffusers' own numpy 2 notice
def test_dpm_solver_steps_match_diffusers_scheduler():
    """MixGRPO-Flash's solver (docs/algorithm.md §10.5): DPM-Solver++(2M), midpoint, data prediction x̂_0 = z − σv,
    first order at the start and at σ = 0, step for step against diffusers' DPMSolverMultistepScheduler on flow
    sigmas."""
    from diffusers import DPMSolverMultistepScheduler

    from tpflow.samplers.dpm_solver import dpm_solver_2m_step

    scheduler = DPMSolverMultistepScheduler(use_flow_sigmas=True, flow_shift=3.0, prediction_type="flow_prediction",
                                            algorithm_type="dpmsolver++", solver_order=2, solver_type="midpoint",
                                            final_sigmas_type="zero")  # fmt: skip
    scheduler.set_timesteps(7)
    backbone = LinearFlow()
    z = ours = backbone.initial_noise(3, cpu_generator(2))
    sig = scheduler.sigmas.double().tolist()
    x0_prev = sigma_prev = None
    for j, t in enumerate(scheduler.timesteps):
        v = backbone.velocity(z, torch.full((3,), sig[j], dtype=torch.float64), None, 1.0)
        z = scheduler.step(v, t, z).prev_sample
        v_ours = backbone.velocity(ours, torch.full((3,), sig[j], dtype=torch.float64), None, 1.0)
        x0 = ours - sig[j] * v_ours
        ours = dpm_solver_2m_step(ours, x0, sig[j], sig[j + 1], x0_prev, sigma_prev)
        x0_prev, sigma_prev = x0, sig[j]
        torch.testing.assert_close(ours, z, rtol=1e-5, atol=1e-5)


def test_flash_tail_follows_mixgrpo_flash():
    """MixGRPO-Flash (docs/algorithm.md §10.5): after the window [0, 4) of K = 25 (e = 3), n = int((25 − 3)·0.4) = 8
    nodes linear in unshifted t from t_4 to 0, shifted (σ = 3t/(1 + 2t)); 7 DPM-Solver++(2M) steps, the first seeded
    with the last window step's x̂_0: 4 + 7 = 11 NFE."""
    from tpflow.samplers.dpm_solver import compressed_tail, dpm_solver_2m_step, post_window_nodes

    def shift(t):
        return 3 * t / (1 + 2 * t)

    nodes = post_window_nodes(25, 4, 0.4)
    assert nodes == 8
    fine = shift(torch.linspace(1, 0, 25 * 7 + 1, dtype=torch.float64))
    t = torch.linspace(1, 0, 26, dtype=torch.float64)
    want = shift(torch.linspace(float(t[4]), 0, 8, dtype=torch.float64))
    torch.testing.assert_close(torch.tensor(compressed_tail(fine, 25, 4, 8), dtype=torch.float64), want)

    class Shifted(LinearFlow):
        def sigmas(self, num_steps):
            return shift(torch.linspace(1, 0, num_steps + 1, dtype=torch.float64))

    backbone, sampler = Shifted(), tpflow.build("sampler", "flow-sde")
    plan = tpflow.build("plan", "window-schedule", after_window="dpm-solver++")
    settings = RolloutSettings(num_steps=25, window_size=4, window_range=(0, 23), guidance=1.0)
    batch_plan = plan.plan(settings, 2, 0, 1, 0)
    cond = Conditioning({"row": torch.arange(2)})
    out = rollout_from_settings(backbone, sampler, cond, [0, 1], batch_plan, settings, None, cpu_generator(4))
    assert out.cost.nfe == 11
    sigmas = backbone.sigmas(25)
    z, x0_prev = out.next_latents[:, -1], out.latents[:, -1] - float(sigmas[3]) * backbone.velocity(
        out.latents[:, -1], sigmas[3:4].expand(2), cond, 1.0)  # fmt: skip
    tail = [float(sigmas[4]), *want[1:].tolist()]
    sigma_prev = float(sigmas[3])
    for sigma, sigma_next in zip(tail, tail[1:], strict=False):
        x0 = z - sigma * backbone.velocity(z, torch.full((2,), sigma, dtype=torch.float64), cond, 1.0)
        z = dpm_solver_2m_step(z, x0, sigma, sigma_next, x0_prev, sigma_prev)
        x0_prev, sigma_prev = x0, sigma
    torch.testing.assert_close(out.final, z, rtol=1e-5, atol=1e-5)


SCHEDULES = [  # (strategy, stride, roll_back): every start, strided ones rolling back before the last, clipped
    ("progressive", 1, True), ("progressive", 2, True), ("progressive", 2, False), ("progressive", 4, True),
    ("random", 1, True),
]  # fmt: skip


def _schedule_cases(num_steps: int):
    """(options, rollout settings) over windows, ranges, truncate and schedules; random with truncate is refused by
    a check of its own (test below) and left out."""
    import itertools

    ranges = ((0, num_steps), (0, num_steps - 1), (1, num_steps), (2, num_steps))
    for width, (lo, hi), truncate, (strategy, stride, roll_back) in itertools.product(
        (1, 2, 3), ranges, (False, True), SCHEDULES
    ):
        if lo > hi - width or (strategy == "random" and truncate):
            continue
        options = WindowScheduleOptions(strategy=strategy, iters_per_group=1, stride=stride, roll_back=roll_back,
                                        truncate=truncate, after_window="dpm-solver++")  # fmt: skip
        yield options, RolloutSettings(num_steps=num_steps, window_size=width, window_range=(lo, hi), guidance=1.0)


def test_a_flash_tail_is_refused_exactly_where_a_window_would_end_at_k():
    """DPM-Solver++ after the window runs from its end e to σ = 0 and needs a step there; a window ending at e = K
    used to leave it the nodes [0, 0], and the rollout of that epoch raised. check_recipe refuses a recipe exactly
    when some epoch's window ends at K (hi = K and l + W ≥ K for a start the schedule reaches), whatever the
    strategy, stride, roll-back or cut; the windows that end at K − 1 (one step left) roll out."""
    from types import SimpleNamespace

    from tpflow.plans.schedule import WindowSchedulePlan

    backbone, sampler, num_steps = LinearFlow(), tpflow.build("sampler", "flow-sde"), 6
    cond = Conditioning({"row": torch.arange(2)})
    outcomes: dict[tuple[int, int], bool] = {}  # (start, size) -> the rollout ran

    def rolls_out(start: int, size: int, settings: RolloutSettings, plan) -> bool:
        if (start, size) not in outcomes:
            try:
                rollout_from_settings(backbone, sampler, cond, [0, 1], plan, settings, None, cpu_generator(4))
                outcomes[start, size] = True
            except ValueError as exc:
                assert "tail_sigmas must run strictly down" in str(exc)
                outcomes[start, size] = False
        return outcomes[start, size]

    refused = accepted_at_k = 0
    for options, settings in _schedule_cases(num_steps):
        plan = tpflow.build("plan", "window-schedule", **options.model_dump())
        epochs = [plan.plan(settings, 2, e, e, 0) for e in range(60 if options.strategy == "random" else 3 * 6)]
        fails = not all(rolls_out(p.starts[0], p.size, settings, p) for p in epochs)
        sections = {"credit": SimpleNamespace(name="outcome"), "rollout": settings}
        problems = WindowSchedulePlan.check_recipe(options, sections)
        assert bool(problems) == fails, (options, settings.window_size, settings.window_range, problems)
        refused += fails
        accepted_at_k += not fails and settings.window_range[1] == num_steps
    assert refused and accepted_at_k  # both sides of the condition are exercised (strides that never reach K)
    assert outcomes[num_steps - 2, 1] and not outcomes[num_steps - 1, 1]  # e = K − 1 rolls out; e = K does not


def test_reachable_starts_are_the_starts_the_schedule_gives():
    """What check_recipe reasons about is what the plan draws: every start schedule_start gives, and no other."""
    from tpflow.plans.schedule import reachable_starts

    for strategy, stride, roll_back in SCHEDULES:
        options = WindowScheduleOptions(strategy=strategy, iters_per_group=2, stride=stride, roll_back=roll_back)
        for first, last in ((0, 0), (0, 5), (1, 6), (2, 9)):
            drawn = {schedule_start(options, first, last, e, 3) for e in range(300)}
            assert drawn == set(reachable_starts(options, first, last)), (options, first, last)


def _validate(recipe: str, *overrides: str):
    """``tpflow validate`` of a shipped recipe in this process: (exit status, the error's non-empty lines)."""
    from pathlib import Path

    from tests.cli_run import tpflow as cli

    path = Path(__file__).resolve().parents[1] / "recipes" / recipe
    done = cli("validate", str(path), *(a for o in overrides for a in ("--set", o)), "--no-machine")
    assert "Traceback" not in done.stderr + done.stdout, done.stderr
    return done.returncode, [line for line in done.stderr.splitlines() if line.strip()]


def test_validate_refuses_a_flash_window_schedule_that_reaches_k():
    """A recipe with K = 10, W = 4, window_range = [0, 10] and a move every epoch used to crash at epoch 6: it is
    refused before anything loads, in one paragraph naming the starts and the fix, which validates."""
    reach = ["rollout.window_range=[0, 10]", "plan.iters_per_group=1"]
    code, lines = _validate("shapes_mixgrpo_flash.toml", *reach)  # truncate: starts 6..9 all end at K
    assert code == 2 and len(lines) == 1, lines
    for text in ("after_window = 'dpm-solver++'", "starts 6..9", "K = 10", "window_range = [0, 9]", "'euler'"):
        assert text in lines[0], (text, lines[0])
    code, lines = _validate("shapes_mixgrpo_flash.toml", *reach, "plan.truncate=false")  # full windows: start 6
    assert code == 2 and len(lines) == 1 and "start 6 ends its window at step K = 10" in lines[0], lines
    assert _validate("shapes_mixgrpo_flash.toml", "rollout.window_range=[0, 9]", "plan.iters_per_group=1")[0] == 0
    assert _validate("shapes_mixgrpo_flash.toml", *reach, "plan.after_window=euler")[0] == 0


def test_a_random_window_schedule_draws_full_windows_and_refuses_truncate():
    """MixGRPO's random strategy (GRPOTrainingStates.update_iteration) draws l = rng.integers(0, max_timesteps −
    w + 1): a full window every time, the cut [l, min(l + w, max_timesteps)) reached by progressive starts only. A
    random schedule with truncate, which drew starts up to hi − 1 and cut their windows, is refused in one paragraph;
    without truncate it draws MixGRPO's starts 0..hi − W, all W steps."""
    plan = tpflow.build("plan", "window-schedule", strategy="random")
    settings = RolloutSettings(num_steps=10, window_size=4, window_range=(0, 8))  # max_timesteps = K − 2 = 8
    drawn = [plan.plan(settings, 2, e, e, 5) for e in range(200)]
    assert {p.starts[0] for p in drawn} == set(range(0, 8 - 4 + 1)) and {p.size for p in drawn} == {4}
    code, lines = _validate("shapes_mixgrpo.toml", "plan.strategy=random")  # the recipe sets truncate = true
    assert code == 2 and len(lines) == 1, lines
    for text in ("strategy = 'random'", "truncate = true", "full window", "truncate = false", "'progressive'"):
        assert text in lines[0], (text, lines[0])
    assert _validate("shapes_mixgrpo.toml", "plan.strategy=random", "plan.truncate=false")[0] == 0


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
@pytest.mark.parametrize("recipe", ["shapes_grpo_guard.toml", "shapes_tempflow.toml", "shapes_dancegrpo.toml"])
def test_method_recipes_train_under_the_recipes_precisions(recipe, precision, tmp_path, tiny_weights, plugin):
    """RatioNorm, branching and a trained subset under CPU bf16 autocast and fp16 with its scaler: on policy at the
    first step, every step taken, the adapter moved."""
    trainer = _method_run(recipe, tmp_path, tiny_weights, epochs=1, extra=[f"train.mixed_precision={precision}"])
    before = {n: p.detach().clone() for n, p in trainer.backbone.model.named_parameters() if "lora_" in n}
    metrics = trainer.fit()
    after = dict(trainer.backbone.model.named_parameters())
    assert metrics["first_ratio_max_deviation"] == 0.0 and metrics["skipped_steps"] == 0.0, metrics
    assert any(not torch.equal(before[n], after[n]) for n in before), (recipe, precision)


def test_inspecting_a_branching_run_recomputes_no_trajectory_credit(tmp_path, tiny_weights, plugin):
    """A TempFlow run's trace columns are sibling children's rewards: consistent or turning-point credit recomputed
    on them (what inspect-trajectory --run used to show beside the trained credit) reads a trajectory that is not
    there."""
    import json

    from tests.cli_run import tpflow

    metrics = _method_run("shapes_tempflow.toml", tmp_path, tiny_weights, epochs=1,
                          extra=["train.group_size=4", "optimizer.micro_batch_size=4"]).fit()  # fmt: skip
    assert "baseline_reward_mean" not in metrics  # column 0 is the first child's reward, not a pure-ODE baseline
    assert "turning_points_per_traj" not in metrics  # branch credit marks none: no "tp/traj 0.00" on the line
    out = tmp_path / "inspect"
    done = tpflow("inspect-trajectory", "--run", str(tmp_path / "run"), "--n", "4", "--out", str(out))
    assert done.returncode == 0, done.stderr
    assert "plan branches" in " ".join(done.stdout.split())
    assert list(json.loads((out / "trace.json").read_text())["credit"]) == ["branch (as trained)"]
    asked = tpflow("inspect-trajectory", "--run", str(tmp_path / "run"), "--n", "4", "--credit", "outcome",
                   "--out", str(tmp_path / "asked"))  # fmt: skip
    assert asked.returncode == 0, asked.stderr
    assert "outcome (recomputed)" in json.loads((tmp_path / "asked" / "trace.json").read_text())["credit"]
