"""``tpflow train --num-processes N``: start N training processes on this machine (and join other machines).

This is ``torchrun`` called in-process (``torch.distributed.run``'s own argument parser and elastic launcher), so the
processes get the usual ``RANK``/``WORLD_SIZE``/``LOCAL_RANK``/``MASTER_ADDR`` environment, which
``accelerate.Accelerator`` reads: NCCL on GPUs (process ``LOCAL_RANK`` on GPU ``LOCAL_RANK``), gloo on CPUs. Users of
``accelerate launch`` get the same thing from their accelerate config (docs/distributed.md).

A process that fails with a clear error (exit status 2) makes the launcher stop the others and exit with that same
status, instead of torchrun's traceback summary. On Ctrl-C or SIGTERM (``kill``, Slurm, Kubernetes) the launcher
passes the same signal on (torchrun's agent) and waits up to ``STOP_WAIT_S`` for the processes, which stop together
at a safe point and save (``tpflow.train.stop``), before it kills them; it then exits with 128 + the signal's number
(130 for SIGINT, 143 for SIGTERM).
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import uuid
from collections.abc import Sequence
from typing import Any

STOP_WAIT_S = 600
"""How long the launcher waits for its processes after Ctrl-C or SIGTERM before it kills them (torchrun's own
default, 30 s, is shorter than an update of a large model, which the processes finish before they save). The
environment variable ``TORCH_ELASTIC_SHUTDOWN_TIMEOUT`` overrides it."""

LAUNCHER_OPTIONS = frozenset({"num_processes", "num_machines", "machine_rank", "main_process_ip", "main_process_port"})
"""Options of ``tpflow train`` that the launcher consumes; every other argument and option goes to each process."""


def child_command(ctx: Any) -> list[str]:
    """The ``tpflow`` command line each launched process runs: the (typer) click context's command with its
    arguments and options as parsed, minus ``LAUNCHER_OPTIONS``. Built from the command's own parameter list, so an
    option added to ``train`` reaches the processes without being listed anywhere else."""
    args = [ctx.info_name]
    for param in ctx.command.params:
        value = ctx.params.get(param.name)
        if param.name in LAUNCHER_OPTIONS or value is None or value == () or value == []:
            continue
        if param.param_type_name == "argument":
            args.append(str(value))
        elif getattr(param, "is_flag", False):
            if value != param.default:
                args.append(param.opts[0] if value else param.secondary_opts[0])
        elif param.multiple:
            args += [a for v in value for a in (param.opts[0], str(v))]
        elif value != param.default:
            args += [param.opts[0], str(value)]
    return args


def torchrun_args(
    module_args: Sequence[str],
    num_processes: int,
    num_machines: int = 1,
    machine_rank: int = 0,
    main_process_ip: str | None = None,
    main_process_port: int = 29500,
) -> list[str]:
    """The torchrun command line that runs ``python -m tpflow.cli *module_args`` in every process."""
    if num_machines == 1:
        # torchrun's --standalone: a rendezvous on a free local port, so runs on one machine never clash
        where = ["--rdzv-backend=c10d", "--rdzv-endpoint=localhost:0", f"--rdzv-id={uuid.uuid4()}"]
    else:
        where = [
            f"--nnodes={num_machines}",
            f"--node-rank={machine_rank}",
            f"--master-addr={main_process_ip}",
            f"--master-port={main_process_port}",
        ]
    wait = os.environ.get("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", str(STOP_WAIT_S))
    return [*where, f"--nproc-per-node={num_processes}", f"--shutdown-timeout={wait}", "-m", "tpflow.cli",
            *module_args]  # fmt: skip


def launch(args: list[str]) -> int:
    """Run torchrun with ``args`` (from :func:`torchrun_args`); returns the exit status to leave with."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import elastic_launch
    from torch.distributed.run import config_from_args, parse_args

    # The agent's own log lines (INFO/WARNING chatter, "Received 2 death signal, shutting down workers", and an ERROR
    # per failed process that repeats what the process printed): tpflow prints one summary line instead. Each of its
    # modules' loggers has a level of its own (torch.distributed.elastic.utils.logging), so each is set.
    for name in ["torch.distributed.elastic", *logging.root.manager.loggerDict]:
        if name.startswith("torch.distributed.elastic"):
            logging.getLogger(name).setLevel(logging.CRITICAL)
    config, command, command_args = config_from_args(parse_args(args))
    try:
        elastic_launch(config, command)(*command_args)
    except KeyboardInterrupt:  # Ctrl-C before torchrun's agent took SIGINT over
        return _interrupted(signal.SIGINT)
    except SignalException as exc:  # Ctrl-C or a kill: passed on to the processes, which saved and stopped
        return _interrupted(exc.sigval)
    except ChildFailedError as exc:
        codes = [failure.exitcode for failure in exc.failures.values()]
        if all(c in STOPPED for c in codes):  # a process got the signal, not the launcher: they stopped and saved
            return _interrupted(max(codes) - 128)
        code = next((c for c in codes if c > 0), 1)  # negative: killed by a signal
        print(f"tpflow: one of the processes exited with status {codes[0]}; the others were stopped.", file=sys.stderr)
        return code
    return 0


STOPPED = (128 + signal.SIGINT, 128 + signal.SIGTERM)  # the statuses of processes that stopped on a signal


def _interrupted(signum: int) -> int:
    """The launcher's last line after a stop on ``signum``, and the status to exit with: 128 + its number."""
    name = signal.Signals(signum).name
    print(f"tpflow: interrupted ({name}); resume with the same command and --resume.", file=sys.stderr)
    return 128 + int(signum)
