"""Arms of a gradient probe, and one paired draw of them: the same main trajectories for every arm, each its credit.

An arm is the probe's recipe with overrides of the sections that decide credit and the update (``[credit]``,
``[rollout]``, ``[optimizer]``), written ``name:key=value,key=value`` (``k3:credit.name=consistent,
rollout.completion_steps=3``); the extra key ``group_sizes=4/8/16/32`` gives the arm its own group sizes (else the
probe's). A draw samples, from one seed, ``blocks`` of copies of each prompt: block b is one rollout batch (every
prompt × ``block`` copies) whose window, SDE noise and z_0 come from the seed and b alone. The rollout engine's
main trajectory depends on those only, not on completions or baseline settings (docs/algorithm.md §1.6), so every
arm's block b holds the same main trajectories bit for bit, and an arm at group size G trains on the first
G / block blocks: arms, and group sizes, are paired. Each distinct rollout setting (completions or none, their
steps) is sampled once per block and shared by the arms that use it; each arm is charged that rollout's NFE and
seconds in full (its cost were it run alone) plus its own credit and gradient.
"""

from __future__ import annotations

import dataclasses
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from tpflow.devices import cpu_generator
from tpflow.errors import UserError
from tpflow.interfaces import Backbone, RewardModel, Sampler, capability
from tpflow.precision import Precision
from tpflow.probe.gradient import first_step_gradient
from tpflow.recipe import Recipe, load_recipe
from tpflow.rollout import rollout_from_settings
from tpflow.sources import encode_rows, group_text
from tpflow.train.scoring import score_rollout
from tpflow.types import PromptItem, Rollout

# What an arm may change: how it samples and what it trains on; the model, reward and prompts are shared.
ARM_SECTIONS = ("sampler", "plan", "credit", "rollout", "optimizer")


@dataclass(frozen=True)
class Arm:
    name: str
    overrides: tuple[str, ...]
    recipe: Recipe
    group_sizes: tuple[int, ...] = ()  # () = the probe's

    @property
    def sampling(self) -> str:
        """The key of the rollout this arm needs: arms with equal keys share one rollout per block (the same sampler,
        plan, ``[rollout]`` settings, completions and stored means)."""
        credit, optimizer = self.recipe.build("credit"), self.recipe.build("optimizer")
        completions = self.recipe.rollout.completions if credit.needs_completions else None
        means = capability(optimizer, "needs_old_means")
        parts = [self.recipe.sampler, self.recipe.plan]
        specs = ":".join(f"{spec.name}{spec.options.model_dump_json()}" for spec in parts)
        return f"{completions}:{means}:{specs}:{self.recipe.rollout.model_dump_json()}"

    @property
    def pairing(self) -> str:
        """What decides the arm's main trajectories (its sampler, plan and window, noise level, guidance, z_0):
        arms with equal keys hold the same main trajectories bitwise; completions and the baseline do not enter."""
        rollout = self.recipe.rollout.model_dump(exclude={"completions", "completion_steps", "baseline_noise"})
        parts = [self.recipe.sampler, self.recipe.plan]
        return (
            ":".join(f"{spec.name}{spec.options.model_dump_json()}" for spec in parts) + f":{sorted(rollout.items())}"
        )

    def sampler(self) -> Sampler:
        """The arm's sampler (the probe's unless the arm overrides ``[sampler]``): its rollouts' and its loss's."""
        return self.recipe.build("sampler")


@dataclass
class Sampled:
    """One block's rollout under one setting, scored."""

    rollout: Rollout  # with completions removed (the optimizer re-scores the window only)
    trace: Tensor  # [n, W+1] reward trace (NaN where no completion was computed)
    nfe: float  # velocity evaluations per trajectory
    seconds: float  # rollout and scoring


@dataclass
class ArmDraw:
    """One draw of one arm at one group size."""

    gradient: Tensor  # [P] float32 CPU: the arm's first-step gradient
    nfe: float  # velocity evaluations per trajectory of the arm's rollout
    seconds: float  # its rollouts and scoring (in full), credit and gradient
    reward: float  # mean final reward of the trajectories it trained on


def parse_arm(spec: str, recipe_path: Path, base: Sequence[str] = ()) -> Arm:
    """``name:key=value,...`` -> an Arm whose recipe is the probe's (``recipe_path`` with ``base`` overrides) with
    the arm's; a key outside ``ARM_SECTIONS`` (and ``group_sizes``) is a UserError (an arm that changed the model
    or the reward would not be paired with the others)."""
    name, sep, body = spec.partition(":")
    if not sep or not name.strip() or not body.strip():
        raise UserError(
            f"--arm {spec!r}: write an arm as NAME:KEY=VALUE[,KEY=VALUE...], e.g. "
            "'k3:credit.name=consistent,rollout.completion_steps=3'."
        )
    overrides, sizes = [], ()
    for item in (part.strip() for part in _split_overrides(body) if part.strip()):
        key, _, value = item.partition("=")
        if key.strip() == "group_sizes":
            sizes = _group_sizes(f"--arm {name}: group_sizes", value)
            continue
        if "=" not in item or key.strip().partition(".")[0] not in ARM_SECTIONS:
            raise UserError(
                f"--arm {name}: {item!r} is not a KEY=VALUE override of [{'], ['.join(ARM_SECTIONS)}] (or "
                "group_sizes=4/8/16); the backbone, reward, dataset and training settings are the probe's, shared by "
                "every arm (pass them with --set)."
            )
        overrides.append(item)
    return Arm(name.strip(), tuple(overrides), load_recipe(recipe_path, [*base, *overrides]), sizes)


def _split_overrides(body: str) -> list[str]:
    """``a=1,b=[0, 5],c=x`` -> ``["a=1", "b=[0, 5]", "c=x"]``: commas inside brackets belong to a TOML array."""
    parts, depth, current = [], 0, []
    for char in body:
        depth += {"[": 1, "]": -1}.get(char, 0)
        if char == "," and depth == 0:
            parts.append("".join(current))
            current = []
        else:
            current.append(char)
    return [*parts, "".join(current)]


def _group_sizes(what: str, text: str) -> tuple[int, ...]:
    try:
        sizes = tuple(int(x) for x in text.replace("/", ",").split(",") if x.strip())
    except ValueError:
        sizes = ()
    if not sizes or min(sizes) < 2:
        raise UserError(f"{what} = {text!r}: give group sizes of at least 2, e.g. 4/8/16 (a baseline needs two).")
    return tuple(sorted(set(sizes)))


def paired_max_batch(copies: int, max_batch: int | None) -> int:
    """The velocity call size that keeps the main trajectories bitwise the same in every variant: the largest divisor
    of ``copies`` (the rows of the main trajectories) not above the recipe's ``max_batch``.

    The engine puts the main trajectory's rows first in each step's call, with the live completions after them; on
    the CPU a row's rounding depends on the size of the call it is in (the shipped shapes-dit: a call of 2 rows and
    one of 8 differ by ~1e-5), so the variants, whose calls hold different numbers of completion rows, drift apart.
    With calls of a divisor of ``copies`` (the main trajectories' rows) the main rows always fill calls of
    their own, of the same sizes."""
    limit = copies if max_batch is None else min(copies, max_batch)
    return max(d for d in range(1, limit + 1) if copies % d == 0)


def same_main_trajectories(a: Rollout, b: Rollout) -> bool:
    """Whether two rollouts hold the same main trajectories, bit for bit (stored window, log-probs, final latents):
    what pairs two arms, or two completion variants, drawn from one seed."""
    fields = ("latents", "next_latents", "log_probs", "final")
    return all(torch.equal(getattr(a, name), getattr(b, name)) for name in fields)


def block_seed(seed: int, block: int) -> int:
    """The seed of block ``block`` of a draw: its window, SDE noise and z_0, whatever the arm."""
    return random.Random(f"{seed}/block/{block}").getrandbits(62)


def sample_block(
    arm: Arm,
    backbone: Backbone,
    sampler: Sampler,
    reward: RewardModel,
    items: Sequence[PromptItem],
    seed: int,
    precision: Precision,
    z0_seed: int | None = None,
) -> Sampled:
    """Sample ``items`` (one trajectory each; copies of a prompt form its group) as ``arm``'s recipe trains, from
    ``seed``: its window, SDE noise and z_0; its completions when its credit needs them.

    With ``[rollout] same_noise`` and ``z0_seed``, each prompt's z_0 comes from (``z0_seed``, prompt) instead, so the
    blocks of a repeat share it: a group of G copies spanning several blocks starts from one z_0, as a training
    group does (TempFlow's siblings branch from one ODE state), instead of one z_0 per block pooled in one group."""
    settings = arm.recipe.rollout
    settings = settings.model_copy(update={"max_batch": paired_max_batch(len(items), settings.max_batch)})
    credit, optimizer = arm.recipe.build("credit"), arm.recipe.build("optimizer")
    start = time.perf_counter()
    prompts = [item.prompt for item in items]
    keys = [group_text(item) for item in items]  # one group per (instruction, sources) pair (tpflow.sources)
    groups = sorted(set(keys))
    # the arm's rollout plan at epoch 0 (a window schedule's first window), from the block's seed
    window = arm.recipe.build("plan").plan(settings, len(items), 0, seed, arm.recipe.train.seed)
    completions = settings.completions if credit.needs_completions else None
    optimizer.bind(backbone, None, precision)
    means = capability(optimizer, "needs_old_means")
    shared = None
    if settings.same_noise and z0_seed is not None:
        shared = {i: random.Random(f"{z0_seed}/z0/{p}").getrandbits(63) for i, p in enumerate(groups)}
    with optimizer.sampling_policy(), precision.autocast():
        out = rollout_from_settings(backbone, sampler, encode_rows(backbone, items), [groups.index(k) for k in keys],
                                    window, settings, completions, cpu_generator(seed), shared,
                                    store_means=means)  # fmt: skip
    metadata = [item.metadata for item in items]
    scored = score_rollout(backbone.decode, reward, out.final, out.completions, prompts, metadata, window.size)
    rollout = dataclasses.replace(out, completions=None)
    return Sampled(rollout, scored.trace, float(out.cost.nfe), time.perf_counter() - start)


def arm_gradient(
    arm: Arm,
    backbone: Backbone,
    sampler: Sampler,
    blocks: Sequence[Sampled],
    prompts: Sequence[str],
    precision: Precision,
) -> ArmDraw:
    """The arm's first-step gradient on the blocks (concatenated: one batch, its groups the copies of a prompt
    across them), its credit assigned and its advantages normalised by its own optimizer (``prompts`` [n] per row)."""
    if len({b.rollout.latents.shape[1] for b in blocks}) != 1:
        raise UserError(f"--arm {arm.name}: its blocks have different window sizes.")
    credit, optimizer = arm.recipe.build("credit"), arm.recipe.build("optimizer")
    if optimizer.consumes != "transitions":
        raise UserError(f"--arm {arm.name}: the probe measures optimizers that train SDE transitions (grpo).")
    start = time.perf_counter()
    optimizer.bind(backbone, None, precision)
    trace = torch.cat([b.trace for b in blocks])  # [n, W+1]
    batch = Rollout.cat([b.rollout for b in blocks]) if len(blocks) > 1 else blocks[0].rollout
    advantages = optimizer.advantages(credit(trace).step_rewards, prompts)
    gradient = first_step_gradient(optimizer, backbone, sampler, batch, advantages)
    seconds = sum(b.seconds for b in blocks) + time.perf_counter() - start
    nfe = sum(b.nfe for b in blocks) / len(blocks)
    return ArmDraw(gradient, nfe, seconds, float(trace[:, -1].double().mean()))


def draw_arm(
    arm: Arm,
    backbone: Backbone,
    sampler: Sampler,
    reward: RewardModel,
    items: Sequence[PromptItem],
    seed: int,
    precision: Precision,
) -> ArmDraw:
    """One block of ``items`` sampled from ``seed`` and the arm's gradient on it (module docstring)."""
    block = sample_block(arm, backbone, sampler, reward, items, seed, precision)
    return arm_gradient(arm, backbone, sampler, [block], [item.prompt for item in items], precision)
