"""Does turning-point credit learn faster than outcome credit? A resumable, paired, multi-seed sweep.

    .venv/bin/python benchmarks/learning_curves.py                    # the protocol of docs/results/first_attempt.md
    .venv/bin/python benchmarks/learning_curves.py --jobs 2 --threads 1 --device cpu
    .venv/bin/python benchmarks/learning_curves.py --report-only      # tables and plots from the finished runs

Tasks (docs/results/first_attempt.md states the protocol, fixed before the runs):

* **A** — ``shapes-geneval`` (the partial GenEval score of the rule-based detector) with the reference scripts' KL,
  β = 1e-4: the GenEval analogue.
* **B** — ``shapes-clip`` (the shapes world's PickScore, a continuous reward) with β = 0: the paper's unconstrained
  setting of its Fig. 4.

Arms: ``outcome`` (Flow-GRPO), ``consistent`` (TP-GRPO as published), ``turning_point``, ``incremental``, and
``consistent_x0`` (consistent with one-step x0 completions: Flow-GRPO's cost). Every arm starts from
``recipes/shapes_tp.toml`` and differs only in ``[credit]`` (copied from the shipped shapes recipes) and, for
``consistent_x0``, ``rollout.completions``; a task changes only ``[reward]`` and β. A seed fixes the prompts, the
noise, the LoRA initialisation and the eval noise, so the arms of one seed are paired.

Every run is saved the moment it finishes (``OUT/TASK_ARM_sSEED.json``); a rerun skips finished runs and resumes an
interrupted one from its last checkpoint (written every ``--eval-every`` epochs). ``--jobs`` runs that many trainings
at once in separate processes, each with ``--threads`` threads (on 2 cores, 2 × 1 beats 1 × 2 for this tiny model).
Analysis (bootstrap confidence intervals, tables, plots) is in ``_learning_stats.py``. Not run in CI.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from multiprocessing import get_context
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))

BASE_RECIPE = ROOT / "recipes" / "shapes_tp.toml"
TASKS: dict[str, dict] = {  # task -> the [reward] section and the KL weight β
    "A": {"reward": {"name": "shapes-geneval"}, "beta": 1e-4, "label": "A: shapes-geneval, β = 1e-4"},
    "B": {"reward": {"name": "shapes-clip"}, "beta": 0.0, "label": "B: shapes-clip, β = 0"},
}
ARMS: dict[str, tuple[str, dict]] = {  # arm -> (recipe whose [credit] it uses, rollout overrides)
    "outcome": ("shapes_flowgrpo", {}),
    "consistent": ("shapes_tp", {}),
    "turning_point": ("shapes_turning_point", {}),
    "incremental": ("shapes_incremental", {}),
    "consistent_x0": ("shapes_tp", {"completions": "x0"}),
}
PROTOCOL = {  # fixed before the first run (docs/results/first_attempt.md); change it only with a note there
    "tasks": ["A", "B"],
    "arms": list(ARMS),
    "seeds": [0, 1, 2, 3, 4],
    "epochs": 8,
    "eval_every": 2,
    "eval_prompts": 96,
}


def recipe_data(task: str, arm: str, seed: int, epochs: int, eval_every: int, eval_prompts: int, device: str):
    """The TOML data of one run: the base recipe with the arm's [credit], the task's reward and β, and the sweep's
    schedule. Returned as a dict for ``tpflow.recipe.validate_recipe``."""
    data = tomllib.loads(BASE_RECIPE.read_text())
    source, rollout = ARMS[arm]
    data["credit"] = tomllib.loads((ROOT / "recipes" / f"{source}.toml").read_text())["credit"]
    data["rollout"].update(rollout)
    data["reward"] = dict(TASKS[task]["reward"])
    data["optimizer"]["beta"] = TASKS[task]["beta"]
    data["train"].update(seed=seed, epochs=epochs, save_every=eval_every)
    data["eval"].update(every=eval_every, num_prompts=eval_prompts, batch_size=eval_prompts)
    data["backbone"]["device"] = device
    if device != "cpu" and task == "B":
        data["reward"]["device"] = device
    return data


def run_one(task: str, arm: str, seed: int, args: dict) -> dict:
    """Train one (task, arm, seed), resuming its run dir if a checkpoint is there; save and return its result."""
    import torch
    from rich.console import Console

    torch.set_num_threads(args["threads"])
    from tpflow.recipe import validate_recipe
    from tpflow.train.checkpoints.format import find_checkpoint
    from tpflow.train.trainer import Trainer

    out = Path(args["out"])
    done = out / f"{task}_{arm}_s{seed}.json"
    if done.exists():
        return json.loads(done.read_text())
    run_dir = out / f"{task}_{arm}_s{seed}"
    data = recipe_data(task, arm, seed, args["epochs"], args["eval_every"], args["eval_prompts"], args["device"])
    recipe = validate_recipe(data, where=f"{task}/{arm}/s{seed}", path=BASE_RECIPE)
    resume = run_dir.exists() and find_checkpoint(run_dir)[0] is not None
    console = Console(file=open(out / f"{task}_{arm}_s{seed}.log", "a"), force_terminal=False)  # noqa: SIM115
    Trainer(recipe, run_dir=run_dir, resume=resume, console=console).fit()
    from _learning_stats import summarise_run

    result = {"task": task, "arm": arm, "seed": seed, "threads": args["threads"], **summarise_run(run_dir, data)}
    tmp = done.with_suffix(".tmp")
    tmp.write_text(json.dumps(result, indent=1))
    os.replace(tmp, done)  # atomic: a finished run is either wholly there or not at all
    return result


def sweep(args: argparse.Namespace) -> list[dict]:
    """Every (task, seed, arm) of the protocol, seed-major so a slow-down of the machine hits all arms alike."""
    todo = [(task, arm, seed) for seed in args.seeds for task in args.tasks for arm in args.arms]
    shared = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    results: list[dict] = []
    start = time.perf_counter()
    if args.jobs == 1:
        for i, spec in enumerate(todo, 1):
            results.append(run_one(*spec, shared))
            print(f"[{i}/{len(todo)}] {spec} done, {time.perf_counter() - start:.0f} s", flush=True)
        return results
    with ProcessPoolExecutor(args.jobs, mp_context=get_context("spawn")) as pool:
        futures = {pool.submit(run_one, *spec, shared): spec for spec in todo}
        for i, future in enumerate(as_completed(futures), 1):
            results.append(future.result())
            print(f"[{i}/{len(todo)}] {futures[future]} done, {time.perf_counter() - start:.0f} s", flush=True)
    return results


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", nargs="+", choices=list(TASKS), default=PROTOCOL["tasks"])
    parser.add_argument("--arms", nargs="+", choices=list(ARMS), default=PROTOCOL["arms"])
    parser.add_argument("--seeds", type=int, nargs="+", default=PROTOCOL["seeds"])
    parser.add_argument("--epochs", type=int, default=PROTOCOL["epochs"])
    parser.add_argument("--eval-every", type=int, default=PROTOCOL["eval_every"])
    parser.add_argument("--eval-prompts", type=int, default=PROTOCOL["eval_prompts"])
    parser.add_argument("--device", default="cpu", help="cpu, cuda or auto: where the model (and shapes-clip) run.")
    parser.add_argument("--jobs", type=int, default=2, help="Trainings run at once, each in its own process.")
    parser.add_argument("--threads", type=int, default=1, help="Torch threads per training process.")
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / "learning_curves")
    parser.add_argument("--docs", type=Path, default=ROOT / "docs" / "results")
    parser.add_argument("--report-only", action="store_true", help="Analyse the finished runs in --out; train none.")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    from _learning_stats import load_results, report

    args = parse(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    if not args.report_only:
        sweep(args)
    results = load_results(args.out, args.tasks, args.arms, args.seeds)
    protocol = {**PROTOCOL, "device": args.device, "jobs": args.jobs}
    return report(results, args.tasks, args.arms, args.docs, protocol, {t: TASKS[t]["label"] for t in args.tasks})


if __name__ == "__main__":
    main()
