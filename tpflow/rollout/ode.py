"""Deterministic Euler sampling, as evaluation draws its images (docs/algorithm.md §6.3)."""

from __future__ import annotations

import torch
from torch import Tensor

from tpflow.devices import to_device
from tpflow.interfaces import Backbone
from tpflow.samplers.euler import euler_step
from tpflow.types import Conditioning


@torch.no_grad()
def sample_ode(
    backbone: Backbone,
    cond: Conditioning,
    z0: Tensor,
    sigmas: Tensor,
    guidance: float,
    max_batch: int | None = None,
) -> Tensor:
    """Deterministic Euler sampling of z0 [N, ...] along ``sigmas`` [K + 1] in chunks of ``max_batch``: the final
    latents [N, ...]."""
    n = z0.shape[0]
    chunk = max_batch or n
    finals = []
    for lo in range(0, n, chunk):
        rows = torch.arange(lo, min(lo + chunk, n), device=z0.device)
        z, part = z0[rows], cond.index(rows)
        for k in range(sigmas.shape[0] - 1):
            sigma = to_device(sigmas[k : k + 1].float(), z.device).expand(z.shape[0])  # filled there: no wait
            v = backbone.velocity(z, sigma, part, guidance)
            z = euler_step(z, v, sigmas[k], sigmas[k + 1])
        finals.append(z)
    return torch.cat(finals)
