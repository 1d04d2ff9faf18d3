"""The epoch's speed changes (docs/results.md, "The cost of an epoch"): what is on by default computes exactly what it
replaced (the on-policy ratio stays exactly 1), what is off by default at least runs."""

from __future__ import annotations

import os

import pytest
import torch

import tpflow
from tpflow.backbones.diffusers_common import compile_blocks
from tpflow.errors import UserError
from tpflow.optim.advantages import group_advantages
from tpflow.rollout import Window, rollout


@pytest.mark.parametrize("name", ["cps", "flow-sde"])
def test_host_sigmas_give_the_device_sigmas_step(name):
    """On by default: σ that come from the host are checked there (no device synchronisation in the rollout loop);
    the step is bit for bit the one with σ already on the latents' device, and bad σ still raise."""
    sampler = tpflow.build("sampler", name)
    gen = torch.Generator().manual_seed(0)
    z, v = torch.randn(4, 3, 8, 8, generator=gen), torch.randn(4, 3, 8, 8, generator=gen)
    noise = torch.randn(4, 3, 8, 8, generator=gen)
    host = sampler.step(z, v, torch.tensor(0.8), 0.6, 0.7, noise=noise)
    vector = sampler.step(z, v, torch.full((4,), 0.8), torch.full((4,), 0.6), 0.7, noise=noise)
    for field in ("prev", "mean", "std", "log_prob", "std_dev_t"):
        assert torch.equal(getattr(host, field), getattr(vector, field)), field
    with pytest.raises(ValueError, match="sigma_next must not exceed sigma"):
        sampler.step(z, v, 0.5, 0.6, 0.7, noise=noise)
    with pytest.raises(ValueError, match="must lie in"):
        sampler.step(z, v, torch.tensor([0.5, 0.5, 1.5, 0.5]), 0.4, 0.7, noise=noise)


def _rollout_and_update(backbone):
    """A Flow-GRPO rollout and the GRPO update over it (KL on); returns the update's metrics."""
    sampler = tpflow.build("sampler", "cps")
    prompts = ["a photo of a red circle"] * 3 + ["a photo of two squares"] * 3
    cond = backbone.encode(prompts)
    z0 = backbone.initial_noise(6, torch.Generator().manual_seed(0))
    gen = torch.Generator().manual_seed(1)
    batch = rollout(backbone, sampler, cond, z0, backbone.sigmas(4), Window(0, 3), 0.7, 2.0, None, generator=gen)
    rewards = torch.randn(6, 3, generator=torch.Generator().manual_seed(2))
    # The update re-scores the rollout's 6 rows in one micro-batch: the same shapes as the rollout's calls. With
    # micro-batches of 3, CPU BLAS on 2 threads may sum in another order (seen: |κ − 1| = 6e-8), which says nothing
    # about tpflow's code paths, the subject here.
    optimizer = tpflow.build("optimizer", "grpo", learning_rate=1e-2, beta=1e-2, micro_batch_size=6)
    optimizer.bind(backbone)
    return optimizer.update(backbone, sampler, batch, group_advantages(rewards, prompts))


def test_default_rollout_is_exactly_on_policy(tiny_weights):
    """Everything on by default (host-checked σ, pinned noise copies on CUDA): ratio exactly 1 before the first
    optimizer step, for the outcome rollout the update re-scores."""
    backbone = tpflow.build("backbone", "shapes-dit", weights=str(tiny_weights), lora_init="gaussian")
    assert _rollout_and_update(backbone)["first_ratio_max_deviation"] == 0.0


def test_compile_blocks_compiles_every_repeated_block(tiny_weights):
    """Off by default. The option compiles each repeated block in place (names and adapters unchanged)."""
    plain = tpflow.build("backbone", "shapes-dit", weights=str(tiny_weights))
    assert all(block._compiled_call_impl is None for block in plain.model.blocks)
    compiled = tpflow.build("backbone", "shapes-dit", weights=str(tiny_weights), compile_blocks=True)
    assert compiled.model.blocks and all(block._compiled_call_impl is not None for block in compiled.model.blocks)
    assert [n for n, _ in plain.model.named_parameters()] == [n for n, _ in compiled.model.named_parameters()]
    sd3 = tpflow.build("backbone", "tiny-sd3", compile_blocks=True)
    assert all(block._compiled_call_impl is not None for block in sd3.transformer.transformer_blocks)
    with pytest.raises(UserError, match="compile_blocks"):
        compile_blocks(torch.nn.Linear(2, 2))


@pytest.mark.slow
@pytest.mark.skipif(
    os.environ.get("TPFLOW_COMPILE_TESTS") != "1",
    reason="torch.compile takes minutes on a CPU; TPFLOW_COMPILE_TESTS=1 runs it",
)
def test_compiled_blocks_run_and_stay_near_policy(tiny_weights):
    """Off by default: with compiled blocks a rollout and an update run, and the first ratio stays within the clip
    range (the rollout's no-grad graph and the update's grad graph round differently)."""
    backbone = tpflow.build(
        "backbone", "shapes-dit", weights=str(tiny_weights), lora_init="gaussian", compile_blocks=True
    )
    assert _rollout_and_update(backbone)["first_ratio_max_deviation"] <= 1e-5
