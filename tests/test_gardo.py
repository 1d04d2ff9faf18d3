"""GARDO's components (docs/algorithm.md §10.9) against the formulas of its public code, written out here in float64
(yifan123/flow_grpo at 94e23ee: ``flow_grpo/stat_tracking.py`` for the shaping, ``scripts/train_sd3_gardo.py`` for
the gate and the reference's resets), and the adaptive reference across a resume."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from tests.kill_leaves import comparable_metrics, what_a_kill_leaves
from tests.test_preflight import assert_one_paragraph, run_cli
from tests.test_train import tiny_recipe
from tpflow.optim.adaptive_reference import AdaptiveReference
from tpflow.optim.grpo import GRPO
from tpflow.optim.grpo_options import GRPOOptions
from tpflow.optim.kl_gate import GateFraction, gated_rows, rank_disagreement
from tpflow.recipe import load_recipe
from tpflow.rewards.diversity_features import pixel_features
from tpflow.rewards.diversity_shaped import DiversityShapedOptions, DiversityShapedReward, shaped
from tpflow.train.run_logger import read_jsonl
from tpflow.train.trainer import Trainer


def reference_gardo_advantages(prompts: list[str], rewards: np.ndarray, features: np.ndarray) -> np.ndarray:
    """``PerPromptStatTracker.update(prompts, rewards, dists, type='gardo')`` for one epoch, step by step."""
    prompts_a = np.array(prompts)
    dists = features / np.linalg.norm(features, ord=2, axis=1, keepdims=True)
    advantages = np.zeros_like(rewards)
    for prompt in np.unique(prompts_a):
        here = prompts_a == prompt
        r, f = rewards[here], dists[here]
        mean = np.mean(r)
        distance = 1 - np.clip(f @ f.T, -1, 1)
        nearest = np.array([np.min(np.delete(distance[i], i)) for i in range(len(r))])
        weight = np.where(r - mean < 0, 1.0, nearest / np.mean(nearest))
        advantages[here] = (r - mean) * weight
    return advantages


def _batch(seed: int = 0) -> tuple[list[str], torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    prompts = [p for p in ("a red circle", "two blue squares", "a green star") for _ in range(5)]
    order = torch.randperm(len(prompts), generator=g).tolist()  # groups need not be contiguous
    prompts = [prompts[i] for i in order]
    rewards = torch.rand(len(prompts), generator=g, dtype=torch.float64)
    features = torch.randn(len(prompts), 6, generator=g, dtype=torch.float64)
    return prompts, rewards, features


def test_the_shaped_reward_is_the_references_advantage_in_float64():
    """r' − μ_g is the reference's (r − μ_g)·w to 1e-12, and it amplifies, damps and keeps the images the reference
    does: above the mean, w > 1 exactly where the nearest sibling is farther than the group's average."""
    prompts, rewards, features = _batch()
    unit = features / features.norm(dim=1, keepdim=True)
    out, weights = shaped(rewards, unit, prompts)
    expected = reference_gardo_advantages(prompts, rewards.numpy(), features.numpy())
    means = {p: float(rewards[[i for i, q in enumerate(prompts) if q == p]].mean()) for p in set(prompts)}
    centred = out - torch.tensor([means[p] for p in prompts], dtype=torch.float64)
    assert torch.allclose(centred, torch.from_numpy(expected), rtol=0, atol=1e-12)
    raw = rewards - torch.tensor([means[p] for p in prompts], dtype=torch.float64)
    amplified = (expected.__abs__() > raw.abs().numpy() + 1e-12) & (raw.numpy() > 0)
    assert bool((weights[torch.from_numpy(amplified)] > 1).all()) and amplified.any()
    assert bool((weights[raw < 0] == 1).all())


def test_the_wrapper_scores_with_its_inner_reward_and_keeps_it_in_details():
    """The registered reward around ``image-stat`` with pixel features: its scores are ``shaped`` of the inner
    scores, and the inner scores are in details under the inner reward's name."""
    options = DiversityShapedOptions.model_validate({"reward": {"name": "image-stat"}, "features": "pixels"})
    reward = DiversityShapedReward(options)
    images = torch.rand(6, 3, 16, 16, generator=torch.Generator().manual_seed(1))
    prompts = ["x"] * 3 + ["y"] * 3
    out = reward(images, prompts, [{}] * 6)
    inner = out.details["image-stat"]
    expected, _ = shaped(inner, pixel_features(images).double(), prompts)
    assert torch.equal(out.scores, expected.float())
    assert not torch.equal(out.scores, inner)


def test_no_std_gives_the_centred_advantages_a_group_constant_from_the_reference():
    """``advantage_std = "none"``: A = r' − mean_g r', the reference's advantage minus the group constant c_g."""
    prompts, rewards, features = _batch(2)
    out, _ = shaped(rewards, features / features.norm(dim=1, keepdim=True), prompts)
    advantages = GRPO(GRPOOptions(advantage_std="none")).advantages(out[:, None], prompts)[:, 0]
    expected = torch.from_numpy(reference_gardo_advantages(prompts, rewards.numpy(), features.numpy()))
    for p in set(prompts):
        rows = [i for i, q in enumerate(prompts) if q == p]
        c_g = expected[rows].mean()
        assert torch.allclose(advantages[rows], expected[rows] - c_g, rtol=0, atol=1e-12)
        assert c_g >= 0


def test_the_gate_is_the_references_ranks_controller_and_percentile():
    """u, φ over five epochs, and the gated rows, against the script's ranking, ``RiskCompensator`` and
    ``np.percentile`` written out."""
    g = torch.Generator().manual_seed(3)
    controller, beta, buffer = GateFraction(), 0.1, []
    for epoch in range(5):
        main, aes, ir = (torch.rand(40, generator=g, dtype=torch.float64) for _ in range(3))
        ranks = []
        for scores in (aes, ir, main):
            order = np.argsort(-scores.numpy(), kind="stable")
            r = np.empty(40)
            r[order] = np.arange(1, 41)
            ranks.append(r)
        u_ref = ranks[2] - (ranks[0] + ranks[1]) / 2
        pad = u_ref[u_ref >= 0]
        if not buffer:
            beta = 0.1
        elif np.mean(pad) > max(buffer):
            beta *= 1.1
        elif np.mean(pad) < min(buffer):
            beta *= 0.9
        beta = float(np.clip(beta, 0.02, 0.2))
        buffer = [*buffer, float(np.mean(pad))][-20:]
        gate_ref = u_ref > np.percentile(pad, 100 - beta * 100)
        u = rank_disagreement(main, [aes, ir])
        assert torch.equal(u, torch.from_numpy(u_ref)), epoch
        assert math.isclose(controller.update(u), beta, rel_tol=0, abs_tol=1e-15), epoch
        assert torch.equal(gated_rows(u, controller.fraction), torch.from_numpy(gate_ref)), epoch
        assert 0 < int(gate_ref.sum()) < 40


def test_the_reference_resets_at_the_references_epochs():
    """``AdaptiveReference`` against the script's loop: a reset when (epoch ≠ 0 and a step's KL exceeded kl_thres)
    or more than reset_freq epochs passed; the copy is the policy of that moment."""
    steps_kl = {3: 5e-4, 4: 1e-4, 9: 3.1e-4, 30: 1.0}  # an epoch's largest step KL (others 0)
    held = AdaptiveReference(every=15, threshold=3e-4)
    param = torch.zeros(2)
    reset, prev_epoch, old, resets = False, 0, param.clone(), []
    for epoch in range(50):
        if (epoch != 0 and reset) or (epoch - prev_epoch) > 15:  # the script, before its update
            old, reset, prev_epoch = param.clone(), False, epoch
            resets.append(epoch)
        did = held.begin_update([param])
        assert did == (resets[-1:] == [epoch]), epoch
        assert held.copy is not None and torch.equal(held.copy[0], old), epoch
        param = param + 1  # the update moves the policy
        kl = steps_kl.get(epoch, 0.0)
        held.observe(kl)
        reset = reset or kl > 3e-4
    assert resets == [4, 10, 26, 31, 47]


def test_refused_in_one_paragraph_before_anything_loads(tmp_path, tiny_weights):
    recipe = tiny_recipe(tmp_path, tiny_weights, credit="outcome", reward="image-stat")
    text = recipe.read_text().replace('name = "grpo"\n', 'name = "grpo"\nadaptive_reference = true\n')
    recipe.write_text(text.replace("beta = 1e-3", "beta = 0.0"))
    code, err = run_cli("validate", str(recipe), "--no-machine")
    assert_one_paragraph(code, err, "adaptive_reference = true with beta = 0", "Set beta > 0")
    recipe.write_text(text.replace('name = "grpo"\n', 'name = "grpo"\nrecompute = "retain"\n'))
    code, err = run_cli("validate", str(recipe), "--no-machine")
    assert_one_paragraph(code, err, 'adaptive_reference = true with recompute = "retain"')


def _adapter(trainer: Trainer) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in trainer.backbone.model.named_parameters() if "lora_" in n}


def test_a_resume_restores_the_reference_copy_and_its_schedule_bitwise(tmp_path, tiny_weights):
    """2 epochs straight against the run resumed from its first checkpoint (the later one deleted, as a kill leaves
    it): the adapter, the reference copy and every logged metric bitwise. A threshold every step's KL exceeds makes
    the copy reset before update 1, which the resumed run knows only from the restored flag."""
    recipe = tiny_recipe(tmp_path, tiny_weights, credit="outcome", reward="image-stat")
    recipe.write_text(recipe.read_text().replace(
        'name = "grpo"\n', 'name = "grpo"\nadaptive_reference = true\nreference_reset_kl = 1e-30\n'))  # fmt: skip
    sets = ["train.epochs=2", "eval.every=0", "train.keep_checkpoints=0", "train.ema=false"]
    straight = Trainer(load_recipe(recipe, sets))
    straight.fit()
    rows = read_jsonl(straight.run_dir / "metrics.jsonl")
    assert [r["reference_reset"] for r in rows if "reference_reset" in r] == [0.0, 1.0]
    killed = tmp_path / "killed"
    what_a_kill_leaves(straight.run_dir, killed)
    resumed = Trainer(load_recipe(recipe, [*sets, f"train.run_dir={killed}"]), resume=True)
    assert resumed.epoch == 1
    resumed.fit()
    a, b = _adapter(straight), _adapter(resumed)
    assert all(torch.equal(a[n], b[n]) for n in a)
    assert straight.optimizer.adaptive.copy is not None
    assert all(torch.equal(x, y) for x, y in zip(straight.optimizer.adaptive.copy, resumed.optimizer.adaptive.copy,
                                                 strict=True))  # fmt: skip
    assert comparable_metrics(straight.run_dir) == comparable_metrics(killed)


@pytest.mark.parametrize("bad", ["features", "reward"])
def test_the_wrappers_options_are_checked_before_anything_loads(bad):
    from tpflow.errors import UserError

    options = {"reward": {"name": "image-stat"}, "features": "pixels"}
    options[bad] = "dinov3" if bad == "features" else {"name": "no-such-reward"}
    with pytest.raises((ValueError, UserError)) as caught:
        DiversityShapedOptions.model_validate(options)
    assert ("names no embedding" if bad == "features" else "no-such-reward") in str(caught.value)


def _observed_kl(weights: str, micro: int, accumulation: int) -> list[float]:
    """The mean KL each optimizer step hands the adaptive reference, over two updates of the same 8 rows (one step
    each) cut into micro-batches of ``micro``, ``accumulation`` per step."""
    import tpflow
    from tests.distributed_workers import two_window_batch

    torch.manual_seed(0)  # the LoRA init
    backbone = tpflow.build("backbone", "shapes-dit", weights=weights, lora_init="gaussian")
    sampler = tpflow.build("sampler", "cps")
    optimizer = tpflow.build("optimizer", "grpo", learning_rate=1e-2, beta=1e-2, micro_batch_size=micro,
                             gradient_accumulation_steps=accumulation, adaptive_reference=True)  # fmt: skip
    optimizer.bind(backbone)
    batch = two_window_batch(backbone, sampler)
    advantages = torch.randn(8, 3, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    seen, observe = [], optimizer.adaptive.observe
    optimizer.adaptive.observe = lambda kl: (seen.append(kl), observe(kl))
    for _ in range(2):
        optimizer.update(backbone, sampler, batch, advantages)
    return seen


def test_the_kl_the_reference_sees_does_not_depend_on_the_micro_batches(tiny_weights):
    """A step's KL is its mean over its rows, whatever their micro-batches: 0 at the first step (the copy is the
    policy), the same value after it for 8 × 1, 4 × 2 and 2 × 4."""
    whole = _observed_kl(str(tiny_weights), 8, 1)
    assert len(whole) == 2 and whole[0] == 0.0 and whole[1] > 0
    for micro, accumulation in ((4, 2), (2, 4)):
        split = _observed_kl(str(tiny_weights), micro, accumulation)
        assert split[0] == 0.0 and math.isclose(split[1], whole[1], rel_tol=1e-5), (micro, split, whole)


def test_timm_features_are_gardos_calls_on_a_tiny_timm_vit(tmp_path, monkeypatch):
    """``features = "timm:<model>:<file>"``: GARDO's embedding, run beside timm's own calls as the reference script
    makes them (``timm.create_model(name, pretrained=True)`` with the file as its ``pretrained_cfg_overlay``, the
    eval transform of ``resolve_model_data_config`` on the float batch, the output L2-normalised), on timm's
    ``test_vit`` saved to a file; without the file or a cached ``timm/<model>``, one paragraph before anything
    loads."""
    import timm
    from safetensors.torch import save_file

    from tpflow.rewards.diversity_features import build_features, feature_sources

    torch.manual_seed(0)
    file = tmp_path / "model.safetensors"
    save_file(timm.create_model("test_vit", pretrained=False).state_dict(), str(file))
    images = torch.rand(3, 3, 32, 32)  # [N, 3, H, W] in [0, 1]
    ours = build_features(f"timm:test_vit:{file}", torch.device("cpu"))(images)
    model = timm.create_model("test_vit", pretrained=True, pretrained_cfg_overlay={"file": str(file)}).eval()
    transform = timm.data.create_transform(**timm.data.resolve_model_data_config(model), is_training=False)
    with torch.no_grad():
        embs = model(transform(images).to(torch.float32)).double().numpy()  # the script's feature_embs
    reference = embs / np.linalg.norm(embs, ord=2, axis=1, keepdims=True)  # stat_tracking.py's normalisation
    np.testing.assert_allclose(ours.double().numpy(), reference, rtol=1e-5, atol=1e-6)
    assert ours.dtype == torch.float32 and ours.device.type == "cpu"
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty-cache"))
    (missing,) = feature_sources("timm:vit_large_patch16_dinov3.lvd1689m", "reward 'diversity-shaped', features")
    assert missing.problem and "\n" not in missing.problem and "never downloads" in missing.problem
    assert "timm/vit_large_patch16_dinov3.lvd1689m" in missing.problem
    (found,) = feature_sources(f"timm:test_vit:{file}", "features")
    assert found.problem is None and found.path == str(file)
    with pytest.raises(ValueError, match="names no embedding"):
        DiversityShapedOptions(reward={"name": "image-stat"}, features="timm:")
