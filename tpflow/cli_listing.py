"""``tpflow components`` and ``tpflow credit``: the two commands that only print tables of what is registered.

Kept apart from ``tpflow.cli`` (which trains, validates, serves and exports) because they share its app, not its
work: ``register`` adds them to the app.
"""

from __future__ import annotations

import inspect
import math
import os
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Group
from rich.markup import escape
from rich.padding import Padding
from rich.table import Table
from rich.text import Text

from tpflow import registry
from tpflow.cli_common import make_console, user_errors
from tpflow.cli_stages import KIND as STAGE
from tpflow.cli_stages import stage_entries, stage_entry
from tpflow.describe import describe_options
from tpflow.errors import UserError


def register(app: typer.Typer) -> None:
    """Add ``components`` and ``credit`` to the ``tpflow`` app."""
    app.command()(components)
    app.command(context_settings={"ignore_unknown_options": True})(credit)  # a trace may start with a minus: -1,2


def _indented(text: str) -> Group:
    """Lines indented by leading spaces keep the indent when they wrap (a description under its option)."""
    lines = []
    for line in text.splitlines():
        indent = len(line) - len(line.lstrip(" "))
        lines.append(Padding(Text(line.lstrip(" ")), (0, 0, 0, indent)))
    return Group(*lines)


def _where(entry: registry.Entry) -> str:
    if entry.source != "tpflow":
        return entry.source
    origin = entry.origin
    package_root = str(Path(__file__).resolve().parent.parent) + os.sep
    return "built-in " + origin.removeprefix(package_root)


def _summary(factory: object) -> str:
    """The first paragraph of a component's docstring, on one line, up to its "Implements"/"Options" sentence: what
    the component does, for the listing."""
    doc = inspect.getdoc(factory) or ""
    text = " ".join(doc.split("\n\n")[0].split())
    for marker in (" Implements ", " Options:"):
        text = text.split(marker)[0]
    return text.replace(" (module docstring)", "").replace("``", "`").strip()


WIDE = 120  # columns from which the listing is a table; narrower terminals get the list layout


@user_errors
def components(
    kind: Annotated[
        str | None, typer.Argument(help=f"One of: {', '.join(registry.KINDS)}, stage. All when omitted.")
    ] = None,
    name: Annotated[
        str | None, typer.Argument(help="One component of KIND: its whole description.", show_default=False)
    ] = None,
) -> None:
    """List the registered components (built-ins and plugins) with their options, and the stages a settings section
    selects (the prompt policy, replay): a table on a wide terminal, a list on a narrow one (under 120 columns).

    Example: tpflow components credit consistent
    """
    kinds = registry.KINDS if kind is None else (kind,) if kind != STAGE else ()
    entries = [(k, e) for k in kinds for e in registry.entries(k)]
    if kind in (None, STAGE):  # the settings-selected stages (tpflow.cli_stages): prompt policy, replay
        entries += [(STAGE, e) for e in stage_entries()]
    if name is not None:  # an unknown name: the registry's message, with close matches
        entries = [(kind, stage_entry(name) if kind == STAGE else registry.get(kind, name))]
    console = make_console()
    if name is None and console.width >= WIDE:
        console.print(_table(entries))
    else:
        for k, entry in entries:
            for line in _block(k, entry, full=name is not None, width=console.width):
                console.print(line, soft_wrap=True)
        if name is None:
            console.print(Text("One component, its whole description: tpflow components KIND NAME", style="dim"))
    for line in [f"{k}: {e}" for k in kinds for e in registry.plugin_errors(k)]:
        console.print(f"[yellow]plugin failed to load[/] {escape(line)}", soft_wrap=True, highlight=False)


def _table(entries: list[tuple[str, registry.Entry]]) -> Table:
    """The listing as one table: kind, name, what it does and its options, where it comes from."""
    table = Table(title="tpflow components", show_lines=True)
    table.add_column("kind", no_wrap=True)
    table.add_column("name", no_wrap=True, style="bold cyan")
    table.add_column("what it does · options", overflow="fold", ratio=3)
    table.add_column("from", overflow="fold", ratio=1)
    for k, entry in entries:
        summary = Text(_summary(entry.factory), style="italic")  # what it does, above its options
        table.add_row(k, entry.name, Group(summary, _indented(describe_options(entry.options))), _where(entry))
    return table


def _block(kind: str, entry: registry.Entry, full: bool, width: int) -> list[Text]:
    """One component in the list layout, as lines of at most ``width`` columns (no padding after them): ``kind
    name`` and where it comes from, what it does, and its options (one per line, descriptions indented under them);
    ``full``: the whole docstring, not its summary."""
    head = Text()
    head.append(f"{kind} ", style="bold")
    head.append(entry.name, style="bold cyan")
    head.append(f"  ({_where(entry)})", style="dim")
    paragraphs = (inspect.getdoc(entry.factory) or "").split("\n\n") if full else [_summary(entry.factory)]
    lines = [head]
    for k, paragraph in enumerate(paragraphs):
        lines += [Text("")] if k else []
        for item in _items(paragraph):  # a bulleted list keeps one bullet per line
            first, rest = ("  ", "    ") if item.startswith(("* ", "- ")) else ("  ", "  ")
            wrapped = _wrap(item.replace("``", "`"), width, rest)
            lines += [Text(first + wrapped[0][len(rest) :] if wrapped else first, style="italic")]
            lines += [Text(line, style="italic") for line in wrapped[1:]]
    described = describe_options(entry.options)
    if described == "-":
        lines.append(Text("  options: none"))
    else:
        lines.append(Text("  options:"))
        for line in described.splitlines():
            indent = "    " + " " * (len(line) - len(line.lstrip(" ")))
            lines += [Text(row) for row in _wrap(line.strip(), width, indent)]
    return [*lines, Text("")]


def _items(paragraph: str) -> list[str]:
    """A docstring paragraph as its items, each on one line: the whole paragraph, or each ``* `` / ``- `` bullet."""
    items: list[str] = []
    for line in paragraph.splitlines():
        word = line.strip()
        if word.startswith(("* ", "- ")) or not items:
            items.append(word)
        else:
            items[-1] += " " + word
    return items


def _wrap(text: str, width: int, indent: str) -> list[str]:
    """``text`` wrapped at ``width`` columns, every line indented by ``indent`` (words longer than a line stay
    whole)."""
    import textwrap

    return textwrap.wrap(text, max(20, width), initial_indent=indent, subsequent_indent=indent,
                         break_long_words=False, break_on_hyphens=False) or [indent]  # fmt: skip


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

    Example (docs/algorithm.md §9, Example 3): tpflow credit 40,37,45,48,49,50 60,62,61,63,64,64 70,72,74,71,68,66
    """
    import torch

    rows = [_trace(text) for text in traces]
    if len({len(r) for r in rows}) != 1 or len(rows[0]) < 2:
        raise UserError("Every trace needs the same number of rewards R_0..R_W, at least two.")
    trace = torch.tensor(rows, dtype=torch.float64, device="cpu")  # [N, W+1]
    names = assigner or registry.names("credit")
    results = {}
    for name in names:
        entry = registry.get("credit", name)
        opts = {"balanced": balanced} if "balanced" in entry.options.model_fields else {}
        results[name] = registry.build("credit", name, **opts)(trace)
    # One row per trajectory and assigner, the numbers wrapping at spaces: K = 10 rewards per trace fit 80 columns.
    table = Table(title="per-step rewards (* = turning point: reward replaced by R_W - R_i)", show_lines=False)
    table.add_column("traj", no_wrap=True, justify="right")
    table.add_column("", no_wrap=True, style="bold cyan")
    table.add_column("R_0..R_W / per-step rewards", overflow="fold")
    for b in range(trace.shape[0]):
        table.add_row(str(b), "R_0..R_W", " ".join(_num(x) for x in rows[b]))
        for i, name in enumerate(names):
            out = results[name]
            steps = (
                f"{_num(r)}{'*' if tp else ''}"
                for r, tp in zip(out.step_rewards[b].tolist(), out.turning_points[b].tolist(), strict=True)
            )
            table.add_row("", name, " ".join(steps), end_section=i == len(names) - 1)
    make_console().print(table)


def _trace(text: str) -> list[float]:
    """One trace argument, e.g. ``50,46,40,47,52,55``: finite numbers (negative ones too), or a UserError."""
    if text.startswith("--"):
        raise UserError(f"{text!r} is not an option of tpflow credit (see tpflow credit --help).")
    try:
        values = [float(x) for x in text.split(",")]
    except ValueError:
        raise UserError(f"Trace {text!r} is not a comma-separated list of numbers, e.g. 50,46,40,47,52,55.") from None
    bad = [x for x in values if not math.isfinite(x)]
    if bad:
        raise UserError(f"Trace {text!r} holds {_num(bad[0])}: rewards must be finite numbers.")
    return values


def _num(x: float) -> str:
    return f"{x:g}"
