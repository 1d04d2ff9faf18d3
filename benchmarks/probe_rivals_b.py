"""TempFlow-GRPO's branching rollout and MixGRPO-Flash against the reference, per NFE (docs/results.md §3.8).

    .venv/bin/python benchmarks/probe_rivals_b.py run       # the committed protocol below (resumable)
    .venv/bin/python benchmarks/probe_rivals_b.py report    # docs/results/probe_rivals_b.md from the finished probe

The two methods built after the first rivals probe's protocol (benchmarks/probe_rivals.py, §3.5), on its task,
prompts, reference and state (Evidence III's: shapes, P = 6 balanced prompts, seed 0, g★ from 16 draws of 32, the
shipped model at epoch 0). Their costs differ from outcome's 10 NFE per trajectory (TempFlow's branching about 46,
Flash about 5), so the comparison that says what each buys is at equal NFE per prompt. For that, outcome runs at
G = 4 to 48, and its cosine is interpolated in log NFE at each arm's cost (``tpflow.probe.report.comparisons``).
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
NAME = "rivals_epoch0_b"
ARMS = {  # as their shapes recipes run them (recipes/shapes_tempflow.toml, recipes/shapes_mixgrpo_flash.toml)
    "outcome": "outcome:credit.name=outcome,group_sizes=4/8/16/32/48",
    "tempflow": "tempflow:credit.name=branch,sampler.name=flow-sde,plan.name=branch,rollout.same_noise=true,"
    "optimizer.step_weight=noise-aware",
    "mixgrpo_flash": "mixgrpo_flash:credit.name=outcome,sampler.name=flow-sde,plan.name=window-schedule,"
    "plan.after_window=dpm-solver++,rollout.window_size=4,rollout.window_range=[0, 8],rollout.same_noise=true",
}
# The protocol, committed before the probe's first run. Repeats: the first rivals probe's differences with outcome
# (arms that sample their own trajectories, paired by seed only) had sd 0.14-0.18 over 30 repeats (§3.6), i.e.
# ±0.05-0.07 at 30; the budget (about 45 min on 2 cores, after the learning sweep of §3.7) allows 30 again. The
# primary is TempFlow-GRPO at equal NFE: its branching spends 4.6x outcome's NFE per trajectory, so the question a
# user asks is whether those evaluations buy more alignment than as many more outcome trajectories would.
PROTOCOL: dict = {
    "arms": list(ARMS),
    "group_sizes": [8],  # every arm but outcome (whose sizes are in its spec)
    "repeats": 30,
    "reference_draws": 16,
    "seed": 0,  # Evidence III's seed: the same reference draws and prompt set
    "baseline": "outcome",
    "primary": "tempflow@8 − outcome at equal NFE",  # cos to g★, paired over repeats, two-sided 95% t
    # one Holm family; an equal-NFE comparison that outcome's sizes do not span is reported as missing, not replaced
    "secondary": ["tempflow@8 − outcome@8", "mixgrpo_flash@8 − outcome@8", "mixgrpo_flash@8 − outcome at equal NFE"],
}


def run(threads: int) -> Path:
    """The protocol's probe, resumable (finished repeats and reference draws are kept)."""
    arms = [ARMS[a] for a in PROTOCOL["arms"]]
    return probe_study.probe(NAME, arms, PROTOCOL["group_sizes"], PROTOCOL["repeats"], PROTOCOL["reference_draws"],
                             PROTOCOL["seed"], None, threads)  # fmt: skip


def find(comparisons: dict[str, dict], name: str) -> dict | None:
    """The comparison the protocol names; an equal-NFE one by its prefix (the report adds the NFE it was taken at)."""
    if name in comparisons:
        return comparisons[name]
    return next((c for key, c in comparisons.items() if key.startswith(name + " (")), None)


def report() -> Path:
    """docs/results/probe_rivals_b.md: the primary, the secondary family with Holm (missing ones named), the probe's
    own table and every repeat; the figure drawn beside it (probe_rivals_b_cosine.png)."""
    from tpflow.intervals import holm
    from tpflow.probe.report import plot

    data = json.loads((OUT / NAME / "report.json").read_text())
    comparisons = {c["name"]: c for c in data["comparisons"]}
    primary = find(comparisons, PROTOCOL["primary"])
    found = {name: find(comparisons, name) for name in PROTOCOL["secondary"]}
    family = {name: c for name, c in found.items() if c is not None}
    adjusted = holm({k: c["p"] for k, c in family.items()})
    lines = ["# TempFlow-GRPO's branching and MixGRPO-Flash against the reference (docs/results.md §3.8)", "",
             "Rebuilt by `.venv/bin/python benchmarks/probe_rivals_b.py report` from "
             f"`runs/probe/{NAME}/report.json`.", ""]  # fmt: skip
    if primary is None:
        lines.append(f"**Primary** ({PROTOCOL['primary']}): not computed (outcome's sizes do not span its NFE).")
    else:
        lines.append(f"**Primary** ({primary['name']}, {primary['repeats']} repeats): {primary['mean']:+.4f}, 95% t "
                     f"[{primary['low']:+.4f}, {primary['high']:+.4f}], p = {primary['p']:.3g}.")  # fmt: skip
    lines += ["", "| secondary comparison | difference in cos to g★ [95% t] | p | Holm p |", "|---|---|---|---|"]
    for name, c in found.items():
        if c is None:
            lines.append(f"| {name} | not computed: outcome's sizes do not span the arm's NFE | – | – |")
        else:
            lines.append(f"| {c['name']} | {c['mean']:+.4f} [{c['low']:+.4f}, {c['high']:+.4f}] | {c['p']:.3g} | "
                         f"{adjusted[name]:.3g} |")  # fmt: skip
    lines += ["", "The probe's own report follows. Its Holm column adjusts over all four comparisons, the primary "
              "among them; the protocol's family is the three secondary comparisons above, and their Holm p are the "
              "ones in that table.", "", (OUT / NAME / "report.md").read_text().split("\n", 3)[-1]]  # fmt: skip
    cos = data["per_repeat_cosine"]  # every repeat, none dropped
    lines += probe_study.repeat_table(cos, list(cos))
    path = ROOT / "docs" / "results" / "probe_rivals_b.md"
    path.write_text("\n".join(lines) + "\n")
    plot(data, path.with_name("probe_rivals_b_cosine.png"), "task.toml: cosine to g★ against NFE per prompt")
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("stage", choices=["run", "report"])
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    print(run(args.threads) if args.stage == "run" else report())


if __name__ == "__main__":
    main()
