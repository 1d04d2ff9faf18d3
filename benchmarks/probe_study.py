"""Evidence III (docs/results.md §3): which credit gives the better first-step gradient, measured by ``tpflow probe``.

    .venv/bin/python benchmarks/probe_study.py prepare     # the task recipe, and the mid-training state
    .venv/bin/python benchmarks/probe_study.py pilot       # the pilot that sizes the repeats (outcome, consistent)
    .venv/bin/python benchmarks/probe_study.py run         # the committed protocol (resumable)
    .venv/bin/python benchmarks/probe_study.py report      # docs/results/probe_*.md from the finished probes
    .venv/bin/python benchmarks/probe_study.py repeats     # docs/results/probe_study_repeats.json from their draws
    .venv/bin/python benchmarks/probe_study.py recompute   # every figure of probe_study.md from that file alone

The task is Evidence II's (§2.1, ``benchmarks/evidence.py``: shapes-geneval, soft score, the regime of §2.4); the
probe's states are the shipped model (epoch 0) and the outcome (Flow-GRPO) run of seed 10 trained 8 epochs in that
regime (§2.4 seed 10's outcome arm, retrained here since the sweep's run dirs are not kept).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import tomli_w

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))

import evidence  # noqa: E402

OUT = ROOT / "runs" / "probe"
MID_SEED, MID_EPOCHS = 10, 8


def task_recipe(out: Path = OUT) -> Path:
    """Evidence II's outcome recipe in the §2.4 regime, written as a TOML the probe reads (arms override it)."""
    data = evidence.recipe_data(evidence.REGIME, MID_SEED, "cpu")
    path = out / "task.toml"
    out.mkdir(parents=True, exist_ok=True)
    path.write_text(tomli_w.dumps(data))
    return path


def prepare(threads: int) -> None:
    """The task recipe, and the mid-training state: outcome, seed 10, 8 epochs (resumes if killed)."""
    import torch
    from rich.console import Console

    from tpflow.recipe import validate_recipe
    from tpflow.train.checkpoints.format import find_checkpoint
    from tpflow.train.trainer import Trainer

    torch.set_num_threads(threads)
    task_recipe()
    data = evidence.recipe_data({**evidence.REGIME, "train.epochs": MID_EPOCHS}, MID_SEED, "cpu")
    recipe = validate_recipe(data, where="probe/mid", path=evidence.BASE_RECIPE)
    run_dir = OUT / f"outcome_s{MID_SEED}_e{MID_EPOCHS}"
    resume = run_dir.exists() and find_checkpoint(run_dir)[0] is not None
    with open(OUT / "mid.log", "a") as log:
        Trainer(recipe, run_dir=run_dir, resume=resume, console=Console(file=log, force_terminal=False)).fit()
    print(f"mid-training state: {run_dir}")


ARMS = {  # docs/results.md §2.4's arms, as probe arms; outcome also at the group sizes its equal-NFE curve needs
    "outcome": "outcome:credit.name=outcome,group_sizes=4/8/16/32",
    "consistent": "consistent:credit.name=consistent,credit.balanced=true",
    "incremental": "incremental:credit.name=incremental",
    "consistent_x0": "consistent_x0:credit.name=consistent,credit.balanced=true,rollout.completions=x0",
    "consistent_k3": "consistent_k3:credit.name=consistent,credit.balanced=true,rollout.completion_steps=3",
}
PILOT = {
    "arms": ["outcome:credit.name=outcome", ARMS["consistent"]],
    "group_sizes": [8],
    "repeats": 4,
    "reference_draws": 4,
    "seed": 1000,
}  # fmt: skip  (seed 1000: draws disjoint from the protocol's seed 0)
PROMPTS, REFERENCE_G = 6, 32
# The protocol (docs/results.md §3.3), committed after the pilot and before the first run of the study.
PROTOCOL: dict = {
    "states": {"epoch0": None, "epoch8": f"outcome_s{MID_SEED}_e{MID_EPOCHS}"},  # probe name -> run dir under OUT
    "arms": list(ARMS),
    "group_sizes": [4, 8],  # every arm but outcome (whose own sizes are in its spec)
    "repeats": 20,  # by the 2-hour budget: the pilot's sd (0.203) would need ~400 for ±0.02 (docs/results.md §3.2)
    "reference_draws": 16,
    "seed": 0,
    "primary": ("epoch0", "consistent@8 − outcome@8"),  # cos to g★, paired over repeats, two-sided 95% t
    "half_width": 0.02,  # the primary's planned interval: ±0.02
}


def probe(name: str, arms: list[str], group_sizes: list[int], repeats: int, reference_draws: int, seed: int,
          checkpoint: Path | None, threads: int) -> Path:  # fmt: skip
    """Run (or continue) one probe into ``OUT/NAME`` through the ``tpflow probe`` command itself."""
    import torch

    from tpflow.cli import main as tpflow_main

    torch.set_num_threads(threads)
    args = ["probe", str(task_recipe()), "--prompts", str(PROMPTS), "--group-sizes", ",".join(map(str, group_sizes)),
            "--repeats", str(repeats), "--reference-draws", str(reference_draws), "--reference-group-size",
            str(REFERENCE_G), "--seed", str(seed), "--out", str(OUT / name)]  # fmt: skip
    for arm in arms:
        args += ["--arm", arm]
    if checkpoint is not None:
        args += ["--checkpoint", str(checkpoint)]
    try:
        tpflow_main(args)
    except SystemExit as stop:
        if stop.code:
            raise
    return OUT / name


def repeat_table(cos: dict[str, list[float]], keys: list[str]) -> list[str]:
    """Markdown lines: every repeat's cosine to g★ for the arms ``keys`` (no repeat dropped)."""
    lines = ["## Every repeat: cos to g★", "", "| repeat | " + " | ".join(keys) + " |", "|---" * (len(keys) + 1) + "|"]
    for r in range(len(cos[keys[0]])):
        lines.append(f"| {r} | " + " | ".join(f"{cos[k][r]:+.4f}" for k in keys) + " |")
    return lines


def plan_repeats(pilot: Path, primary: str, half_width: float) -> dict:
    """Repeats for the primary's t interval to be at most ±half_width, from the pilot's spread of the paired
    difference, taken at its one-sided 80% upper confidence bound (a pilot of few repeats underestimates spread)."""
    import json
    import math

    from scipy import stats

    from tpflow.intervals import repeats_for_half_width

    arm, _, base = (part.strip() for part in primary.partition("−"))
    cos = json.loads((pilot / "report.json").read_text())["per_repeat_cosine"]
    diffs = [a - b for a, b in zip(cos[arm], cos[base], strict=True)]
    n = len(diffs)
    mean = sum(diffs) / n
    sd = math.sqrt(sum((d - mean) ** 2 for d in diffs) / (n - 1))
    upper = sd * math.sqrt((n - 1) / stats.chi2.ppf(0.2, n - 1))
    return {"pilot_differences": diffs, "sd": sd, "sd_upper80": upper,
            "repeats": repeats_for_half_width(upper, half_width)}  # fmt: skip


def run(threads: int) -> None:
    """Every state of the protocol, in order; resumable (finished draws are kept)."""
    for name, run_dir in PROTOCOL["states"].items():
        arms = [ARMS[a] for a in PROTOCOL["arms"]]
        probe(name, arms, PROTOCOL["group_sizes"], PROTOCOL["repeats"], PROTOCOL["reference_draws"],
              PROTOCOL["seed"], None if run_dir is None else OUT / run_dir, threads)  # fmt: skip


def _sweep_ranking() -> dict[str, dict[str, float]]:
    """Per arm of the §2.5 sweep: mean eval reward at epochs 0, 8, 16, the AUC, and the gains of each half."""
    import json

    import numpy as np
    from _evidence_stats import auc, curve

    runs = json.loads((ROOT / "docs" / "results" / "evidence_runs.json").read_text())["sweep"]
    out: dict[str, dict[str, float]] = {}
    for name in ARMS:
        mine = [r for r in runs if r["name"] == name]
        evals = np.array([curve(r)[1] for r in mine])  # [seeds, 3] at epochs 0, 8, 16
        out[name] = {"seeds": len(mine), "auc": float(np.mean([auc(r) for r in mine])),
                     "eval8": float(evals[:, 1].mean()), "eval16": float(evals[:, 2].mean()),
                     "gain_0_8": float((evals[:, 1] - evals[:, 0]).mean()),
                     "gain_8_16": float((evals[:, 2] - evals[:, 1]).mean())}  # fmt: skip
    return out


def _primary_and_family(tables: dict[str, dict]) -> tuple[str, list[str]]:
    """The primary's line and the secondary table (one Holm family over both states) from each state's report
    (its ``comparisons``): shared by ``report`` and ``recompute``, so that both print the same figures the same way."""
    from tpflow.intervals import holm

    primary_state, primary = PROTOCOL["primary"]
    family, c = {}, None
    for state, data in tables.items():
        for row in data["comparisons"]:
            if state == primary_state and row["name"] == primary:
                c = row
            else:
                family[f"{state}: {row['name']}"] = row
    adjusted = holm({k: row["p"] for k, row in family.items()})
    line = (f"**Primary** ({primary_state}, {primary}, {c['repeats']} repeats): {c['mean']:+.4f}, 95% t "
            f"[{c['low']:+.4f}, {c['high']:+.4f}], p = {c['p']:.3g}.")  # fmt: skip
    lines = ["## Secondary comparisons, one Holm family over both states", "",
             "| comparison | difference in cos to g★ [95% t] | p | Holm p |", "|---|---|---|---|"]  # fmt: skip
    for key, row in family.items():
        lines.append(f"| {key} | {row['mean']:+.4f} [{row['low']:+.4f}, {row['high']:+.4f}] | {row['p']:.3g} | "
                     f"{adjusted[key]:.3g} |")  # fmt: skip
    return line, lines


def report() -> Path:
    """docs/results/probe_study.md from the finished probes: each state's table, the primary, the Holm family of
    the secondary comparisons over both states, and the probe's ranking beside the sweep's."""
    import json
    import shutil

    results = ROOT / "docs" / "results"
    lines = [
        "# Evidence III: the probe study (docs/results.md §3)",
        "",
        "Rebuilt by `.venv/bin/python benchmarks/probe_study.py report` from `runs/probe/*/report.json`.",
        "",
    ]
    tables = {}
    for state in PROTOCOL["states"]:
        tables[state] = json.loads((OUT / state / "report.json").read_text())
        shutil.copyfile(OUT / state / "cosine_nfe.png", results / f"probe_cosine_nfe_{state}.png")
    primary_line, family_lines = _primary_and_family(tables)
    lines += [primary_line, ""]
    for state in tables:
        lines += [f"## {state}", "", (OUT / state / "report.md").read_text().split("\n", 3)[-1], ""]
    lines += family_lines
    sweep = _sweep_ranking()
    lines += ["", "## The probe's ranking beside the sweep's (§2.5)", "",
              "| arm | probe cos to g★ at G = 8, epoch 0 | at epoch 8 | sweep AUC | sweep gain 0→8 | "
              "sweep gain 8→16 |",
              "|---|---|---|---|---|---|"]  # fmt: skip
    for name, row in sweep.items():
        cos = [next((a["cosine"][0] for a in tables[s]["arms"] if a["key"] == f"{name}@8"), float("nan"))
               for s in PROTOCOL["states"]]  # fmt: skip
        lines.append(f"| {name} | {cos[0]:.3f} | {cos[1]:.3f} | {row['auc']:.4f} | {row['gain_0_8']:+.4f} | "
                     f"{row['gain_8_16']:+.4f} |")  # fmt: skip
    path = results / "probe_study.md"
    path.write_text("\n".join(lines) + "\n")
    return path


REPEATS = ROOT / "docs" / "results" / "probe_study_repeats.json"


def export_repeats(probes: Path = OUT, path: Path = REPEATS) -> Path:
    """docs/results/probe_study_repeats.json from the finished probes (their draws and ``report.json``): per state
    and arm@G, every repeat's cosine to g★ and its NFE, seconds and reward; the inner products of the arm's draws
    with each other and with the reference draws; and the reference draws' own. The draws (a 32,768-parameter
    gradient per arm, G and unit: tens of MB per state) are too large to commit; every figure of the report is a
    function of these inner products (``recompute``), and they are under 1 MB."""
    import json

    import torch

    from tpflow.probe.run import load_units

    states = {}
    for state in PROTOCOL["states"]:
        tensors, meta = load_units(probes / state)
        report = json.loads((probes / state / "report.json").read_text())
        repeats = sorted(u for u in tensors if u.startswith("arms_"))
        refs = sorted(u for u in tensors if u.startswith("ref_"))
        reference = torch.stack([tensors[u][k].double() for k in ("loo", "normalised") for u in refs])
        arms = {}
        for key in report["per_repeat_cosine"]:  # the report's order (its comparisons' order)
            draws = torch.stack([tensors[u][key].double() for u in repeats])
            arms[key] = {
                "per_repeat_cosine": report["per_repeat_cosine"][key],
                **{field: [meta[u][key][field] for u in repeats] for field in ("nfe", "seconds", "reward")},
                "gram": (draws @ draws.T).tolist(),  # [repeats, repeats]
                "cross": (draws @ reference.T).tolist(),  # [repeats, loo draws then normalised draws]
            }
        states[state] = {
            "prompts": PROMPTS,
            "reference_group_size": REFERENCE_G,
            "repeats": repeats,
            "paired_bitwise": [meta[u].get("paired_bitwise", False) for u in repeats],
            "reference": {
                "units": refs,
                **{field: [meta[u][field] for u in refs] for field in ("nfe", "seconds", "reward")},
                "gram": (reference @ reference.T).tolist(),  # [loo draws then normalised draws] squared
            },
            "arms": arms,
        }
    about = (
        "docs/results.md §3.4's probes, per state and arm@G: every repeat's cosine to g★ (report.json's "
        "per_repeat_cosine) and its NFE per trajectory, seconds and mean reward; 'gram' the inner products of the "
        "arm's draws (float64 over the float32 gradients), 'cross' those with the reference draws (16 leave-one-out "
        "REINFORCE gradients, then 16 group-normalised ones), and the reference's own 'gram' in that order. "
        "Written by `benchmarks/probe_study.py repeats` from the rerun of both probes; "
        "`benchmarks/probe_study.py recompute` rebuilds every figure of docs/results/probe_study.md from this file."
    )
    path.write_text(json.dumps({"about": about, "states": states}, separators=(",", ":")) + "\n")
    return path


def _embedded(gram: list[list[float]]):
    """Vectors [n, n] whose inner products are ``gram`` [n, n] (eigenvectors scaled by the roots of the
    eigenvalues, on the unit-diagonal form so that short and long gradients keep their relative precision): the
    estimators of ``tpflow.probe.stats`` use their inputs only through inner products, so they run unchanged on
    these in place of the draws."""
    import numpy as np
    import torch

    k = np.array(gram, dtype=np.float64)
    norms = np.sqrt(np.diag(k))
    values, vectors = np.linalg.eigh(k / np.outer(norms, norms))
    return torch.from_numpy(vectors * np.sqrt(np.clip(values, 0, None)) * norms[:, None])


def recompute(path: Path = REPEATS) -> str:
    """Every figure of docs/results/probe_study.md from the committed ``path`` alone: each arm's figures through
    ``tpflow.probe.report.figures`` on vectors with the committed inner products (one arm and the reference draws
    at a time: ``_embedded``), the comparisons through ``comparisons`` on the committed per-repeat cosines, and the
    primary and the Holm family as ``report`` prints them. Also each recomputed per-repeat cosine's largest
    distance from the committed one, and the sd of the primary's paired difference (docs/results.md §3.4)."""
    import json
    import math

    from tpflow.probe.report import comparisons, figures, markdown

    states = json.loads(path.read_text())["states"]
    tables, out = {}, []
    for state, data in states.items():
        refs = data["reference"]
        n_ref = len(refs["units"])
        arms, cosines, drift, reference = [], {}, 0.0, None
        for key, arm in data["arms"].items():
            gram = [row + cross for row, cross in zip(arm["gram"], arm["cross"], strict=True)]
            gram += [[*col, *row] for col, row in zip(zip(*arm["cross"], strict=True), refs["gram"], strict=True)]
            x = _embedded(gram)
            repeats = len(arm["gram"])
            tensors = {u: {key: x[r]} for r, u in enumerate(data["repeats"])}
            tensors |= {u: {"loo": x[repeats + k], "normalised": x[repeats + n_ref + k]}
                        for k, u in enumerate(refs["units"])}  # fmt: skip
            fields = ("nfe", "seconds", "reward")
            meta = {u: {key: {f: arm[f][r] for f in fields}, "paired_bitwise": data["paired_bitwise"][r]}
                    for r, u in enumerate(data["repeats"])}  # fmt: skip
            meta |= {u: {f: refs[f][k] for f in fields} for k, u in enumerate(refs["units"])}
            result = figures(tensors, meta, data["prompts"], data["reference_group_size"])
            arms += result["arms"]
            cosines[key] = arm["per_repeat_cosine"]
            again = zip(result["per_repeat_cosine"][key], arm["per_repeat_cosine"], strict=True)
            drift = max(drift, *(abs(a - b) for a, b in again))
            reference = reference or result["reference"]
        result = {"arms": arms, "per_repeat_cosine": cosines, "reference": reference,
                  "paired_bitwise": all(data["paired_bitwise"])}  # fmt: skip
        compared = comparisons(result, "outcome")
        tables[state] = {**result, "comparisons": [c.__dict__ for c in compared]}
        out += [f"## {state}", "", markdown(result, compared, "").split("\n", 1)[-1].lstrip("\n")]
        out += [f"Largest |recomputed − committed| per-repeat cosine: {drift:.1e}.", ""]
    primary_state, primary = PROTOCOL["primary"]
    arm, _, base = (part.strip() for part in primary.partition("−"))
    cos = tables[primary_state]["per_repeat_cosine"]
    diffs = [a - b for a, b in zip(cos[arm], cos[base], strict=True)]
    mean = sum(diffs) / len(diffs)
    sd = math.sqrt(sum((d - mean) ** 2 for d in diffs) / (len(diffs) - 1))
    primary_line, family_lines = _primary_and_family(tables)
    head = [primary_line, f"sd of the primary's paired difference over {len(diffs)} repeats: {sd:.3f}.", ""]
    return "\n".join(head + out + family_lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("command", choices=["prepare", "pilot", "plan", "run", "report", "repeats", "recompute"])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--probes", type=Path, default=OUT, help="the finished probes' folder (repeats)")
    args = parser.parse_args(argv)
    if args.command == "prepare":
        prepare(args.threads)
    elif args.command == "pilot":
        probe("pilot", threads=args.threads, checkpoint=None, **PILOT)
    elif args.command == "plan":
        print(plan_repeats(OUT / "pilot", "consistent@8 − outcome@8", PROTOCOL["half_width"]))
    elif args.command == "run":
        run(args.threads)
    elif args.command == "report":
        print(report())
    elif args.command == "repeats":
        print(export_repeats(args.probes))
    elif args.command == "recompute":
        print(recompute(), end="")


if __name__ == "__main__":
    main()
