"""A third-party optimizer that implements ``tpflow.interfaces.Optimizer`` and nothing more, for the tests.

It uses no tpflow optimizer code (no ``AdamWLoop``): plain SGD on the policy gradient of the first window step,
its gradients averaged over the processes through ``Distributed.sync_gradients``, its forwards in the precision's
autocast region. Importing this module registers it as ``test-minimal``.
"""

from __future__ import annotations

import contextlib

import torch
from pydantic import BaseModel, ConfigDict, Field

from tpflow import register
from tpflow.distributed import Distributed
from tpflow.optim.advantages import group_advantages


class MinimalOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    learning_rate: float = Field(1e-2, gt=0)


@register("optimizer", "test-minimal", options=MinimalOptions)
class MinimalOptimizer:
    consumes = "transitions"

    def __init__(self, options: MinimalOptions) -> None:
        self.settings, self.global_step, self.params = options, 0, []  # no .options: train/ must not read it
        self.dist, self.autocast = Distributed(), contextlib.nullcontext

    def bind(self, backbone, accelerator=None, precision=None) -> None:
        self.params = backbone.trainable_parameters()
        self.sgd = torch.optim.SGD(self.params, lr=self.settings.learning_rate)
        self.dist = Distributed(accelerator)
        self.autocast = precision.autocast if precision is not None else contextlib.nullcontext

    def batch_layout(self):
        return None

    def sampling_policy(self):
        return contextlib.nullcontext()

    def advantages(self, step_rewards, groups):
        return group_advantages(step_rewards, groups)

    def update(self, backbone, sampler, batch, advantages, on_step=None) -> dict[str, float]:
        adv = advantages.to(device=batch.device, dtype=torch.float32)
        sigma, sigma_next = batch.sigmas[:, 0], batch.sigmas[:, 1]
        with self.autocast():
            v = backbone.velocity(batch.latents[:, 0], sigma, batch.cond, batch.guidance)
        out = sampler.log_prob(batch.next_latents[:, 0], batch.latents[:, 0], v, sigma, sigma_next, batch.noise_level)
        (-(adv[:, 0] * out.log_prob).sum()).backward()
        self.dist.sync_gradients(self.params, float(len(adv)))
        self.sgd.step()
        self.sgd.zero_grad(set_to_none=True)
        self.global_step += 1
        if on_step is not None:
            on_step(self.global_step - 1)
        return {"optimizer_steps": 1.0}

    def state_dict(self) -> dict:
        return {"global_step": self.global_step}

    def load_state_dict(self, state: dict) -> None:
        self.global_step = int(state["global_step"])
