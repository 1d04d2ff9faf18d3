"""What FSDP2 sharding costs per epoch: the same 2-process run with the model replicated and sharded, in one run.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/shard_cost.py [--epochs 4] [--finetune full] [--json OUT]

Both arms train recipes/shapes_flowgrpo.toml (shapes-dit, Flow-GRPO) on 2 processes (`tpflow train --num-processes
2`, gloo on the CPU; rollout batches of 16, one per process) with the same seeds, evaluation and checkpoints off;
the only difference is `[train] shard`.
The epoch seconds come from each run's metrics.jsonl (``epoch_s``); the first epoch (start-up) is left out and the
median of the rest reported, with every epoch's figure. On CPUs over gloo the all-gathers and reduce-scatters are
memory copies between two processes on one machine: the ratio says what sharding's extra collectives and lockstep
cost there, not what NCCL between GPUs costs.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def run(shard: str, finetune: str, epochs: int, folder: Path) -> list[float]:
    """Train one arm on 2 processes; its per-epoch seconds."""
    sets = [
        f'backbone.finetune="{finetune}"', f'train.shard="{shard}"', f"train.epochs={epochs}", "train.save_every=0",
        "eval.every=0", "train.ema=false", "log.trackers=[]", "train.rollout_batch=16",
    ]  # fmt: skip
    if finetune == "full":
        sets.append("optimizer.learning_rate=1e-5")
    command = [sys.executable, "-m", "tpflow.cli", "train", str(ROOT / "recipes" / "shapes_flowgrpo.toml"),
               "--run-dir", str(folder), "--num-processes", "2", *(a for s in sets for a in ("--set", s))]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    subprocess.run(command, check=True, env=env, stdout=subprocess.DEVNULL)
    rows = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [float(r["epoch_s"]) for r in rows if "epoch_s" in r]


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--finetune", choices=["lora", "full"], default="full")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    result: dict = {"recipe": "recipes/shapes_flowgrpo.toml", "processes": 2, "finetune": args.finetune}
    with tempfile.TemporaryDirectory() as tmp:
        for shard in ("none", "fsdp"):
            seconds = run(shard, args.finetune, args.epochs, Path(tmp) / shard)
            result[shard] = {"epoch_s": seconds, "median_s": statistics.median(seconds[1:] or seconds)}
            print(f"shard = {shard}: epochs {[round(s, 2) for s in seconds]} s", file=sys.stderr)
    result["sharded_over_replicated"] = result["fsdp"]["median_s"] / result["none"]["median_s"]
    print(json.dumps(result, indent=1))
    if args.json:
        args.json.write_text(json.dumps(result, indent=1) + "\n")
    return result


if __name__ == "__main__":
    main()
