"""The numbers behind ``tpflow inspect-trajectory``: reward traces, their trend and every assigner's credit.

Two sources. ``sample_trajectories`` rolls out n trajectories of one prompt with ODE completions after every SDE
window step (the recipe's rollout settings, ``tpflow.rollout.rollout``) and scores the completion images and the
final image: the trace R_0..R_W of each trajectory (docs/algorithm.md §3.4). ``load_run`` reads the traces a training
run logged in ``traces.jsonl``. Either way ``apply_credit`` turns the traces into the step rewards of each credit
assigner, and ``to_json`` writes all of it out.

Index conventions (docs/algorithm.md §0): j = 0..W counts SDE window steps taken; with window start s and K sampling
steps, the latent after j SDE steps is the paper's x_t with t = K − s − j (x_T is noise, x_0 the image), and window
step i is the paper's step t = K − s − i, the transition x_t → x_{t−1}.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from tpflow import registry
from tpflow.devices import cpu_generator
from tpflow.errors import UserError
from tpflow.plans.base import BatchPlan
from tpflow.recipe import Recipe, validate_recipe
from tpflow.rollout import rollout_from_settings
from tpflow.sources import encode_rows
from tpflow.types import Credit, PromptItem

BUILTIN_CREDIT = ("outcome", "incremental", "turning_point", "consistent")


@dataclass
class Trajectories:
    """Reward traces of n trajectories, with what the plots need to label them."""

    prompt: str  # the prompt, or a summary ("32 trajectories of epoch 3") for a training run's traces
    trace: Tensor  # [n, W+1] float64, R_0..R_W
    num_steps: int | None  # K; None when unknown
    window_start: int | None  # s; None when it varies between the trajectories (a run with a random window)
    metadata: dict[str, Any] = field(default_factory=dict)
    sigmas: list[float] | None = None  # σ_0..σ_K of the schedule
    images: Tensor | None = None  # [n, W+1, 3, H, W] in [0, 1]: completion after j SDE steps (j = W: final image)
    prompts: list[str] | None = None  # per trajectory, when they differ (a run's traces)
    credits: dict[str, Credit] = field(default_factory=dict)  # assigner label -> step rewards, turning points

    @property
    def width(self) -> int:
        return self.trace.shape[1] - 1


def assigners(recipe: Recipe | None, names: Sequence[str] | None) -> dict[str, Any]:
    """The credit assigners to compare, by name.

    Default: the recipe's assigner first, then the other built-in ones. A name equal to the recipe's ``[credit]``
    name is built with the recipe's options, any other with its defaults. Unknown names raise a UserError listing
    the registered ones.
    """
    own = recipe.credit.name if recipe is not None else None
    if not names:
        names = [n for n in (own, *BUILTIN_CREDIT) if n is not None]
    built = {}
    for name in dict.fromkeys(names):
        registry.get("credit", name)  # UnknownComponentError (a UserError) names the available ones
        built[name] = recipe.build("credit") if name == own else registry.build("credit", name)
    return built


def apply_credit(trajectories: Trajectories, built: dict[str, Any]) -> None:
    """Fill ``trajectories.credits`` with each assigner's credit of the whole batch (balancing spans all n)."""
    for name, assigner in built.items():
        trajectories.credits[name] = assigner(trajectories.trace)


def find_prompt(recipe: Recipe, prompt: str) -> tuple[dict[str, Any] | None, list[str]]:
    """The metadata of ``prompt`` in the recipe's dataset (train, then test split), and a few valid prompts."""
    dataset = recipe.build("dataset")
    examples: list[str] = []
    for split in [s for s in ("train", "test") if s in getattr(dataset, "splits", ("train", "test"))]:
        items = list(dataset.split(split))
        examples += [it.prompt for it in items[:3]]
        for item in items:
            if item.prompt == prompt:
                return dict(item.metadata), examples
    return None, examples


def dataset_sources(recipe: Recipe, prompt: str) -> list[str]:
    """The source references of ``prompt``'s first item in the recipe's dataset ([] when it has none, the prompt is
    not there or the dataset cannot be read: the command then asks for ``--image``, naming what it needs)."""
    from tpflow.sources import SOURCES

    try:
        metadata, _ = find_prompt(recipe, prompt)
    except UserError:
        return []
    return list((metadata or {}).get(SOURCES) or [])


def sample_trajectories(
    recipe: Recipe,
    prompt: str,
    n: int,
    seed: int,
    checkpoint: Path | None = None,
    metadata: dict[str, Any] | None = None,
) -> Trajectories:
    """Roll out n trajectories of ``prompt`` with ODE completions and score every completion and final image.

    Args:
        recipe: backbone, sampler, reward and rollout settings (window drawn from ``window_range`` with ``seed``;
            baseline noise and same-noise as in the recipe).
        prompt: the text prompt.
        n: number of trajectories.
        seed: seeds the window draw, the initial noise and the SDE noise.
        checkpoint: a run dir or a checkpoint dir whose adapter is loaded (its newest valid checkpoint).
        metadata: the prompt's task metadata for the reward ({} when None); an editing prompt's source images under
            ``sources`` (``tpflow.sources``), which the backbone encodes and the reward reads.
    """
    from tpflow.scoring.call import recipe_policy
    from tpflow.train.scoring import score_rollout

    if n < 1:
        raise UserError(f"--n must be at least 1, got {n}.")
    r = recipe.rollout
    backbone = _backbone(recipe, checkpoint)
    sampler, reward = recipe.build("sampler"), recipe.build("reward")
    window = _window(recipe, n, seed)
    generator = cpu_generator(seed)  # the same trajectories on the CPU and on a GPU (tpflow.devices)
    sigmas = backbone.sigmas(r.num_steps)
    meta = dict(metadata or {})
    cond = encode_rows(backbone, [PromptItem(prompt, meta)] * n)  # an editing prompt's sources too
    out = rollout_from_settings(backbone, sampler, cond, [0] * n, window, r, completions="ode", generator=generator)
    # The trainer's scoring path (chunks of score_batch rows, one retry, finite scores), images kept for the plots.
    scored = score_rollout(
        backbone.decode,
        reward,
        out.final,
        out.completions,
        [prompt] * n,
        [meta] * n,
        window.size,
        chunk=recipe.train.score_batch,
        keep_images=True,
        policy=recipe_policy(recipe.train),
    )
    return Trajectories(
        prompt=prompt,
        trace=scored.trace.double(),  # [n, W+1]
        num_steps=r.num_steps,
        window_start=window.start,
        metadata=meta,
        sigmas=[float(x) for x in sigmas.cpu()],
        images=scored.images,  # [n, W+1, 3, H, W]
    )


def _backbone(recipe: Recipe, checkpoint: Path | None) -> Any:
    """The recipe's backbone, with the adapter of ``checkpoint`` (a run dir: its newest valid checkpoint) loaded
    when one is given; the checkpoints passed over are warned about, and none valid is a UserError."""
    from tpflow.train.checkpoints.format import find_checkpoint, load_checkpoint

    backbone = recipe.build("backbone")
    if checkpoint is not None:
        path, notes = find_checkpoint(Path(checkpoint))
        for note in notes:
            warnings.warn(note, stacklevel=3)  # attributed to sample_trajectories' caller
        if path is None:
            raise UserError(f"No valid checkpoint in {checkpoint}: pass a run dir or a checkpoints/<step> dir.")
        load_checkpoint(path).load_weights(backbone)
    return backbone


def _window(recipe: Recipe, n: int, seed: int) -> BatchPlan:
    """The window of the n trajectories: the recipe's plan at epoch 0, as training would draw it, but always one
    window shared by all n, since the completions are taken at the window's steps."""
    window = recipe.build("plan").plan(recipe.rollout, n, 0, seed, recipe.train.seed)  # epoch 0's window
    if not window.uniform:  # a window per trajectory leaves no step for completions: one window, the first's
        window = BatchPlan((window.starts[0],) * n, window.size, window.trained)
    return window


@dataclass
class RunTraces:
    """What a training run logged in traces.jsonl, with its recipe when a checkpoint holds one."""

    records: list[dict]  # every record of every epoch
    epochs: list[int]  # the epochs present, ascending
    recipe: Recipe | None
    credit_name: str  # the assigner the run trained with ("as trained" when unknown)

    @property
    def trained_label(self) -> str:
        """The name of the credit the run gave its trajectories, in plots: ``consistent (as trained)``, or ``as
        trained`` alone when no checkpoint tells which assigner that was (not "as trained (as trained)")."""
        return self.credit_name if self.recipe is None else f"{self.credit_name} (as trained)"


def load_run(run_dir: Path) -> RunTraces:
    """Read ``run_dir/traces.jsonl`` and the recipe of its newest valid checkpoint (if any)."""
    from tpflow.train.checkpoints.format import find_checkpoint, load_checkpoint
    from tpflow.train.run_logger import read_jsonl

    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise UserError(f"Run dir not found: {run_dir}. Pass the directory `tpflow train` wrote (train.run_dir).")
    path = run_dir / "traces.jsonl"
    if not path.is_file():
        raise UserError(f"{run_dir} holds no traces.jsonl: it is not a tpflow training run, or no epoch finished.")
    records = [r for r in read_jsonl(path) if isinstance(r.get("trace"), list)]
    if not records:
        raise UserError(f"{path} holds no trajectory traces.")
    recipe = None
    ckpt, _ = find_checkpoint(run_dir)
    if ckpt is not None:
        try:
            recipe = validate_recipe(load_checkpoint(ckpt).recipe, where=str(ckpt / "recipe.json"))
        except UserError as err:  # a recipe of another tpflow version or a missing plugin: plot without it
            warnings.warn(
                f"Cannot read the run's recipe ({err}); steps are labelled by window position.", stacklevel=2
            )
    epochs = sorted({int(r["epoch"]) for r in records})
    return RunTraces(records, epochs, recipe, recipe.credit.name if recipe is not None else "as trained")


def run_trajectories(run: RunTraces, epoch: int | None, n: int) -> Trajectories:
    """The first n trajectories logged at ``epoch`` (default: the last), with the credit the run gave them."""
    epoch = run.epochs[-1] if epoch is None else epoch
    if epoch not in run.epochs:
        raise UserError(
            f"The run logged no traces for epoch {epoch}; it has epochs {run.epochs[0]}..{run.epochs[-1]}."
        )
    rows = [r for r in run.records if int(r["epoch"]) == epoch][:n]
    trace = torch.tensor(
        [[float("nan") if x is None else x for x in r["trace"]] for r in rows], dtype=torch.float64, device="cpu"
    )
    num_steps = window_start = None
    if run.recipe is not None:
        ro = run.recipe.rollout
        num_steps = ro.num_steps
        lo, hi = ro.window_range
        window_start = lo if lo == hi - ro.window_size else None  # a fixed window start: paper steps are known
    stored = Credit(
        step_rewards=torch.tensor([r["step_rewards"] for r in rows], dtype=torch.float64, device="cpu"),
        turning_points=torch.tensor([r["turning_points"] for r in rows], dtype=torch.bool, device="cpu"),
    )
    return Trajectories(
        prompt=f"{len(rows)} trajectories of epoch {epoch}",
        trace=trace,
        num_steps=num_steps,
        window_start=window_start,
        prompts=[r["prompt"] for r in rows],
        credits={run.trained_label: stored},
    )


def turning_point_stats(run: RunTraces) -> dict[str, list[float]]:
    """Per epoch: good and bad turning points per trajectory, mean |step reward| at turning and normal steps."""
    stats: dict[str, list[float]] = {k: [] for k in ("epoch", "good", "bad", "turning_abs", "normal_abs")}
    for epoch in run.epochs:
        rows = [r for r in run.records if int(r["epoch"]) == epoch]
        tp = torch.tensor([r["turning_points"] for r in rows], dtype=torch.bool, device="cpu")  # [n, W]
        good = torch.tensor(
            [r.get("good_turning_points", [0] * tp.shape[1]) for r in rows], dtype=torch.bool, device="cpu"
        )
        reward = torch.tensor([r["step_rewards"] for r in rows], dtype=torch.float64, device="cpu").abs()  # [n, W]
        stats["epoch"].append(epoch)
        stats["good"].append(float((tp & good).sum(1).double().mean()))
        stats["bad"].append(float((tp & ~good).sum(1).double().mean()))
        stats["turning_abs"].append(float(reward[tp].mean()) if tp.any() else float("nan"))
        stats["normal_abs"].append(float(reward[~tp].mean()) if (~tp).any() else float("nan"))
    return stats


def to_json(t: Trajectories) -> dict[str, Any]:
    """Every number behind the plots, JSON-ready (NaN as None)."""
    from tpflow.credit.trend import trend

    tr = trend(t.trace)
    out: dict[str, Any] = {
        "prompt": t.prompt,
        "metadata": t.metadata,
        "num_steps": t.num_steps,
        "window_start": t.window_start,
        "window_size": t.width,
        "sigmas": t.sigmas,
        "paper_t_of_j": paper_labels(t),
        "trace": t.trace.tolist(),
        "d": tr.d.tolist(),
        "delta": tr.delta.tolist(),
        "a": tr.a.tolist(),
        "credit": {
            name: {"step_rewards": c.step_rewards.tolist(), "turning_points": c.turning_points.int().tolist()}
            for name, c in t.credits.items()
        },
    }
    if t.prompts is not None:
        out["prompts"] = t.prompts
    return out


def paper_labels(t: Trajectories) -> list[int] | None:
    """The paper's t of the latent after j = 0..W SDE steps (x_t, t = K − s − j), or None when s or K is unknown."""
    if t.num_steps is None or t.window_start is None:
        return None
    return [t.num_steps - t.window_start - j for j in range(t.width + 1)]


def summary_rows(t: Trajectories, credit: str) -> list[dict[str, Any]]:
    """Per trajectory: R_0, R_W, Δ and the turning points of assigner ``credit`` (paper steps when known)."""
    c = t.credits[credit]
    labels = paper_labels(t)
    rows = []
    for b in range(t.trace.shape[0]):
        steps = c.turning_points[b].nonzero().flatten().tolist()
        delta = float(t.trace[b, -1] - t.trace[b, 0])  # NaN where only R_W was logged (no completions)
        kind = "good" if delta > 0 else "bad"
        names = [f"t={labels[i]}" if labels else f"i={i}" for i in steps]
        unknown = math.isnan(delta)
        rows.append(
            {
                "traj": b,
                "R_0": float(t.trace[b, 0]),
                "R_W": float(t.trace[b, -1]),
                "delta": delta,
                "turning_points": "not known" if unknown else f"{', '.join(names)} ({kind})" if steps else "-",
                "step_rewards": c.step_rewards[b].tolist(),
            }
        )
    return rows
