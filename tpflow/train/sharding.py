"""``[train] shard = "fsdp"``: the trained transformer sharded with PyTorch's FSDP2 (``fully_shard`` per block).

Why FSDP2 directly rather than through accelerate's FSDP plugin: tpflow's update loop owns the gradient arithmetic
(each step's gradient is the sum over every row of every process divided by their count, docs/algorithm.md §8 D10)
and its own autocast regions (``tpflow.precision``); the plugin would wrap the model and the optimizer and take
both over. ``fully_shard`` changes only the module: each block's parameters become DTensors sharded on dim 0 over a
one-dimensional device mesh of every process, all-gathered for its forward and backward and freed after, gradients
reduce-scattered as each block's backward ends.

What tpflow does around it:

* **Sums, not means.** FSDP2 would average the gradients over processes; here every FSDP module reduces by sum
  (``set_force_sum_reduction_for_comms``, divide factor 1: gloo has no pre-multiplied sum) and the loop divides by
  the rows trained over every process, as it does unsharded (``Distributed.sync_gradients``).
* **One reduction per step for a LoRA.** Its gradients are kept whole on each process through an optimizer step
  and reduce-scattered at the step's last backward (:func:`deferred_sync`): the replicated run's gradient, bit for
  bit. A full fine-tune reduces after every backward, as FSDP2 does by default (its gradient whole would cost 4
  bytes per weight).
* **Lockstep.** A sharded block's forward and backward are collectives, so every process must run the same number
  of them in the same order. The update loop pads a process's short optimizer steps with zero-weight micro-batches and
  back-propagates every loss, a masked or non-finite one at weight 0 (``tpflow.optim.loop``). A micro-batch's
  losses are as many on every process: one per window step, or, for the plans that train a subset of steps
  (trained-fraction, window-per-image), one per step each trajectory trains, the same number for every trajectory.
  The rollouts pad their forwards likewise (``tpflow.train.lockstep``). The recompute-free modes are refused;
  evaluation needs its images to split equally.
* **Checkpoints.** By default every process writes its own shards (``tpflow.train.checkpoints.shards``: DCP,
  safetensors files, nothing gathered), read back into any layout. With ``checkpoint_layout = "gathered"`` the
  weights (the transformer's state dict, which the main process's adapter writes as its own), the AdamW moments, the
  EMA and NFT's old policy are gathered into full tensors on the main process's host, one tensor at a time, and
  written in the unsharded format; on resume those weights load before sharding and the moments are sharded as they
  load (:func:`like`). Its cost: the main process's host holds the whole state while a checkpoint is written.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from tpflow.errors import UserError
from tpflow.interfaces import capability
from tpflow.shards import full, gathered_to_host, is_sharded, like  # noqa: F401 (re-exported)

# the lists of repeated blocks each sharded on its own: SD3 / FLUX / FLUX.2 / Qwen-Image, FLUX's single blocks, Wan
# and shapes-dit, shapes-dit's text layers; Z-Image's main layers and its noise and caption refiners
BLOCK_LISTS = ("transformer_blocks", "single_transformer_blocks", "blocks", "text_layers", "layers", "noise_refiner",
               "context_refiner", "siglip_refiner")  # fmt: skip


def equal_eval_shares(images: int, processes: int) -> None:
    """A UserError unless the eval's ``images`` split equally over the processes (sharded, every process must run as
    many forward passes)."""
    if images % processes:
        raise UserError(
            f'[train] shard = "fsdp": the evaluation samples {images} images (eval.num_prompts × '
            f"eval.images_per_prompt), which {processes} processes cannot share equally, and a sharded model needs "
            "every process to run as many forward passes. Set eval.num_prompts (or images_per_prompt) so that the "
            f"images are a multiple of {processes}, or eval.every = 0."
        )


def transformer_of(backbone: Any) -> torch.nn.Module:
    """The module a backbone trains (diffusers backbones: ``transformer``; shapes-dit: ``model``)."""
    for name in ("transformer", "model"):
        module = getattr(backbone, name, None)
        if isinstance(module, torch.nn.Module):
            return module
    raise UserError(
        f'[train] shard = "fsdp" shards the backbone\'s transformer, and {type(backbone).__name__} has none as '
        "'transformer' or 'model'. Set shard = \"none\" for this backbone."
    )


def device_mesh(device: torch.device) -> Any:
    """A one-dimensional mesh of every process of the running group."""
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(device.type, (torch.distributed.get_world_size(),))


def shard(backbone: Any, device: torch.device, compute_dtype: torch.dtype | None) -> int:
    """``fully_shard`` every block of the backbone's transformer, then the transformer itself (a full fine-tune's
    frozen reference copy alike); returns the number of sharded modules of the transformer. ``compute_dtype``: the
    dtype blocks are all-gathered in (None: as stored; the trainer passes None, so that autocast computes exactly as
    unsharded); gradients are reduced in float32 whatever it is."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    module = transformer_of(backbone)
    mesh = device_mesh(device)
    policy = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32)
    count = _shard_module(module, mesh, policy)
    adapter = capability(backbone, "adapter")
    if hasattr(adapter, "shard_reference"):  # a full fine-tune's frozen initial copy (the KL reference), alike
        adapter.shard_reference(lambda reference: _shard_module(reference, mesh, policy), device)
    for sharded in sharded_modules(module):
        sharded.set_force_sum_reduction_for_comms(True)  # a plain sum (gloo has no pre-multiplied one) ...
        sharded.set_gradient_divide_factor(1.0)  # ... undivided: the loop divides by the rows trained
    return count


def deferred_sync(backbone: Any, processes: int) -> Callable[[bool], None] | None:
    """A switch of the reduce-scatter of every sharded module's gradients (FSDP2's ``set_requires_gradient_sync``),
    for the update loop to defer it to each optimizer step's last backward (``Precision.shard``), or None where
    deferring is not taken.

    Deferred, each process sums its own losses' gradients whole and the processes' sums are reduced once: the
    gradient of the replicated run, bit for bit (the per-loss reduce-scatters sum in another order, ~1e-7 relative
    apart), and one reduce-scatter per step instead of one per loss (one per window step of every micro-batch). The
    cost is the trained parameters' gradient held whole through the step: taken when they are at most 1/P of the
    transformer's weights (a LoRA, whose gradient then costs less than the process's shard of the weights), not for a
    full fine-tune, whose gradient whole (4 bytes per weight) would undo much of what sharding saves."""
    module = transformer_of(backbone)
    trained = sum(p.numel() for p in module.parameters() if p.requires_grad)
    if trained * processes > sum(p.numel() for p in module.parameters()):
        return None
    modules = sharded_modules(module)

    def switch(sync: bool) -> None:
        for sharded in modules:
            sharded.set_requires_gradient_sync(sync, recurse=False)

    return switch


def _shard_module(module: torch.nn.Module, mesh: Any, policy: Any) -> int:
    from torch.distributed.fsdp import fully_shard

    blocks = [block for name in BLOCK_LISTS for block in getattr(module, name, None) or ()]
    # reshard_after_forward=True for the root too (FSDP2 keeps a root's weights gathered after its forward by
    # default): a forward without backward (the rollout, eval) would otherwise leave the root's gathered copy in
    # place, and a weight change on the shards after it (the EMA swapped in for eval, NFT's old policy, an optimizer
    # step) would not reach the next forward, which would run the stale copy
    for block in blocks:
        fully_shard(block, mesh=mesh, mp_policy=policy, reshard_after_forward=True)
    fully_shard(module, mesh=mesh, mp_policy=policy, reshard_after_forward=True)
    return len(blocks) + 1


def sharded_modules(module: torch.nn.Module) -> list[Any]:
    from torch.distributed.fsdp import FSDPModule

    return [m for m in module.modules() if isinstance(m, FSDPModule)]


def gathered_state(backbone: Any) -> dict[str, Tensor]:
    """The transformer's state dict with every shard gathered into a full tensor on the main process's host, one
    tensor at a time (a collective: every process calls it; the others get ``None`` values). FSDP2 keeps the
    module's names, so the adapters write it as they write their own."""
    return {name: gathered_to_host(value) if is_sharded(value) else value.detach().cpu()
            for name, value in transformer_of(backbone).state_dict().items()}  # fmt: skip


class GatheredBackbone:
    """A backbone whose ``save_adapter`` writes ``state`` (from :func:`gathered_state`) instead of its sharded
    module: what the main process hands the checkpoint writer of a sharded run."""

    def __init__(self, backbone: Any, state: dict[str, Tensor]) -> None:
        self.backbone, self.state = backbone, state

    def save_adapter(self, directory: Any) -> None:
        self.backbone.adapter.save(directory, state=self.state)
