"""``tpflow shapes``: commands of the embedded shapes world.

    tpflow shapes pretrain --minutes 45 --out runs/shapes-pretrain    # writes shapes_dit.safetensors + .json
    tpflow shapes clip-pretrain --minutes 11 --out runs/shapes-clip --threads 1   # shapes_clip.safetensors + .json
    tpflow shapes video-pretrain --minutes 60 --out runs/shapes-video   # shapes_video_dit.safetensors + .json
    tpflow shapes pretrain-edit --minutes 40 --out runs/shapes-edit-pretrain   # shapes_edit_dit.safetensors + .json

Use the result with ``weights = "runs/shapes-pretrain/shapes_dit.safetensors"`` in a recipe's [backbone] section
(``name = "shapes-dit"``), or copy both files into ``tpflow/shapes/weights/`` to replace the shipped model; the
same for ``shapes_clip.safetensors`` with ``weights = ...`` in the [reward] section (``name = "shapes-clip"``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer

from tpflow.cli_common import user_errors

shapes_app = typer.Typer(
    name="shapes",
    help="The embedded shapes world: a tiny text-to-image flow model trained on rendered shapes.",
    no_args_is_help=True,
    add_completion=False,
)


# The options the pretraining commands share (each its own default)
Minutes = Annotated[float, typer.Option(help="Wall-clock budget of the training loop, in minutes.")]
MaxSteps = Annotated[int, typer.Option(help="Stop after this many steps (0: only the time budget).")]
Progress = Annotated[bool, typer.Option(help="Show a progress bar (otherwise print log lines).")]


@shapes_app.callback()
def _shapes() -> None:
    """The embedded shapes world: a tiny text-to-image flow model trained on rendered shapes."""


@shapes_app.command()
def pretrain(
    minutes: Minutes = 45.0,
    out: Annotated[
        Path, typer.Option(help="Output folder for shapes_dit.safetensors (EMA weights) and shapes_dit.json.")
    ] = Path("runs/shapes-pretrain"),
    seed: Annotated[int, typer.Option(help="Seed of the initialisation, prompts, renderings and noise.")] = 0,
    batch_size: Annotated[int, typer.Option(help="Images per training step.")] = 64,
    lr: Annotated[float, typer.Option(help="AdamW peak learning rate (after a linear warm-up).")] = 1e-3,
    progress: Progress = True,
) -> None:
    """Pretrain the shapes-dit model from scratch by rectified flow on shapes rendered on the fly."""
    from tpflow.shapes.pretrain import pretrain as run_pretrain

    if minutes <= 0 or batch_size < 1 or lr <= 0:
        typer.echo("error: --minutes and --lr must be positive and --batch-size at least 1.", err=True)
        raise typer.Exit(2)
    path = run_pretrain(minutes=minutes, out=out, seed=seed, batch_size=batch_size, lr=lr, progress=progress)
    typer.echo(str(path))


@shapes_app.command("clip-pretrain")
def clip_pretrain(
    minutes: Minutes = 11.0,
    out: Annotated[
        Path, typer.Option(help="Output folder for shapes_clip.safetensors and shapes_clip.json (config + stats).")
    ] = Path("runs/shapes-clip"),
    seed: Annotated[int, typer.Option(help="Seed of the initialisation, prompts, renderings and augmentation.")] = 0,
    threads: Annotated[int, typer.Option(help="Torch CPU threads; 0 keeps torch's default.")] = 0,
    batch_size: Annotated[int, typer.Option(help="Train prompts per step (each with its hard negatives).")] = 32,
    lr: Annotated[float, typer.Option(help="AdamW peak learning rate (warm-up, then cosine decay).")] = 2e-3,
    max_steps: MaxSteps = 0,
    split: Annotated[
        str, typer.Option(help="Prompts it learns: test (every prompt, the default) or train (no held-out pairs).")
    ] = "test",
    progress: Progress = True,
) -> None:
    """Train the shapes-clip reward model (a tiny CLIP with hard negatives) on shapes rendered on the fly."""
    from tpflow.shapes.clip_pretrain import clip_pretrain as run_clip_pretrain

    if split not in ("train", "test"):
        typer.echo(f"error: --split must be train or test, got {split!r}.", err=True)
        raise typer.Exit(2)
    if minutes <= 0 or batch_size < 1 or lr <= 0 or threads < 0 or max_steps < 0:
        typer.echo(
            "error: --minutes and --lr must be positive, --batch-size at least 1, --threads and "
            "--max-steps at least 0.",
            err=True,
        )
        raise typer.Exit(2)
    path = run_clip_pretrain(
        minutes=minutes,
        out=out,
        seed=seed,
        batch_size=batch_size,
        lr=lr,
        threads=threads or None,
        max_steps=max_steps or None,
        split=split,
        progress=progress,
    )
    typer.echo(str(path))


@shapes_app.command("video-pretrain")
@user_errors
def video_pretrain(
    minutes: Minutes = 60.0,
    out: Annotated[
        Path, typer.Option(help="Output folder for shapes_video_dit.safetensors (EMA weights) and its .json.")
    ] = Path("runs/shapes-video-pretrain"),
    seed: Annotated[int, typer.Option(help="Seed of the initialisation, prompts, renderings and noise.")] = 0,
    batch_size: Annotated[int, typer.Option(help="Clips per training step.")] = 12,
    lr: Annotated[float, typer.Option(help="AdamW peak learning rate (after a linear warm-up).")] = 5e-4,
    threads: Annotated[int, typer.Option(help="Torch CPU threads; 0: every core.")] = 0,
    max_steps: MaxSteps = 0,
    init: Annotated[
        str,
        typer.Option(
            help="Starting weights: 'image' (the shipped shapes-dit, inflated), 'none' (from scratch), or a "
            "shapes_dit.safetensors (inflated) or shapes_video_dit.safetensors (continued)."
        ),
    ] = "image",
    progress: Progress = True,
) -> None:
    """Pretrain the video shapes world's model (shapes-video-dit) by rectified flow on clips rendered on the fly."""
    from tpflow.shapes.video_pretrain import video_pretrain as run

    _inflated_pretrain(run, minutes=minutes, out=out, seed=seed, batch_size=batch_size, lr=lr, threads=threads,
                       max_steps=max_steps, init=init, progress=progress)  # fmt: skip


@shapes_app.command("pretrain-edit")
@user_errors
def pretrain_edit(
    minutes: Minutes = 40.0,
    out: Annotated[
        Path, typer.Option(help="Output folder for shapes_edit_dit.safetensors (EMA weights) and its .json.")
    ] = Path("runs/shapes-edit-pretrain"),
    seed: Annotated[int, typer.Option(help="Seed of the initialisation, edits, renderings and noise.")] = 0,
    batch_size: Annotated[int, typer.Option(help="(source, instruction, target) triples per training step.")] = 32,
    lr: Annotated[float, typer.Option(help="AdamW peak learning rate (after a linear warm-up).")] = 5e-4,
    threads: Annotated[int, typer.Option(help="Torch CPU threads; 0: every core.")] = 0,
    max_steps: MaxSteps = 0,
    init: Annotated[
        str,
        typer.Option(
            help="Starting weights: 'image' (the shipped shapes-dit, its layers copied), 'none' (from scratch), or a "
            "shapes_dit.safetensors (copied) or shapes_edit_dit.safetensors (continued: resumes a run)."
        ),
    ] = "image",
    progress: Progress = True,
) -> None:
    """Pretrain the editing shapes world's model (shapes-edit-dit) by rectified flow on edits rendered on the fly."""
    from tpflow.shapes.edit_pretrain import edit_pretrain as run

    _inflated_pretrain(run, minutes=minutes, out=out, seed=seed, batch_size=batch_size, lr=lr, threads=threads,
                       max_steps=max_steps, init=init, progress=progress)  # fmt: skip


def _inflated_pretrain(run: Any, *, minutes: float, batch_size: int, lr: float, threads: int, max_steps: int,
                       **rest: Any) -> None:  # fmt: skip
    """A pretraining that starts from the image model (video, editing): its numbers checked (exit 2), then ``run``,
    printing the weights' path."""
    if minutes <= 0 or batch_size < 1 or lr <= 0 or threads < 0 or max_steps < 0:
        typer.echo("error: --minutes and --lr must be positive, --batch-size at least 1, --threads and --max-steps "
                   "at least 0.", err=True)  # fmt: skip
        raise typer.Exit(2)
    path = run(minutes=minutes, batch_size=batch_size, lr=lr, threads=threads or None, max_steps=max_steps or None,
               **rest)  # fmt: skip
    typer.echo(str(path))
