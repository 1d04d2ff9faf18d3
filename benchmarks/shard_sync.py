"""What deferring FSDP2's gradient reduction to an optimizer step's last backward saves, on 2 processes.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/shard_sync.py [--rounds 20] [--json OUT]

A random shapes-dit of width 128 and depth 4 (1.5 M weights), sharded over 2 CPU processes (gloo) as `[train] shard
= "fsdp"` shards it; each process takes 4 rows of a fixed 8-row rollout (two windows of 3 steps) into one GRPO
optimizer step of 4 micro-batches of 1 row (12 backward passes). Each round times one update reducing after every
backward (FSDP2's default) and one reducing at the step's last backward (``tpflow.train.sharding.deferred_sync``),
interleaved, with a LoRA and with the whole model trained; the first round is left out and the medians reported.
It also checks that both arms' gradients are each other's within float rounding. On CPUs the reduce-scatters are
memory copies between two processes on one machine: the figures say what the extra collectives cost there, not
what NCCL between GPUs costs.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def _worker(rank: int, port: int, weights: str, rounds: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE="2", LOCAL_WORLD_SIZE="2")  # fmt: skip
    torch.set_num_threads(1)
    torch.distributed.init_process_group("gloo", rank=rank, world_size=2)
    try:
        result = {finetune: _arm(rank, weights, finetune, rounds) for finetune in ("lora", "full")}
        torch.save(result, Path(out) / f"rank{rank}.pt")
        torch.distributed.barrier()
    finally:
        torch.distributed.destroy_process_group()


def _arm(rank: int, weights: str, finetune: str, rounds: int) -> dict:
    from accelerate import Accelerator

    import tpflow
    from tpflow.precision import Precision
    from tpflow.rollout import RolloutInputs, Window, WindowEngine
    from tpflow.shards import full
    from tpflow.train.sharding import shard, sharded_modules, transformer_of
    from tpflow.types import Rollout

    torch.manual_seed(0)
    backbone = tpflow.build("backbone", "shapes-dit", weights=weights, lora_init="gaussian", finetune=finetune)
    sampler = tpflow.build("sampler", "cps")
    prompts = ["a photo of a red circle", "a photo of two squares"] * 2
    cond, sigmas = backbone.encode(prompts), backbone.sigmas(4)
    batch = Rollout.cat([
        WindowEngine(sampler, Window(s, 3), 0.7).run(RolloutInputs(
            backbone, cond, backbone.initial_noise(4, torch.Generator().manual_seed(s)), sigmas, 2.0,
            generator=torch.Generator().manual_seed(10 + s)))
        for s in (0, 1)
    ]).index(torch.arange(4 * rank, 4 * rank + 4))  # fmt: skip
    shard(backbone, torch.device("cpu"), None)
    modules = sharded_modules(transformer_of(backbone))

    def switch(sync: bool) -> None:
        for module in modules:
            module.set_requires_gradient_sync(sync, recurse=False)

    optimizer = tpflow.build("optimizer", "grpo", beta=0.0, micro_batch_size=1, gradient_accumulation_steps=4,
                             max_grad_norm=1e9, learning_rate=1e-12)  # fmt: skip
    precision = Precision("no")
    precision.shard(switch)
    optimizer.bind(backbone, Accelerator(cpu=True), precision)
    grads: dict[bool, torch.Tensor] = {}
    step = precision.step

    def recorded(opt, params, max_norm):  # the step's gradient, gathered whole (a collective)
        grads[precision.gradient_sync is not None] = torch.cat([full(p.grad).reshape(-1) for p in params])
        return step(opt, params, max_norm)

    precision.step = recorded
    advantages = torch.randn(8, 3, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    seconds: dict[bool, list[float]] = {False: [], True: []}
    for r in range(2 * rounds):
        deferred = bool(r % 2)
        precision.gradient_sync = switch if deferred else None
        switch(True)
        torch.distributed.barrier()
        start = time.perf_counter()
        optimizer.update(backbone, sampler, batch, advantages[4 * rank : 4 * rank + 4])
        seconds[deferred].append(time.perf_counter() - start)
    relative = float((grads[True] - grads[False]).norm() / grads[False].norm())
    return {"per_backward_s": seconds[False], "deferred_s": seconds[True], "gradient_relative_difference": relative}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    from tpflow.shapes.model import ShapesDiT, ShapesDiTConfig, save_checkpoint

    with tempfile.TemporaryDirectory() as tmp:
        torch.manual_seed(1)
        model = ShapesDiT(ShapesDiTConfig(width=128, depth=4, heads=4, text_width=128, text_layers=1))
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.02 * torch.randn_like(p))
        weights = str(save_checkpoint(model, Path(tmp) / "shapes_dit.safetensors"))
        torch.multiprocessing.spawn(_worker, args=(_free_port(), weights, args.rounds, tmp), nprocs=2, join=True)
        arms = torch.load(Path(tmp) / "rank0.pt", weights_only=True)
    result: dict = {
        "processes": 2,
        "backward_passes_per_step": 12,
        "weights": sum(p.numel() for p in model.parameters()),
    }
    for finetune, arm in arms.items():
        medians = {k: statistics.median(arm[k][1:]) for k in ("per_backward_s", "deferred_s")}
        result[finetune] = {**arm, **{f"median_{k}": v for k, v in medians.items()}}
        print(f"{finetune}: update {medians['per_backward_s']:.3f} s reducing after every backward, "
              f"{medians['deferred_s']:.3f} s deferred; gradients {arm['gradient_relative_difference']:.1e} "
              "relative apart", file=sys.stderr)  # fmt: skip
    print(json.dumps({k: v for k, v in result.items()}, indent=1))
    if args.json:
        args.json.write_text(json.dumps(result, indent=1) + "\n")
    return result


if __name__ == "__main__":
    main()
