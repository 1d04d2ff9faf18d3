"""Training on edits: every credit assigner, rollout plan and optimizer tpflow registers trains an epoch on the tiny
FLUX.1 Kontext twin (``tiny-flux-kontext``: one source image per instruction, appended to the token sequence), its
prompts and sources read from an ``edit-jsonl`` file (2 instructions x groups of 2, K = 3 steps, 16 px).

One test per component, each on the smallest recipe that uses it (the shapes recipes' pairings: the branch credit
with the branch plan, the solver plans with their final-sample optimizers); a recipe shared by several components
trains once. None of them needs a refusal on an editing backbone: each trains, its LoRA moves, and every encode the
trainer made carried each instruction's own source."""

from __future__ import annotations

import json
import math

import pytest
import torch
from PIL import Image

from tpflow import registry
from tpflow.recipe import validate_recipe
from tpflow.train.trainer import Trainer

INSTRUCTIONS = ["make the square red", "add a blue circle"]
LEVELS = (30, 200)  # source i is the flat colour (LEVELS[i], 255 - LEVELS[i], LEVELS[i])
BASE = {
    "backbone": {"name": "tiny-flux-kontext", "seed": 0, "resolution": 16, "lora_init": "gaussian"},
    "reward": {"name": "image-stat"},
    "credit": {"name": "outcome"},
    "optimizer": {"name": "grpo", "learning_rate": 1e-2, "beta": 0.0, "micro_batch_size": 4,
                  "gradient_accumulation_steps": 1},
    "rollout": {"num_steps": 3, "window_size": 2, "window_range": [0, 2], "noise_level": 0.7, "guidance": 2.5},
    "train": {"epochs": 1, "prompts_per_epoch": 2, "group_size": 2, "rollout_batch": 4, "save_every": 0,
              "ema": False, "mixed_precision": "no"},
    "eval": {"every": 0},
}  # fmt: skip
FINAL = {"noise_level": 0.0, "window_size": 1, "window_range": [0, 1]}  # the final-sample optimizers' rollouts
SMALL = {"learning_rate": 1e-2, "kl_weight": 0.0, "micro_batch_size": 4}
# recipe name -> its sections over BASE (a section replaces BASE's, [rollout] updates it)
RECIPES = {
    "outcome": {"eval": {"every": 1, "num_steps": 3, "batch_size": 2, "num_prompts": 2, "images_per_prompt": 1}},
    "consistent": {"credit": {"name": "consistent", "balanced": True}},
    "incremental": {"credit": {"name": "incremental"}},
    "turning_point": {"credit": {"name": "turning_point"}},
    "branch": {"credit": {"name": "branch"}, "plan": {"name": "branch"}, "sampler": {"name": "flow-sde"},
               "rollout": {"same_noise": True}},
    "trained-fraction": {"plan": {"name": "trained-fraction", "fraction": 1.0}},
    "entropy-steps": {"credit": {"name": "branch"}, "plan": {"name": "entropy-steps", "entropy_threshold": 1.0},
                      "sampler": {"name": "flow-sde"}, "rollout": {"same_noise": True},
                      "backbone": {"time_shift": 3.0}},  # the plan's linspace grid at shift 3 is then the schedule
    "window-per-image": {"plan": {"name": "window-per-image"}, "rollout": {"window_size": 1}},
    "window-schedule": {"plan": {"name": "window-schedule", "iters_per_group": 1}, "rollout": {"window_size": 1}},
    "dgpo + dpm-solver": {"plan": {"name": "dpm-solver"}, "rollout": FINAL,
                          "optimizer": {"name": "dgpo", **SMALL, "num_timesteps": 3, "train_timesteps": 2,
                                        "trunc_steps": 2}},
    "awm + sa-solver": {"plan": {"name": "sa-solver"}, "rollout": FINAL,
                        "optimizer": {"name": "awm", **SMALL, "num_timesteps": 4, "train_timesteps": 2}},
    "nft": {"rollout": FINAL, "optimizer": {"name": "nft", **SMALL, "beta": 1.0, "num_timesteps": 3,
                                            "timesteps_per_sample": 2}},
    "awm": {"rollout": FINAL, "optimizer": {"name": "awm", **SMALL, "num_timesteps": 4, "train_timesteps": 2}},
    "dgpo": {"rollout": FINAL, "optimizer": {"name": "dgpo", **SMALL, "num_timesteps": 3, "train_timesteps": 2,
                                             "trunc_steps": 2}},
}  # fmt: skip
COMPONENTS = {  # (kind, registered name) -> the recipe that trains it
    ("credit", "outcome"): "outcome", ("credit", "consistent"): "consistent",
    ("credit", "incremental"): "incremental", ("credit", "turning_point"): "turning_point",
    ("credit", "branch"): "branch",
    ("plan", "window"): "outcome", ("plan", "branch"): "branch", ("plan", "trained-fraction"): "trained-fraction",
    ("plan", "entropy-steps"): "entropy-steps",
    ("plan", "window-per-image"): "window-per-image", ("plan", "window-schedule"): "window-schedule",
    ("plan", "dpm-solver"): "dgpo + dpm-solver", ("plan", "sa-solver"): "awm + sa-solver",
    ("optimizer", "grpo"): "outcome", ("optimizer", "nft"): "nft", ("optimizer", "awm"): "awm",
    ("optimizer", "dgpo"): "dgpo",
}  # fmt: skip


@pytest.fixture(scope="module")
def edits(tmp_path_factory):
    """An edit-jsonl file of the two instructions, each with its own 16 px PNG source beside it."""
    folder = tmp_path_factory.mktemp("edits")
    for i, level in enumerate(LEVELS):
        Image.new("RGB", (16, 16), (level, 255 - level, level)).save(folder / f"source{i}.png")
    lines = [json.dumps({"prompt": p, "source": f"source{i}.png"}) for i, p in enumerate(INSTRUCTIONS)]
    (folder / "edits.jsonl").write_text("\n".join(lines) + "\n")
    return folder


@pytest.fixture(scope="module")
def trained(edits):
    """recipe name -> (the recipe, its metrics, whether each LoRA tensor moved, what each encode was given); each
    recipe trains once for every component that names it."""
    done: dict = {}

    def train(name: str):
        if name not in done:
            data = {k: dict(v) for k, v in BASE.items()}
            for section, values in RECIPES[name].items():
                data[section] = {**data[section], **values} if section in ("rollout", "backbone") else dict(values)
            data["dataset"] = {"name": "edit-jsonl", "path": str(edits / "edits.jsonl"), "min_side": 8}
            data["train"]["run_dir"] = str(edits / "runs" / name)
            recipe = validate_recipe(data)
            trainer = Trainer(recipe)
            seen, encode = [], trainer.backbone.encode

            def spy(prompts, sources=None):
                seen.extend((p, tuple((*s.shape, round(float(s[0].mean()) * 255)) for s in per))
                            for p, per in zip(prompts, sources, strict=True))  # fmt: skip
                return encode(prompts, sources=sources)

            trainer.backbone.encode = spy
            before = [p.detach().clone() for p in trainer.backbone.trainable_parameters()]
            metrics = trainer.fit()
            moved = [
                not torch.equal(a, p) for a, p in zip(before, trainer.backbone.trainable_parameters(), strict=True)
            ]
            done[name] = (recipe, metrics, moved, seen)
        return done[name]

    return train


def test_the_table_names_every_component_tpflow_registers():
    for kind in ("credit", "plan", "optimizer"):
        own = {n for n in registry.names(kind) if registry.get(kind, n).factory.__module__.startswith("tpflow.")}
        assert own == {name for k, name in COMPONENTS if k == kind}, kind


@pytest.mark.parametrize(("kind", "name"), sorted(COMPONENTS), ids=lambda x: x)
def test_it_trains_an_epoch_on_edits(trained, kind, name):
    recipe, metrics, moved, seen = trained(COMPONENTS[(kind, name)])
    assert recipe.components[kind].name == name
    assert metrics["optimizer_steps"] >= 1 and math.isfinite(metrics["loss"])
    assert all(moved), f"{sum(moved)} of {len(moved)} LoRA tensors moved"
    # every encode: each instruction with its own one source, 16 px, its red channel the file's
    assert set(seen) == {(p, ((3, 16, 16, level),)) for p, level in zip(INSTRUCTIONS, LEVELS, strict=True)}
    if COMPONENTS[(kind, name)] == "outcome":  # its recipe evaluates too: the eval encodes the sources the same way
        assert math.isfinite(metrics["eval_reward"])
