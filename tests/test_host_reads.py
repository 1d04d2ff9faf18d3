"""The update reads the device back rarely: once per loss, a few times per update (docs/training.md, "Host reads").

On a GPU each read of a device tensor from the host (``bool``, ``float``, ``.item()``, ``.tolist()``, ``.cpu()``,
``nonzero``) waits for every queued kernel: a dozen per (micro-batch, window step), as the update once had, stalls
the pipeline between every forward. The count is taken on the CPU with a torch function mode that records each
such call made directly from tpflow's code (torch's own, inside the optimizer step, are not tpflow's to change),
so that it cannot creep back. The noise levels are host values by design (the update passes them from the host and
the sampler checks them there): their checks are reads of host tensors, counted here, free on a GPU.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from torch.overrides import TorchFunctionMode

import tpflow
from tpflow.optim.advantages import group_advantages
from tpflow.rollout import Window, rollout

PACKAGE = Path(tpflow.__file__).resolve().parent
READS = {"item", "tolist", "__bool__", "__float__", "__int__", "cpu", "nonzero"}
# The update's own code; the backbone's forward is the model's (shapes-dit reads its CFG mask, the diffusers models'
# code is not tpflow's), the same in the rollout and outside this count.
UPDATE_CODE = [PACKAGE / "optim", PACKAGE / "samplers", PACKAGE / "precision.py", PACKAGE / "distributed.py",
               PACKAGE / "types.py"]  # fmt: skip


class HostReads(TorchFunctionMode):
    """Records ``file:function`` of each host read called directly from the update's code (``UPDATE_CODE``, or the
    files given)."""

    def __init__(self, code: list[Path] | None = None) -> None:
        super().__init__()
        self.calls: list[str] = []
        self.code = UPDATE_CODE if code is None else code

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", "") in READS:
            frame = sys._getframe(1)
            where = Path(frame.f_code.co_filename).resolve()
            if any(where == part or where.is_relative_to(part) for part in self.code):
                self.calls.append(f"{Path(frame.f_code.co_filename).name}:{frame.f_code.co_name}")
        return func(*args, **(kwargs or {}))


def test_the_counter_sees_a_read_from_tpflow_code():
    code = compile("bool(x.any())\nx.sum().item()\n", str(PACKAGE / "optim" / "example.py"), "exec")
    with HostReads() as reads:
        exec(code, {"x": torch.ones(2)})
        torch.ones(2).sum().item()  # from the test's own code: not counted
    assert reads.calls == ["example.py:<module>", "example.py:<module>"]


@pytest.fixture
def backbone(tiny_weights):
    return tpflow.build("backbone", "shapes-dit", weights=str(tiny_weights), lora_init="gaussian")


def test_grpo_reads_once_per_loss_and_for_its_sigma_checks(backbone):
    sampler = tpflow.build("sampler", "flow-sde")
    prompts = ["a photo of a red circle"] * 3 + ["a photo of two squares"] * 3
    z0 = backbone.initial_noise(6, torch.Generator().manual_seed(0))
    batch = rollout(backbone, sampler, backbone.encode(prompts), z0, backbone.sigmas(4), Window(0, 3), 0.7, 2.0,
                    None, generator=torch.Generator().manual_seed(1))  # fmt: skip
    advantages = group_advantages(torch.randn(6, 3, generator=torch.Generator().manual_seed(2)), prompts)
    optimizer = tpflow.build("optimizer", "grpo", beta=1e-2, micro_batch_size=2, gradient_accumulation_steps=2)
    optimizer.bind(backbone)
    with HostReads() as reads:
        metrics = optimizer.update(backbone, sampler, batch, advantages)
    losses = 3 * 3  # 3 micro-batches x 3 window steps, 2 optimizer steps
    assert metrics["optimizer_steps"] == 2 and metrics["rows_trained"] == 18
    assert reads.calls.count("loop.py:_backward") == losses  # the loss's one read
    assert reads.calls.count("_common.py:check_sigmas") == 2 * losses  # host σ: the policy's and the KL reference's
    per_update = [c for c in reads.calls if c not in ("loop.py:_backward", "_common.py:check_sigmas")]
    assert len(per_update) <= 4, per_update  # host copies of σ and the advantages, the rows kept, the metrics


def test_nft_reads_once_per_loss(backbone, monkeypatch):
    prompts = ["a photo of a red circle"] * 4 + ["a photo of two squares"] * 4
    z0 = backbone.initial_noise(8, torch.Generator().manual_seed(0))
    batch = rollout(backbone, tpflow.build("sampler", "flow-sde"), backbone.encode(prompts), z0, backbone.sigmas(4),
                    Window(0, 3), 0.7, 2.0, None, transitions=False)  # fmt: skip
    advantages = group_advantages(torch.randn(8, 1, generator=torch.Generator().manual_seed(2)), prompts)
    optimizer = tpflow.build("optimizer", "nft", micro_batch_size=4, num_timesteps=4, timesteps_per_sample=3, seed=1)
    optimizer.bind(backbone)
    import tpflow.optim.final as final  # the final-sample machinery NFT calls: its lagged copy's swap

    swaps, swapped = [], final.swapped
    monkeypatch.setattr(final, "swapped", lambda *args: swaps.append(1) or swapped(*args))
    with HostReads() as reads:
        metrics = optimizer.update(backbone, None, batch, advantages)
    assert metrics["optimizer_steps"] == 2 and metrics["rows_trained"] == 24
    assert reads.calls.count("loop.py:_backward") == 2 * 3  # 2 micro-batches x 3 times
    assert len(swaps) == 2  # the old policy swapped in once per micro-batch, not twice per (micro-batch, time)
    per_update = [c for c in reads.calls if c not in ("loop.py:_backward", "final.py:micro_batches")]
    assert len(per_update) <= 2, per_update  # the metrics and the mean optimality, once each
    assert reads.calls.count("final.py:micro_batches") == 1  # the sample order (host tensor), once a pass: free on GPU


def test_a_rollout_from_shared_noise_reads_nothing_per_noise_row(backbone):
    """Trajectories that share z_0 rows (same_noise): the first trajectory of each noise row comes from one scatter,
    not a ``nonzero`` read per row (6 here), and the source is checked where the caller made it, on the host."""
    prompts = ["a photo of a red circle"] * 3 + ["a photo of two squares"] * 3
    z0 = backbone.initial_noise(2, torch.Generator().manual_seed(0))  # one row per prompt group
    source = torch.tensor([0, 0, 0, 1, 1, 1])
    with HostReads([PACKAGE / "rollout"]) as reads:
        rollout(backbone, tpflow.build("sampler", "cps"), backbone.encode(prompts), z0, backbone.sigmas(4),
                Window(0, 2), 0.7, 2.0, "ode", source=source, generator=torch.Generator().manual_seed(1))  # fmt: skip
    assert 1 <= reads.calls.count("inputs.py:checked_source") <= 3, reads.calls  # of the host source: free on a GPU
    assert not [c for c in reads.calls if c.endswith((":rollout", ":run", ":begin", ":ode_prefix"))], reads.calls
