"""The whole-trajectory solver plans (docs/algorithm.md §10.7, §10.8): ``dpm-solver`` against diffusers'
``DPMSolverMultistepScheduler`` and ``sa-solver`` against AWM's ``SASolver.sample`` (predictor and corrector of order
2, PEC, its grid edits), with diffusers' ``SASolverScheduler`` update functions for the arithmetic; in float64 on a
linear toy velocity field whose guidance is applied as CFG is."""

from __future__ import annotations

import pytest
import torch

import tpflow
from tpflow.devices import cpu_generator, randn
from tpflow.errors import RecipeError
from tpflow.plans.base import Solver
from tpflow.rollout import RolloutInputs, SolverEngine, baseline_generator, rollout_from_settings
from tpflow.rollout.solver import solver_nodes, step_taus
from tpflow.samplers.sa_solver import flow_lambda, sa_step
from tpflow.samplers.schedules import flow_sigmas, sd3_sigmas
from tpflow.settings import RolloutSettings
from tpflow.types import Conditioning

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")  # diffusers' own numpy 2 notice

DIM, N = 5, 3


class GuidedFlow:
    """A float64 toy backbone: v = z·Aᵀ + σ·(b_u + w·(b_c − b_u)), the CFG combination of two branches at scale w."""

    def __init__(self, schedule=None):
        g = cpu_generator(11)
        self.a = torch.randn(DIM, DIM, generator=g, dtype=torch.float64, device="cpu") * 0.3
        self.b_u, self.b_c = torch.randn(2, DIM, generator=g, dtype=torch.float64, device="cpu")
        self.schedule = schedule or (lambda k: sd3_sigmas(k, 3.0))

    def velocity(self, z, sigma, cond, guidance):
        b = self.b_u + guidance * (self.b_c - self.b_u)
        return z @ self.a.T + sigma.to(z.dtype)[:, None] * b

    def initial_noise(self, n, generator=None):
        return randn((n, DIM), generator, "cpu").double()

    def sigmas(self, num_steps):
        return self.schedule(num_steps)


def _v(model, z, sigma, guidance):
    return model.velocity(z, torch.full((z.shape[0],), sigma, dtype=torch.float32, device="cpu"), None, guidance)


def _run(model, plan_name, num_steps, noise_level, guidance, seed=3, **options):
    """The plan's rollout through ``rollout_from_settings``, as the trainer calls it for a final-sample optimizer."""
    settings = RolloutSettings(num_steps=num_steps, window_size=1, window_range=(0, 1), noise_level=noise_level,
                               guidance=guidance)  # fmt: skip
    plan = tpflow.build("plan", plan_name, **options).plan(settings, N, 0, 1, 0)
    cond = Conditioning({"row": torch.arange(N, device="cpu")})
    out = rollout_from_settings(model, tpflow.build("sampler", "cps"), cond, list(range(N)), plan, settings, None,
                                cpu_generator(seed), transitions=False)  # fmt: skip
    z0 = model.initial_noise(N, cpu_generator(seed))  # the generator's first draw is z_0
    return out, z0


def _dpm_scheduler(num_steps, nodes):
    """diffusers' DPM-Solver++(2M) as Sana's config sets it (DGPO's scheduler), on ``nodes`` in float64."""
    from diffusers import DPMSolverMultistepScheduler

    s = DPMSolverMultistepScheduler(use_flow_sigmas=True, flow_shift=3.0, prediction_type="flow_prediction",
                                    algorithm_type="dpmsolver++", solver_order=2, solver_type="midpoint",
                                    final_sigmas_type="zero")  # fmt: skip
    s.set_timesteps(num_steps)
    s.sigmas = torch.tensor(nodes, dtype=torch.float64, device="cpu")
    return s


def test_flow_sigmas_are_diffusers_and_not_the_schedule():
    """DGPO's grid: diffusers' use_flow_sigmas at shift 3, bit for bit (K = 10: 0.9997, 0.9639, …, 0.2498, 0); it is
    not SD3's own K-step grid, nor what window-schedule's DPM tail after a one-step window reads off it."""
    from tpflow.samplers.dpm_solver import compressed_tail, post_window_nodes

    assert torch.equal(flow_sigmas(10, 3.0), _sigmas_of(10))
    assert flow_sigmas(10)[[0, 1, 2, 9]].tolist() == pytest.approx([0.9997, 0.9639, 0.9227, 0.2498], abs=6e-5)
    sd3 = sd3_sigmas(10)
    assert not torch.allclose(flow_sigmas(10), sd3, atol=1e-3)
    tail = compressed_tail(sd3_sigmas(10 * 9), 10, 1, post_window_nodes(10, 1, 1.0))  # [0, 1) + the tail at ρ = 1
    assert abs(tail[-2] - float(sd3[-2])) > 0.2  # its nodes are not the schedule's: no existing plan is the solver


def _sigmas_of(num_steps):
    from diffusers import DPMSolverMultistepScheduler

    s = DPMSolverMultistepScheduler(use_flow_sigmas=True, flow_shift=3.0, prediction_type="flow_prediction")
    s.set_timesteps(num_steps)
    return s.sigmas


@pytest.mark.parametrize("grid", ["schedule", "flow-sigmas"])
def test_dpm_solver_plan_is_diffusers_dpm_solver_pp_2m_in_float64(grid):
    """Whole-trajectory DPM-Solver++(2M) with CFG (w = 4.5) against the scheduler on the same nodes: its ``step``
    (which rounds the latent to float32 inside) to 1e-6, and its own update functions with ``step``'s order rule
    (first order at the first and last step) in float64 to 1e-12. On SD3's grid σ_0 = 1 (λ = −∞): the first step is
    Euler and the second first order, as the scheduler's arithmetic gives. NFE = K."""
    num_steps, w = 10, 4.5
    model = GuidedFlow()
    out, z0 = _run(model, "dpm-solver", num_steps, 0.0, w, grid=grid)
    nodes = solver_nodes(Solver("dpm-solver++", grid), model.sigmas(num_steps))
    assert out.cost.nfe == num_steps and out.final.dtype == torch.float64
    assert out.latents.shape == (N, 0, DIM)  # final samples only
    rounded, exact = _dpm_scheduler(num_steps, nodes), _dpm_scheduler(num_steps, nodes)
    z = zx = z0
    exact._step_index = 0
    for k, t in enumerate(rounded.timesteps):
        z = rounded.step(_v(model, z, nodes[k], w), t, z).prev_sample
        x0 = exact.convert_model_output(_v(model, zx, nodes[k], w), sample=zx)
        exact.model_outputs = [exact.model_outputs[-1], x0]
        if k == 0 or k == num_steps - 1:
            zx = exact.dpm_solver_first_order_update(x0, sample=zx)
        else:
            zx = exact.multistep_dpm_solver_second_order_update(exact.model_outputs, sample=zx)
        exact._step_index += 1
    torch.testing.assert_close(out.final, z, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(out.final, zx, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("grid", ["schedule", "flow-sigmas"])
def test_the_evaluations_dpm_solver_samples_what_the_dpm_solver_plan_samples(grid):
    """``[eval] solver = "dpm-solver++"`` (``sample_ode`` with the settings' solver) gives the dpm-solver plan's final
    samples from the same z_0: exactly, and in chunks to float64 rounding; the default Euler steps do not."""
    from tpflow.rollout import eval_solver, sample_ode
    from tpflow.settings import EvalSettings

    num_steps, w = 10, 4.5
    model = GuidedFlow()
    out, z0 = _run(model, "dpm-solver", num_steps, 0.0, w, grid=grid)
    cond = Conditioning({"row": torch.arange(N, device="cpu")})
    settings = EvalSettings(solver="dpm-solver++", grid=grid)
    final = sample_ode(model, cond, z0, model.sigmas(num_steps), w, None, eval_solver(settings))
    assert torch.equal(final, out.final)
    chunked = sample_ode(model, cond, z0, model.sigmas(num_steps), w, 2, eval_solver(settings))
    torch.testing.assert_close(chunked, out.final, rtol=0, atol=1e-12)  # a 2-row matmul rounds apart from a 3-row one
    euler = sample_ode(model, cond, z0, model.sigmas(num_steps), w, None, eval_solver(EvalSettings()))
    assert (euler - out.final).abs().max() > 1e-4
    with pytest.raises(ValueError, match="read only by eval.solver"):
        EvalSettings(grid="flow-sigmas")


def test_awm_grid_edits_and_where_the_noise_is():
    """AWM's K = 14 grid (SD3, shift 3): σ_0 → 0.999, σ_13 → σ_12/2 = 0.1031; at noise_level 0.4, τ > 0 on the 8 steps
    whose destination lies in [0.3, 0.9] (0.8715 … 0.3574), 0 elsewhere."""
    nodes = solver_nodes(Solver("sa-solver", first_sigma=0.999, halve_last=True), sd3_sigmas(14))
    want = [0.999, 0.9731, 0.9430, 0.9094, 0.8715, 0.8283, 0.7787, 0.7213, 0.6539, 0.5738, 0.4769, 0.3574, 0.2062,
            0.1031, 0]  # fmt: skip
    assert nodes == pytest.approx(want, abs=6e-5)
    taus = step_taus(Solver("sa-solver"), nodes, 0.4)
    assert [nodes[k + 1] for k, t in enumerate(taus) if t > 0] == pytest.approx(want[4:12], abs=6e-5)
    assert set(taus) == {0.0, 0.4} and taus.count(0.4) == 8
    assert step_taus(Solver("dpm-solver++"), nodes, 0.4) == [0.0] * 14


def _sa_scheduler(nodes):
    from diffusers import SASolverScheduler

    s = SASolverScheduler(use_flow_sigmas=True, prediction_type="flow_prediction", algorithm_type="data_prediction",
                          predictor_order=2, corrector_order=2)  # fmt: skip
    s.set_timesteps(len(nodes) - 1)
    s.sigmas = torch.tensor(nodes, dtype=torch.float64, device="cpu")
    return s


def _diffusers_sa(s, k, z, before, newest, tau, xi, corrector, this=None):
    """diffusers' SA-Solver predictor (step k → k + 1 on ``before``, ``newest``) or corrector (``this`` at k + 1)."""
    tau = torch.tensor(tau, dtype=torch.float64, device="cpu")
    s.model_outputs = [before, newest]
    if not corrector:
        s._step_index = k
        order = 1 if before is None else 2
        return s.stochastic_adams_bashforth_update(newest, sample=z, noise=xi, order=order, tau=tau)
    s._step_index = k + 1
    return s.stochastic_adams_moulton_update(this, last_sample=z, last_noise=xi, this_sample=z, order=2, tau=tau)


@pytest.mark.parametrize("tau", [0.0, 0.4])
def test_sa_solver_steps_are_diffusers_sa_solver_updates(tau):
    """The predictor (orders 1 and 2, with the few-step term) and the corrector (order 2) of one step, against
    ``SASolverScheduler``'s update functions in float64 on flow sigmas (α = 1 − σ), the noise part included."""
    nodes = solver_nodes(Solver("sa-solver", first_sigma=0.999, halve_last=True), sd3_sigmas(14))
    g = cpu_generator(5)
    z, m0, m1, m2, xi = (torch.randn(N, DIM, generator=g, dtype=torch.float64, device="cpu") for _ in range(5))
    s = _sa_scheduler(nodes)
    lam = [flow_lambda(x) for x in nodes[:-1]]
    for k in (0, 4, 9, 12):
        if k == 0:
            ours = sa_step(z, [m1], nodes[0], nodes[1], lam[:1], tau, xi, corrector=False)
            theirs = _diffusers_sa(s, 0, z, None, m1, tau, xi, corrector=False)
        else:
            ours = sa_step(z, [m1, m0], nodes[k], nodes[k + 1], [lam[k], lam[k - 1]], tau, xi, corrector=False,
                           h_prev=lam[k] - lam[k - 1])  # fmt: skip
            theirs = _diffusers_sa(s, k, z, m0, m1, tau, xi, corrector=False)
        torch.testing.assert_close(ours, theirs, rtol=1e-12, atol=1e-12)
        ours = sa_step(z, [m2, m1], nodes[k], nodes[k + 1], [lam[k + 1], lam[k]], tau, xi, corrector=True)
        theirs = _diffusers_sa(s, k, z, m0, m1, tau, xi, corrector=True, this=m2)
        torch.testing.assert_close(ours, theirs, rtol=1e-12, atol=1e-12)


def _awm_sample(model, z, nodes, taus, xis, w, s):
    """AWM's ``SASolver.sample`` (predictor 2, corrector 2, PEC, first corrector skipped, last step x̂_0), written
    from its code's control flow, with diffusers' update functions for each step's arithmetic."""
    steps = len(nodes) - 1

    def x0(x, sigma):
        return x - sigma * _v(model, x, sigma, w)

    models, calls = [x0(z, nodes[0])], 1
    for d in range(1, steps + 1):  # d: the destination node of the step
        if d == steps:
            return models[-1], calls
        before = models[-2] if d > 1 else None
        x_p = _diffusers_sa(s, d - 1, z, before, models[-1], taus[d - 1], xis[d - 1], corrector=False)
        fresh, calls = x0(x_p, nodes[d]), calls + 1
        if d == 1:
            z = x_p
        else:
            z = _diffusers_sa(s, d - 1, z, before, models[-1], taus[d - 1], xis[d - 1], corrector=True, this=fresh)
        models = [models[-1], fresh]
    raise AssertionError


@pytest.mark.parametrize("noise_level", [0.0, 0.4])
def test_sa_solver_plan_is_awms_sampler_in_float64(noise_level):
    """The ``sa-solver`` plan's rollout (K = 14, SD3 grid with AWM's edits, CFG w = 4.5) against AWM's loop: at noise 0
    deterministic (another seed for ξ, same z_0: the same image); at 0.4 the engine's ξ_k (drawn on the CPU
    generator after z_0 and the baseline seed, one per step) enter exactly the steps with destination in [0.3, 0.9].
    NFE = K; the final latent is the last x̂_0."""
    num_steps, w = 14, 4.5
    model = GuidedFlow()
    out, z0 = _run(model, "sa-solver", num_steps, noise_level, w)
    nodes = solver_nodes(Solver("sa-solver", first_sigma=0.999, halve_last=True), model.sigmas(num_steps))
    taus = step_taus(Solver("sa-solver"), nodes, noise_level)
    g = cpu_generator(3)
    model.initial_noise(N, g)  # z_0
    baseline_generator(g)  # every engine's first draw
    xis = [randn((N, DIM), g, "cpu").double() for _ in range(num_steps)]
    want, calls = _awm_sample(model, z0, nodes, taus, xis, w, _sa_scheduler(nodes))
    assert out.cost.nfe == num_steps == calls
    torch.testing.assert_close(out.final, want, rtol=1e-12, atol=1e-12)
    other, _ = _run(model, "sa-solver", num_steps, noise_level, w, seed=3)
    assert torch.equal(other.final, out.final)  # one seed, one image
    if noise_level == 0:  # ξ unused: another generator state after z_0 gives the same image
        inputs = RolloutInputs(model, Conditioning({"row": torch.arange(N, device="cpu")}), z0,
                               model.sigmas(num_steps), w, generator=cpu_generator(99))  # fmt: skip
        again = SolverEngine(Solver("sa-solver", first_sigma=0.999, halve_last=True), 0.0).run(inputs)
        assert torch.equal(again.final, out.final)
    else:
        no_noise = _awm_sample(model, z0, nodes, [0.0] * num_steps, xis, w, _sa_scheduler(nodes))[0]
        assert not torch.allclose(out.final, no_noise)


def test_solver_plans_in_recipes_are_checked():
    """Both plans make final samples only (GRPO refused); dpm-solver refuses a noise_level it would not use; the
    shipped recipes that select them validate."""
    from pathlib import Path

    from tpflow.recipe import load_recipe, validate_recipe

    root = Path(__file__).resolve().parent.parent / "recipes"
    awm = load_recipe(root / "shapes_awm_sa.toml")
    assert awm.components["plan"].name == "sa-solver" and awm.rollout.noise_level == 0.4
    assert load_recipe(root / "shapes_dgpo_dpm.toml").components["plan"].name == "dpm-solver"
    data = {"backbone": {"name": "shapes-dit"}, "reward": {"name": "shapes-geneval"}, "dataset": {"name": "shapes"},
            "sampler": {"name": "cps"}, "credit": {"name": "outcome"}, "optimizer": {"name": "grpo"},
            "plan": {"name": "sa-solver"},
            "rollout": {"num_steps": 10, "window_size": 1, "window_range": [0, 1]}}  # fmt: skip
    with pytest.raises(RecipeError, match="trains stored SDE steps"):
        validate_recipe(data)
    data["optimizer"] = {"name": "awm"}
    data["plan"] = {"name": "dpm-solver"}
    data["rollout"]["noise_level"] = 0.4
    with pytest.raises(RecipeError, match="noise_level = 0"):
        validate_recipe(data)
    with pytest.raises(ValueError, match="noise_level must be 0"):
        SolverEngine(Solver("dpm-solver++"), 0.4)


def test_solver_rollouts_state_every_device():
    """Both plans' rollouts (SA-Solver with noise, so ξ is drawn and moved): no tensor made in tpflow without a
    device (tests/test_device_rules.py's watch)."""
    from tests.test_device_rules import FactoryWatch

    with FactoryWatch() as watch:
        _run(GuidedFlow(), "sa-solver", 6, 0.4, 4.5)
        _run(GuidedFlow(), "dpm-solver", 6, 0.0, 4.5, grid="flow-sigmas")
    assert not watch.calls, watch.calls
