"""The ``tpflow`` command line.

    tpflow components [KIND]                 # what is registered: names, options, where they come from
    tpflow validate RECIPE [--set k=v ...]   # check every section of a recipe without loading weights (cli_validate)
    tpflow validate RECIPE --gpu-memory 80   # ... and whether it fits 80 GiB per GPU (estimated, no GPU needed)
    tpflow credit 50,46,40,47,52,55 ...      # per-step rewards of each credit assigner (tpflow.cli_listing)
    tpflow train RECIPE [--resume [PATH]]    # the training loop (TP-GRPO, Flow-GRPO, ...)
    tpflow shapes pretrain                   # rebuild the embedded shapes model
    tpflow serve-reward --reward NAME        # serve a reward over HTTP for the `remote` reward
    tpflow export RUN --out DIR [--merge]    # the trained LoRA (or merged transformer) for diffusers
    tpflow eval TARGET [--baseline TARGET]   # a run / checkpoint / exported LoRA / base model on a prompt set
    tpflow sample TARGET --prompt TEXT       # a captioned grid of a few images
    tpflow probe RECIPE --arm NAME:K=V ...   # each credit's first-step gradient against the policy gradient
    tpflow sweep EXPERIMENT [--jobs N]       # every (arm, seed) run of a pre-registered experiment, resumable
    tpflow compare EXPERIMENT [--json]       # its primary endpoint (paired t), secondary family (Holm), every seed

Commands are thin wrappers over library functions. A user error (bad recipe, unknown name, missing file) prints
one paragraph on stderr and exits with status 2, without a traceback.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.markup import escape
from rich.table import Table

from tpflow import __version__
from tpflow.cli_common import (
    MachineRank,
    MainProcessIp,
    MainProcessPort,
    NumMachines,
    NumProcesses,
    Overrides,
    help_layout,
    launch_if_asked,
    make_console,
    print_report,
    user_errors,
    warn,
    warn_broken_plugins,
)
from tpflow.cli_listing import register as register_listing
from tpflow.cli_validate import register as register_validate
from tpflow.errors import UserError
from tpflow.evaluation.commands import SourceImageOption
from tpflow.evaluation.commands import register as register_evaluation
from tpflow.experiments.command import register as register_experiments
from tpflow.probe.command import register as register_probe

if TYPE_CHECKING:
    from rich.console import Console

    from tpflow.inspect import Inspection
    from tpflow.recipe import Recipe
    from tpflow.train.trainer import Trainer

app = typer.Typer(
    name="tpflow",
    help="TurningPoint-GRPO and its baselines for flow-matching text-to-image models.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


def _shapes_app() -> typer.Typer:
    from tpflow.cli_shapes import shapes_app

    return shapes_app


app.add_typer(_shapes_app(), name="shapes", help="The embedded shapes world: pretrain its model.")
register_listing(app)  # tpflow components, tpflow credit (first in the help)


def _version(value: bool) -> None:
    if value:
        typer.echo(f"tpflow {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: Annotated[
        bool, typer.Option("--version", callback=_version, is_eager=True, help="Print the version and exit.")
    ] = False,
) -> None:
    """TurningPoint-GRPO and its baselines for flow-matching text-to-image models."""


register_validate(app)  # here: `tpflow --help` lists validate before train


@app.command()
@user_errors
def train(
    ctx: typer.Context,
    recipe: Annotated[Path, typer.Argument(help="Recipe TOML file, e.g. recipes/shapes_tp.toml.")],
    set_: Overrides = None,
    resume: Annotated[
        str | None,
        typer.Option(
            "--resume",
            help="Continue from the newest valid checkpoint of the run dir (bare --resume), or of PATH "
            "(a run dir or a checkpoint dir).",
            show_default=False,
        ),
    ] = None,
    run_dir: Annotated[Path | None, typer.Option(help="Output directory (default: train.run_dir).")] = None,
    epochs: Annotated[int | None, typer.Option(help="Override train.epochs.", show_default=False)] = None,
    num_processes: NumProcesses = 1,
    num_machines: NumMachines = 1,
    machine_rank: MachineRank = 0,
    main_process_ip: MainProcessIp = None,
    main_process_port: MainProcessPort = 29500,
) -> None:
    """Train with TP-GRPO (or the recipe's credit assigner): sample, score, assign credit, update, evaluate.

    With --num-processes N (and --num-machines M) it starts N processes here (torchrun) that train one model with
    gradients averaged over all N x M processes; `accelerate launch -m tpflow.cli train ...` works as well."""
    from tpflow.recipe import load_recipe
    from tpflow.train.prompt_sampler import check_layout

    overrides = [*(set_ or []), *([f"train.epochs={epochs}"] if epochs is not None else [])]
    loaded = load_recipe(recipe, overrides)
    warn_broken_plugins()
    loaded.preflight()  # e.g. the remote reward's server is up: fail now, not after the model has loaded
    world = num_processes * num_machines

    def before_launch() -> None:  # once here, not once per process
        from tpflow.preflight import check_machine, default_run_dir

        check_machine(loaded, run_dir or default_run_dir(loaded))
        check_layout(loaded.train, world)

    launch_if_asked(
        ctx, num_processes, num_machines, machine_rank, main_process_ip, main_process_port, check=before_launch
    )
    from tpflow.train.trainer import Trainer

    resume_from: bool | Path = False if resume is None else (True if resume == _LATEST else Path(resume))
    console = make_console()
    trainer = Trainer(loaded, run_dir=run_dir, resume=resume_from, console=console)
    metrics = _fit(trainer, loaded, console, num_processes)
    trainer.dist.close(exit_workers=True)  # the run is saved: the processes part here (the main one reports)
    if trainer.dist.is_main:
        _print_done(console, trainer.run_dir, metrics)


_LATEST = "@latest"


def _fit(trainer: Trainer, loaded: Recipe, console: Console, num_processes: int) -> dict[str, Any]:
    """``trainer.fit()``; on Ctrl-C the main process prints the command that continues the run (with this launch's
    --num-processes) and every process exits 130 (SIGINT) or 143 (SIGTERM: ``tpflow.train.stop.Stopped``), without
    a traceback: an interrupt is not an error."""
    try:
        return trainer.fit()
    except KeyboardInterrupt as exc:
        if trainer.dist.is_main:
            from tpflow.train.checkpoints.resume import continue_hint

            extra = [] if num_processes == 1 else ["--num-processes", str(num_processes)]
            console.print(escape(continue_hint(loaded, trainer.run_dir, extra)), soft_wrap=True, highlight=False)
        raise typer.Exit(getattr(exc, "exit_status", 130)) from None


def _print_done(console: Console, run_dir: Path, metrics: dict[str, Any]) -> None:
    """train's closing lines: where the run's files are, and the eval reward it started and ended at (when it
    evaluated), the one figure to glance at."""
    first = _first_eval(run_dir / "metrics.jsonl")
    console.print(f"[bold green]done.[/] run: {run_dir}")
    console.print(f"  metrics: {run_dir / 'metrics.jsonl'} (per-trajectory traces: traces.jsonl)")
    console.print(f"  samples: {run_dir / 'samples'}")
    console.print(f"  checkpoints: {run_dir / 'checkpoints'}")
    if "eval_reward" in metrics and first is not None:
        console.print(f"  eval reward: {first:.4f} (first) -> {metrics['eval_reward']:.4f} (last)")


def _first_eval(path: Path) -> float | None:
    from tpflow.train.run_logger import read_jsonl

    values = [line["eval_reward"] for line in read_jsonl(path) if line.get("eval_reward") is not None]
    return values[0] if values else None


@app.command("inspect-trajectory")
@user_errors
def inspect_trajectory(
    recipe: Annotated[
        Path | None, typer.Argument(help="Recipe TOML file to sample with (or use --run instead).", show_default=False)
    ] = None,
    prompt: Annotated[str | None, typer.Option(help="Prompt to sample (with RECIPE).", show_default=False)] = None,
    checkpoint: Annotated[
        Path | None, typer.Option(help="Load the adapter of this run dir or checkpoint dir.", show_default=False)
    ] = None,
    n: Annotated[int, typer.Option("--n", help="Trajectories to sample (with --run: to plot).")] = 8,
    seed: Annotated[
        int | None,
        typer.Option(
            min=0, max=2**63 - 1, help="Seed of window, noise and SDE noise (default: train.seed).", show_default=False
        ),
    ] = None,
    credit_: Annotated[
        list[str] | None,
        typer.Option("--credit", help="Credit assigner to compare (repeatable). Default: the recipe's + built-ins."),
    ] = None,
    out: Annotated[
        Path | None,
        typer.Option(
            help="Output directory (default: runs/inspect/sampled, or runs/inspect/<run dir name> with --run: "
            "the two modes never share a folder).",
            show_default=False,
        ),
    ] = None,
    set_: Overrides = None,
    run: Annotated[
        Path | None, typer.Option(help="Plot the traces a training run logged, not RECIPE.", show_default=False)
    ] = None,
    epoch: Annotated[int | None, typer.Option(help="With --run: the epoch (default: the last).")] = None,
    image: SourceImageOption = None,
) -> None:
    """Reward of the ODE completion along denoising, turning points and each assigner's credit, as plots.

    Example: tpflow inspect-trajectory recipes/shapes_tp.toml --prompt "a photo of a red circle" --n 8
    """
    from tpflow.inspect import inspect_run

    if (recipe is None) == (run is None):
        raise UserError("Give exactly one of RECIPE (sample new trajectories, with --prompt) or --run RUN_DIR.")
    if run is not None and image:
        raise UserError("--image gives the source of new trajectories, with RECIPE; --run plots what a run logged.")
    console = make_console()
    if out is None:  # one folder per mode (and per run), so one mode's plots never sit beside the other's
        out = Path("runs/inspect") / (Path(run).resolve().name if run is not None else "sampled")
    if run is not None:
        result = inspect_run(run, epoch, n, credit_, out)
    else:
        result = _inspect_recipe(recipe, prompt, n, seed, checkpoint, credit_, out, set_, image)
    _print_inspection(console, result)


def _inspect_recipe(
    recipe: Path,
    prompt: str | None,
    n: int,
    seed: int | None,
    checkpoint: Path | None,
    credit_: list[str] | None,
    out: Path,
    set_: list[str] | None,
    image: list[Path] | None = None,
) -> Inspection:
    """inspect-trajectory with RECIPE: new trajectories of ``prompt`` (edits of the ``--image`` sources for an
    editing backbone), sampled once the machine check has passed and the prompt's warnings (as tpflow sample and
    eval give them) are printed, so nothing loads for a mistake."""
    from tpflow.data.source_counts import command_sources
    from tpflow.inspect import inspect_sampled
    from tpflow.inspect.traces import dataset_sources
    from tpflow.recipe import load_recipe

    if not prompt:
        raise UserError('RECIPE needs --prompt TEXT, e.g. --prompt "a photo of a red circle".')
    from tpflow.preflight import check_machine

    loaded = load_recipe(recipe, set_ or [])
    from_dataset = [] if image else dataset_sources(loaded, prompt)  # an editing dataset's item carries its source
    sources = command_sources(loaded.backbone.name, image) if not from_dataset else None
    print_report(check_machine(loaded))  # devices, weight files, prompts: before anything loads
    if from_dataset:
        warn(f"No --image: editing the dataset's first item with this instruction, source {', '.join(from_dataset)}.")

    from tpflow.preflight import prompt_warnings

    for text in prompt_warnings(loaded, [prompt]):  # tpflow sample and eval say the same
        warn(text)
    return inspect_sampled(loaded, prompt, n, seed, checkpoint, credit_, out, warn, sources)


def _print_inspection(console: Any, result: Any) -> None:
    """inspect-trajectory's table (a row per trajectory: R_0, R_W, Δ, turning points, step rewards), its notes and
    the files it wrote."""
    from tpflow.inspect import summary_rows

    table = Table(title=f"{escape(result.trajectories.prompt)}: turning points of {result.marked}")
    for column in ("traj", "R_0", "R_W", "Δ", "turning points", "step rewards"):
        table.add_column(column, no_wrap=column != "step rewards")
    for row in summary_rows(result.trajectories, result.marked):
        table.add_row(
            str(row["traj"]),
            "—" if math.isnan(row["R_0"]) else f"{row['R_0']:.4g}",  # not logged: a run without completions
            f"{row['R_W']:.4g}",
            "—" if math.isnan(row["delta"]) else f"{row['delta']:+.4g}",
            row["turning_points"],
            " ".join(f"{x:.3g}" for x in row["step_rewards"]),
        )
    console.print(table)
    for text in result.notes:
        console.print(f"note: {escape(text)}", soft_wrap=True, highlight=False)
    for path in result.files:
        console.print(f"wrote {path}")


@app.command("serve-reward")
@user_errors
def serve_reward(
    reward: Annotated[str, typer.Option(help="Registered reward to serve (see: tpflow components reward).")],
    port: Annotated[int, typer.Option(help="TCP port (0: any free port; the URL is printed).")] = 18085,
    host: Annotated[str, typer.Option(help="Interface to listen on; 0.0.0.0 for every interface.")] = "127.0.0.1",
    set_: Annotated[
        list[str] | None,
        typer.Option("--set", help="A reward option: key=value (repeatable), e.g. score=strict.", show_default=False),
    ] = None,
    token: Annotated[
        str | None,
        typer.Option(
            envvar="TPFLOW_REWARD_TOKEN",
            help="Require this token from clients (Authorization: Bearer); prefer the environment variable, which "
            "other users cannot read from the process list. Clients read it from TPFLOW_REWARD_TOKEN.",
            show_default=False,
        ),
    ] = None,
    max_request_mb: Annotated[float, typer.Option(min=0.001, help="Largest request body, MB (413 above).")] = 64,
    max_images: Annotated[int, typer.Option(min=1, help="Most images in one request.")] = 256,
    max_side: Annotated[int, typer.Option(min=1, help="Largest image side, read from its PNG header.")] = 2048,
    max_megapixels: Annotated[float, typer.Option(min=0.001, help="Most pixels in one request, millions.")] = 64,
    max_connections: Annotated[
        int, typer.Option(min=1, help="Connections served at once; more get 503 when all are past their headers.")
    ] = 16,
    header_timeout_s: Annotated[
        float, typer.Option(min=0.001, help="Seconds a request's line and headers may take to arrive.")
    ] = 5,
    timeout_s: Annotated[float, typer.Option(min=0.001, help="Seconds a request may take to arrive whole.")] = 30,
) -> None:
    """Serve a reward over HTTP for recipes whose reward is name = "remote" with url = the printed URL.

    Example: tpflow serve-reward --reward shapes-geneval --port 18085 --set score=strict
    """
    from tpflow.preflight import MachineReport
    from tpflow.serving.lifecycle import parse_options, serve
    from tpflow.serving.server import Limits, RewardServer

    console = make_console()
    limits = Limits(
        max_request_bytes=int(max_request_mb * 2**20),
        max_images=max_images,
        max_side=max_side,
        max_pixels=int(max_megapixels * 1e6),
        max_connections=max_connections,
        header_timeout_s=header_timeout_s,
        timeout_s=timeout_s,
    )

    def announce(server: RewardServer) -> None:
        print_report(MachineReport(weights=[("reward", source) for source in server.weights]))
        url = server.url
        console.print(
            f"Serving reward {reward!r} at {url} (GET /health, POST /score). Ctrl-C or SIGTERM stops.", highlight=False
        )
        console.print(f'Recipe: [reward] name = "remote", url = "{url}"', highlight=False, markup=False)
        if not token and host not in ("127.0.0.1", "localhost", "::1"):
            console.print("[yellow]warning:[/] no --token: anyone who reaches this port can use the reward.")
        console.file.flush()

    serve(reward, parse_options(set_ or []), host=host, port=port, announce=announce, limits=limits, token=token)
    console.print("stopped.")


@app.command()
@user_errors
def export(
    source: Annotated[Path, typer.Argument(help="A run dir (its newest valid checkpoint) or a checkpoint dir.")],
    out: Annotated[Path, typer.Option(help="Output folder.")],
    merge: Annotated[bool, typer.Option(help="Write the transformer with the adapter merged in.")] = False,
    ema: Annotated[bool, typer.Option(help="Use the EMA weights when the checkpoint has them (the paper's).")] = True,
    overwrite: Annotated[
        bool, typer.Option(help="Write into an --out folder that is not empty (its exported files are replaced).")
    ] = False,
) -> None:
    """Export a trained adapter for inference: pipe.load_lora_weights(OUT), or --merge for a merged transformer."""
    from tpflow.export import export as run_export

    summary = run_export(source, out, merge=merge, ema=ema, overwrite=overwrite)
    for note in summary["skipped"]:
        warn(note)
    console = make_console()
    what = "merged transformer" if merge else "LoRA adapter"
    console.print(
        f"wrote the {what} of {summary['checkpoint']} (step {summary['step']}, "
        f"{'EMA' if summary['ema'] else 'live'} weights) to {summary['written']}",
        highlight=False,
        markup=False,
    )


register_evaluation(app)  # tpflow eval, tpflow sample (after export in the help)
register_probe(app)  # tpflow probe
register_experiments(app)  # tpflow sweep, tpflow compare


def main(argv: list[str] | None = None) -> None:
    """Console-script entry point."""
    import shutil

    help_layout(shutil.get_terminal_size((160, 24)).columns)  # not a terminal: COLUMNS, else wide (rich's help)
    args = list(sys.argv[1:] if argv is None else argv)
    for i, arg in enumerate(args):  # a bare `--resume` (no value) means the run dir's newest checkpoint
        if arg == "--resume" and (i + 1 == len(args) or args[i + 1].startswith("-")):
            args.insert(i + 1, _LATEST)
            break
    app(args=args, prog_name="tpflow")


if __name__ == "__main__":
    main()
