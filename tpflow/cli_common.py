"""What every ``tpflow`` command shares: the one-paragraph error wrapper, the console, and the option types of
``--set`` and of the launcher (``train`` and ``eval`` start several processes the same way)."""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Annotated, Any, TypeVar

import typer
from rich.console import Console
from rich.markup import escape

from tpflow.errors import UserError

if TYPE_CHECKING:
    from tpflow.preflight import MachineReport

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


def launch_if_asked(
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
    from tpflow.distributed import launched
    from tpflow.launch import child_command, launch, torchrun_args

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
        make_console(stderr=True).print(
            f"[yellow]warning:[/] already started by a launcher with WORLD_SIZE={os.environ.get('WORLD_SIZE')}: "
            f"--num-processes/--num-machines ({world} processes) are ignored."
        )


def make_console(stderr: bool = False) -> Console:
    # Wide enough for the tables when output is not a terminal (pipes, CI logs, tests).
    console = Console(stderr=stderr)
    if not console.is_terminal and not os.environ.get("COLUMNS"):
        console = Console(stderr=stderr, width=160)
    return console


def warn(text: str) -> None:
    """One warning on stderr, as every command prints them: ``warning: TEXT``, unwrapped (the terminal wraps it)."""
    make_console(stderr=True).print(f"[yellow]warning:[/] {escape(text)}", soft_wrap=True, highlight=False)


def user_errors(func: F) -> F:
    """Turn UserError into one clear paragraph on stderr and exit status 2."""

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return func(*args, **kwargs)
        except UserError as exc:
            message = escape(str(exc))  # recipe sections look like rich markup: [credit]
            make_console(stderr=True).print(f"[bold red]error:[/] {message}", soft_wrap=True, highlight=False)
            raise typer.Exit(2) from None

    return wrapper  # type: ignore[return-value]


def warn_broken_plugins() -> None:
    """One warning line per installed plugin that failed to import (it stays unregistered; the rest works)."""
    from tpflow import registry

    for kind in registry.KINDS:
        for line in registry.plugin_errors(kind):
            make_console(stderr=True).print(
                f"[yellow]warning: plugin failed to load[/] {escape(line)}", soft_wrap=True, highlight=False
            )


def print_report(*reports: MachineReport) -> None:
    """What ``tpflow.preflight.check_machine`` found, as a command starts: the device and where each weight will be
    read from on stdout, with the command's results; the warnings on stderr, as every warning. A line two reports
    share (a target and its baseline) is printed once; only the first process of a launched command prints."""
    if os.environ.get("RANK", "0") != "0":
        return
    out, err = make_console(), make_console(stderr=True)
    for line in dict.fromkeys(line for report in reports for line in report.lines()):
        if line.startswith("warning:"):
            err.print(f"[yellow]warning:[/]{escape(line.removeprefix('warning:'))}", soft_wrap=True, highlight=False)
        else:
            out.print(f"[dim]{escape(line)}[/]", soft_wrap=True, highlight=False)


NARROW_HELP = 100  # terminal columns below which --help is click's plain layout (rich's cut words with "…")


def help_layout(columns: int) -> None:
    """Rich's help table gives the descriptions the columns its option, flag and type columns leave; at 80 columns
    that is about 22, and a longer word (``eval.images_per_prompt``) is cut with "…". Below ``NARROW_HELP`` columns
    a command's help uses click's plain layout, which wraps every word whole (the command list of ``tpflow --help``
    has no such columns and stays rich); set per call, as tests run many in one process."""
    import typer.core

    cls = typer.core.TyperCommand
    rich = _RICH_HELP.setdefault("command", cls.format_help)
    cls.format_help = rich if columns >= NARROW_HELP else cls.__bases__[0].format_help  # type: ignore[method-assign]


_RICH_HELP: dict[str, Any] = {}
