"""A probe run: its fixed policy and prompt set, its repeats of paired arm draws and of reference draws, on disk.

The probe's output folder holds ``probe.json`` (what was asked: recipe, overrides, arms, prompts, sizes, seeds) and
one file pair per finished unit under ``draws/`` (``arms_r007.safetensors`` + ``.json``: every (arm, G) gradient of
repeat 7 with its NFE, seconds and reward; ``ref_r003.*``: a reference draw). A unit is written atomically when it
finishes and a rerun skips finished units, so a killed probe continues where it stopped; a rerun that asks for a
different probe in the same folder is refused. Repeat r's seeds depend on (seed, r) alone, so adding repeats later
extends the same probe.

Reference draws are independent of the arm draws (their own seeds): P prompts × ``reference_group_size``
trajectories sampled by the probe recipe's rollout without completions; two gradients each, through the probe
recipe's optimizer code: the leave-one-out REINFORCE gradient of J = E[R(x_0)] (``tpflow.probe.reference``), and
outcome credit with group normalisation at that group size (the normalised objective's reference).
"""

from __future__ import annotations

import hashlib
import json
import os
import random
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load, save
from torch import Tensor

from tpflow.errors import UserError
from tpflow.precision import Precision
from tpflow.probe.arms import (
    Arm,
    Sampled,
    arm_gradient,
    block_seed,
    parse_arm,
    same_main_trajectories,
    sample_block,
)
from tpflow.probe.gradient import first_step_gradient
from tpflow.probe.projection import CountSketch, measured_distortion
from tpflow.probe.reference import leave_one_out_advantages
from tpflow.recipe import load_recipe
from tpflow.types import PromptItem

SKETCH_ABOVE = 1 << 20  # adapters with more parameters are sketched by default (about 4 MB per stored gradient)


@dataclass
class ProbeConfig:
    """What a probe measures; ``probe.json`` holds it and a rerun must ask for the same."""

    recipe: str
    overrides: list[str]
    arms: list[str]  # NAME:KEY=VALUE,... specs
    prompts: int = 6
    group_sizes: list[int] = field(default_factory=lambda: [4, 8])
    repeats: int = 8
    reference_draws: int = 8
    reference_group_size: int = 32
    seed: int = 0
    checkpoint: str | None = None
    sketch_dim: int | None = None  # None: full gradients up to SKETCH_ABOVE parameters, else 65,536

    def key(self) -> dict[str, Any]:
        """What must match for a rerun to continue the probe (repeats and reference draws may grow)."""
        data = asdict(self)
        data.pop("repeats"), data.pop("reference_draws")
        return data


@dataclass
class Probe:
    """A built probe: the config, its arms, the shared model and prompt set."""

    config: ProbeConfig
    out: Path
    arms: list[Arm]
    reference: Arm  # the probe's recipe itself (outcome credit: no completions), for the reference draws
    backbone: Any
    sampler: Any
    reward: Any
    items: list[PromptItem]  # the P prompts, fixed for every draw
    precision: Precision
    sketch: CountSketch | None

    def sizes(self, arm: Arm) -> tuple[int, ...]:
        return arm.group_sizes or tuple(self.config.group_sizes)

    @property
    def block(self) -> int:
        """Copies per prompt in one block: the smallest group size (every size must be a multiple of it)."""
        return min(min(self.sizes(arm)) for arm in self.arms)

    def units(self) -> list[str]:
        return [f"arms_r{r:03d}" for r in range(self.config.repeats)] + [
            f"ref_r{r:03d}" for r in range(self.config.reference_draws)
        ]


def balanced_prompts(items: Sequence[PromptItem], count: int, seed: int) -> list[PromptItem]:
    """``count`` distinct prompts, spread evenly over the ``tag`` (or ``category``) of their metadata when the
    dataset has one (round robin over the tags in sorted order, a seeded pick within each), else a seeded sample."""
    distinct = list({item.prompt: item for item in items}.values())
    if count > len(distinct):
        raise UserError(f"--prompts {count}: the train split has {len(distinct)} distinct prompts.")
    rng = random.Random(f"{seed}/prompts")
    tags: dict[str, list[PromptItem]] = {}
    for item in distinct:
        tags.setdefault(str(item.metadata.get("tag", item.metadata.get("category", ""))), []).append(item)
    pools = [rng.sample(tags[t], len(tags[t])) for t in sorted(tags)]
    picked: list[PromptItem] = []
    while len(picked) < count:
        for pool in pools:
            if pool and len(picked) < count:
                picked.append(pool.pop())
    return picked


def build_probe(config: ProbeConfig, out: Path) -> Probe:
    """Build the model, prompt set and arms of ``config``; write or check ``out/probe.json``."""
    if not config.arms:
        raise UserError("Give at least one --arm NAME:KEY=VALUE (e.g. outcome:credit.name=outcome).")
    recipe_path = Path(config.recipe)
    arms = [parse_arm(spec, recipe_path, config.overrides) for spec in config.arms]
    if len({arm.name for arm in arms}) != len(arms):
        raise UserError(f"--arm names must differ: {[arm.name for arm in arms]}.")
    reference = Arm("reference", ("credit.name=outcome",),
                    load_recipe(recipe_path, [*config.overrides, "credit.name=outcome"]))  # fmt: skip
    base = reference.recipe  # the probe's recipe, whatever an arm overrides
    if base.train.mixed_precision == "fp16":
        raise UserError("The probe measures fp32 or bf16 gradients: fp16's loss scale would enter them (--set "
                        "train.mixed_precision=bf16).")  # fmt: skip
    _check_config(config, out)
    torch.manual_seed(base.train.seed)  # as the trainer: a fresh adapter starts from the run's values
    random.seed(base.train.seed)
    backbone, sampler, reward = base.build("backbone"), base.build("sampler"), base.build("reward")
    if config.checkpoint:
        _load_checkpoint(backbone, Path(config.checkpoint))
    items = balanced_prompts(list(base.build("dataset").split("train")), config.prompts, config.seed)
    numel = sum(p.numel() for p in backbone.trainable_parameters())
    dim = config.sketch_dim if config.sketch_dim is not None else (0 if numel <= SKETCH_ABOVE else 1 << 16)
    sketch = CountSketch(numel, dim, seed=config.seed) if dim else None
    precision = Precision(base.train.mixed_precision, backbone.device.type)
    probe = Probe(config, out, arms, reference, backbone, sampler, reward, items, precision, sketch)
    for arm in arms:
        if any(g % probe.block for g in probe.sizes(arm)):
            raise UserError(f"--arm {arm.name}: every group size must be a multiple of the smallest, {probe.block}.")
    return probe


def _check_config(config: ProbeConfig, out: Path) -> None:
    path = out / "probe.json"
    if path.exists():
        before = json.loads(path.read_text())
        if before.get("key") != config.key():
            raise UserError(
                f"{out} holds a different probe ({path}); give another --out, or the same arms, prompts, sizes, "
                "seed, recipe and overrides to continue it."
            )
    out.mkdir(parents=True, exist_ok=True)
    _write_json(path, {"key": config.key(), "config": asdict(config)})


def _load_checkpoint(backbone: Any, path: Path) -> None:
    from tpflow.train.checkpoints.format import find_checkpoint, load_checkpoint

    found, _ = find_checkpoint(path)
    if found is None:
        raise UserError(f"No valid checkpoint in {path}: pass a run dir or a checkpoints/<step> dir.")
    load_checkpoint(found).load_weights(backbone)


def run_probe(probe: Probe, advance: Callable[[str], None] = lambda unit: None) -> list[str]:
    """Compute every unit not yet on disk (``advance`` is told each finished one); returns the units computed."""
    done = []
    for unit in probe.units():
        if (probe.out / "draws" / f"{unit}.json").exists():
            continue
        kind, r = unit.split("_r")
        tensors, meta = (_arms_unit if kind == "arms" else _reference_unit)(probe, int(r))
        _save_unit(probe, unit, tensors, meta)
        done.append(unit)
        advance(unit)
    return done


def _arms_unit(probe: Probe, r: int) -> tuple[dict[str, Tensor], dict[str, Any]]:
    """Repeat r: every arm at each of its group sizes on the same blocks (module docstring of tpflow.probe.arms)."""
    seed = random.Random(f"{probe.config.seed}/arms/{r}").getrandbits(62)
    block_items = [item for item in probe.items for _ in range(probe.block)]  # prompt-major: P × block rows
    cache: dict[tuple[str, int], Sampled] = {}
    tensors, meta = {}, {}
    for arm in probe.arms:
        sizes = probe.sizes(arm)
        for b in range(max(sizes) // probe.block):
            if (arm.sampling, b) not in cache:
                cache[arm.sampling, b] = sample_block(arm, probe.backbone, arm.sampler(), probe.reward, block_items,
                                                      block_seed(seed, b), probe.precision, seed)  # fmt: skip
    pairing = {arm.sampling: arm.pairing for arm in probe.arms}
    meta["paired_bitwise"] = _paired(cache, pairing)
    meta["pairing_classes"] = len(set(pairing.values()))
    for arm in probe.arms:
        for g in probe.sizes(arm):
            blocks = [cache[arm.sampling, b] for b in range(g // probe.block)]
            prompts = [item.prompt for item in block_items] * len(blocks)
            drawn = arm_gradient(arm, probe.backbone, arm.sampler(), blocks, prompts, probe.precision)
            tensors[f"{arm.name}@{g}"] = drawn.gradient
            meta[f"{arm.name}@{g}"] = {"nfe": drawn.nfe, "seconds": drawn.seconds, "reward": drawn.reward}
    return tensors, meta


def _paired(cache: dict[tuple[str, int], Sampled], pairing: dict[str, str]) -> bool:
    """Whether, within each pairing class (``Arm.pairing``: arms that sample alike), every rollout setting's block b
    holds the same main trajectories, bit for bit: what pairs those arms; the report states it. Arms of different
    classes (their own sampler, plan or window) draw from the same seeds but are not the same trajectories."""
    firsts: dict[tuple[str, int], Sampled] = {}
    for (setting, b), sampled in cache.items():
        first = firsts.setdefault((pairing[setting], b), sampled)
        if not same_main_trajectories(first.rollout, sampled.rollout):
            return False
    return True


def _reference_unit(probe: Probe, r: int) -> tuple[dict[str, Tensor], dict[str, Any]]:
    """Reference draw r: the leave-one-out REINFORCE gradient and the normalised (outcome) one, on one batch."""
    import time

    import tpflow

    start = time.perf_counter()
    seed = random.Random(f"{probe.config.seed}/reference/{r}").getrandbits(62)
    items = [item for item in probe.items for _ in range(probe.config.reference_group_size)]
    sampled = sample_block(probe.reference, probe.backbone, probe.sampler, probe.reward, items, seed, probe.precision)
    optimizer = probe.reference.recipe.build("optimizer")
    optimizer.bind(probe.backbone, None, probe.precision)
    prompts = [item.prompt for item in items]
    width = sampled.rollout.latents.shape[1]
    loo = leave_one_out_advantages(sampled.trace[:, -1], prompts, width)
    outcome = tpflow.build("credit", "outcome")(sampled.trace).step_rewards
    tensors = {
        "loo": first_step_gradient(optimizer, probe.backbone, probe.sampler, sampled.rollout, loo),
        "normalised": first_step_gradient(
            optimizer, probe.backbone, probe.sampler, sampled.rollout, optimizer.advantages(outcome, prompts)
        ),
    }
    meta = {"nfe": sampled.nfe, "seconds": time.perf_counter() - start, "reward": float(sampled.trace[:, -1].mean())}
    return tensors, meta


def _save_unit(probe: Probe, unit: str, tensors: dict[str, Tensor], meta: dict[str, Any]) -> None:
    """Sketch (when the probe does), then write the tensors and the JSON atomically, the JSON last: a unit is done
    when its JSON exists."""
    folder = probe.out / "draws"
    folder.mkdir(parents=True, exist_ok=True)
    if probe.sketch is not None:
        if unit == "arms_r000":  # the distortion the sketch adds, measured on full gradients, stated once
            meta["sketch_distortion"] = measured_distortion(probe.sketch, torch.stack(list(tensors.values())))
        tensors = {k: probe.sketch(v).float() for k, v in tensors.items()}
    path = folder / f"{unit}.safetensors"
    data = save({k: v.contiguous() for k, v in tensors.items()})  # the file's bytes: hashed as written
    path.with_suffix(".tmp").write_bytes(data)
    os.replace(path.with_suffix(".tmp"), path)
    _write_json(folder / f"{unit}.json", {"meta": meta, "sha256": hashlib.sha256(data).hexdigest()})


def load_units(out: Path) -> tuple[dict[str, dict[str, Tensor]], dict[str, dict[str, Any]]]:
    """Every finished unit of the probe in ``out``: tensors and metadata by unit name (a unit whose tensors do not
    match the digest its JSON recorded is a UserError: the folder was altered)."""
    tensors, meta = {}, {}
    for path in sorted((out / "draws").glob("*.json")):
        record = json.loads(path.read_text())
        file = path.with_suffix(".safetensors")
        data = file.read_bytes() if file.exists() else b""  # read once: hashed, then parsed
        if hashlib.sha256(data).hexdigest() != record["sha256"]:
            raise UserError(f"{file} is missing or does not match {path}: delete both and rerun to redraw it.")
        tensors[path.stem], meta[path.stem] = load(data), record["meta"]
    return tensors, meta


def _write_json(path: Path, data: dict[str, Any]) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=1))
    os.replace(tmp, path)
