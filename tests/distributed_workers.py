"""Functions that run inside the processes of a 2-process gloo group (started by ``spawn``), for the tests.

Each worker joins the group, does its part, and writes what the test checks into ``out`` as ``rank<r>.pt`` (loaded
with ``weights_only=True``). An assertion that fails in a worker fails the test through ``spawn``.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed
import torch.multiprocessing


def spawn(worker: Callable, out: Path, *args, world_size: int = 2, backend: str = "gloo") -> list[dict]:
    """Run ``worker(rank, out, *args)`` in ``world_size`` new processes joined in one group (gloo; "nccl": on the
    GPUs, process r on GPU r); return the dicts they saved, in rank order.

    On the CPU the processes are forked from this one, which has imported torch and tpflow already: a fresh
    interpreter spends about 10 s of a 2-core machine on those imports, more than the tests' tiny trainings. No
    process group exists here to be copied (``init_process_group`` runs in the children). Under NCCL they are
    started fresh: CUDA does not survive a fork."""
    port = free_port()
    context = (world_size, port, worker, out, args, backend)
    method = "spawn" if backend == "nccl" else "fork"
    torch.multiprocessing.start_processes(_enter, args=context, nprocs=world_size, join=True, start_method=method)
    return [torch.load(out / f"rank{r}.pt", weights_only=True) for r in range(world_size)]


def _enter(rank: int, world_size: int, port: int, worker: Callable, out: Path, args: tuple, backend: str) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
        OMP_NUM_THREADS="1",
    )
    torch.set_num_threads(1)
    _forget_the_parents_accelerate_state()
    # A short timeout: a worker that fails before a collective must not leave its peer waiting for 30 minutes.
    if backend == "nccl":
        torch.cuda.set_device(rank)
    torch.distributed.init_process_group(backend, rank=rank, world_size=world_size, timeout=timedelta(seconds=120))
    try:
        result = worker(rank, out, *args)
        torch.save(result, out / f"rank{rank}.pt")
        # both done before either tears its group down: a peer's gloo threads still waiting on a destroyed group
        # end the process with "terminate called without an active exception" (SIGABRT) now and then
        torch.distributed.barrier()
    finally:
        torch.distributed.destroy_process_group()


def _forget_the_parents_accelerate_state() -> None:
    """A forked process starts with its parent's accelerate state: the test process's, one process whose index is 0.
    Rank 1 would take itself for the main process (and for the run dir's lock holder); reset it, as a fresh
    interpreter has none."""
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


def several_worker(rank: int, out: Path, jobs: list[tuple[str, Callable, tuple]]) -> dict:
    """Each ``(name, worker, args)`` of ``jobs`` in turn in the same processes, ``worker(rank, out/name, *args)``:
    ``{name: its result}``. Starting the processes costs more than most workers (about 10 s of imports per process
    on a 2-core machine): one start serves several tests."""
    results = {}
    for name, worker, args in jobs:
        folder = out / name
        folder.mkdir(exist_ok=True)  # by whichever rank comes first
        results[name] = worker(rank, folder, *args)
        torch.distributed.barrier()  # each job starts with both processes at its beginning
    return results


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _distributed():
    from accelerate import Accelerator

    from tpflow.distributed import Distributed

    return Distributed(Accelerator(cpu=True))


# ---- workers -----------------------------------------------------------------------------------------------------


def group_stats_worker(rank: int, out: Path, layouts: dict[str, list[list[int]]], rewards: torch.Tensor) -> dict:
    """For each layout (rank -> trajectory ids), the advantages this rank gets back from the gathered rewards.

    ``rewards`` [T, W] and the prompt of trajectory t (``t // G``, here G = 4) are known to every rank; the layout
    decides which rank holds which rows, as the prompt sampler would."""
    from tpflow.optim.advantages import group_advantages

    dist = _distributed()
    result = {}
    for name, layout in layouts.items():
        ids = torch.tensor(layout[rank])
        local = torch.cat([rewards[ids], (ids // 4)[:, None].double()], dim=1)  # [n, W + 1]: rewards, prompt
        gathered = dist.gather(local)
        advantages = group_advantages(gathered[:, :-1], gathered[:, -1].long().tolist())
        offset = sum(len(layout[r]) for r in range(rank))
        result[name] = {"ids": ids, "advantages": advantages[offset : offset + len(ids)]}
    return result


def collectives_worker(rank: int, out: Path) -> dict:
    """Ragged gathers, reductions, the gradient all-reduce and the divergence check, on a 2-process group."""
    from tpflow.errors import UserError

    dist = _distributed()
    assert (dist.world_size, dist.rank, dist.is_main) == (2, rank, rank == 0)
    rows = dist.gather(torch.full((rank + 1, 2), float(rank)))  # 1 row from rank 0, 2 from rank 1
    objects = dist.gather_objects([f"r{rank}"] * (rank + 1))
    total, largest = dist.sum(rank + 1.0), dist.max(10.0 * rank)

    a = torch.nn.Parameter(torch.zeros(3))  # gradients on both processes
    b = torch.nn.Parameter(torch.zeros(2))  # a gradient on rank 1 only
    c = torch.nn.Parameter(torch.zeros(1))  # no gradient anywhere
    a.grad = torch.full((3,), 1.0 + rank) * (rank + 1)  # rank 0: 1 loss summing to 1; rank 1: 2 losses summing to 4
    b.grad = torch.ones(2) * 6.0 if rank == 1 else None
    losses = dist.sync_gradients([a, b, c], rows=rank + 1)

    diverged = None
    dist.check_in_sync([("w", torch.ones(2))])
    try:
        dist.check_in_sync([("w", torch.ones(2) * (1 + rank))])
    except UserError as exc:
        diverged = str(exc)
    return {
        "rows": rows,
        "objects": objects,
        "sum": total,
        "max": largest,
        "losses": losses,
        "grad_a": a.grad,
        "grad_b": b.grad,
        "grad_c_is_none": c.grad is None,
        "diverged": diverged,
        "lockstep": lockstep_padding(rank),
    }


def lockstep_padding(rank: int) -> dict:
    """A module of two blocks sharded as tpflow shards a transformer, called 2 + rank times in one
    ``Lockstep.batch``, then twice by both, then in different batches: whether its outputs are the unsharded ones,
    the forwards each process repeated, and the error of the last batch."""
    from torch.distributed.fsdp import fully_shard

    from tpflow.train.lockstep import Lockstep, LockstepError
    from tpflow.train.sharding import device_mesh

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    inputs = [torch.randn(2, 4) for _ in range(2 + rank)]
    with torch.no_grad():
        unsharded = [model(x) for x in inputs]
    mesh = device_mesh(torch.device("cpu"))
    for block in model:
        fully_shard(block, mesh=mesh, reshard_after_forward=True)
    fully_shard(model, mesh=mesh, reshard_after_forward=True)
    lockstep = Lockstep(model, torch.device("cpu"))
    with torch.no_grad():
        with lockstep.batch():  # rank 0 runs out of calls first: it repeats its last one to join rank 1's third
            outputs = [model(x) for x in inputs]
        with lockstep.batch():  # as many on both: nothing repeated
            outputs += [model(x) for x in inputs[:2]]
        lockstep.batches += rank  # rank 1 a batch ahead (a bug): both processes stop at the same exchange
        error = None
        try:
            with lockstep.batch():
                model(inputs[0])
        except LockstepError as exc:
            error = str(exc)
    expected = [*unsharded, *unsharded[:2]]
    return {"equal": all(torch.equal(a, b) for a, b in zip(outputs, expected, strict=True)),
            "repeats": lockstep.repeats, "error": error}  # fmt: skip


def train_worker(rank: int, out: Path, recipe: str, overrides: list[str]) -> dict:
    """Train a recipe with the Trainer on this process; return the adapter it ends with."""
    from tpflow.recipe import load_recipe
    from tpflow.shards import full
    from tpflow.train.trainer import Trainer

    trainer = Trainer(load_recipe(Path(recipe), overrides))
    start = [full(p.detach()).clone() for p in trainer.backbone.trainable_parameters()]  # whole, if sharded
    trainer.fit()
    return {
        "start": start,
        "end": [full(p.detach()).clone() for p in trainer.backbone.trainable_parameters()],
        "world_size": trainer.dist.world_size,
        "repeats": trainer.lockstep.repeats if trainer.lockstep is not None else 0,  # forwards run to keep in step
    }


GATE = {"kl_gate": True, "kl_gate_main": "main", "kl_gate_aux": ["aux"], "kl_gate_fraction": 0.5, "kl_gate_max": 0.5}
GATE_PARTS = {  # a discrete main reward (GenEval-like) and an auxiliary one: ties that a row order would break
    "main": torch.tensor([0.0, 1.0, 0.5, 0.0, 0.5, 1.0, 0.0, 0.5]),
    "aux": torch.tensor([1.0, 0.0, 0.5, 0.5, 1.0, 0.0, 0.0, 1.0]),
}


def layout_gradient(
    weights: str,
    share: list[int],
    micro: int,
    accumulation: int,
    accelerator=None,
    recompute: str = "native",
    beta: float = 1e-2,
    outcome: bool = False,
    plan: str = "window",
    finetune: str = "lora",
    shard: bool = False,
    mode: str = "no",
    model: str = "shapes-dit",
    device: str = "cpu",
    gradient_checkpointing: bool = False,
    gated: bool = False,
) -> torch.Tensor:
    """The gradient of one GRPO optimizer step over ``share`` (this process's rows of one fixed 8-row batch) cut
    into micro-batches of ``micro``, ``accumulation`` per step: the flat gradient the step is taken with.

    The batch mixes two rollouts whose windows differ (:func:`two_window_batch`): the rows a step trains differ
    between steps and micro-batches. ``recompute = "retain"``: the rollouts keep their graphs and the step
    back-propagates them; "reweight" (``beta`` 0): the rollouts keep per-step gradients and the step weighs them.
    ``outcome``: one advantage per trajectory (outcome credit; reweight keeps one gradient per trajectory).
    ``plan = "branch"``: the rows come from TempFlow-GRPO's branches (:func:`branch_batch`), per-step credit.
    ``finetune = "full"``: the whole model trains; ``shard``: FSDP2 over the processes, after the rollout; ``mode``:
    the update's precision; ``model``: shapes-dit from ``weights``, or "tiny-sd3" (a diffusers transformer, with
    ``gradient_checkpointing`` if asked), on ``device``. ``gated``: GARDO's KL gate over two reward parts full of
    ties (:data:`GATE_PARTS`), ranked over every process's rows, the LoRA moved off its init (where the KL and its
    gradient are 0)."""
    import tpflow

    torch.manual_seed(0)  # the LoRA init: the same adapter on every call and process
    if model == "tiny-sd3":
        backbone = tpflow.build("backbone", "tiny-sd3", lora_init="gaussian", resolution=8, finetune=finetune,
                                device=device, gradient_checkpointing=gradient_checkpointing)  # fmt: skip
        assert backbone.transformer.is_gradient_checkpointing == gradient_checkpointing
    else:
        backbone = tpflow.build("backbone", "shapes-dit", weights=weights, lora_init="gaussian", finetune=finetune,
                                device=device)  # fmt: skip
    sampler = tpflow.build("sampler", "cps")
    optimizer = tpflow.build(
        "optimizer", "grpo", beta=beta, micro_batch_size=micro, gradient_accumulation_steps=accumulation,
        max_grad_norm=1e9, recompute=recompute, **(GATE if gated else {}),
    )  # fmt: skip
    retain = optimizer.retain if optimizer.retain is None else optimizer.retain.for_credit(outcome)
    rollout = {"window": two_window_batch, "branch": branch_batch}[plan]
    batch = rollout(backbone, sampler, retain)
    if gated:
        generator = cpu_generator(1)
        with torch.no_grad():
            for p in backbone.trainable_parameters():
                p.add_(0.05 * torch.randn(p.shape, generator=generator).to(p))
        batch = dataclasses.replace(batch, reward_details={k: v.clone() for k, v in GATE_PARTS.items()})
    batch = batch.index(torch.tensor(share))
    sync = shard_as_the_trainer_does(backbone, device) if shard else None
    advantages = torch.randn(8, 3, generator=cpu_generator(3), dtype=torch.float64)
    advantages = (advantages[:, :1].expand(8, 3).contiguous() if outcome else advantages)[share]
    return one_step_gradient(optimizer, backbone, sampler, batch, advantages, accelerator, mode, sync)


def shard_as_the_trainer_does(backbone, device: str = "cpu"):
    """The backbone's transformer sharded over the processes; returns the gradient-sync switch the trainer gives its
    precision (a LoRA's reduction deferred to the step's last backward; None for the whole model)."""
    from tpflow.train.sharding import deferred_sync, shard

    shard(backbone, torch.device(device), None)
    return deferred_sync(backbone, torch.distributed.get_world_size())


def two_window_batch(backbone, sampler, retain=None):
    """8 trajectories of 2 prompts × 2, K = 4: rows 0-3 with the window [0, 3), rows 4-7 with [1, 4), so that at
    window position 2 the later window's rows step to σ = 0 (cps: std 0, masked) while the others do not. ``retain``:
    the rollouts keep their graphs (``recompute = "retain"``)."""
    from tpflow.rollout import RolloutInputs, Window, WindowEngine
    from tpflow.types import Rollout

    prompts = ["a photo of a red circle", "a photo of two squares"] * 2
    cond, sigmas = backbone.encode(prompts), backbone.sigmas(4)
    return Rollout.cat([
        WindowEngine(sampler, Window(s, 3), 0.7, retain=retain).run(
            RolloutInputs(backbone, cond, backbone.initial_noise(4, cpu_generator(s)), sigmas, 2.0,
                          generator=cpu_generator(10 + s))
        )
        for s in (0, 1)
    ])  # fmt: skip


def branch_batch(backbone, sampler, retain=None):
    """8 trajectories of TempFlow-GRPO's branch, K = 4, window [0, 3): 4 noise rows (2 prompts × 2), each shared
    by 2 copies (trajectories t and t + 4), which branch off its ODE path with SDE steps of their own."""
    from tpflow.rollout import BranchEngine, RolloutInputs, Window

    prompts = ["a photo of a red circle", "a photo of two squares"] * 4  # trajectory t's prompt: noise row t % 4's
    inputs = RolloutInputs(backbone, backbone.encode(prompts), backbone.initial_noise(4, cpu_generator(0)),
                           backbone.sigmas(4), 2.0, torch.arange(8) % 4, cpu_generator(10), None)  # fmt: skip
    return BranchEngine(sampler, Window(0, 3), 0.7, retain=retain).run(inputs)


def nft_layout_gradient(
    weights: str, share: list[int], micro: int, accumulation: int, accelerator=None, finetune: str = "lora",
    shard: bool = False, name: str = "nft", mode: str = "no",
) -> torch.Tensor:  # fmt: skip
    """``layout_gradient`` for the nft optimizer: the gradient of its one optimizer step over ``share`` (this
    process's samples of one fixed batch of 8 final samples) in micro-batches of ``micro``, ``accumulation`` per
    step. Each sample's times t and noise ε must not depend on the layout. ``finetune``, ``shard`` and ``mode`` as
    for ``layout_gradient``; ``name = "awm"``: the awm optimizer (its times stratified over the same schedule);
    ``"dgpo"``: the dgpo optimizer (its group weights over the two prompts' groups, wherever their rows lie)."""
    import tpflow
    from tpflow.rollout import Window, rollout

    torch.manual_seed(0)  # the LoRA init: the same adapter on every call and process
    backbone = tpflow.build("backbone", "shapes-dit", weights=weights, lora_init="gaussian", finetune=finetune)
    sampler = tpflow.build("sampler", "cps")
    prompts = ["a photo of a red circle", "a photo of two squares"] * 4
    z0 = backbone.initial_noise(8, cpu_generator(0))
    batch = rollout(backbone, sampler, backbone.encode(prompts), z0, backbone.sigmas(3), Window(0, 1), 0.0, 2.0,
                    None, transitions=False)  # fmt: skip
    groups = torch.tensor([0, 1] * 4, dtype=torch.long, device="cpu")  # the prompts' groups, as the trainer numbers
    batch = dataclasses.replace(batch, groups=groups).index(torch.tensor(share))
    advantages = torch.randn(8, 1, generator=cpu_generator(3), dtype=torch.float64)[share]
    sync = shard_as_the_trainer_does(backbone) if shard else None
    times = {"nft": {"timesteps_per_sample": 2}, "awm": {"train_timesteps": 2, "timestep_fraction": 1.0},
             "dgpo": {"train_timesteps": 2, "trunc_steps": 3}}[name]  # fmt: skip
    optimizer = tpflow.build(
        "optimizer", name, micro_batch_size=micro, gradient_accumulation_steps=accumulation, max_grad_norm=1e9,
        num_timesteps=4, seed=11, **times,
    )  # fmt: skip
    return one_step_gradient(optimizer, backbone, sampler, batch, advantages, accelerator, mode, sync)


def one_step_gradient(optimizer, backbone, sampler, batch, advantages, accelerator=None, mode="no",
                      sync=None) -> torch.Tensor:  # fmt: skip
    """The flat gradient (clipping and all) of the one optimizer step ``optimizer.update`` takes over ``batch``,
    its forward passes under ``mode`` ("no", "bf16" autocast, "fp16" with the gradient scaler); ``sync``: a sharded
    run's gradient-sync switch (``shard_as_the_trainer_does``)."""
    from tpflow.precision import Precision
    from tpflow.shards import full

    precision = Precision(mode)
    if sync is not None:
        precision.shard(sync)
    optimizer.bind(backbone, accelerator, precision)
    seen = []

    def recorded(opt, params, max_norm):  # a sharded gradient gathered whole (every process calls this)
        grads = [full(p.grad).reshape(-1) if p.grad is not None else torch.zeros(p.numel(), device=p.device)
                 for p in params]  # fmt: skip
        seen.append(torch.cat(grads))
        return Precision.step(precision, opt, params, max_norm)

    precision.step = recorded
    metrics = optimizer.update(backbone, sampler, batch, advantages)
    assert metrics["optimizer_steps"] == 1 and len(seen) == 1, metrics
    return seen[0]


EIGHT = list(range(8))


def cpu_generator(seed: int) -> torch.Generator:
    return torch.Generator(device="cpu").manual_seed(seed)


def layout_worker(
    rank: int, out: Path, weights: str, layouts: dict[str, list[tuple[list[int], int, int]]], optimizer: str = "grpo"
) -> dict:
    """For each layout (rank -> (rows, micro, accumulation)), the gradient of its one optimizer step here (GRPO's;
    with ``optimizer = "grpo+grpo-retain+grpo-reweight"`` also from the rollout's retained graphs and its per-row
    gradients; with "nft+awm+dgpo" DiffusionNFT's, AWM's and DGPO's)."""
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True)
    if optimizer.startswith("nft"):  # e.g. "nft+awm+dgpo": each, keyed "<optimizer>/<layout>", from one start
        return {f"{opt}/{name}": nft_layout_gradient(weights, *layout[rank], accelerator=accelerator, name=opt)
                for opt in optimizer.split("+") for name, layout in layouts.items()}  # fmt: skip
    if optimizer == "grpo":
        return {name: layout_gradient(weights, *layout[rank], accelerator=accelerator)
                for name, layout in layouts.items()}  # fmt: skip
    # "grpo+grpo-retain+grpo-reweight": each, keyed "<mode>/<layout>", from one start of the processes
    # (reweight refuses the KL: it trains with beta = 0)
    settings = {  # recompute, beta, outcome credit, plan
        "grpo": ("native", 1e-2, False, "window"),
        "grpo-retain": ("retain", 1e-2, False, "window"),
        "grpo-reweight": ("reweight", 0.0, False, "window"),
        "grpo-reweight-outcome": ("reweight", 0.0, True, "window"),
        "grpo-retain-branch": ("retain", 1e-2, False, "branch"),
        "grpo-reweight-branch": ("reweight", 0.0, False, "branch"),
        "grpo-gated": ("native", 1e-2, False, "window"),
    }
    return {f"{mode}/{name}": layout_gradient(weights, *layout[rank], accelerator, *settings[mode],
                                              gated=mode == "grpo-gated")
            for mode in optimizer.split("+") for name, layout in layouts.items()}  # fmt: skip


def sharded_layout_worker(rank: int, out: Path, weights: str, layouts: dict[str, list[tuple[list[int], int, int]]]
                          ) -> dict:  # fmt: skip
    """For each layout, the gradient of one FSDP2-sharded optimizer step here (gathered whole), keyed
    "<optimizer>-<finetune>/<layout>": GRPO and NFT, LoRA and the full model."""
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True)
    result = {}
    for finetune in ("lora", "full"):
        for name, layout in layouts.items():
            result[f"grpo-{finetune}/{name}"] = layout_gradient(weights, *layout[rank], accelerator, finetune=finetune,
                                                                shard=True)  # fmt: skip
            result[f"nft-{finetune}/{name}"] = nft_layout_gradient(weights, *layout[rank], accelerator,
                                                                   finetune=finetune, shard=True)  # fmt: skip
    for finetune in ("lora", "full"):  # a diffusers transformer (SD3's blocks; its last block's context unused)
        result[f"tiny-sd3-{finetune}"] = layout_gradient(weights, *layouts["3 + 3 | 2"][rank], accelerator,
                                                         finetune=finetune, shard=True, model="tiny-sd3")  # fmt: skip
    # activation checkpointing per block (diffusers' gradient_checkpointing) inside the sharded blocks
    result["tiny-sd3-full-checkpointed"] = layout_gradient(weights, *layouts["3 + 3 | 2"][rank], accelerator,
                                                           finetune="full", shard=True, model="tiny-sd3",
                                                           gradient_checkpointing=True)  # fmt: skip
    result["clipped"] = clipped_step(weights, EIGHT[:4] if rank == 0 else EIGHT[4:], accelerator, shard=True)
    result["checkpoint"] = sharded_checkpoint(out, rank)
    for mode in ("bf16", "fp16"):  # the update under mixed precision (fp16: the sharded gradient scaler)
        result[f"grpo-full-{mode}"] = layout_gradient(weights, *layouts["4 + 4"][rank], accelerator, finetune="full",
                                                      shard=True, mode=mode)  # fmt: skip
    return result


def sharded_checkpoint(out: Path, rank: int) -> dict:
    """tiny-sd3's LoRA sharded over the processes, its weights moved off their initialisation, written as a sharded
    checkpoint with stand-in AdamW moments (2× the weights) and EMA (3×): where it is (main process) and the weights
    whole."""
    import tpflow
    from tpflow.shards import full
    from tpflow.train.checkpoints.format import capture_rng_state
    from tpflow.train.checkpoints.sharded import save_sharded
    from tpflow.train.sharding import shard as fully_shard

    torch.manual_seed(0)
    backbone = tpflow.build("backbone", "tiny-sd3", lora_init="gaussian", resolution=8, device="cpu")
    fully_shard(backbone, torch.device("cpu"), None)
    params = backbone.trainable_parameters()
    with torch.no_grad():
        for index, p in enumerate(params):
            p.add_(1.0 + index)
    moments = {"state": {str(i): {"exp_avg": 2 * p.detach(), "step": torch.tensor(3.0)} for i, p in enumerate(params)}}
    path = save_sharded(out / "sharded-run", 1, backbone=backbone, optimizer_state={"optimizer": moments},
                        ema_state={str(i): 3 * p.detach() for i, p in enumerate(params)}, is_main=rank == 0,
                        processes=2, rng_state=capture_rng_state(), train_state={"epoch": 1, "global_step": 1},
                        recipe={}, keep_last=1)  # fmt: skip
    return {"path": str(path) if path is not None else None, "weights": [full(p.detach()).clone() for p in params]}


def clipped_step(weights: str, share: list[int], accelerator=None, shard: bool = False, accumulation: int = 1) -> dict:
    """One GRPO optimizer step of shapes-dit's whole model over ``share`` (micro-batches of 4, ``accumulation`` per
    step) with the gradient clipped (max_grad_norm 1e-3, far below its norm): the pre-clip norm the step reports and
    the weights after the step (gathered whole)."""
    import tpflow
    from tpflow.precision import Precision
    from tpflow.shards import full

    torch.manual_seed(0)
    backbone = tpflow.build("backbone", "shapes-dit", weights=weights, finetune="full")
    sampler = tpflow.build("sampler", "cps")
    batch = two_window_batch(backbone, sampler).index(torch.tensor(share))
    if shard:
        from tpflow.train.sharding import shard as fully_shard

        fully_shard(backbone, torch.device("cpu"), None)
    optimizer = tpflow.build("optimizer", "grpo", beta=0.0, micro_batch_size=4, max_grad_norm=1e-3,
                             gradient_accumulation_steps=accumulation, learning_rate=1e-3)  # fmt: skip
    optimizer.bind(backbone, accelerator, Precision("no"))
    advantages = torch.randn(8, 3, generator=cpu_generator(3), dtype=torch.float64)[share]
    metrics = optimizer.update(backbone, sampler, batch, advantages)
    weights_after = torch.cat([full(p.detach()).reshape(-1) for p in backbone.trainable_parameters()])
    return {"grad_norm": metrics["grad_norm"], "weights": weights_after}


def gpu_sharded_worker(rank: int, out: Path, device: str) -> dict:
    """One process on ``device``: tiny-sd3's whole model, one GRPO step sharded by FSDP2 (a group of one) and
    unsharded, in fp32 and under bf16 autocast."""
    return {f"{mode}/{shard}": layout_gradient("", list(range(8)), 4, 2, finetune="full", shard=shard, mode=mode,
                                               model="tiny-sd3", device=device).cpu()
            for mode in ("no", "bf16") for shard in (False, True)}  # fmt: skip


def minimal_optimizer_worker(rank: int, out: Path, recipe: str, overrides: list[str]) -> dict:
    """``train_worker`` with the protocol-only test optimizer registered in this process."""
    import tests.minimal_optimizer  # noqa: F401  (registers "test-minimal")

    return train_worker(rank, out, recipe, overrides)


def train_recipes_worker(rank: int, out: Path, runs: list[tuple[str, list[str]]]) -> dict:
    """``train_worker`` on each (recipe, overrides) of ``runs`` in turn, in the same processes: ``{"runs": [...]}``.

    Starting the processes costs more than training the tests' tiny recipes (about 10 s of imports, torch and peft,
    per process on the 2-core CI machine): one start serves several runs."""
    return {"runs": [train_worker(rank, out, recipe, overrides) for recipe, overrides in runs]}


def interrupt_chain_worker(rank: int, out: Path, recipe: str, sets: list[str], chain: list[tuple[str, int, int]]
                           ) -> dict:  # fmt: skip
    """One run stopped at each (phase, epoch, signal) of ``chain`` by a signal process 0 sends itself
    (``tests.test_interrupt._with_signal``) and resumed each time, then to its end; beside it the run uninterrupted.
    Returns each stop's exit status and the epoch of the newest checkpoint, and both runs' final adapters."""
    import signal as signals

    import pytest

    from tests.test_interrupt import _adapter, _states, _with_signal
    from tpflow.recipe import load_recipe
    from tpflow.train.stop import Stopped
    from tpflow.train.trainer import Trainer

    signals.signal(signals.SIGINT, signals.default_int_handler)  # a spawned process may start with it ignored

    def trainer(name: str, resume: bool) -> Trainer:
        return Trainer(load_recipe(Path(recipe), [*sets, f"train.run_dir={out / name}"]), resume=resume)

    straight = trainer("straight", False)
    straight.fit()
    stops = []
    for i, (phase, epoch, signum) in enumerate(chain):
        with pytest.MonkeyPatch.context() as patch:
            run = trainer("chain", i > 0)
            if rank == 0:
                _with_signal(run, patch, phase, epoch, signum)
            try:
                run.fit()
                status = 0
            except Stopped as exc:
                status = exc.exit_status
        stops.append((status, _states(out / "chain")[-1]["epoch"]))
    resumed = trainer("chain", True)
    resumed.fit()
    return {"stops": stops, "straight": _adapter(straight), "resumed": _adapter(resumed)}
