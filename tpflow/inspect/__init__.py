"""See the reward evolve along denoising, with turning points marked: ``tpflow inspect-trajectory``.

    tpflow inspect-trajectory recipes/shapes_tp.toml --prompt "a photo of a red circle" --n 8 --out runs/inspect
    tpflow inspect-trajectory --run runs/shapes_tp [--epoch E] --out runs/inspect

The first form samples n trajectories of one prompt with ODE completions after every SDE window step and writes
trajectories.png, completions.png, credit.png and trace.json; the second reads a training run's traces.jsonl and
writes trajectories.png, credit.png, turning_points.png and trace.json. See docs/inspect.md.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tpflow.inspect.traces import (
    BUILTIN_CREDIT,
    Trajectories,
    apply_credit,
    assigners,
    find_prompt,
    load_run,
    run_trajectories,
    sample_trajectories,
    summary_rows,
    to_json,
    turning_point_stats,
)
from tpflow.interfaces import capability
from tpflow.recipe import Recipe
from tpflow.sources import SOURCES
from tpflow.train.run_logger import jsonable

__all__ = ["Inspection", "inspect_run", "inspect_sampled", "summary_rows"]


@dataclass
class Inspection:
    """What an inspection wrote, and the trajectories behind it."""

    trajectories: Trajectories
    marked: str  # the assigner whose turning points the plots mark
    files: list[Path]
    notes: list[str] = field(default_factory=list)  # what the files leave out, and why (printed by the command)


def inspect_sampled(
    recipe: Recipe,
    prompt: str,
    n: int = 8,
    seed: int | None = None,
    checkpoint: Path | None = None,
    credit: Sequence[str] | None = None,
    out: Path = Path("runs/inspect"),
    warn: Callable[[str], None] = print,
    sources: Sequence[str] = (),
) -> Inspection:
    """Sample n trajectories of ``prompt`` under ``recipe`` and write the four files into ``out``.

    Args:
        recipe: the loaded recipe (backbone, sampler, reward, credit, rollout settings).
        prompt: looked up in the recipe's dataset for its metadata ({} with a warning when absent).
        n: trajectories to sample.
        seed: seeds window, noise and SDE noise (default: the recipe's train.seed).
        checkpoint: run dir or checkpoint dir whose adapter is loaded.
        credit: assigner names to compare (default: the recipe's, then the other built-ins).
        out: output directory.
        warn: called with each warning line.
        sources: the prompt's source images (absolute paths), for an editing backbone (``--image``).
    """
    from tpflow.inspect import plots

    built = assigners(recipe, credit)  # unknown names fail here, before any weights load
    metadata, examples = find_prompt(recipe, prompt)
    if metadata is None:
        warn(
            f"{prompt!r} is not in the recipe's dataset: scoring with empty metadata (rewards that need it, like "
            f"shapes-geneval, then give 0). Dataset prompts look like: {'; '.join(repr(e) for e in examples[:4])}."
        )
    if sources:  # the command's --image, in place of any the dataset's item with this instruction carries
        metadata = {**(metadata or {}), SOURCES: list(sources)}
    t = sample_trajectories(recipe, prompt, n, recipe.train.seed if seed is None else seed, checkpoint, metadata)
    apply_credit(t, built)
    marked = _marked(t)
    out = Path(out)
    files = [
        plots.plot_trajectories(t, marked, out / "trajectories.png"),
        plots.plot_completions(t, marked, out / "completions.png"),
        plots.plot_credit(t, out / "credit.png"),
        _write_json({**to_json(t), "turning_points_marked": marked}, out / "trace.json"),
    ]
    if t.images is not None and t.images.ndim == 6:  # clips [n, W+1, F, 3, H, W]: the completions playing
        files.append(plots.completion_clips(t, out / "completions.webp"))
    return Inspection(t, marked, files)


def inspect_run(
    run_dir: Path,
    epoch: int | None = None,
    n: int = 8,
    credit: Sequence[str] | None = None,
    out: Path = Path("runs/inspect"),
) -> Inspection:
    """Plot the first n trajectories a training run logged at ``epoch`` (default: the last) and its turning points.

    credit.png shows the step rewards the run trained with, then the other assigners (``credit``, default the other
    built-ins) recomputed on these n traces (their balancing spans these n only, not the run's rollout batch).
    """
    from tpflow.inspect import plots

    run = load_run(Path(run_dir))
    branched = branched_run(run.recipe)
    names = list(credit) if credit else [] if branched else [c for c in BUILTIN_CREDIT if c != run.credit_name]
    built = assigners(run.recipe, names) if names else {}
    t = run_trajectories(run, epoch, n)
    trained = next(iter(t.credits))
    has_nan = bool(t.trace.isnan().any())  # a run without completions (outcome credit) logs only R_W
    apply_credit(t, {f"{k} (recomputed)": a for k, a in built.items() if not (has_nan and a.needs_completions)})
    stats = turning_point_stats(run)
    out = Path(out)
    if has_nan:  # only R_W was logged: no reward along denoising, no turning points to plot
        for stale in ("trajectories.png", "turning_points.png"):  # a folder reused from a run with completions
            (out / stale).unlink(missing_ok=True)
        files = [plots.plot_final_rewards(t, run.credit_name, out / "final_rewards.png")]
        notes = [no_completions_note(run.credit_name, run_dir)]
    else:
        (out / "final_rewards.png").unlink(missing_ok=True)
        files = [
            plots.plot_trajectories(t, trained, out / "trajectories.png"),
            plots.plot_turning_points(stats, run.credit_name, out / "turning_points.png"),
        ]
        notes = []
    files += [
        plots.plot_credit(t, out / "credit.png"),
        _write_json(
            {**to_json(t), "run_dir": str(run_dir), "turning_points_over_training": stats}, out / "trace.json"
        ),
    ]
    if branched and not credit:
        notes.append(
            "this run's plan branches (TempFlow-GRPO): column i of its trace is the completed reward of step i's own "
            "SDE child, not of one trajectory's states, so the other assigners (which read a trajectory's rewards "
            "along denoising) are not recomputed on it; --credit NAME recomputes one anyway."
        )
    return Inspection(t, trained, files, notes)


def branched_run(recipe: Recipe | None) -> bool:
    """Whether the run's rollout plan branches (its trace columns are sibling children's rewards)."""
    from tpflow import registry

    if recipe is None:
        return False
    return bool(capability(registry.get("plan", recipe.plan.name).factory, "branches"))


def no_completions_note(credit: str, run_dir: Path) -> str:
    """Why a run's inspection has final rewards only, and the command that shows the reward along denoising."""
    return (
        f"this run's credit ({credit}) takes no ODE completions, so the run logged each trajectory's final reward "
        f"R_W only: R_0, Δ and turning points are not known, and final_rewards.png plots R_W alone. To see the "
        f"reward along denoising, sample from the run's weights (sampling mode always completes by ODE): tpflow "
        f"inspect-trajectory RECIPE --checkpoint {run_dir} --prompt TEXT, with the recipe the run was trained with."
    )


def _marked(t: Trajectories) -> str:
    """The first assigner (in the order given) that marks a turning point, else the first."""
    return next((k for k, c in t.credits.items() if bool(c.turning_points.any())), next(iter(t.credits)))


def _write_json(data: dict[str, Any], path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(jsonable(data), indent=1, allow_nan=False) + "\n", encoding="utf-8")
    return path
