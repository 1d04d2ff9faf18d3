"""``tpflow probe``: how well each credit method's first update estimates the policy gradient (docs/probe.md).

    tpflow probe recipes/shapes_flowgrpo.toml --arm outcome:credit.name=outcome \\
        --arm consistent:credit.name=consistent --repeats 12 --out runs/probe/demo

A thin wrapper over ``tpflow.probe.run`` (the draws, resumable) and ``tpflow.probe.report`` (the figures).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.console import Console
from rich.markup import escape

from tpflow.cli_common import Overrides, make_console, print_report, user_errors
from tpflow.errors import UserError

if TYPE_CHECKING:
    from tpflow.probe.run import Probe


def register(app: typer.Typer) -> None:
    app.command()(probe)


def _sizes(text: str) -> list[int]:
    from tpflow.probe.arms import _group_sizes

    return list(_group_sizes("--group-sizes", text))


ArmOption = Annotated[
    list[str] | None,
    typer.Option(
        "--arm",
        help="NAME:KEY=VALUE[,KEY=VALUE] over the sampler, plan, credit, rollout and optimizer sections "
        "(e.g. credit.name=consistent), or group_sizes=4/8/16 (repeatable).",
        show_default=False,
    ),
]
SketchDimOption = Annotated[
    int | None,
    typer.Option(
        min=0,
        help="Project gradients to this many numbers (0: keep them whole). Default: "
        "whole up to 2^20 parameters, else 65536.",
        show_default=False,
    ),
]


@user_errors
def probe(
    recipe: Annotated[Path, typer.Argument(help="The probe's recipe: model, reward, prompts (arms override it).")],
    arm: ArmOption = None,
    prompts: Annotated[int, typer.Option(min=1, help="P: prompts of the train split, balanced over its tags.")] = 6,
    group_sizes: Annotated[str, typer.Option(help="Group sizes of every arm (comma-separated).")] = "4,8",
    repeats: Annotated[int, typer.Option(min=2, help="Independent paired draws of every arm.")] = 8,
    reference_draws: Annotated[int, typer.Option(min=2, help="Independent draws of the reference gradient.")] = 8,
    reference_group_size: Annotated[
        int, typer.Option(min=2, help="Trajectories per prompt in a reference draw.")
    ] = 32,
    checkpoint: Annotated[
        Path | None, typer.Option(help="The policy: this run dir's (or checkpoint's) adapter.", show_default=False)
    ] = None,
    seed: Annotated[int, typer.Option(min=0, help="Seeds the prompt pick and every draw.")] = 0,
    sketch_dim: SketchDimOption = None,
    baseline: Annotated[
        str | None, typer.Option(help="The arm others are compared with (default: the first).")
    ] = None,
    out: Annotated[Path, typer.Option(help="Output folder (a rerun continues the probe in it).")] = Path("runs/probe"),
    set_: Overrides = None,
) -> None:
    """Paired first-step gradients of each arm against the policy gradient, from a fixed policy and prompt set.

    Example: tpflow probe recipes/shapes_flowgrpo.toml --arm outcome:credit.name=outcome --arm
    tp:credit.name=consistent --repeats 8 --out runs/probe/tp
    """
    from tpflow.preflight import check_machine
    from tpflow.probe.run import ProbeConfig, build_probe
    from tpflow.recipe import load_recipe

    if not recipe.is_file():
        raise UserError(f"Recipe {recipe} is not a file.")
    print_report(check_machine(load_recipe(recipe, set_ or [])))
    config = ProbeConfig(
        recipe=str(recipe), overrides=list(set_ or []), arms=list(arm or []), prompts=prompts,
        group_sizes=_sizes(group_sizes), repeats=repeats, reference_draws=reference_draws,
        reference_group_size=reference_group_size, seed=seed,
        checkpoint=None if checkpoint is None else str(checkpoint), sketch_dim=sketch_dim,
    )  # fmt: skip
    built = build_probe(config, out)
    names = [a.name for a in built.arms]
    if baseline is not None and baseline not in names:
        raise UserError(f"--baseline {baseline!r} is not an arm ({', '.join(names)}).")
    console = make_console()
    console.print(f"probe: {len(built.items)} prompts ({', '.join(escape(i.prompt) for i in built.items)})",
                  highlight=False, soft_wrap=True)  # fmt: skip
    _draw(console, built, out)
    _write_report(console, built, out, recipe, checkpoint, baseline or names[0], reference_group_size)


def _draw(console: Console, built: Probe, out: Path) -> None:
    """Run the probe's draws not yet in ``out/draws`` (a rerun continues a stopped probe), with a progress bar that
    counts the ones already there as done."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from tpflow.probe.run import run_probe

    units = built.units()
    todo = [u for u in units if not (out / "draws" / f"{u}.json").exists()]
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=console, disable=not console.is_terminal) as progress:  # fmt: skip
        task = progress.add_task("probe draws", total=len(units), completed=len(units) - len(todo))
        run_probe(built, lambda unit: progress.advance(task))


def _write_report(
    console: Console,
    built: Probe,
    out: Path,
    recipe: Path,
    checkpoint: Path | None,
    baseline: str,
    reference_group_size: int,
) -> None:
    """The figures of every draw in ``out`` (this run's and an earlier one's alike), compared with the ``baseline``
    arm: report.md (also printed), report.json and the cosine-against-NFE plot."""
    from tpflow.probe.report import comparisons, figures, markdown, plot
    from tpflow.probe.run import load_units

    tensors, meta = load_units(out)
    result = figures(tensors, meta, len(built.items), reference_group_size)
    compared = comparisons(result, baseline)
    header = (f"# Probe of {recipe}" + (f" at {checkpoint}" if checkpoint else "") +
              f"\n\nP = {len(built.items)} prompts: " + "; ".join(i.prompt for i in built.items))  # fmt: skip
    text = markdown(result, compared, header)
    (out / "report.md").write_text(text)
    from tpflow.probe.caveats import caveats

    data = {**result, "comparisons": [c.__dict__ for c in compared], "caveats": caveats(result)}
    (out / "report.json").write_text(json.dumps(data, indent=1))
    figure = plot(result, out / "cosine_nfe.png", f"{recipe.name}: cosine to g★ against NFE per prompt")
    console.print(text, markup=False, highlight=False, soft_wrap=True)
    console.print(f"wrote {out / 'report.md'}, {out / 'report.json'}, {figure}", highlight=False)
