"""Arms of a gradient probe and one paired draw of an arm: the same trajectories for every arm, each its own credit.

An arm is the probe's recipe with overrides of the sections that decide credit and the update (``[credit]``,
``[rollout]``, ``[optimizer]``), written ``name:key=value,key=value`` (``k3:credit.name=consistent,
rollout.completion_steps=3``). A draw of an arm from a seed samples as training does (the window and the SDE noise
from the seed, z_0 per prompt group from the seed), scores its reward trace, assigns its credit, normalises its
advantages and measures its optimizer's first-step gradient (``tpflow.probe.gradient``). The rollout engine's main
trajectory depends on the seed only, not on completions or baseline settings (docs/algorithm.md §1.6), so arms
drawn from one seed share their main trajectories bit for bit and differ only in what their credit adds; each arm
is charged its own rollout's NFE and seconds.
"""

from __future__ import annotations

import dataclasses
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from torch import Tensor

from tpflow.devices import cpu_generator
from tpflow.errors import UserError
from tpflow.interfaces import Backbone, RewardModel, Sampler
from tpflow.precision import Precision
from tpflow.probe.gradient import first_step_gradient
from tpflow.recipe import Recipe, load_recipe
from tpflow.rollout import draw_window, rollout_from_settings
from tpflow.train.scoring import score_rollout
from tpflow.types import PromptItem, Rollout

ARM_SECTIONS = ("credit", "rollout", "optimizer")  # what an arm may change; the model, reward and prompts are shared


@dataclass(frozen=True)
class Arm:
    name: str
    overrides: tuple[str, ...]
    recipe: Recipe


@dataclass
class ArmDraw:
    """One draw of one arm."""

    rollout: Rollout  # the stored window (its main trajectories are every arm's of this seed)
    trace: Tensor  # [n, W+1] reward trace (NaN where the arm computes no completions)
    gradient: Tensor  # [P] float32 CPU: the arm's first-step gradient
    nfe: float  # velocity evaluations per trajectory of the arm's rollout
    seconds: float  # its rollout, scoring, credit and gradient


def parse_arm(spec: str, recipe_path: Path, base: Sequence[str] = ()) -> Arm:
    """``name:key=value,...`` -> an Arm whose recipe is the probe's (``recipe_path`` with ``base`` overrides) with
    the arm's; a key outside ``ARM_SECTIONS`` is a UserError (an arm that changed the model or the reward would not
    be paired with the others)."""
    name, sep, body = spec.partition(":")
    if not sep or not name.strip() or not body.strip():
        raise UserError(
            f"--arm {spec!r}: write an arm as NAME:KEY=VALUE[,KEY=VALUE...], e.g. "
            "'k3:credit.name=consistent,rollout.completion_steps=3'."
        )
    overrides = tuple(part.strip() for part in body.split(",") if part.strip())
    for item in overrides:
        section = item.partition("=")[0].strip().partition(".")[0]
        if "=" not in item or section not in ARM_SECTIONS:
            raise UserError(
                f"--arm {name}: {item!r} is not a KEY=VALUE override of [{'], ['.join(ARM_SECTIONS)}]; the "
                "backbone, reward, dataset and training settings are the probe's, shared by every arm (pass them "
                "with --set)."
            )
    return Arm(name.strip(), overrides, load_recipe(recipe_path, [*base, *overrides]))


def draw_arm(
    arm: Arm,
    backbone: Backbone,
    sampler: Sampler,
    reward: RewardModel,
    items: Sequence[PromptItem],
    seed: int,
    precision: Precision,
) -> ArmDraw:
    """Sample ``items`` (one trajectory each; copies of a prompt form its group) as the arm's recipe trains, from
    ``seed``, and measure the arm's first-step gradient (module docstring)."""
    credit, optimizer = arm.recipe.build("credit"), arm.recipe.build("optimizer")
    if optimizer.consumes != "transitions":
        raise UserError(f"--arm {arm.name}: the probe measures optimizers that train SDE transitions (grpo).")
    settings = arm.recipe.rollout
    start = time.perf_counter()
    optimizer.bind(backbone, None, precision)
    prompts = [item.prompt for item in items]
    groups = sorted(set(prompts))
    window = draw_window(settings.num_steps, settings.window_size, settings.window_range, random.Random(seed))
    seeds = {g: random.Random(f"{seed}/z0/{text}").getrandbits(63) for g, text in enumerate(groups)}
    completions = settings.completions if credit.needs_completions else None
    with optimizer.sampling_policy(), precision.autocast():
        out = rollout_from_settings(backbone, sampler, backbone.encode(prompts), [groups.index(p) for p in prompts],
                                    window, settings, completions, cpu_generator(seed), seeds)  # fmt: skip
    metadata = [item.metadata for item in items]
    scored = score_rollout(backbone.decode, reward, out.final, out.completions, prompts, metadata, window.size)
    advantages = optimizer.advantages(credit(scored.trace).step_rewards, prompts)
    batch = dataclasses.replace(out, completions=None)
    gradient = first_step_gradient(optimizer, backbone, sampler, batch, advantages)
    return ArmDraw(batch, scored.trace, gradient, out.cost.nfe, time.perf_counter() - start)
