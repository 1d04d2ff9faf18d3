"""The figures of ``tpflow inspect-trajectory`` (matplotlib, drawn off-screen with the Agg canvas).

Every function takes the numbers from ``tpflow.inspect.traces`` and writes one PNG. Steps are labelled as in the
paper when the window start is known: the point after j SDE window steps is the latent x_t, t = K − s − j (x_T is
noise, x_0 the image), and window step i is the paper's step t = K − s − i (x_t → x_{t−1}). A turning point at
window step i is drawn on the segment R_i → R_{i+1} and marked at R_{i+1}, the reward that step reached.
"""

from __future__ import annotations

import math
import textwrap
from pathlib import Path
from typing import Any

from tpflow.inspect.traces import Trajectories, paper_labels
from tpflow.video import frame_strip, strip_frames

DPI = 120
STYLE = {"font.size": 9, "axes.titlesize": 10, "axes.labelsize": 9, "legend.fontsize": 8, "figure.dpi": DPI}
GOOD, BAD = "#1a9641", "#d7191c"  # turning points of trajectories with Δ > 0 (good) and Δ < 0 (bad)
MARKS = {True: ("^", GOOD), False: ("v", BAD)}


def _figure(width: float, height: float) -> Any:
    from matplotlib.figure import Figure

    return Figure(figsize=(width, height), dpi=DPI, layout="constrained")


def _colors(n: int) -> list[Any]:
    """Trajectory colours, avoiding the green and red of the turning-point markers."""
    import matplotlib

    if n <= 8:
        tab10 = matplotlib.colormaps["tab10"]
        return [tab10(k) for k in (0, 1, 4, 5, 6, 9, 7, 8)[:n]]
    cmap = matplotlib.colormaps["viridis"]
    return [cmap(b / (n - 1)) for b in range(n)]


def _save(fig: Any, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=DPI)
    return path


def _title(t: Trajectories, extra: str) -> str:
    return "\n".join([*textwrap.wrap(repr(t.prompt) if t.prompts is None else t.prompt, 90), extra])


def _turning_handles() -> list[Any]:
    from matplotlib.lines import Line2D

    return [
        Line2D([], [], ls="", marker="^", ms=9, mfc=GOOD, mec="k", label="good turning point (Δ > 0)"),
        Line2D([], [], ls="", marker="v", ms=9, mfc=BAD, mec="k", label="bad turning point (Δ < 0)"),
    ]


def plot_trajectories(t: Trajectories, credit: str, path: Path) -> Path:
    """Reward of the ODE completion vs. step per trajectory (the paper's Figure 1), turning points of ``credit``."""
    import matplotlib
    from matplotlib.lines import Line2D

    width, n = t.width, t.trace.shape[0]
    labels, colors = paper_labels(t), _colors(n)
    js = list(range(width + 1))
    turning = t.credits[credit].turning_points if credit in t.credits else None
    with matplotlib.rc_context(STYLE):
        fig = _figure(10, 5.6)
        ax = fig.add_subplot()
        for b in range(n):
            r = t.trace[b].tolist()
            delta = r[-1] - r[0]
            ax.plot(js, r, "-o", color=colors[b], ms=4, lw=1.5, label=f"traj {b}: Δ = {delta:+.3g}")
            ax.plot([width], [r[-1]], "s", color=colors[b], ms=8, mec="k")
            for i in [] if turning is None else turning[b].nonzero().flatten().tolist():
                ax.plot([i, i + 1], r[i : i + 2], color=colors[b], lw=6, alpha=0.35, solid_capstyle="round")
                marker, face = MARKS[delta > 0]
                ax.plot([i + 1], [r[i + 1]], marker, ms=11, mfc=face, mec="k", zorder=5)
        ax.set_xticks(js)
        if labels:
            names = [f"$x_{{{tt}}}$" for tt in labels]
            ax.set_xlabel(
                f"latent the ODE completion starts from (paper: x_T noise → x_0 image; T = K = {t.num_steps})"
            )
        else:
            names = [f"j={j}" for j in js]
            ax.set_xlabel("SDE window steps taken j (the window start varies, so paper steps are not shown)")
        names[0] += "\nR_0 (ODE)"
        names[-1] += "\nR_W (final)"
        ax.set_xticklabels(names)
        if labels:
            top = ax.secondary_xaxis("top")
            top.set_xticks(js)
            top.set_xlabel("SDE window steps taken, j")
        ax.set_ylabel("reward R_j of the ODE-completed image")
        ax.grid(alpha=0.3)
        extra = [
            Line2D([], [], ls="", marker="s", ms=8, mfc="w", mec="k", label="final image reward R_W"),
            *_turning_handles(),
        ]
        handles, _ = ax.get_legend_handles_labels()
        fig.legend(handles=[*handles, *extra], loc="outside right upper")
        fig.suptitle(_title(t, f"reward along denoising; turning points: {credit}"))
        return _save(fig, path)


def plot_final_rewards(t: Trajectories, credit: str, path: Path) -> Path:
    """The final reward R_W of each trajectory, for a run that logged nothing else (credit without completions)."""
    import matplotlib

    n = t.trace.shape[0]
    final = t.trace[:, -1].tolist()
    with matplotlib.rc_context(STYLE):
        fig = _figure(max(5.0, 0.5 * n + 2.5), 4.2)
        ax = fig.add_subplot()
        ax.bar(range(n), final, color=_colors(n), edgecolor="k")
        ax.set_xticks(range(n))
        ax.set_xticklabels([f"traj {b}" for b in range(n)], rotation=45 if n > 8 else 0)
        ax.set_ylabel("final image reward R_W")
        ax.grid(alpha=0.3, axis="y")
        fig.suptitle(_title(t, f"final rewards only: credit {credit} logs no ODE completions"))
        return _save(fig, path)


def _frame_dividers(ax: Any, image: Any) -> None:
    """A clip's strip [3, H, k·W] sets its frames apart with a grey line between them, as the eval grids do
    (``tpflow.grids``): without one, a circle moving across 4 frames reads as 4 circles."""
    if image.ndim == 4:  # [F, 3, H, W]
        shown, width = len(strip_frames(image.shape[0])), image.shape[-1]
        for k in range(1, shown):
            ax.axvline(k * width - 0.5, color="0.5", linewidth=1.5)


def plot_completions(t: Trajectories, credit: str, path: Path) -> Path:
    """Per trajectory the strip of images after j = 0..W SDE steps, reward under each, turning steps framed."""
    import matplotlib

    assert t.images is not None, "completion images are only available for freshly sampled trajectories"
    n, width = t.trace.shape[0], t.width
    labels = paper_labels(t)
    turning = t.credits[credit].turning_points if credit in t.credits else None
    cell = min(1.15, 28 / (width + 2), 28 / (n + 1.5))
    with matplotlib.rc_context(STYLE):
        fig = _figure(cell * (width + 1) + 1.0, (cell + 0.25) * n + 1.0)
        axes = fig.subplots(n, width + 1, squeeze=False)
        for b in range(n):
            delta = float(t.trace[b, -1] - t.trace[b, 0])
            framed = set() if turning is None else {i + 1 for i in turning[b].nonzero().flatten().tolist()}
            for j in range(width + 1):
                ax = axes[b][j]
                shown = frame_strip(t.images[b, j][None])[0]  # a clip [F, 3, H, W]: a strip of its frames
                ax.imshow(shown.permute(1, 2, 0).clamp(0, 1).numpy(), interpolation="nearest")
                _frame_dividers(ax, t.images[b, j])
                ax.set_xticks([])
                ax.set_yticks([])
                ax.set_xlabel(f"{float(t.trace[b, j]):.3f}", labelpad=1)
                color, lw = (MARKS[delta > 0][1], 3.5) if j in framed else ("0.7", 0.8)
                for spine in ax.spines.values():
                    spine.set_edgecolor(color)
                    spine.set_linewidth(lw)
                if b == 0:
                    top = f"$x_{{{labels[j]}}}$\n" if labels else ""
                    ax.set_title(f"{top}j={j}" + (" (final)" if j == width else ""))
            axes[b][0].set_ylabel(f"traj {b}\nΔ={delta:+.3g}")
        note = f"reward under each image; framed: the image right after a turning step of {credit} "
        fig.suptitle(_title(t, note + "(green: good, Δ > 0; red: bad, Δ < 0)"))
        return _save(fig, path)


def completion_clips(t: Trajectories, path: Path) -> Path:
    """A video backbone's completions as an animated WebP: one row per trajectory, one column per j = 0..W (as
    completions.png lays out their frame strips), each tile playing its clip, its reward under it."""
    from tpflow.grids import Tile, clip_grid
    from tpflow.images import to_uint8

    n, width = t.trace.shape[0], t.width
    tiles = [
        Tile(
            t.images[b, j, 0], f"traj {b}, j={j}", note=f"{float(t.trace[b, j]):.3f}", frames=to_uint8(t.images[b, j])
        )
        for b in range(n)
        for j in range(width + 1)
    ]
    return clip_grid(tiles, width + 1, path)


def plot_credit(t: Trajectories, path: Path) -> Path:
    """One panel per assigner: the step reward r_i of every trajectory, turning points marked."""
    import matplotlib

    n, width = t.trace.shape[0], t.width
    labels, colors = paper_labels(t), _colors(n)
    names = list(t.credits)
    cols = 1 if len(names) == 1 else 2
    rows = math.ceil(len(names) / cols)
    steps = list(range(width))
    ticks = [f"{labels[i]}" for i in steps] if labels else [str(i) for i in steps]
    delta = (t.trace[:, -1] - t.trace[:, 0]).tolist()
    with matplotlib.rc_context(STYLE):
        fig = _figure(6.0 * cols + 1.8, 3.4 * rows + 1.0)
        axes = fig.subplots(rows, cols, squeeze=False).flatten()
        for ax, name in zip(axes, names, strict=False):
            c = t.credits[name]
            for b in range(n):
                ax.plot(steps, c.step_rewards[b].tolist(), "-o", ms=3, lw=1.2, color=colors[b], label=f"traj {b}")
                for i in c.turning_points[b].nonzero().flatten().tolist():
                    marker, face = MARKS[delta[b] > 0]
                    ax.plot([i], [float(c.step_rewards[b, i])], marker, ms=10, mfc=face, mec="k", zorder=5)
            ax.axhline(0, color="0.4", lw=0.8)
            ax.set_xticks(steps)
            ax.set_xticklabels(ticks)
            ax.set_xlabel(r"paper step t ($x_t \to x_{t-1}$)" if labels else "window step i")
            ax.set_ylabel("step reward r")
            ax.set_title(f"credit: {name}")
            ax.grid(alpha=0.3)
        for ax in axes[len(names) :]:
            ax.set_visible(False)
        handles, _ = axes[0].get_legend_handles_labels()
        fig.legend(handles=[*handles, *_turning_handles()], loc="outside right upper")
        fig.suptitle(_title(t, "per-step credit of each assigner (same trajectories)"))
        return _save(fig, path)


def plot_turning_points(stats: dict[str, list[float]], credit: str, path: Path) -> Path:
    """Turning points per trajectory over training (paper Figure 11) and step rewards at them (Figure 10)."""
    import matplotlib
    from matplotlib.ticker import MaxNLocator

    epochs = stats["epoch"]
    with matplotlib.rc_context(STYLE):
        fig = _figure(11, 4.4)
        left, right = fig.subplots(1, 2)
        # Balancing keeps as many good as bad ones: the bad line is dashed and wider so that both stay visible.
        left.plot(epochs, stats["bad"], "--v", color=BAD, lw=3, ms=9, alpha=0.7, label="bad (Δ < 0)")
        left.plot(epochs, stats["good"], "-^", color=GOOD, label="good (Δ > 0)")
        left.set_ylabel("turning points per trajectory")
        left.set_title("turning points over training (cf. paper Fig. 11)")
        right.plot(epochs, stats["turning_abs"], "-o", color="#7b3294", label="at turning points")
        right.plot(epochs, stats["normal_abs"], "-s", color="0.45", label="at normal steps")
        right.set_ylabel("mean |step reward|")
        right.set_title("step reward at turning vs. normal points (cf. Fig. 10)")
        for ax in (left, right):
            ax.set_xlabel("epoch")
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
            ax.grid(alpha=0.3)
            ax.legend()
        fig.suptitle(f"training run, credit: {credit}")
        return _save(fig, path)
