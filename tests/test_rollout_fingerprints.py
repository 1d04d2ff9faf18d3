"""Every shipped shapes recipe's first rollout batch is what it was when the fingerprints were recorded (recorded at
commit 473be44, before the engines moved into the ``tpflow.rollout`` package): a refactor of the engines that changes
a noise draw, a step, what is stored or where a window lies fails here, recipe by recipe.

    .venv/bin/python tests/test_rollout_fingerprints.py > tests/data/rollout_fingerprints.json   # record again

Each recipe rolls out two prompt groups of its group size on the shipped shapes-dit as the trainer's sampling stage
does (``tpflow.train.sampling``: its plan's windows for epoch 0, its sampler, the completions its credit reads, the
transitions and means its optimizer trains on, ``same_noise`` by group seeds). A fingerprint is, for each tensor of
the Rollout (the stored transitions, their σ and means, the final latents, the completions, the trained mask), the
float64 sum, sum of absolute values, first element and size: a wrong noise draw, step or store moves them by far more
than float32 rounding; the tolerance (1e-5 relative) allows only the rounding of another machine's matrix kernels.
"""

from __future__ import annotations

import json
import sys
from functools import cache
from pathlib import Path

import pytest
import torch

RECIPES = Path(__file__).resolve().parents[1] / "recipes"
FIELDS = ("latents", "next_latents", "log_probs", "sigmas", "final", "means", "completions", "trained")
PROMPTS = ("a photo of two circles", "a photo of a red square")
SEED = 1234


def shapes_recipes() -> list[Path]:
    return sorted(RECIPES.glob("shapes_*.toml"))


def stats(tensor: torch.Tensor) -> list[float]:
    t = tensor.detach().double().reshape(-1)
    return [float(t.sum()), float(t.abs().sum()), float(t[0]) if t.numel() else 0.0, float(t.numel())]


@cache
def _backbone():
    import tpflow

    return tpflow.build("backbone", "shapes-dit")


def fingerprint(recipe_path: Path) -> dict[str, list[float]]:
    from tpflow.interfaces import capability
    from tpflow.recipe import load_recipe

    recipe = load_recipe(recipe_path)
    sampler, plan = recipe.build("sampler"), recipe.build("plan")
    credit, optimizer, settings = recipe.build("credit"), recipe.build("optimizer"), recipe.rollout
    size = recipe.train.group_size
    groups = [g for g in range(len(PROMPTS)) for _ in range(size)]  # [N] two prompt groups
    transitions = optimizer.consumes == "transitions"
    completions = settings.completions if credit.needs_completions and transitions else None
    store_means = transitions and capability(optimizer, "needs_old_means")
    window = plan.plan(settings, len(groups), 0, SEED, recipe.train.seed)
    # recipes that differ only in what the rollout does not see (the credit's arithmetic, the reward) roll out the
    # same batch: it is computed once
    key = json.dumps([size, settings.model_dump(mode="json"), recipe.data.get("sampler"), repr(window), completions,
                      transitions, store_means], sort_keys=True, default=str)  # fmt: skip
    return _rolled_out(key, sampler, plan, settings, groups, window, completions, transitions, store_means)


_SEEN: dict[str, dict[str, list[float]]] = {}


def _rolled_out(key, sampler, plan, settings, groups, window, completions, transitions, store_means):
    from tpflow.devices import cpu_generator
    from tpflow.rollout import rollout_from_settings

    if key not in _SEEN:
        backbone = _backbone()
        cond = backbone.encode([PROMPTS[g] for g in groups])
        seeds = {g: SEED + 1 + g for g in range(len(PROMPTS))} if settings.same_noise else None
        out = rollout_from_settings(backbone, sampler, cond, groups, window, settings, completions,
                                    cpu_generator(SEED), seeds, transitions, store_means)  # fmt: skip
        _SEEN[key] = {name: stats(getattr(out, name)) for name in FIELDS if getattr(out, name) is not None}
    return _SEEN[key]


RECORDED_PATH = Path(__file__).parent / "data" / "rollout_fingerprints.json"


def test_every_shipped_shapes_recipe_is_fingerprinted():
    assert sorted(json.loads(RECORDED_PATH.read_text())) == [p.name for p in shapes_recipes()]


@pytest.mark.parametrize("recipe", shapes_recipes(), ids=lambda p: p.stem)
def test_the_first_rollout_batch_is_as_recorded(recipe):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as recorded
    try:
        found = fingerprint(recipe)
    finally:
        torch.set_num_threads(threads)
    want = json.loads(RECORDED_PATH.read_text())[recipe.name]
    assert sorted(found) == sorted(want)
    for name, values in want.items():
        assert found[name] == pytest.approx(values, rel=1e-5, abs=1e-6), name


if __name__ == "__main__":
    torch.set_num_threads(1)
    json.dump({p.name: fingerprint(p) for p in shapes_recipes()}, sys.stdout, indent=1)
    print()
