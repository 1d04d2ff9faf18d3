"""The ``tpflow`` command line.

    tpflow components [KIND]                 # what is registered: names, options, where they come from
    tpflow validate RECIPE [--set k=v ...]   # check every section of a recipe without loading weights
    tpflow credit 50,46,40,47,52,55 ...      # per-step rewards of each credit assigner for reward traces
    tpflow train RECIPE [--resume [PATH]]    # the training loop (TP-GRPO, Flow-GRPO, ...)
    tpflow shapes pretrain                   # rebuild the embedded shapes model
    tpflow serve-reward --reward NAME        # serve a reward over HTTP for the `remote` reward
    tpflow export RUN --out DIR [--merge]    # the trained LoRA (or merged transformer) for diffusers
    tpflow eval TARGET [--baseline TARGET]   # a run / checkpoint / exported LoRA / base model on a prompt set
    tpflow sample TARGET --prompt TEXT       # a captioned grid of a few images

Commands are thin wrappers over library functions. A user error (bad recipe, unknown name, missing file) prints
one paragraph on stderr and exits with status 2, without a traceback.
"""

from __future__ import annotations

import functools
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any, TypeVar

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from tpflow import __version__, registry
from tpflow.errors import UserError

app = typer.Typer(
    name="tpflow",
    help="TurningPoint-GRPO and its baselines for flow-matching text-to-image models.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)

F = TypeVar("F", bound=Callable[..., Any])
Overrides = Annotated[
    list[str] | None,
    typer.Option("--set", help="Override an option: section.key=value (repeatable).", show_default=False),
]

# The launcher options of `train` and `eval` (tpflow.launch consumes them; every other option reaches each process).
NumProcesses = Annotated[
    int,
    typer.Option("--num-processes", min=1, help="Processes on this machine, one per GPU (docs/distributed.md)."),
]
NumMachines = Annotated[int, typer.Option("--num-machines", min=1, help="Machines taking part.")]
MachineRank = Annotated[int, typer.Option("--machine-rank", min=0, help="This machine's rank, 0..M-1.")]
MainProcessIp = Annotated[
    str | None, typer.Option("--main-process-ip", help="Address of machine 0 (with --num-machines > 1).")
]
MainProcessPort = Annotated[int, typer.Option("--main-process-port", help="Port on machine 0.")]


def _launch_if_asked(
    ctx: typer.Context,
    num_processes: int,
    num_machines: int,
    machine_rank: int,
    main_process_ip: str | None,
    main_process_port: int,
    check: Callable[[], None] | None = None,
) -> None:
    """With more than one process asked for and no launcher around us: start them (torchrun in-process), each
    running this command minus the launcher options, and exit with their status. ``check`` runs first, so a bad
    layout is one error here rather than one per process."""
    from tpflow.launch import child_command, launch, launched, torchrun_args

    world = num_processes * num_machines
    if world > 1 and not launched():
        if num_machines > 1 and not main_process_ip:
            raise UserError("--num-machines > 1 needs --main-process-ip, the address of machine 0.")
        if machine_rank >= num_machines:
            raise UserError(f"--machine-rank must be below --num-machines ({num_machines}), got {machine_rank}.")
        if check is not None:
            check()
        child = child_command(ctx)  # this command as parsed, minus the launcher options
        args = torchrun_args(child, num_processes, num_machines, machine_rank, main_process_ip, main_process_port)
        raise typer.Exit(launch(args))
    if world > 1 and int(os.environ.get("WORLD_SIZE", "1")) != world:
        _console(stderr=True).print(
            f"[yellow]warning:[/] already started by a launcher with WORLD_SIZE={os.environ.get('WORLD_SIZE')}: "
            f"--num-processes/--num-machines ({world} processes) are ignored."
        )


def _console(stderr: bool = False) -> Console:
    # Wide enough for the tables when output is not a terminal (pipes, CI logs, tests).
    console = Console(stderr=stderr)
    if not console.is_terminal and not os.environ.get("COLUMNS"):
        console = Console(stderr=stderr, width=160)
    return console


def user_errors(func: F) -> F:
    """Turn UserError into one clear paragraph on stderr and exit status 2."""

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return func(*args, **kwargs)
        except UserError as exc:
            message = escape(str(exc))  # recipe sections look like rich markup: [credit]
            _console(stderr=True).print(f"[bold red]error:[/] {message}", soft_wrap=True, highlight=False)
            raise typer.Exit(2) from None

    return wrapper  # type: ignore[return-value]


def _shapes_app() -> typer.Typer:
    from tpflow.shapes.cli import shapes_app

    return shapes_app


app.add_typer(_shapes_app(), name="shapes", help="The embedded shapes world: pretrain its model.")


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


def _describe_options(model: type[Any]) -> str:
    parts = []
    for name, info in model.model_fields.items():
        annotation = getattr(info.annotation, "__name__", None) or str(info.annotation).replace("typing.", "")
        default = "required" if info.is_required() else repr(info.get_default(call_default_factory=True))
        parts.append(f"{name}: {annotation} = {default}")
    return "\n".join(parts) or "-"


def _where(entry: registry.Entry) -> str:
    if entry.source != "tpflow":
        return entry.source
    origin = entry.origin
    package_root = str(Path(__file__).resolve().parent.parent) + os.sep
    return "built-in " + origin.removeprefix(package_root)


@app.command()
@user_errors
def components(
    kind: Annotated[str | None, typer.Argument(help=f"One of: {', '.join(registry.KINDS)}. All when omitted.")] = None,
) -> None:
    """List the registered components (built-ins and plugins) with their options."""
    kinds = registry.KINDS if kind is None else (kind,)
    table = Table(title="tpflow components", show_lines=True)
    table.add_column("kind", no_wrap=True)
    table.add_column("name", no_wrap=True, style="bold cyan")
    table.add_column("options")
    table.add_column("from", overflow="fold")
    broken = []
    for k in kinds:
        for entry in registry.entries(k):
            table.add_row(k, entry.name, _describe_options(entry.options), _where(entry))
        broken += [f"{k}: {e}" for e in registry.plugin_errors(k)]
    console = _console()
    console.print(table)
    for line in broken:
        console.print(f"[yellow]plugin failed to load[/] {escape(line)}", soft_wrap=True, highlight=False)


@app.command()
@user_errors
def validate(
    recipe: Annotated[Path, typer.Argument(help="Recipe TOML file.")],
    set_: Overrides = None,
    offline: Annotated[bool, typer.Option(help="Skip contacting services (the remote reward's server).")] = False,
    machine: Annotated[
        bool,
        typer.Option(
            help="Also check this machine: devices, the files the recipe names, its prompts, the run dir "
            "(--no-machine: the values only, for a recipe meant for another machine)."
        ),
    ] = True,
) -> None:
    """Check every section of a recipe against its component, without loading any weights."""
    from tpflow.preflight import check_machine, default_run_dir
    from tpflow.recipe import load_recipe

    loaded = load_recipe(recipe, set_ or [])
    _warn_broken_plugins()
    if machine:
        check_machine(loaded, default_run_dir(loaded))
    if not offline:
        loaded.preflight()  # the remote reward's server: up, and serving the recipe's reward
    table = Table(title=f"{recipe}: valid", show_lines=True)
    table.add_column("section", no_wrap=True)
    table.add_column("name", no_wrap=True, style="bold cyan")
    table.add_column("options")
    for kind, spec in loaded.components.items():
        table.add_row(kind, spec.name, _format_values(spec.options))
    for section, settings in loaded.settings.items():
        table.add_row(section, "", _format_values(settings))
    _console().print(table)


@app.command()
@user_errors
def credit(
    traces: Annotated[
        list[str],
        typer.Argument(help="One trajectory per argument: rewards R_0,...,R_W (comma-separated), all of one length."),
    ],
    assigner: Annotated[
        list[str] | None,
        typer.Option("--assigner", "-a", help="Credit assigner (repeatable). Default: all registered."),
    ] = None,
    balanced: Annotated[bool, typer.Option(help="Balance good and bad turning points across the batch.")] = True,
) -> None:
    """Show the per-step rewards each credit assigner gives a batch of reward traces.

    Example (ALGORITHM.md §9, Example 3): tpflow credit 40,37,45,48,49,50 60,62,61,63,64,64 70,72,74,71,68,66
    """
    import torch

    rows = []
    for text in traces:
        try:
            rows.append([float(x) for x in text.split(",")])
        except ValueError:
            raise UserError(
                f"Trace {text!r} is not a comma-separated list of numbers, e.g. 50,46,40,47,52,55."
            ) from None
    if len({len(r) for r in rows}) != 1 or len(rows[0]) < 2:
        raise UserError("Every trace needs the same number of rewards R_0..R_W, at least two.")
    trace = torch.tensor(rows, dtype=torch.float64)  # [N, W+1]
    table = Table(title="per-step rewards (* = turning point: reward replaced by R_W - R_i)", show_lines=True)
    table.add_column("traj", no_wrap=True)
    table.add_column("R_0..R_W", no_wrap=True)
    names = assigner or registry.names("credit")
    results = {}
    for name in names:
        entry = registry.get("credit", name)
        opts = {"balanced": balanced} if "balanced" in entry.options.model_fields else {}
        results[name] = registry.build("credit", name, **opts)(trace)
        table.add_column(name, no_wrap=True)
    for b in range(trace.shape[0]):
        cells = []
        for name in names:
            out = results[name]
            steps = (
                f"{_num(r)}{'*' if tp else ''}"
                for r, tp in zip(out.step_rewards[b].tolist(), out.turning_points[b].tolist(), strict=True)
            )
            cells.append(" ".join(steps))
        table.add_row(str(b), " ".join(_num(x) for x in rows[b]), *cells)
    _console().print(table)


def _warn_broken_plugins() -> None:
    """One warning line per installed plugin that failed to import (it stays unregistered; the rest works)."""
    for kind in registry.KINDS:
        for line in registry.plugin_errors(kind):
            _console(stderr=True).print(
                f"[yellow]warning: plugin failed to load[/] {escape(line)}", soft_wrap=True, highlight=False
            )


def _num(x: float) -> str:
    return f"{x:g}"


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
    _warn_broken_plugins()
    loaded.preflight()  # e.g. the remote reward's server is up: fail now, not after the model has loaded
    world = num_processes * num_machines

    def before_launch() -> None:  # once here, not once per process
        from tpflow.preflight import check_machine, default_run_dir

        check_machine(loaded, run_dir or default_run_dir(loaded))
        check_layout(loaded.train, world)

    _launch_if_asked(
        ctx, num_processes, num_machines, machine_rank, main_process_ip, main_process_port, check=before_launch
    )
    from tpflow.train.trainer import Trainer

    resume_from: bool | Path = False if resume is None else (True if resume == _LATEST else Path(resume))
    console = _console()
    trainer = Trainer(loaded, run_dir=run_dir, resume=resume_from, console=console)
    try:
        metrics = trainer.fit()
    except KeyboardInterrupt:
        if trainer.dist.is_main:
            console.print(f"Resume with: tpflow train {recipe} --resume --run-dir {trainer.run_dir}")
        raise typer.Exit(130) from None
    if not trainer.dist.is_main:
        return
    first = _first_eval(trainer.run_dir / "metrics.jsonl")
    console.print(f"[bold green]done.[/] run: {trainer.run_dir}")
    console.print(f"  metrics: {trainer.run_dir / 'metrics.jsonl'} (per-trajectory traces: traces.jsonl)")
    console.print(f"  samples: {trainer.run_dir / 'samples'}")
    console.print(f"  checkpoints: {trainer.run_dir / 'checkpoints'}")
    if "eval_reward" in metrics and first is not None:
        console.print(f"  eval reward: {first:.4f} (first) -> {metrics['eval_reward']:.4f} (last)")


_LATEST = "@latest"


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
    out: Annotated[Path, typer.Option(help="Output directory.")] = Path("runs/inspect"),
    set_: Overrides = None,
    run: Annotated[
        Path | None, typer.Option(help="Plot the traces a training run logged, not RECIPE.", show_default=False)
    ] = None,
    epoch: Annotated[int | None, typer.Option(help="With --run: the epoch (default: the last).")] = None,
) -> None:
    """Reward of the ODE completion along denoising, turning points and each assigner's credit, as plots.

    Example: tpflow inspect-trajectory recipes/shapes_tp.toml --prompt "a photo of a red circle" --n 8
    """
    from tpflow.inspect import inspect_run, inspect_sampled, summary_rows

    if (recipe is None) == (run is None):
        raise UserError("Give exactly one of RECIPE (sample new trajectories, with --prompt) or --run RUN_DIR.")
    console = _console()
    if run is not None:
        result = inspect_run(run, epoch, n, credit_, out)
    else:
        from tpflow.recipe import load_recipe

        if not prompt:
            raise UserError('RECIPE needs --prompt TEXT, e.g. --prompt "a photo of a red circle".')
        from tpflow.preflight import check_machine

        loaded = load_recipe(recipe, set_ or [])
        check_machine(loaded)  # devices, weight files, prompts: before anything loads

        def warn(text: str) -> None:
            _console(stderr=True).print(f"[yellow]warning:[/] {escape(text)}", soft_wrap=True, highlight=False)

        result = inspect_sampled(loaded, prompt, n, seed, checkpoint, credit_, out, warn)
    table = Table(title=f"{escape(result.trajectories.prompt)}: turning points of {result.marked}")
    for column in ("traj", "R_0", "R_W", "Δ", "turning points", "step rewards"):
        table.add_column(column, no_wrap=column != "step rewards")
    for row in summary_rows(result.trajectories, result.marked):
        table.add_row(
            str(row["traj"]),
            f"{row['R_0']:.4g}",
            f"{row['R_W']:.4g}",
            f"{row['delta']:+.4g}",
            row["turning_points"],
            " ".join(f"{x:.3g}" for x in row["step_rewards"]),
        )
    console.print(table)
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
    max_connections: Annotated[int, typer.Option(min=1, help="Connections served at once; more get 503.")] = 16,
    timeout_s: Annotated[float, typer.Option(min=0.001, help="Seconds a request may take to arrive whole.")] = 30,
) -> None:
    """Serve a reward over HTTP for recipes whose reward is name = "remote" with url = the printed URL.

    Example: tpflow serve-reward --reward shapes-geneval --port 18085 --set score=strict
    """
    from tpflow.rewards.serve import Limits, parse_options, serve

    console = _console()
    limits = Limits(
        max_request_bytes=int(max_request_mb * 2**20),
        max_images=max_images,
        max_side=max_side,
        max_pixels=int(max_megapixels * 1e6),
        max_connections=max_connections,
        timeout_s=timeout_s,
    )

    def announce(url: str) -> None:
        console.print(f"Serving reward {reward!r} at {url} (GET /health, POST /score). Ctrl-C stops.", highlight=False)
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
) -> None:
    """Export a trained adapter for inference: pipe.load_lora_weights(OUT), or --merge for a merged transformer."""
    from tpflow.export import export as run_export

    summary = run_export(source, out, merge=merge, ema=ema)
    console = _console()
    what = "merged transformer" if merge else "LoRA adapter"
    console.print(
        f"wrote the {what} of {summary['checkpoint']} (step {summary['step']}, "
        f"{'EMA' if summary['ema'] else 'live'} weights) to {summary['written']}",
        highlight=False,
        markup=False,
    )


Target = Annotated[
    str,
    typer.Argument(help="A run dir, a checkpoint dir, a folder from `tpflow export`, or a recipe .toml (base model)."),
]
RecipeOption = Annotated[
    Path | None,
    typer.Option(help="The recipe of an exported adapter that has no recipe.json beside it.", show_default=False),
]
CheckpointOption = Annotated[
    str | None,
    typer.Option(help="With a run dir: the checkpoint's step or folder name (default: the newest valid).",
                 show_default=False),
]  # fmt: skip
EmaOption = Annotated[bool, typer.Option(help="Use the run's EMA weights when it kept them (the paper's).")]
SeedOption = Annotated[
    int | None,
    typer.Option(help="Noise seed (default: the recipe's eval seed, train.seed + 12345).", show_default=False),
]
GuidanceOption = Annotated[
    float | None, typer.Option(help="Guidance scale (default: the recipe's eval.guidance).", show_default=False)
]
ResolutionOption = Annotated[
    int | None,
    typer.Option(help="Image side in pixels (sets backbone.resolution; SD3 / FLUX).", show_default=False),
]


def _target_overrides(set_: list[str] | None, resolution: int | None) -> list[str]:
    return [*(set_ or []), *([f"backbone.resolution={resolution}"] if resolution is not None else [])]


def _eval_accelerator(recipe: Any) -> Any:
    from tpflow.devices import resolve_device
    from tpflow.distributed import make_accelerator

    cpu = resolve_device(getattr(recipe.backbone.options, "device", None)).type != "cuda"
    return make_accelerator(cpu=cpu, mixed_precision="no" if cpu else recipe.train.mixed_precision)


@app.command("eval")
@user_errors
def eval_(
    ctx: typer.Context,
    target: Target,
    baseline: Annotated[
        str | None,
        typer.Option(
            help="A second TARGET evaluated the same way; the table shows both and the difference.", show_default=False
        ),
    ] = None,
    prompts: Annotated[
        str,
        typer.Option(help="test | train (the recipe's splits) | geneval | ocr | a .jsonl or text file of prompts."),
    ] = "test",
    num_prompts: Annotated[
        int | None,
        typer.Option(
            min=1, help="The first N prompts (default: eval.num_prompts for test, else all).", show_default=False
        ),
    ] = None,
    steps: Annotated[int, typer.Option(min=1, help="ODE sampling steps (the paper evaluates at 40).")] = 40,
    guidance: GuidanceOption = None,
    images_per_prompt: Annotated[int, typer.Option(min=1, help="Images per prompt (GenEval: 4).")] = 1,
    seed: SeedOption = None,
    resolution: ResolutionOption = None,
    batch_size: Annotated[
        int | None, typer.Option(min=1, help="Images per batch (default: eval.batch_size).", show_default=False)
    ] = None,
    recipe: RecipeOption = None,
    checkpoint: CheckpointOption = None,
    ema: EmaOption = True,
    out: Annotated[
        Path | None,
        typer.Option(help="Output folder (default: RUN/eval/step<S>_<prompts>_T<steps>).", show_default=False),
    ] = None,
    set_: Overrides = None,
    num_processes: NumProcesses = 1,
    num_machines: NumMachines = 1,
    machine_rank: MachineRank = 0,
    main_process_ip: MainProcessIp = None,
    main_process_port: MainProcessPort = 29500,
) -> None:
    """Sample TARGET on a prompt set by ODE and score it: a table per category (GenEval: strict accuracy per tag and
    overall), eval.json and a sample grid.

    Example: tpflow eval runs/geneval_tp --prompts geneval --images-per-prompt 4 --baseline recipes/geneval_tp.toml
    """
    from tpflow.distributed import Distributed
    from tpflow.evaluation.run import EvalOptions, default_out, evaluate_target, write_outputs
    from tpflow.evaluation.targets import resolve_target

    overrides = _target_overrides(set_, resolution)
    resolved = resolve_target(target, recipe, checkpoint, overrides)
    other = resolve_target(baseline, None, None, overrides) if baseline is not None else None
    from tpflow.preflight import check_machine

    for which in (resolved, other):
        if which is not None:  # before any weights load: devices, model files, the reward's server
            check_machine(which.recipe, where=str(which.path))
            which.recipe.preflight()
    options = EvalOptions(
        prompts=prompts, num_prompts=num_prompts, steps=steps, guidance=guidance,
        images_per_prompt=images_per_prompt, seed=seed, batch_size=batch_size, ema=ema,
    )  # fmt: skip
    if prompts not in ("test", "train", "geneval", "ocr") and not Path(prompts).expanduser().is_file():
        raise UserError(f"--prompts {prompts!r} is neither test, train, geneval, ocr nor an existing prompt file.")
    _launch_if_asked(ctx, num_processes, num_machines, machine_rank, main_process_ip, main_process_port)
    accelerator = _eval_accelerator(resolved.recipe)
    dist = Distributed(accelerator)
    console = _console() if dist.is_main else Console(quiet=True)
    results = []
    for which in [resolved, *([other] if other is not None else [])]:
        with _progress(console, f"eval {which.label}") as advance:
            results.append(evaluate_target(which, options, dist, accelerator.autocast, advance))
    if not dist.is_main:
        return
    result, base = results[0], (results[1] if len(results) > 1 else None)
    folder = out or default_out(resolved, options)
    console.print(_eval_table(result, base))
    for path in write_outputs(folder, result, base, ema):
        console.print(f"wrote {path}", highlight=False, markup=False)


@app.command()
@user_errors
def sample(
    target: Target,
    prompt: Annotated[list[str], typer.Option("--prompt", "-p", help="A prompt (repeatable): one row each.")],
    n: Annotated[int, typer.Option("--n", min=1, help="Images per prompt.")] = 4,
    out: Annotated[Path, typer.Option(help="The PNG to write (its tile layout goes to OUT.json).")] = Path(
        "samples.png"
    ),
    steps: Annotated[int, typer.Option(min=1, help="ODE sampling steps.")] = 40,
    guidance: GuidanceOption = None,
    seed: Annotated[int, typer.Option(help="Noise seed.")] = 0,
    resolution: ResolutionOption = None,
    recipe: RecipeOption = None,
    checkpoint: CheckpointOption = None,
    ema: EmaOption = True,
    set_: Overrides = None,
) -> None:
    """Images of TARGET for a quick look: one row per prompt, the prompt under each image.

    Example: tpflow sample runs/shapes_tp --prompt "a photo of a red circle" --prompt "two blue squares" --n 4
    """
    from tpflow.evaluation.sample import captioned_grid, sample_images
    from tpflow.evaluation.targets import resolve_target

    if out.suffix.lower() != ".png":
        raise UserError(f"--out {out} should name a .png file.")
    resolved = resolve_target(target, recipe, checkpoint, _target_overrides(set_, resolution))
    from tpflow.preflight import check_machine

    check_machine(resolved.recipe, where=str(resolved.path))  # devices and model files, before weights load
    accelerator = _eval_accelerator(resolved.recipe)
    scale = resolved.recipe.eval.guidance if guidance is None else guidance
    batch = resolved.recipe.eval.batch_size
    images = sample_images(resolved, prompt, n, steps, scale, seed, accelerator.autocast, ema, batch)
    grid = captioned_grid(images, [p for p in prompt for _ in range(n)], n, out)
    _console().print(
        f"wrote {grid.path} ({len(grid.boxes)} images of {resolved.label}, {steps} steps, guidance {scale:g}, "
        f"seed {seed})",
        highlight=False,
        markup=False,
    )


def _progress(console: Console, description: str) -> Any:
    """A context giving ``advance(images)`` for a rich progress bar (silent when not on a terminal)."""
    import contextlib

    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    @contextlib.contextmanager
    def bar() -> Any:
        progress = Progress(
            TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
            console=console, transient=True, disable=not console.is_terminal,
        )  # fmt: skip
        task = progress.add_task(escape(description), total=None)
        with progress:
            yield lambda images: progress.advance(task, images)

    return bar()


def _eval_table(result: Any, baseline: Any | None) -> Table:
    """Per category: images, mean reward, GenEval strict accuracy (when the reward has it); with a baseline, its
    figures and the difference."""
    from tpflow.evaluation.run import difference

    mine = result.categories()
    figures = [key for key in ("reward", "strict") if key in mine["overall"]]
    table = Table(title=f"tpflow eval: {escape(result.target.label)} ({result.settings['num_prompts']} prompts, "
                        f"{result.settings['steps']} steps, {escape(str(result.settings['prompts']))})")  # fmt: skip
    table.add_column("category", no_wrap=True)
    table.add_column("images", justify="right")
    for key in figures:
        table.add_column(key, justify="right")
        if baseline is not None:
            table.add_column(f"baseline {key}", justify="right")
            table.add_column(f"Δ {key}", justify="right")
    theirs = baseline.categories() if baseline is not None else {}
    delta = difference(result, baseline) if baseline is not None else {}
    for category, row in mine.items():
        cells = [category, str(int(row["images"]))]
        for key in figures:
            cells.append(f"{row[key]:.4f}")
            if baseline is not None:
                other = theirs.get(category, {}).get(key)
                change = delta.get(category, {}).get(key)
                cells += ["-" if other is None else f"{other:.4f}", "-" if change is None else f"{change:+.4f}"]
        table.add_row(*cells, style="bold" if category == "overall" else None)
    return table


def _format_values(model: Any) -> str:
    return "\n".join(f"{k} = {v!r}" for k, v in model.model_dump().items()) or "-"


def main(argv: list[str] | None = None) -> None:
    """Console-script entry point."""
    args = list(sys.argv[1:] if argv is None else argv)
    for i, arg in enumerate(args):  # a bare `--resume` (no value) means the run dir's newest checkpoint
        if arg == "--resume" and (i + 1 == len(args) or args[i + 1].startswith("-")):
            args.insert(i + 1, _LATEST)
            break
    app(args=args, prog_name="tpflow")


if __name__ == "__main__":
    main()
