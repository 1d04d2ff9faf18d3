"""MixGRPO-Flash's solver after the SDE window (``rollout(..., tail_sigmas=...)``, docs/algorithm.md §10.5):
DPM-Solver++(2M) over the post-window σ nodes, its history seeded with the last window step's x̂_0."""

from __future__ import annotations

from torch import Tensor

from tpflow.rollout_parts import Branch, Velocity
from tpflow.samplers.dpm_solver import dpm_solver_2m_step


def checked_tail(tail, sigmas: Tensor, end: int, completions, row_starts) -> list[float] | None:
    """The post-window σ nodes as floats, checked: from σ_end (the window's end) strictly down to 0."""
    if tail is None:
        return None
    nodes = [float(x) for x in tail]
    if completions is not None or row_starts is not None:
        raise ValueError("tail_sigmas (a solver after the window) need completions=None and one window.")
    if (
        len(nodes) < 2
        or nodes[0] != float(sigmas[end])
        or nodes[-1] != 0
        or any(a <= b for a, b in zip(nodes, nodes[1:], strict=False))
    ):
        raise ValueError(f"tail_sigmas must run strictly down from σ_{end} = {float(sigmas[end])} to 0; got {nodes}.")
    return nodes


def dpm_tail(engine: Velocity, main: Branch, last_x0: Tensor, last_sigma: float, nodes: list[float]) -> Tensor:
    """DPM-Solver++(2M) from nodes[0] (the window's end) to 0, one velocity call per node but the last; the first
    step is second order with the last window step's x̂_0 (at σ = ``last_sigma``) as its history."""
    z, x0_prev, sigma_prev = main.z, last_x0, last_sigma
    for sigma, sigma_next in zip(nodes, nodes[1:], strict=False):
        (v,) = engine.at([main], sigma)
        x0 = z.float() - sigma * v.float()
        z = dpm_solver_2m_step(z, x0, sigma, sigma_next, x0_prev, sigma_prev)
        main.z, x0_prev, sigma_prev = z, x0, sigma
    return z
