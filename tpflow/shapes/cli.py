"""``tpflow shapes``: commands of the embedded shapes world.

    tpflow shapes pretrain --minutes 45 --out runs/shapes-pretrain    # writes shapes_dit.safetensors + .json

Use the result with ``weights = "runs/shapes-pretrain/shapes_dit.safetensors"`` in a recipe's [backbone] section
(``name = "shapes-dit"``), or copy both files into ``tpflow/shapes/weights/`` to replace the shipped model.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

shapes_app = typer.Typer(
    name="shapes",
    help="The embedded shapes world: a tiny text-to-image flow model trained on rendered shapes.",
    no_args_is_help=True,
    add_completion=False,
)


@shapes_app.callback()
def _shapes() -> None:
    """The embedded shapes world: a tiny text-to-image flow model trained on rendered shapes."""


@shapes_app.command()
def pretrain(
    minutes: Annotated[float, typer.Option(help="Wall-clock budget of the training loop, in minutes.")] = 45.0,
    out: Annotated[
        Path, typer.Option(help="Output folder for shapes_dit.safetensors (EMA weights) and shapes_dit.json.")
    ] = Path("runs/shapes-pretrain"),
    seed: Annotated[int, typer.Option(help="Seed of the initialisation, prompts, renderings and noise.")] = 0,
    batch_size: Annotated[int, typer.Option(help="Images per training step.")] = 64,
    lr: Annotated[float, typer.Option(help="AdamW peak learning rate (after a linear warm-up).")] = 1e-3,
    progress: Annotated[bool, typer.Option(help="Show a progress bar (otherwise print log lines).")] = True,
) -> None:
    """Pretrain the shapes-dit model from scratch by rectified flow on shapes rendered on the fly."""
    from tpflow.shapes.pretrain import pretrain as run_pretrain

    if minutes <= 0 or batch_size < 1 or lr <= 0:
        typer.echo("error: --minutes and --lr must be positive and --batch-size at least 1.", err=True)
        raise typer.Exit(2)
    path = run_pretrain(minutes=minutes, out=out, seed=seed, batch_size=batch_size, lr=lr, progress=progress)
    typer.echo(str(path))
