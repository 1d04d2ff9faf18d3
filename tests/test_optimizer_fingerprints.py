"""Each optimizer's first update on a shipped shapes recipe is what it was when the fingerprints were recorded
(before the optimizers were rebuilt by composition): a refactor of ``tpflow.optim`` that changes a draw of
times or noise, a loss, the order of the rows, a step of the loop, the lagged copy's move or the state a checkpoint
keeps fails here, case by case.

    .venv/bin/python tests/test_optimizer_fingerprints.py > tests/data/optimizer_fingerprints.json   # record again

Each case loads a shapes recipe (with a few ``--set`` overrides: a smaller batch, and the options that select another
path through an optimizer: the KL, a recompute mode, the lagged copy's unit; a GRPO recipe's window shortened to 3
steps), rolls out two prompt groups of two images on the shipped shapes-dit as the trainer's sampling stage does
(the optimizer bound first, the rollout under
its ``sampling_policy``, the transitions, means and retained graphs it asks for; no completions: the update reads
none), draws seeded step rewards (the same at every step where the credit gives every step one reward) and runs one
``update`` from ``advantages``. Held
bitwise, as sha256 digests of the tensors' bytes: the trained parameters after every optimizer step, the kept copy
after the update, and every metric the update returns; the state dict's keys and shapes are held as written, so that
a checkpoint written before a change still loads after it. One thread, as recorded: the digests hold on the machine
and torch build they were recorded with (a digest moved by another build's kernels is re-recorded, not loosened).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import sys
from functools import cache
from pathlib import Path

import pytest
import torch

RECIPES = Path(__file__).resolve().parents[1] / "recipes"
RECORDED_PATH = Path(__file__).parent / "data" / "optimizer_fingerprints.json"
PROMPTS = ("a photo of two circles", "a photo of a red square")
GROUP_SIZE = 2
SEED = 4321
SMALL = ("optimizer.micro_batch_size=2", "optimizer.gradient_accumulation_steps=1")
WINDOW = "rollout.window_size=3"  # a GRPO recipe's window, shortened: 3 trained steps per trajectory

# case -> (recipe file, overrides beyond SMALL): every optimizer, and the options that take another path through it
CASES: dict[str, tuple[str, tuple[str, ...]]] = {
    "flowgrpo": ("shapes_flowgrpo.toml", (WINDOW,)),
    "flowgrpo_kl": ("shapes_flowgrpo.toml", (WINDOW, "optimizer.beta=1e-4", "optimizer.kl_std=transition")),
    "flowgrpo_retain": ("shapes_flowgrpo.toml", (WINDOW, "optimizer.recompute=retain")),
    "flowgrpo_reweight": ("shapes_flowgrpo.toml", (WINDOW, "optimizer.recompute=reweight")),
    "flowgrpo_conditional": ("shapes_flowgrpo.toml", (WINDOW, "optimizer.cfg_gradient=conditional",
                                                      "rollout.guidance=2.0")),
    "tp": ("shapes_tp.toml", (WINDOW,)),
    "dancegrpo": ("shapes_dancegrpo.toml", ()),
    "grpo_guard": ("shapes_grpo_guard.toml", (WINDOW,)),
    "gardo": ("shapes_gardo.toml", (WINDOW, "optimizer.kl_gate_fraction=0.5", "optimizer.kl_gate_max=0.5")),
    "tempflow": ("shapes_flowgrpo.toml", (WINDOW, "optimizer.step_weight=noise-aware", "optimizer.kl_std=transition")),
    "nft": ("shapes_nft.toml", ()),
    "nft_kl": ("shapes_nft.toml", ("optimizer.kl_weight=1e-4", "optimizer.old_decay_rate=0.25")),
    "gardo_nft": ("shapes_gardo_nft.toml", ("optimizer.kl_gate_fraction=0.5", "optimizer.kl_gate_max=0.5",
                                            "optimizer.kl_gate_batch=2", "optimizer.seed=5")),
    "awm": ("shapes_awm.toml", ()),
    "awm_kl_step": ("shapes_awm.toml", ("optimizer.kl_weight=1e-3", "optimizer.old_decay_unit=step",
                                        "optimizer.train_guidance=2.0", "optimizer.old_decay_rate=0.25")),
    "dgpo": ("shapes_dgpo.toml", ()),
    "dgpo_dpm": ("shapes_dgpo_dpm.toml", ()),
    "dgpo_ema_step": ("shapes_dgpo.toml", ("optimizer.use_ema_ref=true", "optimizer.kl_weight=0.02",
                                           "optimizer.old_decay_unit=step", "optimizer.old_decay_rate=0.25")),
}  # fmt: skip


def digest(tensors) -> str:
    """sha256 of the tensors' bytes (contiguous, on the CPU) and shapes, in order."""
    h = hashlib.sha256()
    for t in tensors:
        t = t.detach().cpu().contiguous()
        h.update(repr((tuple(t.shape), str(t.dtype))).encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def _layout(value):
    """A state dict's structure: keys, tensor shapes and dtypes, scalars as written (not the AdamW moments' values)."""
    if isinstance(value, torch.Tensor):
        return f"tensor{list(value.shape)}:{value.dtype}"
    if isinstance(value, dict):
        return {str(k): _layout(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_layout(v) for v in value]
    return value if value is None or isinstance(value, bool | int | float | str) else type(value).__name__


@cache
def _backbone():
    """The shapes-dit every shapes recipe names, built once; its LoRA's initial values, put back before each case."""
    from tpflow.recipe import load_recipe

    backbone = load_recipe(RECIPES / "shapes_flowgrpo.toml").build("backbone")
    return backbone, [p.detach().clone() for p in backbone.trainable_parameters()]


def _recipe_path(name: str) -> Path:
    found = sorted(RECIPES.rglob(name))  # wherever the recipe index files it
    assert found, f"no shipped recipe {name}"
    return found[0]


def fingerprint(case: str) -> dict:
    from tpflow.devices import cpu_generator
    from tpflow.interfaces import capability
    from tpflow.recipe import load_recipe
    from tpflow.rollout import rollout_from_settings

    name, sets = CASES[case]
    torch.manual_seed(SEED)  # the LoRA's initial values and an optimizer's base seed come from the global RNG
    recipe = load_recipe(_recipe_path(name), [*SMALL, *sets])
    backbone, initial = _backbone()
    with torch.no_grad():
        for p, value in zip(backbone.trainable_parameters(), initial, strict=True):
            p.copy_(value)
            p.grad = None
    sampler, plan, credit, optimizer = (recipe.build(kind) for kind in ("sampler", "plan", "credit", "optimizer"))
    settings = recipe.rollout
    optimizer.bind(backbone)
    groups = [g for g in range(len(PROMPTS)) for _ in range(GROUP_SIZE)]
    transitions = optimizer.consumes == "transitions"
    store_means = transitions and capability(optimizer, "needs_old_means")
    same_reward = bool(capability(credit, "same_reward_every_step"))
    retain = capability(optimizer, "retain") if transitions else None
    retain = None if retain is None else retain.for_credit(same_reward).for_batch(0)
    window = plan.plan(settings, len(groups), 0, SEED, recipe.train.seed)
    cond = backbone.encode([PROMPTS[g] for g in groups])
    seeds = {g: SEED + 1 + g for g in range(len(PROMPTS))} if settings.same_noise else None
    with optimizer.sampling_policy():
        batch = rollout_from_settings(backbone, sampler, cond, groups, window, settings, None,
                                      cpu_generator(SEED), seeds, transitions, store_means, retain)  # fmt: skip
    batch = dataclasses.replace(batch, completions=None, groups=torch.tensor(groups, dtype=torch.long))
    if capability(optimizer, "reads_reward_details"):  # the reward parts GARDO's KL gate ranks: drawn at random
        keys = [optimizer.options.kl_gate_main, *optimizer.options.kl_gate_aux]
        parts = torch.rand(len(keys), len(groups), generator=cpu_generator(SEED + 25))  # row 2 gated
        batch = dataclasses.replace(batch, reward_details=dict(zip(keys, parts, strict=True)))
    width = batch.log_probs.shape[1] if transitions else 1
    generator = cpu_generator(SEED + 7)
    rewards = torch.rand(len(groups), 1 if same_reward else width, generator=generator, dtype=torch.float64)
    advantages = optimizer.advantages(rewards.expand(len(groups), width), groups)
    params = list(backbone.trainable_parameters())
    steps: list[str] = []
    metrics = optimizer.update(backbone, sampler, batch, advantages, lambda n: steps.append(digest(params)))
    state = optimizer.state_dict()
    kept = {key: digest(state[key]) for key in ("old",) if key in state}
    return {
        "advantages": digest([advantages]),
        "steps": steps,
        "kept": kept,
        "metrics": {k: float(v) for k, v in sorted(metrics.items())},
        "state": _layout({k: v for k, v in state.items() if k != "optimizer"}),
        "adam": _layout(state["optimizer"]),
    }


def _single_threaded(function, *args):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as recorded
    try:
        return function(*args)
    finally:
        torch.set_num_threads(threads)


def test_every_case_is_recorded():
    assert sorted(json.loads(RECORDED_PATH.read_text())) == sorted(CASES)


@pytest.mark.parametrize("case", sorted(CASES))
def test_the_first_update_is_as_recorded(case):
    found = _single_threaded(fingerprint, case)
    want = json.loads(RECORDED_PATH.read_text())[case]
    assert found["steps"], "the update took no optimizer step: nothing is held"
    for key in ("advantages", "steps", "kept", "state", "adam"):
        assert found[key] == want[key], key
    assert found["metrics"] == want["metrics"]


if __name__ == "__main__":
    import time

    recorded = {}
    for case in sorted(CASES):
        start = time.perf_counter()
        recorded[case] = _single_threaded(fingerprint, case)
        print(f"{case}: {time.perf_counter() - start:.2f} s", file=sys.stderr)
    json.dump(recorded, sys.stdout, indent=1)
    print()
