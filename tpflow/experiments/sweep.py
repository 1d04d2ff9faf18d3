"""``tpflow sweep``: every missing (arm, seed) run of an experiment as a ``tpflow train`` run, resumable.

A run is done when its folder holds ``sweep_done.json`` (written after its ``tpflow train`` exits 0); a folder with
a checkpoint but no marker is a killed run and continues with ``--resume``; anything else starts afresh (the trainer
tidies a dead attempt's logs). Runs go seed-major, ``jobs`` at once, each logging to ``<arm>/seed_<s>.log``; with
``gpus`` each job gets one (``CUDA_VISIBLE_DEVICES``). ``commands`` writes the missing runs' command lines instead,
for a cluster scheduler.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from tpflow.experiments.spec import Experiment, Run

DONE = "sweep_done.json"
Launch = Callable[[list[str], dict[str, str], Path], int]  # (tpflow arguments, extra environment, log file) -> rc


def state(run: Run) -> str:
    """ "done", "killed" (a checkpoint, no marker: it resumes) or "missing"."""
    from tpflow.train.checkpoints.format import find_checkpoint

    if (run.run_dir / DONE).exists():
        return "done"
    if run.run_dir.exists() and find_checkpoint(run.run_dir)[0] is not None:
        return "killed"
    return "missing"


def arguments(experiment: Experiment, run: Run) -> list[str]:
    """The ``tpflow`` arguments of one run (``--resume`` when it was killed)."""
    sets = [arg for value in run.overrides for arg in ("--set", value)]
    resume = ["--resume"] if state(run) == "killed" else []
    return ["train", str(experiment.recipe), *sets, "--run-dir", str(run.run_dir), *resume]


def commands(experiment: Experiment) -> list[str]:
    """One shell line per run that is not done, in sweep order."""
    program = [sys.executable, "-m", "tpflow.cli"]
    return [shlex.join([*program, *arguments(experiment, run)]) for run in experiment.runs() if state(run) != "done"]


def _subprocess(args: list[str], env: dict[str, str], log: Path) -> int:
    with open(log, "a") as out:
        return subprocess.run([sys.executable, "-m", "tpflow.cli", *args], stdout=out, stderr=subprocess.STDOUT,
                              env={**os.environ, **env}, check=False).returncode  # fmt: skip


def sweep(
    experiment: Experiment,
    jobs: int = 1,
    gpus: list[str] | None = None,
    launch: Launch = _subprocess,
    on_change: Callable[[dict[str, int], float | None], None] | None = None,
) -> dict[str, list[str]]:
    """Run every run that is not done; returns {"done": [...], "failed": [...], "skipped": [...]} (run names
    ``arm/seed_s``). ``on_change(counts, eta_s)`` is called whenever a run starts or ends."""
    runs = experiment.runs()
    todo = [run for run in runs if state(run) != "done"]
    result = {"skipped": [f"{r.arm}/seed_{r.seed}" for r in runs if r not in todo], "done": [], "failed": []}
    counts = {"done": len(result["skipped"]), "running": 0, "left": len(todo)}
    lock, free, durations = threading.Lock(), list(gpus or []), []

    def report() -> None:
        if on_change is not None:
            eta = None
            if durations:
                eta = sum(durations) / len(durations) * (counts["left"] + counts["running"]) / max(jobs, 1)
            on_change(dict(counts), eta)

    def one(run: Run) -> None:
        with lock:
            device = free.pop(0) if free else None
            counts["running"], counts["left"] = counts["running"] + 1, counts["left"] - 1
            report()
        args = arguments(experiment, run)
        run.run_dir.parent.mkdir(parents=True, exist_ok=True)
        start = time.perf_counter()
        env = {} if device is None else {"CUDA_VISIBLE_DEVICES": device}
        rc = launch(args, env, run.run_dir.parent / f"seed_{run.seed}.log")
        seconds = time.perf_counter() - start
        name = f"{run.arm}/seed_{run.seed}"
        if rc == 0:
            (run.run_dir / DONE).write_text(json.dumps({"seconds": seconds, "finished": time.time()}))
        with lock:
            if device is not None:
                free.append(device)
            durations.append(seconds)
            counts["running"] -= 1
            counts["done" if rc == 0 else "failed"] = counts.get("done" if rc == 0 else "failed", 0) + 1
            result["done" if rc == 0 else "failed"].append(name)
            report()

    with ThreadPoolExecutor(max_workers=max(jobs, 1)) as pool:
        list(pool.map(one, todo))
    return result
