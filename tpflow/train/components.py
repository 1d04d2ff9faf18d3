"""A run's components, built from its recipe once, before the trainer runs anything (``Trainer.__init__``).

Apart from the trainer because building is where a run's determinism is set: every process seeds alike (so the
adapters start equal), a sharded run shards the transformer before anything (the optimizer's bind, the EMA) holds
its parameters, and the optimizer binds from a seed that depends on ``train.seed`` alone. The trainer then only
runs what is built here.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch
from rich.console import Console
from rich.markup import escape

from tpflow.devices import resolve_device
from tpflow.distributed import Distributed
from tpflow.errors import UserError
from tpflow.interfaces import Backbone, CreditAssigner, Optimizer, Sampler, capability
from tpflow.plans.base import derived_rng
from tpflow.precision import Precision
from tpflow.recipe import Recipe
from tpflow.train.checkpoints.format import Checkpoint
from tpflow.train.checkpoints.resume import restoring
from tpflow.train.evaluation import eval_split, no_test_split
from tpflow.train.lockstep import Lockstep
from tpflow.train.sampling import EpochSampler
from tpflow.train.sharding import deferred_sync, shard, transformer_of
from tpflow.types import PromptItem


@dataclass
class RunComponents:
    """What a run trains and samples with; the reward is the epoch sampler's (``Trainer.reward``)."""

    backbone: Backbone
    sampler: Sampler
    credit: CreditAssigner
    optimizer: Optimizer
    train_items: list[PromptItem]  # the training split, indexed by the epoch plans
    test_items: list[PromptItem]  # the prompts each evaluation samples
    eval_split: str  # "test", or "train" for a dataset without a test split (said, and in the metrics)
    epoch_sampler: EpochSampler
    lockstep: Lockstep | None  # sharded: each rollout batch's forwards in step over the processes


def build_components(
    recipe: Recipe,
    dist: Distributed,
    accelerator: object,
    precision: Precision,
    console: Console,
    checkpoint: Checkpoint | None,
) -> RunComponents:
    """The recipe's components, seeded alike on every process (the adapters start equal), the prompt splits and
    the epoch sampler; the optimizer bound to the adapter, the processes (``accelerator``) and the precision.
    Sharded (``[train] shard = "fsdp"``), the transformer is sharded before anything holds its parameters."""
    train = recipe.train
    torch.manual_seed(train.seed)
    random.seed(train.seed)
    backbone = recipe.build("backbone")
    plan = recipe.build("plan")
    check = capability(plan, "schedule_problem")  # a plan that assumes a schedule checks it against the backbone's
    problem = check([float(s) for s in backbone.sigmas(recipe.rollout.num_steps)]) if check is not None else None
    if problem:
        raise UserError(problem)
    lockstep = None
    sampler = recipe.build("sampler")
    reward = recipe.build("reward")
    credit = recipe.build("credit")
    optimizer = recipe.build("optimizer")
    uses_reference = capability(optimizer, "uses_reference")  # an optimizer without it: assume it does
    drop = getattr(capability(backbone, "adapter"), "drop_reference", None)
    if callable(drop) and callable(uses_reference) and not uses_reference():
        drop()  # a full fine-tune's initial copy, for a KL this run does not take
    if train.shard == "fsdp" and dist.enabled:  # one process holds everything: nothing to shard
        lockstep = _shard(recipe, backbone, dist, precision, checkpoint)  # before anything holds the parameters
    dataset = recipe.build("dataset")
    train_items: list[PromptItem] = list(dataset.split("train"))
    split = eval_split(dataset)  # "train" for a dataset without a test split: said, and in the metrics
    test = list(dataset.split("test")) if split == "test" else train_items
    test_items = test[: recipe.eval.num_prompts] if recipe.eval.num_prompts else test
    if split != "test":
        console.print(f"[yellow]warning:[/] {escape(no_test_split(recipe.dataset.name))}", soft_wrap=True)
    # What an optimizer draws from the global RNG as it binds (nft's base seed) depends on train.seed alone, not
    # on how many draws building the reward and the dataset took before it (shapes-clip's took some).
    torch.manual_seed(derived_rng(train.seed, "optimizer.bind").getrandbits(63))
    optimizer.bind(backbone, accelerator, precision)
    epoch_sampler = EpochSampler(
        backbone=backbone,
        sampler=sampler,
        reward=reward,
        optimizer=optimizer,
        credit=credit,
        precision=precision,
        items=train_items,
        train=train,
        rollout=recipe.rollout,
        plan=plan,
        lockstep=lockstep,
    )
    return RunComponents(backbone, sampler, credit, optimizer, train_items, test_items, split, epoch_sampler, lockstep)


def _shard(
    recipe: Recipe, backbone: Backbone, dist: Distributed, precision: Precision, checkpoint: Checkpoint | None
) -> Lockstep:
    """FSDP2 over every process (``tpflow.train.sharding``): an unsharded checkpoint's weights load whole first,
    then each block is sharded (a sharded checkpoint's load into the shards: ``RunCheckpoints.restore``); the fp16
    scaler becomes the sharded one, and defers a LoRA's gradient reduction to each step's last backward
    (``deferred_sync``); each rollout batch's forwards are padded to every process's count, by the returned
    ``Lockstep`` (``tpflow.train.lockstep``)."""
    if checkpoint is not None and checkpoint.layout is None:
        with restoring(checkpoint.path):
            backbone.load_adapter(checkpoint.adapter_dir)
    device = resolve_device(getattr(recipe.backbone.options, "device", None))
    shard(backbone, device, None)
    lockstep = Lockstep(transformer_of(backbone), device)
    dist.sharded = True
    precision.shard(deferred_sync(backbone, dist.world_size))
    return lockstep
