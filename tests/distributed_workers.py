"""Functions that run inside the processes of a 2-process gloo group (started by ``spawn``), for the tests.

Each worker joins the group, does its part, and writes what the test checks into ``out`` as ``rank<r>.pt`` (loaded
with ``weights_only=True``). An assertion that fails in a worker fails the test through ``spawn``.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed
import torch.multiprocessing


def spawn(worker: Callable, out: Path, *args, world_size: int = 2) -> list[dict]:
    """Run ``worker(rank, out, *args)`` in ``world_size`` fresh processes joined in one gloo group; return the
    dicts they saved, in rank order."""
    port = free_port()
    torch.multiprocessing.spawn(_enter, args=(world_size, port, worker, out, args), nprocs=world_size, join=True)
    return [torch.load(out / f"rank{r}.pt", weights_only=True) for r in range(world_size)]


def _enter(rank: int, world_size: int, port: int, worker: Callable, out: Path, args: tuple) -> None:
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
    # A short timeout: a worker that fails before a collective must not leave its peer waiting for 30 minutes.
    torch.distributed.init_process_group("gloo", rank=rank, world_size=world_size, timeout=timedelta(seconds=120))
    try:
        result = worker(rank, out, *args)
        torch.save(result, out / f"rank{rank}.pt")
    finally:
        torch.distributed.destroy_process_group()


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
    }


def train_worker(rank: int, out: Path, recipe: str, overrides: list[str]) -> dict:
    """Train a recipe with the Trainer on this process; return the adapter it ends with."""
    from tpflow.recipe import load_recipe
    from tpflow.train.trainer import Trainer

    trainer = Trainer(load_recipe(Path(recipe), overrides))
    start = [p.detach().clone() for p in trainer.backbone.trainable_parameters()]
    trainer.fit()
    return {
        "start": start,
        "end": [p.detach().clone() for p in trainer.backbone.trainable_parameters()],
        "world_size": trainer.dist.world_size,
    }


def train_recipes_worker(rank: int, out: Path, runs: list[tuple[str, list[str]]]) -> dict:
    """``train_worker`` on each (recipe, overrides) of ``runs`` in turn, in the same processes: ``{"runs": [...]}``.

    Starting the processes costs more than training the tests' tiny recipes (about 10 s of imports, torch and peft,
    per process on the 2-core CI machine): one start serves several runs."""
    return {"runs": [train_worker(rank, out, recipe, overrides) for recipe, overrides in runs]}
