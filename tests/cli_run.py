"""Running the ``tpflow`` command line from a test.

``tpflow`` runs a command in this process: a new interpreter spends about 5 s importing torch on the 2-core CI
machine, which the suite's 10-minute budget cannot pay for every command. ``tpflow_process`` runs the console-script
entry point in a new interpreter, for what only a real process shows (the entry point itself, killed runs, and one
launched run of real launcher processes in test_distributed_train.py). ``tpflow_launching`` runs a command that
launches processes (``--num-processes 2``) with its launcher, torchrun's agent, in this process: the processes it
starts are real, the launcher's own interpreter (about 4 s) is saved."""

from __future__ import annotations

import contextlib
import io
import os
import signal
import subprocess
import sys
import traceback
from pathlib import Path


def tpflow_process(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    """``python -m tpflow.cli ARGS`` in a new process."""
    env = {**os.environ, "COLUMNS": "200"}
    return subprocess.run(
        [sys.executable, "-m", "tpflow.cli", *args], capture_output=True, text=True, env=env, cwd=cwd, timeout=120
    )


def tpflow(*args: str, cwd: Path | None = None, columns: str | None = "200") -> subprocess.CompletedProcess[str]:
    """``tpflow ARGS`` in this process, with what a process would give: its exit status, stdout and stderr. An
    exception that escapes the command is printed to stderr with status 1, as the interpreter does, so a test that
    asserts "no traceback" still sees one. ``columns``: the terminal width the command sees (None: as set)."""
    from tpflow import cli

    out, err = io.StringIO(), io.StringIO()
    previous = os.environ.get("COLUMNS"), os.getcwd()
    if columns is not None:
        os.environ["COLUMNS"] = columns
    try:
        if cwd is not None:
            os.chdir(cwd)
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = exit_status(cli.main, args, Exception)
    finally:
        os.chdir(previous[1])
        if previous[0] is None:
            os.environ.pop("COLUMNS", None)
        else:
            os.environ["COLUMNS"] = previous[0]
    return subprocess.CompletedProcess(["tpflow", *args], code, out.getvalue(), err.getvalue())


def exit_status(main, args: tuple[str, ...], caught: type[BaseException]) -> int:
    """``main(args)``'s exit status as the interpreter gives it: 0, a ``SystemExit``'s code (a message it carries
    printed to stderr, with 1), or 1 with the traceback on stderr for an exception of ``caught`` that escapes."""
    try:
        main(list(args))
        return 0
    except SystemExit as exc:
        if isinstance(exc.code, str):
            print(exc.code, file=sys.stderr)
        return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except caught:
        traceback.print_exc()
        return 1


# torchrun's agent takes these signals over in the process it runs in, and names them in the environment
# (torch.distributed.elastic's PContext.start, launcher/api.py), without putting anything back.
LAUNCHER_SIGNALS = ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT")


def tpflow_launching(capfd, monkeypatch, *args: str) -> subprocess.CompletedProcess[str]:
    """``tpflow ARGS`` in this process, for a command that launches processes: what they print goes to this
    process's file descriptors, read back through ``capfd`` after the launcher's own output; they run with
    OMP_NUM_THREADS=1 (two processes on two cores). The signal handlers and the variable that torchrun's agent sets
    are restored (the variable when ``monkeypatch`` is undone)."""
    handlers = {name: signal.getsignal(getattr(signal, name)) for name in LAUNCHER_SIGNALS}
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setenv("TORCHELASTIC_SIGNALS_TO_HANDLE", ",".join(LAUNCHER_SIGNALS))
    capfd.readouterr()  # what came before
    try:
        out = tpflow(*args)
    finally:
        for name, handler in handlers.items():
            signal.signal(getattr(signal, name), handler)
    launched = capfd.readouterr()
    return subprocess.CompletedProcess(out.args, out.returncode, out.stdout + launched.out, out.stderr + launched.err)


class TpflowForked:
    """``tpflow ARGS`` in a process forked from this one: a real process (its own exit status, killable with
    SIGKILL, its threads gone with it) without a new interpreter's imports (torch, tpflow: about 5 s of the 2-core
    machine). The child starts as a fresh ``python -m tpflow.cli`` would in what matters here: default SIGINT and
    SIGTERM handlers, no accelerate state, stdout and stderr to files; and it ends as the interpreter does, waiting
    for every non-daemon thread before it exits (``threading._shutdown``), so a command that would hang at exit on a
    thread still hangs. What only a new interpreter shows (warnings printed at import, the entry point itself) needs
    ``tpflow_process``."""

    def __init__(self, *args: str, folder: Path, env: dict[str, str] | None = None, session: bool = False) -> None:
        """``session``: the process leads a session of its own (``start_new_session``), which :meth:`kill_group`
        ends with every process it started."""
        folder.mkdir(parents=True, exist_ok=True)
        self.stdout_path, self.stderr_path = folder / "stdout.txt", folder / "stderr.txt"
        for path in (self.stdout_path, self.stderr_path):
            path.write_text("")  # readable from the start
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:  # the child never returns to the test
            code = 1
            try:
                if session:
                    os.setsid()
                code = _forked_command(args, self.stdout_path, self.stderr_path, env or {})
            finally:
                os._exit(code)
        self.pid, self.returncode = pid, None

    def poll(self) -> int | None:
        """The exit status (negative: the signal that ended it) once the process has ended, else None."""
        if self.returncode is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: float) -> int:
        """Wait up to ``timeout`` seconds for the exit status; kill the process and fail the test after that."""
        import time

        deadline = time.monotonic() + timeout
        while self.poll() is None:
            if time.monotonic() > deadline:
                os.kill(self.pid, signal.SIGKILL)
                os.waitpid(self.pid, 0)
                raise AssertionError(f"tpflow did not exit within {timeout} s")
            time.sleep(0.02)
        return self.returncode

    def kill_group(self) -> None:
        """SIGKILL to the process's session (``session=True``) if it is still running: it and what it started."""
        if self.poll() is None:
            try:
                os.killpg(self.pid, signal.SIGKILL)
            except ProcessLookupError:  # before its setsid
                os.kill(self.pid, signal.SIGKILL)
            self.wait(10)

    def output(self) -> tuple[str, str]:
        """What it printed: (stdout, stderr)."""
        return self.stdout_path.read_text(), self.stderr_path.read_text()


def _forked_command(args: tuple[str, ...], stdout: Path, stderr: Path, env: dict[str, str]) -> int:
    import threading

    import torch
    from accelerate.state import AcceleratorState, GradientState

    torch.set_num_threads(1)  # the parent's OpenMP threads are not in this process: a team of one never waits for them
    for fd, path in ((1, stdout), (2, stderr)):
        os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644), fd)
    sys.stdout = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115 (the process's own streams)
    sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115
    os.environ.update({"COLUMNS": "200", **env})
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    from tpflow import cli

    code = exit_status(cli.main, args, BaseException)
    sys.stdout.flush()
    sys.stderr.flush()
    threading._shutdown()  # as the interpreter's exit: every non-daemon thread is waited for
    return code
