"""Why a retaining rollout is sometimes slow on CPU: the minor page faults of its velocity calls, epoch by epoch.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/retain_faults.py [--variant flow-1step-retain] [--epochs 4]

``[optimizer] recompute = "retain"`` keeps every retained step's autograd graph until the update (1.4 GiB of saved
tensors for shapes-dit Flow-GRPO's 32 trajectories × 9 window steps). benchmarks/epoch_cost.py, which interleaves one
trainer per variant in one process, measured retain's rollout at 3-4× native's in some epochs and not in others. This
script runs one trainer (the epoch_cost recipe and variant) alone and records, for every velocity call, its seconds,
the minor page faults it took (``getrusage``) and whether it ran with gradients, so that the time can be set against
the memory the process had to fault in rather than against the arithmetic. Prints one line per epoch; ``--json``
writes the calls.
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import epoch_cost  # noqa: E402


def faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    from rich.console import Console

    from tpflow.recipe import validate_recipe
    from tpflow.train.trainer import Trainer

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variant", default="flow-1step-retain", choices=sorted(epoch_cost.VARIANTS))
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    bench = epoch_cost.parse(["--backbone", "shapes-dit", "--set", "optimizer.beta=0"])
    data = epoch_cost.merge(epoch_cost.base_recipe("shapes-dit", bench), epoch_cost.VARIANTS[args.variant][1])
    epochs: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        data["train"]["run_dir"] = tmp
        trainer = Trainer(validate_recipe(data, where="retain_faults"), run_dir=Path(tmp), console=Console(quiet=True))
        calls: list[tuple[float, int, bool, int]] = []  # seconds, minor faults, with gradients, rows
        velocity = trainer.backbone.velocity

        def timed(*a, **k):
            before, start = faults(), time.perf_counter()
            out = velocity(*a, **k)
            calls.append((time.perf_counter() - start, faults() - before, torch.is_grad_enabled(), a[0].shape[0]))
            return out

        trainer.backbone.velocity = timed
        for epoch in range(args.epochs):
            calls.clear()
            start = time.perf_counter()
            trainer.train_epoch(epoch)
            trainer.epoch = epoch + 1
            grad = [c for c in calls if c[2]]
            record = {
                "epoch": epoch,
                "epoch_s": time.perf_counter() - start,
                "grad_calls": len(grad),
                "grad_s": sum(c[0] for c in grad),
                "grad_faults": sum(c[1] for c in grad),
                "no_grad_s": sum(c[0] for c in calls if not c[2]),
                "calls": [{"s": c[0], "faults": c[1], "grad": c[2], "rows": c[3]} for c in calls],
            }
            epochs.append(record)
            print(
                f"epoch {epoch}: {record['epoch_s']:.2f} s; {len(grad)} velocity calls with gradients "
                f"{record['grad_s']:.2f} s, {record['grad_faults']} minor faults; without "
                f"{record['no_grad_s']:.2f} s",
                flush=True,
            )
    if args.json:
        args.json.write_text(json.dumps({"variant": args.variant, "epochs": epochs}, indent=1))
    return epochs


if __name__ == "__main__":
    main()
