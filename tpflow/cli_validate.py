"""``tpflow validate``: every section of a recipe checked against its component without loading weights, the
machine's devices and files, the epoch's layout on N processes, and (``--gpu-memory``) the estimated memory per GPU.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.markup import escape
from rich.table import Table

from tpflow.cli_common import Overrides, make_console, user_errors, warn, warn_broken_plugins
from tpflow.errors import UserError

if TYPE_CHECKING:
    from rich.console import Console

    from tpflow.preflight import MachineReport
    from tpflow.recipe import Recipe


def register(app: typer.Typer) -> None:
    """Add ``validate`` to the ``tpflow`` app."""
    app.command()(validate)


Offline = Annotated[bool, typer.Option(help="Skip contacting services (the remote reward's server).")]
Machine = Annotated[
    bool,
    typer.Option(
        help="Also check this machine: devices, the files the recipe names, its prompts, the run dir "
        "(--no-machine: the values only, for a recipe meant for another machine)."
    ),
]
NumProcesses = Annotated[
    int,
    typer.Option(
        "--num-processes",
        min=1,
        help="Also check the epoch's layout on this many processes per machine, as "
        "`tpflow train --num-processes` would (docs/distributed.md).",
    ),
]
NumMachines = Annotated[int, typer.Option("--num-machines", min=1, help="Machines taking part (with it).")]
GpuMemory = Annotated[
    float | None,
    typer.Option(
        "--gpu-memory",
        metavar="GIB",
        help="Also estimate the peak GPU memory of each of the --num-processes × --num-machines processes (the "
        "real model's shapes on fake tensors: no weights, no GPU; the reward models, the CUDA context and a "
        "safety margin counted) and say whether it fits in GIB GiB per GPU, with what would help when not; exit "
        "2 when it does not fit reliably. Also estimates the time per epoch (docs/distributed.md, 'Will it "
        "fit?').",
        show_default=False,
    ),
]
Gpu = Annotated[
    str | None,
    typer.Option(
        "--gpu",
        metavar="NAME",
        help="The GPU whose peak bf16 throughput the time estimate of --gpu-memory uses: h100 (the default), "
        "h100-pcie, h200 or a100.",
        show_default=False,
    ),
]


@user_errors
def validate(
    recipe: Annotated[Path, typer.Argument(help="Recipe TOML file.")],
    set_: Overrides = None,
    offline: Offline = False,
    machine: Machine = True,
    num_processes: NumProcesses = 1,
    num_machines: NumMachines = 1,
    gpu_memory: GpuMemory = None,
    gpu: Gpu = None,
) -> None:
    """Check every section of a recipe against its component, without loading any weights.

    Example: tpflow validate recipes/geneval_tp.toml --no-machine --num-processes 8 --num-machines 4 --gpu-memory 80
    """
    from tpflow.experiments.spec import is_experiment_file
    from tpflow.preflight import check_machine, default_run_dir
    from tpflow.recipe import load_recipe

    if is_experiment_file(recipe):  # an experiment: the file and every (arm, seed) recipe (docs/experiments.md)
        from tpflow.experiments.command import validate as validate_experiment

        if gpu_memory is not None:
            warn("--gpu-memory estimates one recipe; validate an arm's recipe with it (docs/distributed.md).")
        validate_experiment(recipe)
        return
    if gpu_memory is not None and not gpu_memory > 0:
        raise UserError(f"--gpu-memory is the memory of one GPU in GiB, a number > 0; got {gpu_memory:g}.")
    gpu = _gpu_name(gpu, gpu_memory)
    loaded = load_recipe(recipe, set_ or [])
    warn_broken_plugins()
    processes = num_processes * num_machines
    layout = layout_report(loaded, processes) if processes > 1 else None  # before the table: a bad layout exits 2
    console = make_console()
    # The estimate needs no weights: it runs before the machine check, so that a machine without them still gets
    # the memory answer (printed before the missing-weights paragraph).
    fit = _memory_fit(loaded, recipe, processes, gpu_memory, gpu) if gpu_memory is not None else None
    try:
        report = check_machine(loaded, default_run_dir(loaded)) if machine else None
        if not offline:
            loaded.preflight()  # the remote reward's server: up, and serving the recipe's reward
    except UserError:
        if fit is not None:
            _print_lines(console, fit.lines())
        raise
    console.print(_recipe_table(recipe, loaded))
    if report is not None:
        _print_machine(console, report)
    if layout is not None:
        console.print(layout, highlight=False, soft_wrap=True)
    if fit is not None:
        _print_lines(console, fit.lines())
        if not fit.fits:
            raise UserError(fit.paragraph())


def layout_report(recipe: Any, processes: int) -> str:
    """How ``processes`` processes would share the recipe's epochs (the line ``tpflow train`` prints when it starts
    on them), or a UserError (exit 2) naming the process counts that work; no weights, no dataset."""
    from tpflow import registry
    from tpflow.train.prompt_sampler import check_layout, layout_line, plan_epoch

    train = recipe.train
    check_layout(train, processes)
    layout_of = getattr(registry.get("optimizer", recipe.optimizer.name).factory, "layout_of", None)
    layout = layout_of(recipe.optimizer.options) if callable(layout_of) else None
    plan = plan_epoch(train.prompts_per_epoch, train, 0)  # the layout depends on the sizes only, not the prompts
    lines = [f"layout: {layout_line(plan, layout, processes, recipe.replay.drawn)}"]
    if train.shard == "fsdp":
        from tpflow.train.sharding import equal_eval_shares

        if recipe.eval.every and recipe.eval.num_prompts:  # else the test split's size decides, at the start
            equal_eval_shares(recipe.eval.num_prompts * recipe.eval.images_per_prompt, processes)
        lines.append(
            f"sharding: FSDP2 over {processes} processes, each holding 1/{processes} of the trained transformer's "
            "weights, gradients and AdamW moments plus the blocks it gathers (estimates per recipe: "
            "docs/distributed.md, 'Memory per GPU')"
        )
    return "\n".join(lines)


def _gpu_name(gpu: str | None, gpu_memory: float | None) -> str:
    """``--gpu``, checked before anything loads: a name of the time estimate's table, with ``--gpu-memory``."""
    from tpflow.memory.timing import DEFAULT_GPU, GPUS

    if gpu is None:
        return DEFAULT_GPU
    if gpu_memory is None:
        raise UserError(
            f"--gpu {gpu} names the GPU of the time estimate, which comes with the memory estimate: add "
            "--gpu-memory GIB (that GPU's memory in GiB, e.g. 80)."
        )
    if gpu.lower() not in GPUS:
        names = ", ".join(f"{name} ({label})" for name, (label, _) in GPUS.items())
        raise UserError(f"--gpu {gpu!r} is not a GPU of the time estimate's table: use one of {names}.")
    return gpu.lower()


def _memory_fit(loaded: Recipe, recipe: Path, processes: int, gib: float, gpu: str) -> Any:
    """``tpflow.memory.estimate_fit`` for validate's --gpu-memory, or None with a warning where the estimate cannot
    model the recipe (a backbone or optimizer it does not build, the embedded shapes-dit) or fails: the rest of
    validate still runs, and its exit status is theirs."""
    from tpflow.memory import NotModelled, estimate_fit

    make_console(stderr=True).print(
        f"estimating the memory per GPU on {processes} process{'es' if processes > 1 else ''} (fake tensors: no "
        "weights, no GPU; about 20 s for a paper-scale model)",
        style="dim",
        highlight=False,
        soft_wrap=True,
    )
    try:
        return estimate_fit(loaded, processes, gib, name=str(recipe), gpu=gpu)
    except NotModelled as exc:
        warn(f"--gpu-memory: no memory estimate: {exc}. Nothing was checked against {gib:g} GiB.")
    except Exception as exc:  # an estimator failure must not hide the rest of validate's checks
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        warn(
            f"--gpu-memory: the memory estimate failed ({type(exc).__name__}: {reason}). Nothing was checked "
            f"against {gib:g} GiB."
        )
    return None


def _print_lines(console: Console, lines: list[str]) -> None:
    for line in lines:
        console.print(line, highlight=False, soft_wrap=True, markup=False)


def _recipe_table(recipe: Path, loaded: Recipe) -> Table:
    """validate's table: every component (section, registered name, options) and every settings section with the
    values the recipe resolved to, defaults included, so that what a run would use is seen before it runs."""
    table = Table(title=f"{recipe}: valid", show_lines=True)
    table.add_column("section", no_wrap=True)
    table.add_column("name", no_wrap=True, style="bold cyan")
    table.add_column("options", overflow="fold")
    for kind, spec in loaded.components.items():
        table.add_row(kind, spec.name, _format_values(spec.options))
    for section, settings in loaded.settings.items():
        table.add_row(section, "", _format_values(settings))
    return table


def _print_machine(console: Console, report: MachineReport) -> None:
    """validate's machine check (``tpflow.preflight.MachineReport``): where each weight would be read from (nothing
    is loaded), the device, then the check's warnings."""
    weights = Table(title="weights: where each will be read from (nothing loaded)", show_lines=True)
    weights.add_column("section", no_wrap=True)
    weights.add_column("weight")
    weights.add_column("from", overflow="fold")
    for kind, source in report.weights:
        weights.add_row(kind, escape(source.what), escape(source.where or ""))
    if report.weights:
        console.print(weights)
    console.print(f"device: {escape(report.device)}", highlight=False, soft_wrap=True)
    if report.dataset:  # what reading the prompts checked (edit-jsonl: its lines and source images)
        console.print(f"dataset: {escape(report.dataset)}", highlight=False, soft_wrap=True)
    for text in report.warnings:
        warn(text)


def _format_values(model: Any) -> str:
    return "\n".join(f"{k} = {v!r}" for k, v in model.model_dump().items()) or "-"
