"""The command line of experiments: ``tpflow sweep``, ``tpflow compare``; ``tpflow validate`` calls ``validate``."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from tpflow.cli_common import make_console, user_errors, warn
from tpflow.errors import UserError

if TYPE_CHECKING:
    from tpflow.experiments.spec import Experiment


def register(app: typer.Typer) -> None:
    app.command()(sweep)
    app.command()(compare)


def validate(path: Path) -> None:
    """``tpflow validate EXPERIMENT.toml``: the file and every (arm, seed) recipe, nothing loaded or run."""
    from tpflow.experiments.spec import load_experiment

    experiment = load_experiment(path)
    spec = experiment.spec
    table = Table(title=f"{path}: valid experiment ({len(experiment.runs())} runs)", show_lines=True)
    table.add_column("arm", no_wrap=True, style="bold cyan")
    table.add_column("overrides (after the task's)", overflow="fold")
    from tpflow.experiments.spec import flatten

    for arm, overrides in spec.arms.items():
        table.add_row(arm, escape(", ".join(f"{k} = {v!r}" for k, v in flatten(overrides).items())))
    console = make_console()
    console.print(table)
    e = spec.primary
    text = (
        f"valid experiment, {len(experiment.runs())} runs: recipe {escape(str(experiment.recipe))}; seeds "
        f"{spec.experiment.seeds}; runs in "
        f"{escape(str(experiment.out))}; primary: {e.statistic} of {e.metric}, {e.arm} − {e.baseline}; "
        f"secondary: {', '.join(spec.secondary.arms) or 'none'}."
    )
    console.print(text, highlight=False, soft_wrap=True)


@user_errors
def sweep(
    experiment_file: Annotated[Path, typer.Argument(help="Experiment TOML file (docs/experiments.md).")],
    jobs: Annotated[int, typer.Option(min=1, help="Runs at once.")] = 1,
    gpus: Annotated[str | None, typer.Option(help="GPUs to share out, one per job, e.g. 0,1,2,3.")] = None,
    print_commands: Annotated[
        bool, typer.Option("--print-commands", help="Print one line per missing run (for a scheduler); run none.")
    ] = False,
    amend: Annotated[
        str | None, typer.Option(help="Declare a change to the file after its runs began, with the reason.")
    ] = None,
) -> None:
    """Run every missing (arm, seed) run of an experiment, resuming killed ones; pre-registered on the first run."""
    from tpflow.experiments import lock
    from tpflow.experiments.spec import load_experiment
    from tpflow.experiments.sweep import commands, state

    experiment = load_experiment(experiment_file)
    if experiment.spec.experiment.summaries:
        raise UserError(
            f"{experiment_file} compares the committed run summaries {experiment.spec.experiment.summaries}, which "
            "are its results: there is nothing to sweep. Run tpflow compare on it, or drop [experiment] summaries to "
            "run the experiment afresh."
        )
    existing = [f"{r.arm}/seed_{r.seed}" for r in experiment.runs() if state(r) != "missing"]
    if print_commands:
        for line in commands(experiment):
            typer.echo(line)
        return
    devices = [g.strip() for g in gpus.split(",") if g.strip()] if gpus else None
    if devices is not None and len(devices) < jobs:
        raise UserError(f"--gpus {gpus} names {len(devices)} GPUs for --jobs {jobs}: give one GPU per job.")
    record = lock.register(experiment_file, experiment.out, existing, amend)
    uncommitted = lock.uncommitted_warning(experiment_file, record)
    if uncommitted:
        warn(uncommitted)
    console = make_console()
    runs = experiment.runs()
    console.print(f"{experiment.spec.experiment.name}: {len(runs)} runs, seed-major (a slow-down hits every arm of a "
                  f"seed alike), {jobs} at once, into {escape(str(experiment.out))}; registered "
                  f"{record['registered']}.", highlight=False, soft_wrap=True)  # fmt: skip
    result = _run_with_progress(console, experiment, len(runs), jobs, devices)
    console.print(f"{len(result['done'])} runs done now, {len(result['skipped'])} were done already.",
                  highlight=False)  # fmt: skip
    if result["failed"]:
        logs = ", ".join(f"{experiment.out / name.split('/')[0] / (name.split('/')[1] + '.log')}" for name in
                         result["failed"])  # fmt: skip
        raise UserError(
            f"{len(result['failed'])} runs failed: {', '.join(result['failed'])}. Their logs: {logs}. Fix the "
            "cause and run tpflow sweep again: finished runs are skipped, killed ones resume."
        )


def _run_with_progress(
    console: Console, experiment: Experiment, total: int, jobs: int, devices: list[str] | None
) -> dict[str, list[str]]:
    """The sweep itself (``tpflow.experiments.sweep.sweep``), its counts and ETA on a bar; without a terminal (a
    log file, a pipe) there is no bar, so a line is printed each time a run finishes instead."""
    from rich.progress import BarColumn, Progress, TextColumn

    from tpflow.experiments.sweep import sweep as run_sweep

    with Progress(TextColumn("{task.description}"), BarColumn(), console=console,
                  disable=not console.is_terminal) as progress:  # fmt: skip
        task = progress.add_task("runs", total=total)
        finished = [-1]  # runs finished at the last line printed (no terminal: a line per finished run)

        def show(counts: dict[str, int], eta: float | None) -> None:
            done = counts["done"] + counts.get("failed", 0)
            text = f"runs: {counts['done']} done, {counts['running']} running, {counts['left']} left"
            text += f", ETA {eta / 60:.0f} min" if eta is not None else ""
            progress.update(task, completed=done, description=text)
            if not console.is_terminal and done != finished[0]:  # a log file or a pipe: no bar, so say it in lines
                finished[0] = done
                console.print(f"{time.strftime('%H:%M:%S')} {text}", highlight=False, soft_wrap=True)

        return run_sweep(experiment, jobs, devices, on_change=show)


@user_errors
def compare(
    experiment_file: Annotated[Path, typer.Argument(help="Experiment TOML file (docs/experiments.md).")],
    as_json: Annotated[bool, typer.Option("--json", help="Print the comparison as JSON.")] = False,
    figure: Annotated[
        Path | None, typer.Option(help="Where to draw the curves (default: <out>/report.png when the runs are there).")
    ] = None,
    summaries: Annotated[
        Path | None,
        typer.Option(
            help="Read the runs from this JSON of summaries (--write-summaries), not from their folders.",
            show_default=False,
        ),
    ] = None,  # fmt: skip
    write_summaries: Annotated[
        Path | None,
        typer.Option(
            help="Also write the finished runs' summaries to this JSON, to commit beside the report.",
            show_default=False,
        ),
    ] = None,  # fmt: skip
) -> None:
    """The experiment's primary endpoint (paired t, bootstrap beside), secondary family (Holm), every seed, cost.

    Example: tpflow compare experiments/rivals_learning.toml --write-summaries docs/results/rivals_learning_runs.json
    """
    from tpflow.experiments.compare import compare as run_compare
    from tpflow.experiments.compare import load_runs, markdown
    from tpflow.experiments.compare import write_summaries as save_summaries
    from tpflow.experiments.spec import load_experiment

    experiment = load_experiment(experiment_file, check_arms=False)
    loaded = load_runs(experiment, summaries)  # read once: the comparison and the figure
    result = run_compare(experiment, loaded)
    text = markdown(result)
    if write_summaries is not None:
        text += f"\nSummaries of the {sum(map(len, loaded[0].values()))} finished runs: "
        text += f"{save_summaries(loaded[0], experiment, write_summaries)}\n"
    if summaries is None and experiment.out.exists():
        (experiment.out / "report.md").write_text(text)
        (experiment.out / "report.json").write_text(json.dumps(result, indent=1))
        figure = figure or experiment.out / "report.png"
    if figure is not None and result["runs"]:
        from tpflow.experiments.plot import plot_curves

        runs, _ = loaded
        e = experiment.spec.primary
        title = f"{experiment.spec.experiment.name}: {e.metric} of every seed (thin) and each arm's mean"
        plot_curves({arm: list(seeds.values()) for arm, seeds in runs.items()}, Path(figure), e.metric, title)
        text += f"\nFigure: {figure}\n"
    if as_json:
        typer.echo(json.dumps(result, indent=1))
    else:
        make_console().print(text, markup=False, highlight=False, soft_wrap=True)
