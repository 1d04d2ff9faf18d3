"""The rival methods' first-step gradients against the reference, on one engine (docs/results.md §3.5, §3.6).

    .venv/bin/python benchmarks/probe_rivals.py run       # the committed protocol below (resumable)
    .venv/bin/python benchmarks/probe_rivals.py report    # docs/results/probe_rivals.md from the finished probe

The task, prompts, reference and state are Evidence III's (benchmarks/probe_study.py: Evidence II's outcome recipe in
the §2.4 regime, cps at α = 0.7, W = 9; P = 6 balanced prompts; g★ from 16 draws of 32 per prompt; the shipped model,
epoch 0). Every arm is scored against the gradient of *that* recipe's policy (docs/probe.md, "Arms"): the rivals
sample with their own sampler, plan and window (docs/credit.md's table), as their shapes recipes do, and train with
their own loss options, so this measures how well each method's update points where the shipped model's SDE policy
improves, per trajectory, per NFE and per second. All arms at G = 8 (80 NFE per prompt for every arm but consistent,
440): equal G is equal NFE for the rivals.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))

import probe_study  # noqa: E402

OUT = probe_study.OUT
NAME = "rivals_epoch0"
ARMS = {  # name -> probe arm: each rival as its shapes recipe runs it (recipes/shapes_*.toml), on the task's model
    "outcome": "outcome:credit.name=outcome",
    "consistent": "consistent:credit.name=consistent,credit.balanced=true",
    "dancegrpo": "dancegrpo:credit.name=outcome,sampler.name=dance-sde,plan.name=trained-fraction,"
    "rollout.window_size=10,rollout.window_range=[0, 10],rollout.noise_level=0.3,rollout.same_noise=true",
    "flowgrpo_fast": "flowgrpo_fast:credit.name=outcome,plan.name=window-per-image,rollout.window_size=3,"
    "rollout.window_range=[0, 5],rollout.noise_level=0.8,optimizer.global_std=true",
    "mixgrpo": "mixgrpo:credit.name=outcome,sampler.name=flow-sde,plan.name=window-schedule,rollout.window_size=4,"
    "rollout.window_range=[0, 8],rollout.same_noise=true",
    "grpo_guard": "grpo_guard:credit.name=outcome,sampler.name=flow-sde,plan.name=trained-fraction,plan.fraction=1.0,"
    "rollout.window_size=10,rollout.window_range=[0, 10],optimizer.ratio_norm=true,optimizer.ratio_norm_reweight=true",
    "noise_aware": "noise_aware:credit.name=outcome,optimizer.step_weight=noise-aware",
}
# The protocol, committed before the probe's first run. Repeats: Evidence III's paired spread of consistent − outcome
# (sd ≈ 0.10 over 20 repeats, docs/results.md §3.4) gives ±0.038 at 30; rival arms are not paired on trajectories
# with outcome (their own windows), so their spread is expected larger: ±0.02 would take ~100-150 repeats, beyond
# the probe's budget on 2 CPU cores (30 repeats and the reference: ~1 h). The primary is DanceGRPO, the other
# baseline the TP-GRPO paper names beside Flow-GRPO; the rest form one Holm family.
PROTOCOL: dict = {
    "arms": list(ARMS),
    "group_sizes": [8],
    "repeats": 30,
    "reference_draws": 16,
    "seed": 0,  # Evidence III's seed: the same reference draws and prompt set
    "baseline": "outcome",
    "primary": "dancegrpo@8 − outcome@8",  # cos to g★, paired over repeats, two-sided 95% t
    "secondary": ["consistent", "flowgrpo_fast", "mixgrpo", "grpo_guard", "noise_aware"],  # each − outcome, Holm
}


def run(threads: int) -> Path:
    """The protocol's probe, resumable (finished repeats and reference draws are kept)."""
    arms = [ARMS[a] for a in PROTOCOL["arms"]]
    return probe_study.probe(NAME, arms, PROTOCOL["group_sizes"], PROTOCOL["repeats"], PROTOCOL["reference_draws"],
                             PROTOCOL["seed"], None, threads)  # fmt: skip


def report() -> Path:
    """docs/results/probe_rivals.md: the probe's own table, the primary, the secondary family with Holm, and each
    arm's cost per repeat (NFE and seconds per prompt)."""
    import shutil

    from tpflow.intervals import holm

    data = json.loads((OUT / NAME / "report.json").read_text())
    comparisons = {c["name"]: c for c in data["comparisons"]}
    primary = comparisons[PROTOCOL["primary"]]
    family = {f"{a}@8 − outcome@8": comparisons[f"{a}@8 − outcome@8"] for a in PROTOCOL["secondary"]}
    adjusted = holm({k: c["p"] for k, c in family.items()})
    results = ROOT / "docs" / "results"
    shutil.copyfile(OUT / NAME / "cosine_nfe.png", results / "probe_rivals_cosine.png")
    lines = [
        "# The rival methods' first-step gradients (docs/results.md §3.5)",
        "",
        "Rebuilt by `.venv/bin/python benchmarks/probe_rivals.py report` from `runs/probe/rivals_epoch0/report.json`.",
        "",
        f"**Primary** ({PROTOCOL['primary']}, {primary['repeats']} repeats): {primary['mean']:+.4f}, 95% t "
        f"[{primary['low']:+.4f}, {primary['high']:+.4f}], p = {primary['p']:.3g}.",
        "",
        "| secondary comparison | difference in cos to g★ [95% t] | p | Holm p |",
        "|---|---|---|---|",
    ]
    for key, c in family.items():
        lines.append(f"| {key} | {c['mean']:+.4f} [{c['low']:+.4f}, {c['high']:+.4f}] | {c['p']:.3g} | "
                     f"{adjusted[key]:.3g} |")  # fmt: skip
    lines += ["", (OUT / NAME / "report.md").read_text().split("\n", 3)[-1]]
    cos = data["per_repeat_cosine"]  # every repeat, none dropped
    lines += probe_study.repeat_table(cos, [f"{a}@8" for a in PROTOCOL["arms"]])
    path = results / "probe_rivals.md"
    path.write_text("\n".join(lines) + "\n")
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("stage", choices=["run", "report"])
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    if args.stage == "run":
        print(run(args.threads))
    else:
        print(report())


if __name__ == "__main__":
    main()
