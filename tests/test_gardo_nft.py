"""GARDO on DiffusionNFT (``[optimizer] name = "nft"`` with ``kl_gate``, ``adaptive_reference``,
``advantage_std = "none"`` and the ``diversity-shaped`` reward; docs/algorithm.md §10.9) against the authors' script
written out here in float64 (tinnerhrhe/GARDO at 52fd5e7: ``scripts/train_sd3_nft_gardo.py``,
``flow_grpo/stat_tracking.py``'s ``PerPromptStatTrackerNFT``): the advantage and NFT's optimality, the gated KL with
its all-rows fallback, the moving reset threshold; the same step whatever the micro-batches; a resume bitwise."""

from __future__ import annotations

import dataclasses
import itertools
import math

import numpy as np
import pytest
import torch

import tpflow
from tests.kill_leaves import comparable_metrics, what_a_kill_leaves
from tests.test_gardo import reference_gardo_advantages
from tests.test_gardo_gate import reference_gate
from tests.test_nft_train import NFT_SECTION, nft_recipe
from tpflow.devices import cpu_generator
from tpflow.optim.adaptive_reference import AdaptiveReference
from tpflow.optim.final import draw_noise, draw_times, forward_noising
from tpflow.optim.kl_gate import fallback_weights
from tpflow.optim.nft_loss import optimality
from tpflow.recipe import load_recipe
from tpflow.rewards.diversity_shaped import shaped
from tpflow.train.trainer import Trainer

GATE = {"kl_gate": True, "kl_gate_main": "main", "kl_gate_aux": ["aes", "ir"], "kl_gate_fraction": 0.5,
        "kl_gate_max": 0.5, "kl_gate_batch": 2}  # fmt: skip


def reference_nft_advantages(prompts: list[str], rewards: np.ndarray, features: np.ndarray) -> np.ndarray:
    """``PerPromptStatTrackerNFT.update(prompts, rewards, dists)`` for one epoch (its shaping is the GRPO tracker's,
    line for line: ``reference_gardo_advantages``), then the script's clip to ±5 and ``r = clamp(A / 5 / 2 + 0.5, 0,
    1)``: the optimality each sample trains at."""
    advantages = reference_gardo_advantages(prompts, rewards, features)
    return np.clip(np.clip(advantages, -5, 5) / 5 / 2.0 + 0.5, 0, 1)


def test_the_optimality_is_the_scripts_less_a_group_constant_in_float64():
    """tpflow's r (shaped reward, advantages not divided by a std, NFT's mapping) is the script's r minus
    c_g / (2·adv_clip_max), c_g the group's mean of the script's advantages (1e-12)."""
    g = torch.Generator().manual_seed(4)
    prompts = [p for p in ("a red circle", "two squares", "a star") for _ in range(6)]
    rewards = torch.rand(18, generator=g, dtype=torch.float64)
    features = torch.randn(18, 5, generator=g, dtype=torch.float64)
    expected = reference_nft_advantages(prompts, rewards.numpy(), features.numpy())
    out, _ = shaped(rewards, features / features.norm(dim=1, keepdim=True), prompts)
    nft = tpflow.build("optimizer", "nft", advantage_std="none")
    r = optimality(nft.advantages(out[:, None], prompts)[:, 0], 5.0)
    for p in set(prompts):
        rows = [i for i, q in enumerate(prompts) if q == p]
        c_g = float((torch.from_numpy(expected[rows]) - 0.5).mean()) * 10  # the script's advantages' group mean
        assert torch.allclose(r[rows], torch.from_numpy(expected[rows]) - c_g / 10, rtol=0, atol=1e-12)
    assert not torch.allclose(r, torch.from_numpy(expected), rtol=0, atol=1e-6)  # the constant is there


def _authors_kl(kl: torch.Tensor, gated: torch.Tensor, batch: int) -> float:
    """The script's KL term averaged over every micro-batch of ``batch`` rows: the mean over its gated rows, over
    all its rows when none is gated."""
    terms = []
    for rows in itertools.combinations(range(len(kl)), batch):
        s = torch.tensor(rows)
        g = gated[s]
        terms.append(kl[s][g].mean() if g.any() else kl[s].mean())
    return float(torch.stack(terms).mean())


def test_the_fallback_weights_are_the_scripts_rule_in_expectation():
    """For any KL values, the weighted row mean is the script's micro-batch term averaged over every micro-batch
    of B rows (1e-12), B = 1..8, with 0, some and all rows gated."""
    g = torch.Generator().manual_seed(2)
    for gated in (torch.tensor([0, 1, 0, 0, 1, 0, 0, 0]).bool(), torch.zeros(8).bool(), torch.ones(8).bool()):
        for batch in range(1, 9):
            kl = torch.rand(8, generator=g, dtype=torch.float64)
            weights = fallback_weights(gated, batch)
            assert math.isclose(float((weights * kl).mean()), _authors_kl(kl, gated, batch), rel_tol=1e-12)


def _update(weights: str, micro: int, accumulation: int, updates: int = 1, **options):
    """nft on 8 final samples of shapes-dit with its LoRA moved off its init (the KL to the base model > 0),
    reward details for the gate; the metrics of ``updates`` updates, the optimizer, backbone and batch."""
    from tpflow.rollout import Window, rollout

    torch.manual_seed(0)  # the LoRA init
    backbone = tpflow.build("backbone", "shapes-dit", weights=weights, lora_init="gaussian")
    with torch.no_grad():
        for p in backbone.trainable_parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=cpu_generator(1)).to(p))
    prompts = ["a photo of a red circle", "a photo of two squares"] * 4
    z0 = backbone.initial_noise(8, cpu_generator(0))
    batch = rollout(backbone, tpflow.build("sampler", "cps"), backbone.encode(prompts), z0, backbone.sigmas(3),
                    Window(0, 1), 0.0, 1.0, None, transitions=False)  # fmt: skip
    g = torch.Generator().manual_seed(5)
    batch = dataclasses.replace(batch, reward_details={k: torch.rand(8, generator=g) for k in ("main", "aes", "ir")})
    optimizer = tpflow.build("optimizer", "nft", learning_rate=1e-2, kl_weight=1e-2, micro_batch_size=micro,
                             gradient_accumulation_steps=accumulation, num_timesteps=4, timesteps_per_sample=2,
                             seed=11, **options)  # fmt: skip
    optimizer.bind(backbone)
    advantages = torch.randn(8, 1, generator=cpu_generator(3), dtype=torch.float64)
    metrics = [optimizer.update(backbone, None, batch, advantages) for _ in range(updates)]
    return metrics, optimizer, backbone, batch


def test_the_gated_kl_is_the_scripts_in_float64(tiny_weights):
    """One update: the gate is the script's (ranks, percentile at φ), the step's KL the script's micro-batch rule
    (B = 2) averaged over every micro-batch, from v_θ and the base model's v_ref at each sample's drawn t and ε
    computed here in float64 (rel 1e-5)."""
    from tpflow.optim.kl_gate import GateFraction, KLGate

    (metrics,), optimizer, backbone, batch = _update(str(tiny_weights), 8, 1, **GATE)
    torch.manual_seed(0)
    fresh = tpflow.build("backbone", "shapes-dit", weights=str(tiny_weights), lora_init="gaussian")
    with torch.no_grad():  # the adapter as the update found it
        for p in fresh.trainable_parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=cpu_generator(1)).to(p))
    gated = torch.from_numpy(reference_gate(batch.reward_details, 0.5))
    assert 0 < int(gated.sum()) < 8
    key, schedule = (11, 0, 0), fresh.sigmas(4)[:4]
    times = draw_times(key, range(8), num_timesteps=4, per_sample=2)
    kl = torch.zeros(8, 2, dtype=torch.float64)
    with torch.no_grad():
        for i, j in itertools.product(range(8), range(2)):
            t = schedule[times[i, j]].reshape(1)
            x_t = forward_noising(
                batch.final[i : i + 1].float(),
                t,
                draw_noise(key, [i], j, tuple(batch.final.shape[1:]), torch.device("cpu")),
            )
            cond = batch.cond.index(torch.tensor([i]))
            v = fresh.velocity(x_t, t, cond, 1.0).double()
            with fresh.reference():
                v_ref = fresh.velocity(x_t, t, cond, 1.0).double()
            kl[i, j] = (v - v_ref).square().mean()
    expected = sum(_authors_kl(kl[:, j], gated, 2) for j in range(2)) / 2
    assert metrics["kl"] > 0 and math.isclose(metrics["kl"], expected, rel_tol=1e-5), (metrics["kl"], expected)
    assert metrics["kl_gated_fraction"] == float(gated.double().mean()) and metrics["kl_gate_phi"] == 0.5
    weights, _ = KLGate("main", ["aes", "ir"], GateFraction(0.5, 0.1, 0.02, 0.5), 2).row_weights(
        batch.reward_details, optimizer.loop.dist
    )
    assert torch.equal(weights, fallback_weights(gated, 2).float())


def test_the_step_does_not_depend_on_the_micro_batches(tiny_weights):
    """Gate (with its fallback) and adaptive reference, two updates (the second's KL to the copy made at the first):
    8 × 1, 4 × 2 and 2 × 4 give the same KL (rel 1e-5) and the same adapter (1e-6)."""
    runs = []
    for micro, accumulation in ((8, 1), (4, 2), (2, 4)):
        metrics, optimizer, backbone, _ = _update(str(tiny_weights), micro, accumulation, updates=2,
                                                  adaptive_reference=True, **GATE)  # fmt: skip
        params = torch.cat([p.detach().flatten() for p in backbone.trainable_parameters()])
        runs.append((metrics[1]["kl"], params))
        assert metrics[0]["kl"] == 0.0 and metrics[1]["kl"] > 0  # the first update's copy is the policy itself
    for kl, params in runs[1:]:
        assert math.isclose(kl, runs[0][0], rel_tol=1e-5)
        assert torch.allclose(params, runs[0][1], rtol=1e-5, atol=1e-6)  # Adam: a ~1e-7 gradient change, a step


def test_the_threshold_moves_as_the_scripts():
    """``moves``: resets and thresholds over 60 epochs against the script's loop (thres from 0.15; after a reset,
    max(thres − 0.01, 0.1) when more than 15 epochs passed, min(thres + 0.01, 0.05) when fewer than 5)."""
    steps_kl = {2: 0.2, 20: 0.06, 36: 0.2, 39: 0.06}  # 0.06 passes 0.05, not 0.1
    held = AdaptiveReference(every=15, threshold=0.15, moves=True)
    thres, prev_epoch, reset, seen = 0.15, 0, False, []
    for epoch in range(60):
        if (epoch != 0 and reset) or (epoch - prev_epoch) > 15:
            reset = False
            if epoch - prev_epoch > 15:
                thres = max(thres - 1e-2, 1e-1)
            if epoch - prev_epoch < 5:
                thres = min(thres + 1e-2, 5e-2)
            prev_epoch = epoch
            seen.append((epoch, thres))
        held.begin_update([torch.zeros(1)])
        assert held.threshold == thres and held.last_reset == prev_epoch, epoch
        held.observe(steps_kl.get(epoch, 0.0))
        reset = reset or steps_kl.get(epoch, 0.0) > thres
    assert seen == [(3, 0.05), (19, 0.1), (35, 0.1), (37, 0.05), (40, 0.05), (56, 0.1)], seen


ALL = (
    NFT_SECTION
    + """adaptive_reference = true
reference_reset_kl = 1e-30
reference_reset_kl_moves = true
advantage_std = "none"
kl_gate = true
kl_gate_main = "weighted/bright"
kl_gate_aux = ["weighted/saturated"]
kl_gate_fraction = 0.5
kl_gate_max = 0.5
kl_gate_batch = 2
"""
)
SHAPED = ('name = "diversity-shaped"\nfeatures = "pixels"\nreward = { name = "weighted", options = { rewards = [ '
          '{ name = "image-stat", label = "bright" }, { name = "image-stat", label = "saturated", weight = 0.0, '
          'options = { statistic = "saturation" } } ] } }')  # fmt: skip


def test_a_resume_restores_the_reference_the_threshold_and_the_gate_bitwise(tmp_path, tiny_weights):
    """GARDO's three parts on nft, 2 epochs straight against the run resumed from its first checkpoint (the later
    one deleted, as a kill leaves it): adapter, old policy, reference copy, moved threshold, gate controller and
    every logged metric bitwise. Every step's KL exceeds the threshold, so the copy resets before update 1, which
    the resumed run knows only from the restored flag."""
    recipe = nft_recipe(tmp_path, tiny_weights, section=ALL)
    recipe.write_text(recipe.read_text().replace('name = "image-stat"', SHAPED, 1))
    sets = ["train.epochs=2", "eval.every=0", "train.keep_checkpoints=0", "train.ema=false", "train.rollout_batch=8"]
    straight = Trainer(load_recipe(recipe, sets))
    straight.fit()
    assert straight.optimizer.adaptive.last_reset == 1 and straight.optimizer.adaptive.threshold == 0.01
    killed = tmp_path / "killed"
    what_a_kill_leaves(straight.run_dir, killed)
    resumed = Trainer(load_recipe(recipe, [*sets, f"train.run_dir={killed}"]), resume=True)
    assert resumed.epoch == 1 and resumed.optimizer.adaptive.flagged
    resumed.fit()
    a, b = (torch.cat([p.detach().flatten() for p in t.backbone.trainable_parameters()]) for t in (straight, resumed))
    assert torch.equal(a, b)
    s, r = straight.optimizer, resumed.optimizer
    for x, y in ((s.adaptive.copy, r.adaptive.copy), (s.lagged.old, r.lagged.old)):
        assert all(torch.equal(p, q) for p, q in zip(x, y, strict=True))
    assert s.adaptive.threshold == r.adaptive.threshold
    assert s.gate.controller.state_dict() == r.gate.controller.state_dict()
    assert comparable_metrics(straight.run_dir) == comparable_metrics(killed)


@pytest.mark.parametrize(
    "sets,expected",
    [
        (["optimizer.kl_gate=true", 'optimizer.kl_gate_main="bright"', 'optimizer.kl_gate_aux=["saturated"]',
          "optimizer.kl_weight=0.0"], "kl_gate = true with kl_weight = 0"),
        (["optimizer.adaptive_reference=true", "optimizer.kl_weight=0.0"],
         "adaptive_reference = true with kl_weight = 0"),
        (["optimizer.kl_gate_batch=9"], "kl_gate_batch is set without kl_gate = true"),
        (["optimizer.reference_reset_kl_moves=true"], "reference_reset_kl_moves is set without adaptive_reference"),
        (["optimizer.kl_gate=true", 'optimizer.kl_gate_main="bright"', 'optimizer.kl_gate_aux=["contrast"]'],
         "'contrast', which the recipe's reward does not return"),
    ],
)  # fmt: skip
def test_refused_in_one_paragraph_before_anything_loads(tmp_path, tiny_weights, sets, expected):
    from tpflow.errors import RecipeError

    recipe = nft_recipe(tmp_path, tiny_weights)
    parts = ('name = "weighted"\nrewards = [{ name = "image-stat", label = "bright" }, { name = "image-stat", '
             'label = "saturated", weight = 0.0, options = { statistic = "saturation" } }]')  # fmt: skip
    recipe.write_text(recipe.read_text().replace('name = "image-stat"', parts, 1))
    with pytest.raises(RecipeError) as caught:
        load_recipe(recipe, sets)
    text = str(caught.value).strip()
    assert expected in text and "\n\n" not in text and "Traceback" not in text
