"""Training on edits: every credit assigner, rollout plan, sampler and optimizer of tpflow runs an epoch on
``shapes-edit-dit`` with the ``shapes-edit`` dataset and reward (each instruction's source reaching the backbone and
the reward), one recipe per component, the shipped recipes' settings at test size."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import tomllib
import torch

from tpflow.recipe import validate_recipe
from tpflow.train.run_logger import read_jsonl
from tpflow.train.trainer import Trainer

ROOT = Path(__file__).resolve().parent.parent
# recipe -> the components it is here for: together every credit assigner, plan, sampler and optimizer of tpflow
RECIPES = {
    "shapes_edit_tp": "credit consistent, plan window, sampler cps, optimizer grpo",
    "shapes_tempflow": "credit branch, plan branch, sampler flow-sde",
    "shapes_incremental": "credit incremental",
    "shapes_turning_point": "credit turning_point",
    "shapes_dancegrpo": "credit outcome, plan trained-fraction, sampler dance-sde",
    "shapes_flowgrpo_fast": "plan window-per-image",
    "shapes_mixgrpo": "plan window-schedule",
    "shapes_dgpo_dpm": "plan dpm-solver, optimizer dgpo",
    "shapes_awm_sa": "plan sa-solver, optimizer awm",
    "shapes_nft": "optimizer nft",
    "shapes_egrpo": "plan entropy-steps",
}


# shapes-edit, plus a brightness term of weight 0.01: a random tiny model's edits all score alike (no groups' spread,
# nothing to learn), and its samples' brightness differs within every group
SPREAD = {"name": "weighted", "rewards": [{"name": "shapes-edit"},
                                          {"name": "image-stat", "label": "bright", "weight": 0.01}]}  # fmt: skip


@pytest.fixture(scope="module")
def edit_weights(tmp_path_factory) -> Path:
    """A tiny random ShapesEditDiT (width 32, one block), its zero-initialised layers perturbed (so its samples and
    their scores differ), saved as ``tpflow shapes pretrain-edit`` saves."""
    from tpflow.shapes.edit_model import ShapesEditConfig, ShapesEditDiT
    from tpflow.shapes.model import save_checkpoint

    torch.manual_seed(1)
    model = ShapesEditDiT(ShapesEditConfig(width=32, depth=1, heads=2, text_width=32, text_layers=1))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p))
    return save_checkpoint(model, tmp_path_factory.mktemp("edit-weights") / "shapes_edit_dit.safetensors")


def edit_recipe(name: str, run_dir: Path, weights: Path) -> dict:
    """``recipes/<name>.toml`` on shapes-edit-dit with the shapes-edit dataset and reward, one small epoch, an eval."""
    data = tomllib.loads((ROOT / "recipes" / f"{name}.toml").read_text())
    data["backbone"] = {"name": "shapes-edit-dit", "weights": str(weights), "lora_init": "gaussian"}
    data["reward"] = SPREAD
    data["dataset"] = {"name": "shapes-edit", "test_scenes": 1}
    data.setdefault("train", {}).update(epochs=1, prompts_per_epoch=1, group_size=4, rollout_batch=4,
                                        run_dir=str(run_dir), mixed_precision="no")  # fmt: skip
    data["train"].pop("save_every", None)
    rollout = data["rollout"]
    full = rollout["window_size"] >= rollout["num_steps"]  # every step trained (DanceGRPO)
    rollout.update(num_steps=4, window_size=4 if full else 2, window_range=[0, 4] if full else [0, 3])
    data.setdefault("eval", {}).update(every=1, num_prompts=1, images_per_prompt=1, batch_size=1, num_steps=2)
    data["optimizer"]["micro_batch_size"] = 4
    data["optimizer"].pop("gradient_accumulation_steps", None)
    return data


@pytest.mark.parametrize("name", list(RECIPES), ids=[f"{k}: {v}" for k, v in RECIPES.items()])
def test_each_component_trains_an_epoch_on_edits(name, edit_weights, tmp_path):
    recipe = validate_recipe(edit_recipe(name, tmp_path, edit_weights))
    trainer = Trainer(recipe)
    before = [p.detach().clone() for p in trainer.backbone.trainable_parameters()]
    metrics = trainer.fit()
    moved = [not torch.equal(a, p) for a, p in zip(before, trainer.backbone.trainable_parameters(), strict=True)]
    assert sum(moved) >= len(moved) // 2, f"{name}: the LoRA trains on edits"
    assert metrics["optimizer_steps"] >= 1 and math.isfinite(metrics["eval_reward"]), name
    traces = read_jsonl(tmp_path / "traces.jsonl")
    assert len(traces) == 4 and all(math.isfinite(r["trace"][-1]) for r in traces), name


def test_the_recipes_above_cover_every_component():
    from tpflow import registry

    covered = {}
    for name in RECIPES:
        recipe = tomllib.loads((ROOT / "recipes" / f"{name}.toml").read_text())
        for kind in ("credit", "plan", "sampler", "optimizer"):
            covered.setdefault(kind, set()).add(recipe.get(kind, {}).get("name", "window" if kind == "plan" else None))
    for kind, names in covered.items():
        own = {n for n in registry.names(kind) if registry.get(kind, n).factory.__module__.startswith("tpflow.")}
        assert names == own, (kind, own - names)
