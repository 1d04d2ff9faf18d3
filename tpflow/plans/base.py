"""What a rollout plan decides for one rollout batch, and the seeds its draws come from.

A plan answers, for the N trajectories of one rollout batch: where each one's SDE window of W steps starts (the
steps before and after it are Euler ODE, the window's steps are sampled by the recipe's sampler and stored), and
which of those W stored steps the update trains (all of them unless the plan says otherwise). Everything a plan
draws comes from the batch's own seed or from (run seed, epoch), never from a process's RNG, so every process and
every resumed run agrees (docs/architecture.md, "Randomness").
"""

from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

from tpflow.devices import cpu_generator
from tpflow.interfaces import capability


@dataclass(frozen=True)
class Window:
    """The SDE window: generation steps start .. start + size - 1 are stochastic and trained."""

    start: int
    size: int


def draw_window(num_steps: int, size: int, window_range: tuple[int, int], rng: random.Random) -> Window:
    """s uniform in lo..hi-size, both ends included (docs/algorithm.md §2), one draw per rollout batch."""
    lo, hi = window_range
    if not (0 <= lo <= hi - size and hi <= num_steps):
        raise ValueError(f"window_range {window_range} cannot hold {size} steps within {num_steps}.")
    return Window(rng.randint(lo, hi - size), size)


@dataclass(frozen=True)
class Solver:
    """A solver that samples the whole trajectory in place of the window and the Euler steps around it
    (``tpflow.plans.solver``, ``tpflow.rollout.solver``): final samples only, nothing stored.

    ``method``: DPM-Solver++(2M) (deterministic) or SA-Solver's predictor–corrector (τ = ``[rollout] noise_level``
    where the step's destination σ lies in ``noise_range``, else 0). ``grid``: the backbone's own K-step schedule or
    diffusers' flow sigmas at ``flow_shift``. ``first_sigma`` replaces σ_0 and ``halve_last`` sets σ_{K−1} to
    σ_{K−2}/2 (AWM's edits of the grid, where SA-Solver's last step returns the data prediction made at σ_{K−1})."""

    method: Literal["dpm-solver++", "sa-solver"]
    grid: Literal["schedule", "flow-sigmas"] = "schedule"
    flow_shift: float = 3.0
    first_sigma: float | None = None
    halve_last: bool = False
    noise_range: tuple[float, float] = (0.3, 0.9)


@dataclass(frozen=True)
class BatchPlan:
    """One rollout batch's plan: per-trajectory window starts, the window size and the trained steps."""

    starts: tuple[int, ...]  # N window starts s_n: trajectory n is SDE on steps s_n .. s_n + W - 1
    size: int  # W, the same for every trajectory (the stored transitions are [N, W, ...])
    trained: Tensor | None = None  # [N, W] bool on the host, the stored steps the update trains; None: all
    branch: bool = False  # branch at every window step from the ODE path instead of one SDE path (``rollout``)
    tail_ratio: float | None = None  # DPM-Solver++(2M) after the window on int((K − e)·ρ) nodes (None: Euler steps)
    solver: Solver | None = None  # a whole-trajectory solver instead of the window (final samples only)
    # branch only: the W + 1 grid indices the window's transitions join, step i from nodes[i] to nodes[i + 1] (a
    # merged SDE step spans several schedule steps, E-GRPO); None: start .. start + W
    nodes: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if self.size < 1 or not self.starts or min(self.starts) < 0:
            raise ValueError(f"A plan needs N >= 1 window starts >= 0 and W >= 1, got {self.starts}, {self.size}.")
        if self.trained is not None and tuple(self.trained.shape) != (len(self.starts), self.size):
            raise ValueError(
                f"trained must be [N, W] = [{len(self.starts)}, {self.size}], got {tuple(self.trained.shape)}."
            )
        if self.nodes is not None and not (
            self.branch and self.uniform and len(self.nodes) == self.size + 1 and self.nodes[0] == self.starts[0]
            and all(a < b for a, b in zip(self.nodes[:-1], self.nodes[1:], strict=True))
        ):  # fmt: skip
            raise ValueError(f"nodes {self.nodes} must be W + 1 = {self.size + 1} increasing grid indices from the "
                             "start of one branching window.")  # fmt: skip

    @property
    def start(self) -> int:
        """The earliest window start of the batch (the one window's start when ``uniform``)."""
        return min(self.starts)

    @property
    def uniform(self) -> bool:
        """Whether every trajectory of the batch has the same window (the only layout completions support)."""
        return len(set(self.starts)) == 1


def derived_rng(*parts: int | str) -> random.Random:
    """A ``random.Random`` seeded by a hash of ``parts`` (e.g. the batch seed and the draw's name): a stream apart
    from every other draw of the same seed, the same on every process and platform."""
    digest = hashlib.sha256(":".join(str(p) for p in parts).encode()).digest()
    return random.Random(int.from_bytes(digest[:8], "little"))


def derived_generator(*parts: int | str) -> torch.Generator:
    """A CPU ``torch.Generator`` seeded like :func:`derived_rng` (for ``torch.randperm`` draws)."""
    return cpu_generator(derived_rng(*parts).getrandbits(63))


def needs_transition_optimizer(settings: dict, plan: str, why: str) -> list[str]:
    """The recipe-check sentence of a plan whose steps an optimizer must train as stored transitions (``why``
    says what it decides about them), or none when the recipe's optimizer consumes transitions."""
    from tpflow import registry

    optimizer = settings["optimizer"].name
    if capability(registry.get("optimizer", optimizer).factory, "consumes") == "transitions":
        return []
    return [
        f"optimizer {optimizer!r} trains on final samples, not on stored SDE steps, and {why}. Use [optimizer] "
        f'name = "grpo", or [plan] name = "window" instead of {plan!r}.'
    ]
