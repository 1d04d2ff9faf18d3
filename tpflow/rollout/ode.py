"""Deterministic sampling, as evaluation draws its images (docs/algorithm.md §6.3): Euler steps, or DPM-Solver++(2M)
where the recipe's ``[eval] solver`` asks for it (DGPO's code evaluates with it)."""

from __future__ import annotations

import torch
from torch import Tensor

from tpflow.devices import to_device
from tpflow.interfaces import Backbone
from tpflow.plans.base import Solver
from tpflow.samplers.dpm_solver import data_prediction, dpm_solver_2m
from tpflow.samplers.euler import euler_step
from tpflow.settings import EvalSettings
from tpflow.types import Conditioning


@torch.no_grad()
def sample_ode(
    backbone: Backbone,
    cond: Conditioning,
    z0: Tensor,
    sigmas: Tensor,
    guidance: float,
    max_batch: int | None = None,
    solver: Solver | None = None,
) -> Tensor:
    """Deterministic sampling of z0 [N, ...] along ``sigmas`` [K + 1] in chunks of ``max_batch``: the final latents
    [N, ...]. Euler steps on ``sigmas``, or with a DPM-Solver++ ``solver`` its 2M steps on the solver's nodes (the
    schedule ``sigmas`` or diffusers' flow-sigmas grid of K steps), as the ``dpm-solver`` rollout plan samples: K
    velocity calls either way."""
    if solver is not None and solver.method != "dpm-solver++":
        raise ValueError(f"sample_ode solves the ODE deterministically: Euler or DPM-Solver++, not {solver.method!r}.")
    n = z0.shape[0]
    chunk = max_batch or n
    finals = []
    for lo in range(0, n, chunk):
        rows = torch.arange(lo, min(lo + chunk, n), device=z0.device)
        z, part = z0[rows], cond.index(rows)
        if solver is not None:
            finals.append(_dpm(backbone, part, z, sigmas, guidance, solver))
            continue
        for k in range(sigmas.shape[0] - 1):
            sigma = to_device(sigmas[k : k + 1].float(), z.device).expand(z.shape[0])  # filled there: no wait
            v = backbone.velocity(z, sigma, part, guidance)
            z = euler_step(z, v, sigmas[k], sigmas[k + 1])
        finals.append(z)
    return torch.cat(finals)


def eval_solver(settings: EvalSettings) -> Solver | None:
    """What ``sample_ode`` runs for an ``[eval]`` section: None for Euler steps, else DPM-Solver++ on its ``grid``
    (the section holds the names, the engine builds the solver)."""
    if settings.solver == "euler":
        return None
    return Solver("dpm-solver++", grid=settings.grid, flow_shift=settings.flow_shift)


def _dpm(backbone: Backbone, cond: Conditioning, z: Tensor, sigmas: Tensor, guidance: float, solver: Solver) -> Tensor:
    """DPM-Solver++(2M) of one chunk z [M, ...] on ``solver``'s nodes (``tpflow.rollout.solver.solver_nodes``)."""
    from tpflow.rollout.solver import solver_nodes

    def x0_of(x: Tensor, sigma: float) -> Tensor:
        level = to_device(torch.tensor(sigma, device="cpu").to(torch.float32), x.device).expand(x.shape[0])
        return data_prediction(x, backbone.velocity(x, level, cond, guidance), sigma)

    return dpm_solver_2m(x0_of, z, solver_nodes(solver, sigmas))
