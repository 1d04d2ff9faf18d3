"""The rollout engines' parts: the latents of one ODE branch, the noise stream, the batched velocity call.

Shared by every engine of ``tpflow.rollout``. docs/algorithm.md §1.6 and the package docstring of
``tpflow.rollout`` say what the noise stream guarantees.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
from torch import Tensor

from tpflow.devices import cpu_generator, randn, to_device
from tpflow.interfaces import Backbone
from tpflow.types import Conditioning


class Branch:
    """Latents of one group of rows that advance together by ODE: the prefix, the baseline or a completion.

    ``nodes`` are the grid indices the branch visits (None: every step); ``at`` is the one its latents are at, so the
    branch is evaluated at step k only when ``at == k`` and then jumps to its next node."""

    def __init__(self, z: Tensor, rows: Tensor, nodes: list[int] | None = None, at: int = 0):
        self.z = z  # [n, ...]
        self.rows = rows  # [n] long, the trajectory whose conditioning each row uses
        self.nodes = nodes
        self.at = at

    def live(self, k: int) -> bool:
        return self.nodes is None or self.at == k

    def target(self, k: int) -> int:
        """The grid index an Euler step taken at step k reaches."""
        return k + 1 if self.nodes is None else self.nodes[self.nodes.index(k) + 1]


def completion_nodes(start: int, num_steps: int, steps: int | None) -> list[int] | None:
    """Grid indices of a completion from step ``start`` to K = ``num_steps`` in ``steps`` Euler steps: ``steps + 1``
    indices spread evenly (rounded) from start to K, so the schedule's own spacing (its shift) is kept. None (every
    step, the exact completion) when ``steps`` is None or not smaller than the K − start steps left."""
    left = num_steps - start
    if steps is None or steps >= left:
        return None
    if steps < 1:
        raise ValueError(f"completion_steps must be >= 1, got {steps}.")
    return sorted({start + round(i * left / steps) for i in range(steps + 1)})


def baseline_generator(generator: torch.Generator | None) -> torch.Generator:
    """The independent baseline's CPU generator, seeded by one 63-bit draw from ``generator`` (the CPU's global RNG
    when None): a stream of its own, so its fresh noise is not the main trajectory's ξ nor z_0, and a rollout's first
    draw, made whatever ``baseline_noise`` is, keeps the ξ that follow the same in every arm."""
    device = generator.device if generator is not None else torch.device("cpu")
    seed = torch.randint(0, 2**63 - 1, (1,), generator=generator, device=device, dtype=torch.int64)
    return cpu_generator(int(seed))


class MainNoise:
    """The main trajectory's ξ: one [N, ...] standard-normal draw per generation step k = 0..K-1, taken in order
    from ``generator`` whether or not step k is in the window, so ξ_k is a function of the generator's state and k
    only. A window step's ξ is moved to ``device`` (``tpflow.devices.randn``); any other step's draw only advances
    the stream (on the generator's device, nothing moved, nothing kept)."""

    def __init__(self, generator: torch.Generator | None, shape: tuple[int, ...], device: torch.device):
        self.generator, self.shape, self.device = generator, shape, device
        self.source = generator.device if generator is not None else torch.device("cpu")
        self.k = 0  # the step whose ξ is drawn next

    def draw(self, k: int, keep: bool) -> Tensor | None:
        """ξ_k [N, ...] float32 on ``device`` when ``keep``, else None (the draw made and discarded)."""
        if k != self.k:
            raise RuntimeError(f"ξ of step {self.k} is due, not of step {k}: the draws must follow the steps.")
        self.k += 1
        xi = randn(self.shape, self.generator, self.device if keep else self.source)
        return xi if keep else None


class Velocity:
    """One velocity call for every live branch at step k (split by ``max_batch``), with the NFE and time count."""

    def __init__(self, backbone: Backbone, cond: Conditioning, sigmas: Tensor, guidance: float, max_batch):
        self.backbone, self.cond, self.sigmas, self.guidance, self.max_batch = (
            backbone,
            cond,
            sigmas,
            guidance,
            max_batch,
        )
        self.model_s = 0.0
        self.rows_evaluated = 0
        # told (first row, rows) before each chunk's call: per-row gradients fold a layer's batch onto its rows
        self.on_chunk: Callable[[int, int], None] | None = None

    def __call__(self, branches: list[Branch], k: int) -> list[Tensor]:
        return self.at(branches, self.sigmas[k])

    def at(self, branches: list[Branch], sigma: Tensor | float) -> list[Tensor]:
        """The velocities of ``branches`` at noise level σ (off the schedule's grid too)."""
        z = torch.cat([b.z for b in branches])
        rows = torch.cat([b.rows for b in branches])
        chunk = self.max_batch or z.shape[0]
        start = time.perf_counter()
        out = []
        for lo in range(0, z.shape[0], chunk):
            part = slice(lo, lo + chunk)
            if self.on_chunk is not None:
                self.on_chunk(lo, z[part].shape[0])
            level = sigma if isinstance(sigma, Tensor) else torch.tensor(sigma, device="cpu")  # off-grid: a float
            level = to_device(level.to(torch.float32), z.device).expand(z[part].shape[0])  # no wait (tpflow.devices)
            out.append(self.backbone.velocity(z[part], level, self.cond.index(rows[part]), self.guidance))
        self.model_s += time.perf_counter() - start
        self.rows_evaluated += z.shape[0]
        return list(torch.cat(out).split([b.z.shape[0] for b in branches]))
