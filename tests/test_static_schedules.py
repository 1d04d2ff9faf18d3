"""A backbone's σ schedule before it is built (capability ``static_sigmas``) is the built backbone's, bit for bit,
on every dynamically shifted twin (FLUX.1, Kontext, FLUX.2, Qwen-Image, Qwen-Image-Edit, Z-Image), a real model's
comes from its scheduler config alone, and an ``entropy-steps`` grid that does not match is refused by the recipe
check, before anything loads (it was refused only once the weights had loaded)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.combinations import overrides, recipe_text
from tpflow import registry
from tpflow.backbones.diffusers_common import scheduler_sigmas
from tpflow.backbones.flux2 import flux2_sigmas
from tpflow.backbones.static_schedules import scheduler_before_loading
from tpflow.errors import RecipeError
from tpflow.interfaces import capability
from tpflow.recipe import load_recipe

TWINS = [("tiny-z-image", 16), ("tiny-z-image", 32), ("tiny-z-image-turbo", 16), ("tiny-flux.2-klein", 32),
         ("tiny-flux.2-klein", 64), ("tiny-flux.2-dev", 32), ("tiny-flux", 16), ("tiny-flux", 32),
         ("tiny-flux-kontext", 16), ("tiny-qwen-image", 16), ("tiny-qwen-image", 32), ("tiny-qwen-image-edit", 32),
         ("tiny-qwen-image-edit", 64)]  # fmt: skip
FLUX2_SCHEDULER = {"_class_name": "FlowMatchEulerDiscreteScheduler", "shift": 3.0, "use_dynamic_shifting": True,
                   "base_shift": 0.5, "max_shift": 1.15, "base_image_seq_len": 256, "max_image_seq_len": 4096,
                   "time_shift_type": "exponential"}  # fmt: skip


@pytest.mark.parametrize(("name", "resolution"), TWINS)
def test_a_twins_schedule_before_building_is_the_built_ones(name, resolution):
    static = capability(registry.get("backbone", name).factory, "static_sigmas")
    backbone = registry.build("backbone", name, seed=0, resolution=resolution)
    for steps in (4, 10):
        assert torch.equal(torch.tensor(static(backbone.options, steps)), backbone.sigmas(steps))


@pytest.mark.parametrize(
    "name", ["flux.2-klein-4b", "flux.2-dev", "z-image", "z-image-turbo", "flux.1-dev", "flux.1-kontext-dev",
             "qwen-image", "qwen-image-edit"]
)  # fmt: skip
def test_a_real_models_schedule_is_read_from_its_scheduler_config_alone(tmp_path, name):
    """A local folder holding only scheduler/scheduler_config.json gives the schedule (no weights read); without the
    file, or with a broken one, the value is None and the check waits for the built backbone."""
    static = capability(registry.get("backbone", name).factory, "static_sigmas")
    options = registry.get("backbone", name).options(pretrained=str(tmp_path), resolution=512)
    assert static(options, 8) is None  # no scheduler config here
    (tmp_path / "scheduler").mkdir()
    (tmp_path / "scheduler" / "scheduler_config.json").write_text("{not json")
    assert static(options, 8) is None
    (tmp_path / "scheduler" / "scheduler_config.json").write_text(json.dumps(FLUX2_SCHEDULER))
    scheduler = scheduler_before_loading(str(tmp_path))
    tokens = (512 // 16) ** 2  # the packed tokens of the output: VAE factor 8, 2x2 patches
    if name.startswith("flux.2"):  # the built backbones' own calls
        schedule = lambda sch, k: flux2_sigmas(sch, k, tokens)  # noqa: E731
    else:  # FLUX.1 (Kontext), Qwen-Image (Edit), Z-Image
        schedule = lambda sch, k: scheduler_sigmas(sch, k, tokens, True)  # noqa: E731
    expected = [float(x) for x in schedule(scheduler, 8)]
    assert static(options, 8) == expected and expected[0] == 1.0 and expected[-1] == 0.0
    larger = registry.get("backbone", name).options(pretrained=str(tmp_path), resolution=1024)
    assert static(larger, 8) != expected  # it shifts with the image's tokens


@pytest.mark.parametrize("backbone", ["tiny-z-image", "tiny-flux.2-klein", "tiny-qwen-image-edit"])
def test_an_entropy_grid_that_is_not_a_dynamic_schedule_is_refused_before_anything_loads(tmp_path, backbone):
    recipe = tmp_path / "tiny.toml"
    recipe.write_text(recipe_text(tmp_path / "run"))
    combo = {"backbone": backbone, "plan": "entropy-steps", "sampler": "flow-sde", "credit": "branch",
             "optimizer": "grpo", "recompute": "native", "precision": "no", "compile": "off", "cfg_gradient": "full",
             "finetune": "lora"}  # fmt: skip
    with pytest.raises(RecipeError, match="entropy-steps ranks the steps' entropies"):
        load_recipe(recipe, overrides(combo, Path(tmp_path / "unused.safetensors")))
