"""Evidence II (docs/results.md §2): outcome-only pilots that choose a regime, then a pre-registered, paired sweep.

    .venv/bin/python benchmarks/evidence.py pilot NAME [NAME ...] --seeds 0 1     # outcome-only regime pilots
    .venv/bin/python benchmarks/evidence.py sweep                                 # the committed protocol
    .venv/bin/python benchmarks/evidence.py report                                # tables from finished runs

The task is the shapes world with the continuous GenEval-style reward (``shapes-geneval``, ``score = "soft"``),
evaluated on every distinct prompt of the world, small tags repeated to ≥ 24 prompts per tag (195 prompts × 4
images = 780, one fixed noise for every run, ODE, CFG 3): the
primary metric is ``eval_reward_tags``, the soft reward averaged per tag and then over the six tags; strict GenEval
accuracy (``eval_strict_tags``) and the held-out colour-shape pairs' sub-scores are logged beside it.

A run is one (group, name, seed): ``OUT/GROUP/NAME_sSEED/`` is its run dir and ``OUT/GROUP/NAME_sSEED.json`` its
summary, written atomically when it finishes; a rerun skips finished runs and resumes an interrupted one from its
last checkpoint. ``--jobs`` trainings run at once, each in its own process with ``--threads`` torch threads. The
credit audit (``credit_audit.py``) runs on every finished run and its verdict is stored in the summary.
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

BASE_RECIPE = ROOT / "recipes" / "shapes_flowgrpo.toml"
TASK = {  # what every run of Evidence II shares, whatever the pilot or arm (dotted recipe keys)
    "reward.name": "shapes-geneval",
    "reward.score": "soft",
    "dataset.test_prompts": "distinct",
    "eval.images_per_prompt": 4,
    "eval.num_prompts": None,
    "dataset.test_min_per_tag": 24,  # small tags repeat their prompts: >= 96 images per tag (780 in all)
    "eval.batch_size": 195,
    "eval.seed": 12345,  # one eval noise for every run (= seed 0's; round-1 pilots of seed 1 drew 12346, said so)
    "eval.at_start": False,  # every run's epoch-0 eval is the same base model on the same noise: ``base_eval``
    "optimizer.beta": 0.0,
    "train.ema": False,
}
# Outcome-only pilots (docs/results.md §2.2): each changes the shipped outcome recipe by these keys. Listed in the
# order they were run; none is ever removed, so the pilot table shows every one.
_PILOT = {  # the pilots' shared budget: 16 epochs of 8 prompts x 8 images (8 AdamW steps each), 3 evaluations
    "train.epochs": 16,
    "eval.every": 8,
    "train.prompts_per_epoch": 8,
    "train.rollout_batch": 64,
}
_WIDE_LORA = {  # rank 32 on the attention projections and the joint blocks' feed-forward layers
    "backbone.lora_rank": 32,
    "backbone.lora_alpha": 64.0,
    "backbone.lora_targets": ["attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0", "ff.net.0", "ff.net.2"],
}
PILOTS: dict[str, dict] = {
    "p8": _PILOT,  # the first pilot, the shared budget alone (lr 1e-3, 8 steps per epoch) on the soft task
    "p8_noise0.4": {**_PILOT, "rollout.noise_level": 0.4},  # SDE samples closer to the ODE the eval uses
    "p8_lr3e-3_clip1e-3": {**_PILOT, "optimizer.learning_rate": 3e-3, "optimizer.clip_range": 1e-3},
    "p8_lora32_ff": {**_PILOT, **_WIDE_LORA},
    # round 2, after round 1 (seed 0: p8 +0.066, noise 0.4 +0.013, lr 3e-3 / clip 1e-3 +0.011, wide LoRA +0.023
    # at epoch 8 with 21% of ratios clipped): more exploration, and more optimizer steps per epoch
    "p8_noise1.0": {**_PILOT, "rollout.noise_level": 1.0},
    "p8_mb4": {**_PILOT, "optimizer.micro_batch_size": 4},
    # after p8's seed 1 (+0.066 on seed 0, -0.009 on seed 1): is the gradient too noisy? bigger groups, more prompts
    "p4_g16": {**_PILOT, "train.prompts_per_epoch": 4, "train.group_size": 16},
    "p16": {**_PILOT, "train.prompts_per_epoch": 16, "train.rollout_batch": 64, "optimizer.micro_batch_size": 16},
}
# DiffusionNFT (docs/results.md §2.6): the optimizer section replaced, final samples by the ODE (no SDE window),
# outcome credit; its pilots tune beta, lr and the sampling guidance on the same budget; the evaluation (CFG 3) is
# every arm's.
_NFT = {
    "optimizer": {"name": "nft", "learning_rate": 1e-3, "beta": 1.0, "kl_weight": 0.0, "num_timesteps": 10,
                  "timesteps_per_sample": 9, "micro_batch_size": 8, "gradient_accumulation_steps": 1},
    "rollout.noise_level": 0.0,
    "rollout.window_size": 1,
    "rollout.window_range": [0, 1],
}  # fmt: skip
NFT_PILOTS: dict[str, dict] = {
    "nft_b1_lr1e-3_g1": {**_PILOT, **_NFT, "rollout.guidance": 1.0},  # shapes_nft.toml's settings: CFG-free samples
    "nft_b1_lr1e-3_g3": {**_PILOT, **_NFT, "rollout.guidance": 3.0},  # samples at the eval's CFG
    "nft_b0.1_lr1e-3_g3": {**_PILOT, **_NFT, "optimizer": {**_NFT["optimizer"], "beta": 0.1}, "rollout.guidance": 3.0},
    # after seed 0 of the first two (g1 +0.033, g3 +0.043): the learning rate
    "nft_b1_lr3e-3_g3": {
        **_PILOT,
        **_NFT,
        "optimizer": {**_NFT["optimizer"], "learning_rate": 3e-3},
        "rollout.guidance": 3.0,
    },
}
PILOTS.update(NFT_PILOTS)
ARMS: dict[str, tuple[str, dict]] = {  # arm -> (recipe whose [credit] it uses, rollout overrides)
    "outcome": ("shapes_flowgrpo", {}),
    "consistent": ("shapes_tp", {}),
    "incremental": ("shapes_incremental", {}),
    "consistent_x0": ("shapes_tp", {"rollout.completions": "x0"}),
    "consistent_k3": ("shapes_tp", {"rollout.completion_steps": 3}),  # k chosen in docs/results.md §2.2
}
# The protocol (docs/results.md §2.4), committed before any arm but outcome ran. The regime is pilot p8: the best mean
# AUC gain over two seeds among the pilots whose cost lets all five arms x 8 seeds fit the 5-hour budget.
REGIME: dict = dict(PILOTS["p8"])
PROTOCOL: dict = {
    "arms": list(ARMS),
    "seeds": list(range(10, 18)),  # fresh seeds: the regime was chosen on seeds 0 and 1
    "primary_arm": "consistent",  # primary endpoint: paired AUC of eval_reward_tags, consistent - outcome
}


def recipe_data(overrides: dict, seed: int, device: str) -> dict:
    """The TOML data of one run: the base recipe with ``TASK``, then ``overrides`` (dotted keys; None removes a
    key; a key without a dot replaces its whole section), then the seed and device."""
    data = tomllib.loads(BASE_RECIPE.read_text())
    for key, value in {**TASK, **overrides, "train.seed": seed, "backbone.device": device}.items():
        section, _, name = key.partition(".")
        if not name:
            data[section] = dict(value)
        elif value is None:
            data.setdefault(section, {}).pop(name, None)
        else:
            data.setdefault(section, {})[name] = value
    data["train"]["save_every"] = data["eval"]["every"]
    return data


# DiffusionNFT's own protocol (docs/results.md §2.6), committed after its pilots and before its runs
NFT_PROTOCOL: dict = {
    "pilot": "nft_b1_lr3e-3_g3",
    "seeds": list(range(10, 18)),
}


def arm_overrides(arm: str) -> dict:
    """The regime plus the arm's [credit] section (from its shipped recipe) and rollout overrides; ``nft``: the
    regime with the NFT pilot its protocol chose."""
    if arm == "nft":
        return {**REGIME, **PILOTS[NFT_PROTOCOL["pilot"]]}
    source, rollout = ARMS[arm]
    credit = tomllib.loads((ROOT / "recipes" / f"{source}.toml").read_text())["credit"]
    return {**REGIME, **{f"credit.{k}": v for k, v in credit.items()}, **rollout}


def _base_key(data: dict) -> str:
    """What the epoch-0 evaluation depends on: the eval settings, the eval prompts, the reward and the base weights
    (a fresh LoRA has B = 0, so it changes no output whatever its rank, targets or seed; eval.seed is fixed)."""
    import hashlib

    keys = {s: data[s] for s in ("eval", "dataset", "reward")} | {"weights": data["backbone"].get("weights")}
    return hashlib.sha256(json.dumps(keys, sort_keys=True).encode()).hexdigest()[:12]


def base_eval(overrides: dict, args: dict) -> dict:
    """The epoch-0 evaluation the runs with these ``overrides`` share, computed once (``OUT/base/KEY.json``)."""
    import torch
    from rich.console import Console

    from tpflow.recipe import validate_recipe
    from tpflow.train.trainer import Trainer

    data = recipe_data({**overrides, "eval.at_start": True}, 0, args["device"])
    out, key = Path(args["out"]) / "base", _base_key(data)
    done = out / f"{key}.json"
    if done.exists():
        return json.loads(done.read_text())
    out.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(args["threads"])
    recipe = validate_recipe(data, where="base", path=BASE_RECIPE)
    with open(out / f"{key}.log", "a") as log:  # the trainer's own epoch-0 evaluation, nothing trained
        trainer = Trainer(recipe, run_dir=out / key, console=Console(file=log, force_terminal=False))
        try:
            line = trainer.evaluate(0)
        finally:
            trainer.run_lock.release()
    result = {"epoch": 0, "seconds": 0.0, **{k: v for k, v in line.items() if k.startswith("eval_")}}
    tmp = done.with_suffix(".tmp")
    tmp.write_text(json.dumps(result, indent=1))
    os.replace(tmp, done)
    return result


def run_one(group: str, name: str, overrides: dict, seed: int, args: dict) -> dict:
    """Train one run, resuming its run dir if a checkpoint is there; save and return its summary."""
    import torch
    from rich.console import Console

    torch.set_num_threads(args["threads"])
    from tpflow.recipe import validate_recipe
    from tpflow.train.checkpoints.format import find_checkpoint
    from tpflow.train.trainer import Trainer

    out = Path(args["out"]) / group
    out.mkdir(parents=True, exist_ok=True)
    done = out / f"{name}_s{seed}.json"
    if done.exists():
        return json.loads(done.read_text())
    run_dir = out / f"{name}_s{seed}"
    data = recipe_data(overrides, seed, args["device"])
    recipe = validate_recipe(data, where=f"{group}/{name}/s{seed}", path=BASE_RECIPE)
    resume = run_dir.exists() and find_checkpoint(run_dir)[0] is not None
    with open(out / f"{name}_s{seed}.log", "a") as log:
        Trainer(recipe, run_dir=run_dir, resume=resume, console=Console(file=log, force_terminal=False)).fit()
    from _evidence_stats import summarise

    base = None if data["eval"].get("at_start", True) else base_eval(overrides, args)
    result = {"group": group, "name": name, "seed": seed, "overrides": overrides, **summarise(run_dir, data, base)}
    tmp = done.with_suffix(".tmp")
    tmp.write_text(json.dumps(result, indent=1))
    os.replace(tmp, done)  # atomic: a finished run is either wholly there or not at all
    return result


def run_all(todo: list[tuple[str, str, dict, int]], args: argparse.Namespace) -> list[dict]:
    """Run every (group, name, overrides, seed), ``--jobs`` at once; print progress as each finishes."""
    shared = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    for _, _, overrides, _ in todo:  # before the pool, once per eval set: every run's summary starts with it
        base_eval(overrides, shared)
    start, results = time.perf_counter(), []
    with ProcessPoolExecutor(args.jobs, mp_context=get_context("spawn")) as pool:
        futures = {pool.submit(run_one, *spec, shared): spec for spec in todo}
        for i, future in enumerate(as_completed(futures), 1):
            results.append(future.result())
            group, name, _, seed = futures[future]
            print(f"[{i}/{len(todo)}] {group}/{name}_s{seed} done, {time.perf_counter() - start:.0f} s", flush=True)
    return results


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("command", choices=["pilot", "sweep", "report"])
    parser.add_argument(
        "names",
        nargs="*",
        help="pilot names (pilot) or arms (sweep; default: the protocol's, and nft once it has one)",
    )
    parser.add_argument("--seeds", type=int, nargs="+", default=None)
    parser.add_argument("--device", default="cpu", help="cpu, cuda or auto: where the model runs.")
    parser.add_argument("--jobs", type=int, default=2, help="Trainings run at once, each in its own process.")
    parser.add_argument("--threads", type=int, default=1, help="Torch threads per training process.")
    parser.add_argument(
        "--group",
        default="pilots2",
        help="pilot runs' folder under --out (pilots: round 1, "
        "evaluated on 126 prompts x 4 with each seed's own eval noise; pilots2: the final eval set)",
    )
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / "evidence")
    parser.add_argument("--docs", type=Path, default=ROOT / "docs" / "results")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    from _evidence_stats import report

    args = parse(argv)
    if args.command == "pilot":
        unknown = sorted(set(args.names) - set(PILOTS))
        if unknown or not args.names:
            sys.exit(f"Pilots to run: one or more of {', '.join(PILOTS)} (unknown: {', '.join(unknown) or 'none'}).")
        seeds = args.seeds or [0, 1]
        run_all([(args.group, n, PILOTS[n], s) for s in seeds for n in args.names], args)
    elif args.command == "sweep":
        if not PROTOCOL["seeds"]:
            sys.exit("No protocol is committed yet (PROTOCOL['seeds'] is empty): run pilots and commit one first.")
        nft = ["nft"] if NFT_PROTOCOL["pilot"] else []
        arms = args.names or PROTOCOL["arms"] + nft
        seeds = args.seeds or PROTOCOL["seeds"]
        todo = [("sweep", a, arm_overrides(a), s) for s in seeds for a in arms  # seed-major
                if a != "nft" or s in NFT_PROTOCOL["seeds"]]  # fmt: skip
        run_all(todo, args)
    report(args.out, PILOTS, {**PROTOCOL, "nft": NFT_PROTOCOL}, args.docs)


if __name__ == "__main__":
    main()
