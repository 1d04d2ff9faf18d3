"""The rival methods' paper-scale recipes carry their code's published settings (../shared/RIVALS.md).

A recipe that drifts from its method (a default left where the method's code sets something else: the std its
advantages divide by, the KL's normalisation, FLUX's time shift, how many samples an optimizer step averages) still
validates and trains; only a comparison with the source catches it. Each table below is RIVALS.md's, section by
section, written out here; the recipes are read as tpflow reads them (no weights needed).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tpflow.recipe import load_recipe

RECIPES = Path(__file__).resolve().parents[1] / "recipes"

# §1(c), (d): TempFlow-GRPO, pickscore_sd3_pr: K = 10, 6 siblings, flow-sde η 0.7, steps 0..8, β 1e-3 on a KL over
# 2·s_k², the noise-aware weight.
TEMPFLOW = {
    "rollout.num_steps": 10, "rollout.window_size": 9, "rollout.window_range": (0, 9), "rollout.noise_level": 0.7,
    "rollout.same_noise": True, "train.group_size": 6, "sampler": "flow-sde", "plan": "branch", "credit": "branch",
    "optimizer.beta": 1e-3, "optimizer.kl_std": "transition", "optimizer.step_weight": "noise-aware",
}  # fmt: skip
# §2(d): Flow-GRPO-Fast, pickscore_sd3_fast_nocfg: K = 10, w = 3 at a ∈ {0, 1, 2} per image, cps η 0.8, G 18,
# ε 1e-5, the std over the whole batch.
FLOWGRPO_FAST = {
    "rollout.num_steps": 10, "rollout.window_size": 3, "rollout.window_range": (0, 5), "rollout.noise_level": 0.8,
    "train.group_size": 18, "sampler": "cps", "plan": "window-per-image", "optimizer.clip_range": 1e-5,
    "optimizer.global_std": True,
}  # fmt: skip
# §3: MixGRPO on FLUX: K = 25 on σ = 3t/(1 + 2t), w = 4 flow-sde steps at η 0.7 cut at K − 2, 25 iterations per
# start, stride 1, roll back; 12 copies sharing x_0; A over torch.std + 1e-8; a step every 3 samples; lr 1e-5.
MIXGRPO = {
    "backbone.time_shift": 3.0, "rollout.num_steps": 25, "rollout.window_size": 4, "rollout.window_range": (0, 23),
    "rollout.noise_level": 0.7, "rollout.same_noise": True, "train.group_size": 12, "sampler": "flow-sde",
    "plan": "window-schedule", "plan.strategy": "progressive", "plan.iters_per_group": 25, "plan.stride": 1,
    "plan.roll_back": True, "plan.truncate": True, "plan.after_window": "euler", "optimizer.learning_rate": 1e-5,
    "optimizer.clip_range": 1e-4, "optimizer.adv_clip_max": 5.0, "optimizer.beta": 0.0,
    "optimizer.advantage_std": "sample", "optimizer.advantage_eps": 1e-8, "samples_per_step": 3,
}  # fmt: skip
MIXGRPO_FLASH = {**MIXGRPO, "plan.iters_per_group": 20, "plan.after_window": "dpm-solver++", "plan.post_ratio": 0.4}
# §4: GRPO-Guard, pickscore_hps_sd3_ratio_norm: flow-sde η 0.7 on all K = 10, steps 0..8 trained, G 24, RatioNorm
# with the 1/Δσ reweight, ε 4e-6, lr 1e-4, β 0.
GRPO_GUARD = {
    "rollout.num_steps": 10, "rollout.window_size": 10, "rollout.window_range": (0, 10), "rollout.noise_level": 0.7,
    "train.group_size": 24, "sampler": "flow-sde", "plan": "trained-fraction", "plan.fraction": 1.0,
    "plan.exclude_last": True, "optimizer.ratio_norm": True, "optimizer.ratio_norm_reweight": True,
    "optimizer.clip_range": 4e-6, "optimizer.learning_rate": 1e-4, "optimizer.beta": 0.0,
}  # fmt: skip
# §6(c): DanceGRPO, finetune_flux_grpo_8gpus_lora.sh: K = 12 dance-sde steps at η 0.3 on shift 3, 12 copies sharing
# x_0, int(11·0.6) of the first 11 trained, A over torch.std + 1e-8, ε 1e-4, lr 3e-4, a step every 12 samples.
DANCEGRPO = {
    "backbone.time_shift": 3.0, "rollout.num_steps": 12, "rollout.window_size": 12, "rollout.window_range": (0, 12),
    "rollout.noise_level": 0.3, "rollout.same_noise": True, "train.group_size": 12, "sampler": "dance-sde",
    "plan": "trained-fraction", "plan.fraction": 0.6, "plan.exclude_last": True, "optimizer.learning_rate": 3e-4,
    "optimizer.clip_range": 1e-4, "optimizer.adv_clip_max": 5.0, "optimizer.beta": 0.0,
    "optimizer.advantage_std": "sample", "optimizer.advantage_eps": 1e-8, "samples_per_step": 12,
}  # fmt: skip

PUBLISHED = {
    "pickscore_tempflow.toml": TEMPFLOW,
    "pickscore_flowgrpo_fast.toml": FLOWGRPO_FAST,
    "flux_mixgrpo.toml": MIXGRPO,
    "flux_mixgrpo_flash.toml": MIXGRPO_FLASH,
    "pickscore_grpo_guard.toml": GRPO_GUARD,
    "flux_dancegrpo.toml": DANCEGRPO,
}


def setting(recipe, key: str):
    """A recipe's value of ``key``: a component's name ("plan"), a component option ("plan.stride"), a settings
    field ("rollout.num_steps"), or the samples one optimizer step averages per process ("samples_per_step")."""
    if key == "samples_per_step":
        options = recipe.optimizer.options
        return options.micro_batch_size * options.gradient_accumulation_steps
    section, _, name = key.partition(".")
    part = getattr(recipe, section)
    if hasattr(part, "options"):  # a component: [backbone], [sampler], [plan], [credit], [optimizer]
        return part.name if not name else getattr(part.options, name)
    value = getattr(part, name)
    return tuple(value) if isinstance(value, list) else value


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_a_rival_recipe_holds_its_codes_published_settings(name):
    recipe = load_recipe(RECIPES / name)
    got = {key: setting(recipe, key) for key in PUBLISHED[name]}
    wrong = {key: (got[key], want) for key, want in PUBLISHED[name].items() if got[key] != want}
    assert not wrong, f"{name}: (recipe, published) {wrong}"
