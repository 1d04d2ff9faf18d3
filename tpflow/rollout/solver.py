"""Whole-trajectory solvers for optimizers that train on final samples (docs/algorithm.md §10.7, §10.8).

AWM's and DGPO's public code do not sample with the Euler ODE or an SDE window: AWM runs SA-Solver's stochastic
predictor–corrector over its whole grid, DGPO diffusers' DPM-Solver++(2M). Neither is a ``Sampler`` (a step that
carries no history), and neither stores transitions: :class:`SolverEngine` runs one of them from z_0 to the final
sample, with one velocity call per node at the rollout's guidance (CFG batched as the backbone does it), and returns
the final latents only, as :class:`~tpflow.rollout.window.FinalSamplesEngine` does.

* ``dpm-solver++``: diffusers' ``DPMSolverMultistepScheduler`` with ``algorithm_type="dpmsolver++"``,
  ``solver_order=2``, midpoint, ``final_sigmas_type="zero"``: the first step first order (on a grid that starts at
  σ = 1 it is the Euler step, λ = −∞ there, and the second step is first order as well), the last step returns x̂_0,
  every other step second order on the previous node's x̂_0 (``tpflow.samplers.dpm_solver``). NFE = K.
* ``sa-solver``: AWM's ``SASolver.sample`` with predictor order 2, corrector order 2, PEC (``tpflow.samplers.
  sa_solver``). x̂_0 at σ_0; then at each step from node k to k + 1 the predictor (order 1 at the first step, 2
  after), one velocity call at the predicted point and its x̂_0, and the corrector (order 2, the predictor's ξ; skipped
  at the first step) from the same z with that x̂_0. The last step, to σ = 0, makes no call and returns the x̂_0 of
  the predicted point at σ_{K−1}. NFE = K. τ = ``noise_level`` where the destination σ lies in ``noise_range``.

Noise: the rollout's first draw seeds the baseline generator as in every engine, then ξ_k of step k (node k to
k + 1) is drawn on the CPU generator for every k in order and moved to the latents' device only where τ_k > 0
(docs/algorithm.md §1.6).
"""

from __future__ import annotations

import torch
from torch import Tensor

from tpflow.plans.base import Solver, Window
from tpflow.rollout.inputs import RolloutInputs, begin
from tpflow.rollout.parts import Branch, Velocity
from tpflow.rollout.window import stored_rollout
from tpflow.samplers.dpm_solver import data_prediction, dpm_solver_2m
from tpflow.samplers.sa_solver import flow_lambda, sa_step
from tpflow.samplers.schedules import flow_sigmas
from tpflow.types import Rollout


def solver_nodes(solver: Solver, sigmas: Tensor) -> list[float]:
    """The K + 1 σ nodes a solver runs on: the backbone's schedule ``sigmas`` [K + 1] or the flow-sigmas grid, held in
    float32 as the code holds them, with AWM's edits (σ_{K−1} ← σ_{K−2}/2 first, then σ_0 ← ``first_sigma``)."""
    num_steps = sigmas.shape[0] - 1
    grid = sigmas.float() if solver.grid == "schedule" else flow_sigmas(num_steps, solver.flow_shift)
    grid = grid.to("cpu").clone()  # host: [K + 1] float32
    if solver.halve_last:
        if num_steps < 2:
            raise ValueError("halve_last needs K >= 2 steps: σ_{K−1} becomes half of σ_{K−2}.")
        grid[-2] = grid[-3] / 2
    if solver.first_sigma is not None:
        grid[0] = solver.first_sigma
    nodes = grid.double().tolist()
    if nodes[-1] != 0 or any(a <= b for a, b in zip(nodes, nodes[1:], strict=False)) or not nodes[0] <= 1:
        raise ValueError(f"A solver's σ nodes must fall strictly from σ_0 <= 1 to 0; got {nodes}.")
    return nodes


def step_taus(solver: Solver, nodes: list[float], noise_level: float) -> list[float]:
    """τ of each of the K steps: ``noise_level`` where the destination σ lies in ``noise_range`` (the bounds held in
    float32, as AWM's code compares its float32 nodes), else 0; always 0 for DPM-Solver++."""
    if solver.method == "dpm-solver++":
        return [0.0] * (len(nodes) - 1)
    lo, hi = (float(torch.tensor(b, dtype=torch.float32, device="cpu")) for b in solver.noise_range)
    return [noise_level if lo <= t <= hi else 0.0 for t in nodes[1:]]


class SolverEngine:
    """A whole trajectory by DPM-Solver++(2M) or SA-Solver (module docstring); the final latents only."""

    def __init__(self, solver: Solver, noise_level: float) -> None:
        if solver.method == "dpm-solver++" and noise_level != 0:
            raise ValueError(f"DPM-Solver++(2M) samples deterministically; noise_level must be 0, not {noise_level}.")
        self.solver, self.noise_level = solver, noise_level

    @torch.no_grad()
    def run(self, inputs: RolloutInputs) -> Rollout:
        nodes = solver_nodes(self.solver, inputs.sigmas)
        taus = step_taus(self.solver, nodes, self.noise_level)
        started = begin(inputs, Window(0, inputs.num_steps))
        z0 = inputs.z0
        main = Branch(z0[started.source], torch.arange(inputs.n, device=z0.device))
        if self.solver.method == "dpm-solver++":
            final = _dpm_solver(started.engine, main, nodes)
        else:
            final = _sa_solver(started.engine, main, nodes, taus, started.noise)
        return stored_rollout(started, self.noise_level, final)


def _x0(engine: Velocity, main: Branch, z: Tensor, sigma: float) -> Tensor:
    """x̂_0 = z − σ·v(z, σ) [N, ...], in float32 (float64 for float64 latents): one velocity call."""
    (v,) = engine.at([Branch(z, main.rows)], sigma)
    return data_prediction(z, v, sigma)


def _dpm_solver(engine: Velocity, main: Branch, nodes: list[float]) -> Tensor:
    """DPM-Solver++(2M) from nodes[0] to 0 (module docstring): one call per node but the last."""
    return dpm_solver_2m(lambda z, sigma: _x0(engine, main, z, sigma), main.z, nodes)


def _sa_solver(engine: Velocity, main: Branch, nodes: list[float], taus: list[float], noise) -> Tensor:
    """SA-Solver, predictor and corrector of order 2, PEC (module docstring): K calls, the last step returns x̂_0."""
    num_steps = len(nodes) - 1
    if num_steps < 2 or nodes[0] >= 1:
        raise ValueError(f"SA-Solver needs K >= 2 steps and σ_0 < 1 (AWM: 0.999); got nodes {nodes}.")
    lams = [flow_lambda(s) for s in nodes[:-1]]  # λ_0..λ_{K−1}; σ_K = 0 is never a node of a step
    z = main.z
    predictions = [_x0(engine, main, z, nodes[0])]  # newest last
    for k in range(num_steps):
        xi = noise.draw(k, keep=taus[k] > 0)  # [N, ...] on the latents' device where τ_k > 0, else None
        if k == num_steps - 1:  # to σ = 0: the prediction made at the last predicted point
            return predictions[-1].to(z.dtype)
        sigma, sigma_next, tau = nodes[k], nodes[k + 1], taus[k]
        if k == 0:  # order 1: the one prediction so far
            predicted = sa_step(z, predictions[-1:], sigma, sigma_next, lams[:1], tau, xi, corrector=False)
        else:
            predicted = sa_step(z, predictions[::-1][:2], sigma, sigma_next, [lams[k], lams[k - 1]], tau, xi,
                                corrector=False, h_prev=lams[k] - lams[k - 1])  # fmt: skip
        fresh = _x0(engine, main, predicted, sigma_next)  # the one call of the step, at the predicted point
        if k == 0:  # the first corrector is skipped
            z = predicted
        else:
            z = sa_step(z, [fresh, predictions[-1]], sigma, sigma_next, [lams[k + 1], lams[k]], tau, xi,
                        corrector=True)  # fmt: skip
        predictions = [predictions[-1], fresh]
    raise AssertionError("unreachable: the last step returns")
