"""The probe's figures from its finished draws: per (arm, group size) cosine to the reference, bias ceiling, SNR,
cost; paired comparisons against a baseline arm at equal group size and at equal NFE; a table and a figure.

g★ is the mean of the reference draws' leave-one-out REINFORCE gradients (the primary reference: the gradient of
J = E[R(x_0)], which the eval reward measures), g★ₙ that of their group-normalised outcome gradients (the objective
that GRPO's std normalisation optimises instead). A repeat's cosine is cos(ĝ_r, g★): it carries both estimates'
noise, the same g★ for every arm, so arms compare paired over repeats. The bias ceiling frees it of both noises
(``tpflow.probe.stats.noise_free_cosine``: every pair of independent draws), with a delete-one-repeat jackknife
interval (the reference held fixed); the SNR per trajectory has the same kind of interval. "At equal NFE"
interpolates the baseline arm's repeat-r cosine, linearly in log NFE per prompt between its group sizes, at the other
arm's NFE per prompt (only inside the baseline's range; never extrapolated).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from tpflow.intervals import holm, t_interval
from tpflow.probe.caveats import caveats
from tpflow.probe.stats import cosine, jackknife, mean_of, noise_free_cosine, signal_to_noise, split_half_reliability


@dataclass
class ArmFigures:
    key: str  # NAME@G
    arm: str
    group_size: int
    repeats: int
    nfe_per_traj: float
    nfe_per_prompt: float
    seconds: float  # mean per draw
    reward: float  # mean final reward of its trajectories
    cosine: tuple[float, float, float]  # to g★: mean, 95% t interval over repeats
    cosine_normalised: tuple[float, float, float]  # to g★ₙ
    bias_ceiling: tuple[float, float, float]  # noise-free cos(E ĝ, g★), jackknife 95% t interval over repeats
    bias_ceiling_normalised: tuple[float, float, float]  # against g★ₙ
    snr_per_trajectory: tuple[float, float, float]  # jackknife 95% t interval over repeats


@dataclass
class Comparison:
    name: str  # "ARM@G − BASE@G" or "ARM@G − BASE@equal NFE"
    mean: float
    low: float
    high: float
    p: float
    p_holm: float
    repeats: int


def _halves(draws: list[Tensor]) -> tuple[Tensor, Tensor]:
    return mean_of(draws[0::2]), mean_of(draws[1::2])


def _interval(values: list[float]) -> tuple[float, float, float]:
    mean, low, high, _ = t_interval(values)
    return mean, low, high


def figures(
    tensors: dict[str, dict[str, Tensor]], meta: dict[str, dict[str, Any]], prompts: int, reference_group_size: int
) -> dict[str, Any]:
    """Every figure (module docstring) from ``load_units``' output, for a probe of ``prompts`` prompts."""
    arm_units = sorted(u for u in tensors if u.startswith("arms_"))
    ref_units = sorted(u for u in tensors if u.startswith("ref_"))
    if len(ref_units) < 2 or len(arm_units) < 2:
        raise ValueError("a report needs at least 2 finished repeats and 2 reference draws.")
    loo = [tensors[u]["loo"] for u in ref_units]
    normalised = [tensors[u]["normalised"] for u in ref_units]
    star, star_n = mean_of(loo), mean_of(normalised)
    loo_stack, normalised_stack = torch.stack(loo).double(), torch.stack(normalised).double()  # [draws, d]
    keys = list(tensors[arm_units[0]])
    per_repeat = {key: [cosine(tensors[u][key], star) for u in arm_units] for key in keys}
    arms = []
    for key in keys:
        name, _, g = key.rpartition("@")
        draws = [tensors[u][key] for u in arm_units]
        nfe = float(np.mean([meta[u][key]["nfe"] for u in arm_units]))
        stack = torch.stack([d.double() for d in draws])  # [repeats, d]
        trajectories = prompts * int(g)
        arms.append(ArmFigures(
            key=key, arm=name, group_size=int(g), repeats=len(draws), nfe_per_traj=nfe,
            nfe_per_prompt=nfe * int(g), seconds=float(np.mean([meta[u][key]["seconds"] for u in arm_units])),
            reward=float(np.mean([meta[u][key]["reward"] for u in arm_units])),
            cosine=_interval(per_repeat[key]),
            cosine_normalised=_interval([cosine(d, star_n) for d in draws]),
            bias_ceiling=jackknife(lambda x: noise_free_cosine(x, loo_stack), stack),
            bias_ceiling_normalised=jackknife(lambda x: noise_free_cosine(x, normalised_stack), stack),
            snr_per_trajectory=jackknife(lambda x, n=trajectories: signal_to_noise(x) / n, stack),
        ))  # fmt: skip
    reliability = split_half_reliability(*_halves(loo))
    reliability_n = split_half_reliability(*_halves(normalised))
    return {
        "arms": [asdict(a) for a in arms],
        "per_repeat_cosine": per_repeat,
        "reference": {
            "draws": len(ref_units),
            "trajectories": len(ref_units) * prompts * reference_group_size,
            "split_half": reliability,
            "split_half_normalised": reliability_n,
            "cos_loo_normalised": cosine(star, star_n),
            "nfe_per_traj": float(np.mean([meta[u]["nfe"] for u in ref_units])),
            "seconds": float(np.mean([meta[u]["seconds"] for u in ref_units])),
            "sketch_distortion": meta[arm_units[0]].get("sketch_distortion"),
        },
        "paired_bitwise": all(meta[u].get("paired_bitwise", False) for u in arm_units),
        "pairing_classes": max((meta[u].get("pairing_classes", 1) for u in arm_units), default=1),
    }


def comparisons(result: dict[str, Any], baseline: str) -> list[Comparison]:
    """Each other arm against ``baseline`` (an arm name), paired over repeats: at each group size both have, and
    at equal NFE per prompt where the baseline's sizes span the arm's NFE. Holm over the whole list."""
    arms = {a["key"]: a for a in result["arms"]}
    cos = result["per_repeat_cosine"]
    base = sorted((a for a in arms.values() if a["arm"] == baseline), key=lambda a: a["nfe_per_prompt"])
    rows: list[tuple[str, list[float]]] = []
    for a in arms.values():
        if a["arm"] == baseline:
            continue
        same = f"{baseline}@{a['group_size']}"
        if same in arms:
            rows.append((f"{a['key']} − {same}", [x - y for x, y in zip(cos[a["key"]], cos[same], strict=True)]))
        nfes = [b["nfe_per_prompt"] for b in base]
        if len(base) > 1 and nfes[0] <= a["nfe_per_prompt"] <= nfes[-1]:
            at = np.log(a["nfe_per_prompt"])
            curve = np.array([cos[b["key"]] for b in base])  # [sizes, repeats]
            interpolated = [float(np.interp(at, np.log(nfes), curve[:, r])) for r in range(curve.shape[1])]
            rows.append((f"{a['key']} − {baseline} at equal NFE ({a['nfe_per_prompt']:.0f}/prompt)",
                         [x - y for x, y in zip(cos[a["key"]], interpolated, strict=True)]))  # fmt: skip
    tests = {name: t_interval(values) for name, values in rows}
    adjusted = holm({name: t[3] for name, t in tests.items()}) if tests else {}
    return [Comparison(name, *tests[name], adjusted[name], len(values)) for name, values in rows]


def _fmt(interval: tuple[float, float, float] | list[float]) -> str:
    mean, low, high = interval
    return f"{mean:.3f} [{low:.3f}, {high:.3f}]" if not math.isnan(low) else f"{mean:.3f}"


def _snr(interval: tuple[float, float, float] | list[float]) -> str:
    mean, low, high = interval
    return f"{mean:.2e} [{low:.1e}, {high:.1e}]" if not math.isnan(low) else f"{mean:.2e}"


def markdown(result: dict[str, Any], compared: list[Comparison], header: str) -> str:
    """The report as markdown: the arms table, the comparisons, the reference's reliability."""
    ref = result["reference"]
    lines = [header, "", "| arm | G | repeats | NFE/traj | NFE/prompt | s/draw | reward | cos to g★ [95% t] | "
             "cos to g★ₙ [95% t] | bias ceiling to g★ [jackknife] | to g★ₙ | SNR/traj [jackknife] |",
             "|" + "---|" * 12]  # fmt: skip
    for a in result["arms"]:
        lines.append(
            f"| {a['arm']} | {a['group_size']} | {a['repeats']} | {a['nfe_per_traj']:.1f} | {a['nfe_per_prompt']:.0f} "
            f"| {a['seconds']:.1f} | {a['reward']:.3f} | {_fmt(a['cosine'])} | {_fmt(a['cosine_normalised'])} | "
            f"{_fmt(a['bias_ceiling'])} | {_fmt(a['bias_ceiling_normalised'])} | {_snr(a['snr_per_trajectory'])} |"
        )
    lines += [
        "",
        "| comparison (paired over repeats) | difference in cos to g★ [95% t] | p | Holm p |",
        "|---|---|---|---|",
    ]
    for c in compared:
        lines.append(f"| {c.name} | {c.mean:+.4f} [{c.low:+.4f}, {c.high:+.4f}] | {c.p:.3g} | {c.p_holm:.3g} |")
    r, whole = ref["split_half"]
    rn, whole_n = ref["split_half_normalised"]
    lines += [
        "",
        f"Reference: {ref['draws']} draws ({ref['trajectories']} trajectories, {ref['nfe_per_traj']:.0f} NFE each, "
        f"{ref['seconds']:.1f} s per draw). Split-half cosine of g★ {r:.3f} (Spearman-Brown {whole:.3f}); of g★ₙ "
        f"{rn:.3f} ({whole_n:.3f}); cos(g★, g★ₙ) = {ref['cos_loo_normalised']:.3f}.",
    ]
    classes = result.get("pairing_classes", 1)
    if classes > 1:  # arms with their own sampler, plan or window: paired by repeat (seeds), not by trajectory
        held = "the same, bit for bit, in every repeat" if result["paired_bitwise"] else "NOT the same in some repeat"
        lines.append(
            f"The arms sample in {classes} ways (their own sampler, plan or window): within each, the main "
            f"trajectories were {held}; across them, repeat r draws from the same seeds but not the same "
            "trajectories (docs/probe.md)."
        )
    else:
        lines.append(
            "Every arm's main trajectories were the same, bit for bit, in every repeat."
            if result["paired_bitwise"]
            else "**Not paired bitwise:** in some repeat the arms' main trajectories differed (docs/probe.md)."
        )
    if ref.get("sketch_distortion") is not None:
        lines.append(f"Gradients sketched; measured inner-product distortion {ref['sketch_distortion']:.2e} "
                     "(largest |⟨Sx,Sy⟩ − ⟨x,y⟩| / ‖x‖‖y‖ over repeat 0's gradients).")  # fmt: skip
    notes = caveats(result)
    if notes:  # figures this size leaves undefined or noise (tpflow.probe.caveats)
        lines += ["", "**What this probe's size cannot show:**", "", *(f"- {note}" for note in notes)]
    return "\n".join(lines) + "\n"


def plot(result: dict[str, Any], path: Path, title: str) -> Path:
    """Cosine to g★ against NFE per prompt (left) and seconds per draw (right), one line per arm over its group
    sizes (95% t intervals as bars)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    fig, axes = plt.subplots(1, 2, figsize=(10, 4.2), sharey=True)
    by_arm: dict[str, list[dict]] = {}
    for a in result["arms"]:
        by_arm.setdefault(a["arm"], []).append(a)
    panels = [(axes[0], "nfe_per_prompt", "model evaluations (NFE) per prompt"),
              (axes[1], "seconds", "seconds per draw (its rollouts, scoring, credit, gradient)")]  # fmt: skip
    for ax, axis, label in panels:
        for name, rows in by_arm.items():
            rows = sorted(rows, key=lambda a: a[axis])
            x, y = [a[axis] for a in rows], [a["cosine"][0] for a in rows]
            err = [[a["cosine"][0] - a["cosine"][1] for a in rows], [a["cosine"][2] - a["cosine"][0] for a in rows]]
            ax.errorbar(x, y, yerr=np.nan_to_num(np.array(err)), marker="o", capsize=3, label=name)
            for a in rows:
                ax.annotate(f"G={a['group_size']}", (a[axis], a["cosine"][0]), fontsize=7,
                            textcoords="offset points", xytext=(4, -8))  # fmt: skip
        ax.set_xscale("log")
        # ticks at 1-2-5 steps, labelled as plain numbers (matplotlib's default labels minor ticks "3×10²" on a
        # short log range, and they overlap)
        ax.xaxis.set_major_locator(LogLocator(subs=(1.0, 2.0, 5.0)))
        ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.set_xlabel(label)
        ax.axhline(0, color="grey", lw=0.5)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("cos(first-step gradient, g★)")
    axes[0].legend(fontsize=8)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
