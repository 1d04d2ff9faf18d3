"""``tpflow eval`` and ``tpflow sample``: the command-line side of tpflow.evaluation (``register`` adds them to the
``tpflow`` app); the work is done by tpflow.evaluation.run, .targets and .sample."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from tpflow.cli_common import (
    MachineRank,
    MainProcessIp,
    MainProcessPort,
    NumMachines,
    NumProcesses,
    Overrides,
    launch_if_asked,
    make_console,
    print_report,
    user_errors,
    warn,
    warn_broken_plugins,
)
from tpflow.errors import UserError


def register(app: typer.Typer) -> None:
    """Add ``eval`` and ``sample`` to the ``tpflow`` app."""
    app.command("eval")(eval_)
    app.command()(sample)


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
StepsOption = Annotated[
    int | None,
    typer.Option(min=1, help="ODE sampling steps (default: the recipe's eval.num_steps, what training evaluated at; "
                 "the SD3.5 recipes' 40 is the paper's T).", show_default=False),
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
SourceImageOption = Annotated[
    list[Path] | None,
    typer.Option("--image", help="A source image to edit (repeatable: several sources), for a recipe whose backbone "
                 "edits images; every prompt edits the same source(s). Refused for a text-to-image backbone.",
                 show_default=False),
]  # fmt: skip


def _eval_accelerator(recipe: Any) -> tuple[Any, Any]:
    """The processes' accelerator and the forward precision of the recipe's training (``tpflow.precision``), on
    the backbone's device: an eval samples as the run's own evals did."""
    from tpflow.devices import resolve_device
    from tpflow.distributed import make_accelerator
    from tpflow.precision import Precision

    device = resolve_device(getattr(recipe.backbone.options, "device", None))
    accelerator = make_accelerator(cpu=device.type != "cuda", mixed_precision="no")
    return accelerator, Precision(recipe.train.mixed_precision, device)


BaselineOption = Annotated[
    str | None,
    typer.Option(
        help="A second TARGET (a run, checkpoint, export or recipe) scored exactly as TARGET is: by TARGET's "
        "recipe's reward, watched rewards and eval settings (prompts, images per prompt, seed, steps, guidance), "
        "with only its model (backbone and adapter or weights) taken from it; refused when its images would differ "
        "in kind (another backbone, image size or frame count). The table shows both and the difference.",
        show_default=False,
    ),
]
PromptsOption = Annotated[
    str,
    typer.Option(help="test | train | a split of the recipe's dataset by name | geneval | ocr | a prompts file."),
]
NumPromptsOption = Annotated[
    int | None,
    typer.Option(
        min=1, help="The first N prompts (default: eval.num_prompts for test, else all).", show_default=False
    ),
]
ImagesPerPromptOption = Annotated[
    int | None,
    typer.Option(min=1, help="Images per prompt (default: eval.images_per_prompt; GenEval: 4).", show_default=False),
]
BatchSizeOption = Annotated[
    int | None, typer.Option(min=1, help="Images per batch (default: eval.batch_size).", show_default=False)
]
EvalOutOption = Annotated[
    Path | None,
    typer.Option(
        help="Output folder (default: RUN/eval/step<S>_<prompts>_T<steps>; under runs/eval/ for an exported "
        "adapter or a recipe).",
        show_default=False,
    ),
]


@user_errors
def eval_(
    ctx: typer.Context,
    target: Target,
    baseline: BaselineOption = None,
    prompts: PromptsOption = "test",
    num_prompts: NumPromptsOption = None,
    steps: StepsOption = None,
    guidance: GuidanceOption = None,
    images_per_prompt: ImagesPerPromptOption = None,
    seed: SeedOption = None,
    resolution: ResolutionOption = None,
    batch_size: BatchSizeOption = None,
    recipe: RecipeOption = None,
    checkpoint: CheckpointOption = None,
    ema: EmaOption = True,
    out: EvalOutOption = None,
    set_: Overrides = None,
    num_processes: NumProcesses = 1,
    num_machines: NumMachines = 1,
    machine_rank: MachineRank = 0,
    main_process_ip: MainProcessIp = None,
    main_process_port: MainProcessPort = 29500,
) -> None:
    """Sample TARGET on a prompt set by ODE and score it: a table per category (GenEval: strict accuracy per tag and
    overall), eval.json, a sample grid (with --baseline also a comparison image), each grid with its tile map.
    With --baseline both are scored by TARGET's reward and eval settings: a comparison of models (one line says so).

    Example: tpflow eval runs/geneval_tp --prompts geneval --images-per-prompt 4 --baseline recipes/geneval_tp.toml
    """
    from tpflow.distributed import Distributed
    from tpflow.evaluation.run import EvalOptions, default_out, evaluate_target

    warn_broken_plugins()
    options = EvalOptions(
        prompts=prompts, num_prompts=num_prompts, steps=steps, guidance=guidance,
        images_per_prompt=images_per_prompt, seed=seed, batch_size=batch_size, ema=ema,
    )  # fmt: skip
    targets = _checked_targets(target, baseline, options, recipe, checkpoint, set_, resolution)
    launch_if_asked(ctx, num_processes, num_machines, machine_rank, main_process_ip, main_process_port)
    accelerator, precision = _eval_accelerator(targets[0].recipe)
    dist = Distributed(accelerator)
    console = make_console() if dist.is_main else Console(quiet=True)
    results = []
    for which in targets:
        with _progress(console, f"eval {which.label}") as advance:
            results.append(evaluate_target(which, options, dist, precision.autocast, advance))
    dist.close(exit_workers=True)  # every image is gathered: the processes part here (the main one reports)
    if dist.is_main:
        _report_eval(console, results, out or default_out(targets[0], options), ema)


def _checked_targets(
    target: str,
    baseline: str | None,
    options: Any,
    recipe: Path | None,
    checkpoint: str | None,
    set_: list[str] | None,
    resolution: int | None,
) -> list[Any]:
    """TARGET and the baseline (when given) resolved, the baseline to be scored as TARGET is (its model in TARGET's
    recipe: ``tpflow.evaluation.scorer``), each checked against this machine and its recipe's preflight, and
    ``--prompts`` checked, all before any weights load or any process launches, so that a mistake costs seconds;
    the checks' report, then what scores both, is printed once every one has passed. Returns ``[target]`` or
    ``[target, baseline]``."""
    from tpflow.evaluation.scorer import scored_as, scoring_line
    from tpflow.evaluation.targets import resolve_target

    resolved = resolve_target(target, recipe, checkpoint, set_, resolution)
    other, line = None, None
    if baseline is not None:  # the comparison is of models: one reward, one eval set, for both
        own = resolve_target(baseline, None, None, set_, resolution)
        other, line = scored_as(resolved, own), scoring_line(resolved, own, options)
    prompts = options.prompts
    from tpflow.preflight import check_machine

    reports = []
    for which in (resolved, other):
        if which is not None:  # before any weights load: devices, model files, the reward's server
            reports.append(check_machine(which.recipe, where=str(which.path)))
            which.recipe.preflight()
    from tpflow.evaluation.prompt_sets import check_prompt_set

    check_prompt_set(prompts, resolved.recipe)  # a named set, a split of the recipe's dataset, or a file
    print_report(*reports)  # every check passed: the device, where each weight comes from
    for problem in _prompt_file_problems(prompts, resolved.recipe):  # scored, but not by what the reward reads
        warn(
            f"{problem} These prompts' rewards are scored without it (a GenEval check asks nothing: reward 0, "
            "strict accuracy NaN); the images are still sampled and shown."
        )
    if line is not None:
        make_console().print(line, highlight=False, markup=False, soft_wrap=True)
    return [resolved, *([other] if other is not None else [])]


def _prompt_file_problems(prompts: str, recipe: Any) -> list[str]:
    """A prompt file's items against what the recipe's rewards read from each prompt's metadata
    (``tpflow.rewards.needs``): the recipe's own splits and the named sets were checked with the recipe."""
    if prompts in ("test", "train", "geneval", "ocr"):
        return []
    from tpflow.evaluation.prompt_sets import prompt_set
    from tpflow.rewards.needs import item_problems

    items, _ = prompt_set(prompts, recipe)
    return item_problems({**recipe.components, **recipe.settings}, f"--prompts {Path(prompts).name}", items)


def _report_eval(console: Console, results: list[Any], folder: Path, ema: bool) -> None:
    """The main process's output of an eval: the tables (target, and baseline with the difference when there is
    one), each warning once (target and baseline often share them), and the files written under ``folder``."""
    from tpflow.evaluation.run import write_outputs
    from tpflow.scoring.watched import hacking_warnings
    from tpflow.train.evaluation import summarize

    result, base = results[0], (results[1] if len(results) > 1 else None)
    for table in _eval_tables(result, base):
        console.print(table)
    for warning in dict.fromkeys(w for r in results for w in r.settings["warnings"]):  # target's, baseline's
        warn(warning)
    if base is not None:  # the trained reward up on the baseline's while a watched one (or the diversity) fell
        mine, theirs = (summarize(r.scored, r.items) for r in (result, base))
        for warning in hacking_warnings(theirs, mine, since="over the baseline"):
            warn(warning)
    for path in write_outputs(folder, result, base, ema):
        console.print(f"wrote {path}", highlight=False, markup=False)
    console.print(f"the grids show {result.scored.grid_rule}", highlight=False, markup=False)


SampleOutOption = Annotated[
    Path | None,
    typer.Option(
        help="The PNG to write, its tile layout beside it in OUT.json (default: RUN/samples/sample_step<S>.png for "
        "a run or checkpoint, beside the trainer's eval grids; ./samples.png for an export or a recipe).",
        show_default=False,
    ),
]


@user_errors
def sample(
    target: Target,
    prompt: Annotated[list[str], typer.Option("--prompt", "-p", help="A prompt (repeatable): one row each.")],
    n: Annotated[int, typer.Option("--n", min=1, help="Images per prompt.")] = 4,
    out: SampleOutOption = None,
    steps: StepsOption = None,
    guidance: GuidanceOption = None,
    seed: Annotated[int, typer.Option(help="Noise seed.")] = 0,
    resolution: ResolutionOption = None,
    recipe: RecipeOption = None,
    checkpoint: CheckpointOption = None,
    ema: EmaOption = True,
    set_: Overrides = None,
    image: SourceImageOption = None,
) -> None:
    """Images of TARGET for a quick look: one row per prompt, the prompt under each image.

    Example: tpflow sample runs/shapes_tp --prompt "a photo of a red circle" --prompt "two blue squares" --n 4

    An editing model's: tpflow sample runs/kontext --prompt "make the cup red" --image cup.png
    """
    from tpflow.data.source_counts import command_sources
    from tpflow.evaluation.sample import sample_images
    from tpflow.grids import Tile, captioned_grid, clip_grid
    from tpflow.images import to_uint8
    from tpflow.video import frame_strip

    if out is not None and out.suffix.lower() != ".png":
        raise UserError(f"--out {out} should name a .png file.")
    from tpflow.evaluation.targets import resolve_target

    resolved = resolve_target(target, recipe, checkpoint, set_, resolution)
    sources = command_sources(resolved.recipe.backbone.name, image)  # before anything loads
    out = out or sample_out(resolved)
    from tpflow.preflight import check_machine

    print_report(check_machine(resolved.recipe, where=str(resolved.path)))  # devices, model files: before loading
    from tpflow.preflight import prompt_warnings
    from tpflow.sources import SOURCES, load
    from tpflow.types import PromptItem

    for warning in prompt_warnings(resolved.recipe, list(prompt)):  # inspect-trajectory and eval say the same
        warn(warning)
    accelerator, precision = _eval_accelerator(resolved.recipe)
    scale = resolved.recipe.eval.guidance if guidance is None else guidance
    steps = steps or resolved.recipe.eval.num_steps  # the recipe's eval steps, as tpflow eval
    batch = resolved.recipe.eval.batch_size
    items = [PromptItem(text, {SOURCES: sources} if sources else {}) for text in prompt]
    images = sample_images(resolved, items, n, steps, scale, seed, precision.autocast, ema, batch)
    clips = images.ndim == 5  # a video backbone's: strips on the PNG, the clips playing in a WebP beside it
    frames = to_uint8(images) if clips else [None] * len(images)
    shown = tuple(load(ref) for ref in sources or ())  # an edit's source(s): drawn left of it, source | edit
    tiles = [Tile(frame_strip(image[None])[0], text, info={"index": r}, frames=f, sources=shown)
             for r, (image, text, f) in enumerate(zip(images, [p for p in prompt for _ in range(n)], frames,
                                                      strict=True))]  # fmt: skip
    grid = captioned_grid(tiles, n, out)
    if clips:
        clip_grid(tiles, n, out.with_suffix(".webp"))
    make_console().print(
        f"wrote {grid.path}{' and ' + str(out.with_suffix('.webp')) if clips else ''} ({len(grid.boxes)} "
        f"{'clips' if clips else 'images'} of {resolved.label}, {steps} steps, guidance {scale:g}, seed {seed})",
        highlight=False,
        markup=False,
        soft_wrap=True,  # one line, the path whole: the terminal wraps it
    )


def sample_out(target: Any) -> Path:
    """Where ``tpflow sample`` writes without --out: a run's (or checkpoint's run's) samples/ folder, beside the
    trainer's eval grids, named for the checkpoint's step; ./samples.png for an exported adapter or a recipe."""
    if target.kind in ("run", "checkpoint"):
        return target.path / "samples" / f"sample_step{target.step}.png"
    return Path("samples.png")


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


def _eval_title(result: Any) -> str:
    """The tables' title: the target, its prompt count, how many steps (and whence), which prompts."""
    prompts = str(result.settings["prompts"])
    if prompts == "test" and result.settings["split"] != "test":
        prompts = f"{result.settings['split']} split, no test split"
    steps = f"{result.settings['steps']} steps"
    steps += " as the recipe's \\[eval]" if result.settings.get("steps_from") == "recipe" else " (--steps)"
    return (f"tpflow eval: {escape(result.target.label)} ({result.settings['num_prompts']} prompts, "
            f"{steps}, {escape(prompts)})")  # fmt: skip


def _eval_tables(result: Any, baseline: Any | None) -> list[Table]:
    """Per category: images, mean reward, GenEval strict accuracy (when the reward has it). The ``overall`` row is
    the mean over images (training's ``eval_*``); GenEval's score, the mean over tags, has a row of its own. The
    watched rewards (``watch_<label>``) and the diversity within groups (``[eval] rewards``, ``diversity``) have a
    table of their own beside. With a baseline, one table per figure (target, baseline, difference), so that each
    fits 80 columns."""
    from tpflow.evaluation.paired import SEEDS_NOTE, paired_intervals
    from tpflow.evaluation.run import OVERALL, difference
    from tpflow.scoring.watched import DIVERSITY, PREFIX

    mine = result.categories()
    figures = [key for key in ("reward", "strict") if key in mine["overall"]]
    watched = [key for key in mine["overall"] if key.startswith(PREFIX) or key == DIVERSITY]
    title = _eval_title(result)
    theirs = baseline.categories() if baseline is not None else {}
    delta = difference(result, baseline) if baseline is not None else {}
    spans = paired_intervals(result, baseline) if baseline is not None else {}
    groups = [figures, *([watched] if watched else [])] if baseline is None else [[k] for k in figures + watched]
    tables = []
    for keys in groups:
        table = Table(
            title=title
            if baseline is None
            else f"{title}: {'watched ' if keys[0] in watched else ''}{keys[0].removeprefix(PREFIX)} vs baseline "
            f"{escape(baseline.target.label)}"
        )
        if baseline is None and keys is not figures:
            table.title = f"{title}: watched, not trained on"
        table.add_column("category", no_wrap=True)
        table.add_column("images", justify="right", no_wrap=True)
        for key in keys:
            name = key.removeprefix(PREFIX)  # a watched reward by its label: the title says watched
            table.add_column(name, justify="right", no_wrap=True)
            if baseline is not None:
                table.add_column("baseline", justify="right", no_wrap=True)
                short = "Δ" if key in watched else f"Δ {key}"  # narrow enough for 80 columns
                table.add_column(f"{short} [95% t]" if spans else short, justify="right", no_wrap=True)
        for category, row in mine.items():
            label = "overall (images)" if category == OVERALL and "strict_tags" in row else category
            cells = [label, str(int(row["images"]))]
            for key in keys:
                cells += _figures(
                    row.get(key), theirs.get(category, {}).get(key), delta.get(category, {}).get(key), baseline,
                    spans.get(category, {}).get(key),
                )  # fmt: skip
            table.add_row(*cells, style="bold" if category == OVERALL else None)
        if "strict" in keys and "strict_tags" in mine[OVERALL]:  # GenEval's score: the mean of the tags' accuracies
            row = mine[OVERALL]
            cells = ["overall (tags)", str(int(row["images"]))]
            for key in keys:
                other = theirs.get(OVERALL, {}).get("strict_tags") if key == "strict" else None
                change = delta.get(OVERALL, {}).get("strict_tags") if key == "strict" else None
                cells += _figures(row["strict_tags"] if key == "strict" else None, other, change, baseline)
            table.add_row(*cells, style="bold")
            table.caption = (
                "overall (images): the mean over images (training's eval_strict); overall (tags): GenEval's score, "
                "the mean of the tags' accuracies (eval_strict_tags)"
            )
        if baseline is not None:
            caption = f"Δ: target − baseline. {SEEDS_NOTE}" if spans else (
                "Δ: target − baseline; no interval: the two evaluated different prompt lists (no pairs)."
            )  # fmt: skip
            table.caption = f"{table.caption}. {caption}" if table.caption else caption
        tables.append(table)
    return tables


def _figures(
    value: float | None, other: float | None, change: float | None, baseline: Any | None, span: dict | None = None
) -> list[str]:
    """The cells of one figure: its value, and with a baseline the baseline's and the difference ("-": none), with
    its paired interval over prompts when there is one."""
    import math

    cells = ["-" if value is None else f"{value:.4f}"]
    if baseline is not None:
        shown = "-" if change is None else f"{change:+.4f}"
        if change is not None and span is not None and not math.isnan(span["low"]):
            shown += f" [{span['low']:+.3f}, {span['high']:+.3f}]"
        cells += ["-" if other is None else f"{other:.4f}", shown]
    return cells
