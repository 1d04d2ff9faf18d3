"""`make demo` trains into a directory of its own (DEMO_DIR, runs/make-demo) and deletes it on the next run only when
the demo made it (its marker file inside): a run directory it did not make is refused with one line and exit 2, and
nothing in it is touched. The Makefile's own recipe runs here, with a stand-in for `tpflow` (VENV points at a fake
venv), so no training happens."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MARKER = ".made-by-make-demo"

pytestmark = pytest.mark.skipif(shutil.which("make") is None, reason="needs make")


def make(*args: str) -> subprocess.CompletedProcess:
    # A Makefile without DEMO_DIR would ignore it and delete the clone's own demo run: fail before calling it.
    assert "DEMO_DIR ?=" in (ROOT / "Makefile").read_text(), "the Makefile has no DEMO_DIR"
    env = {k: v for k, v in os.environ.items() if not k.startswith("MAKE")}  # not a sub-make of a calling make
    return subprocess.run(
        ["make", "--no-print-directory", "-C", str(ROOT), *args], capture_output=True, text=True, env=env, timeout=60
    )


def tree(path: Path) -> dict[str, bytes]:
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


def a_users_run(path: Path) -> Path:
    (path / "checkpoints" / "step_00000014").mkdir(parents=True)
    (path / "checkpoints" / "step_00000014" / "adapter.safetensors").write_bytes(b"weights")
    (path / "metrics.jsonl").write_text('{"epoch": 0}\n')
    return path


def test_demo_clean_refuses_a_directory_the_demo_did_not_make_and_deletes_nothing(tmp_path):
    run = a_users_run(tmp_path / "demo")
    before = tree(run)
    result = make("demo-clean", f"DEMO_DIR={run}")
    assert result.returncode == 2
    ours = [line for line in result.stderr.splitlines() if line.startswith("make demo:")]
    assert len(ours) == 1 and "not made by make demo" in ours[0] and MARKER in ours[0], result.stderr
    assert tree(run) == before


@pytest.mark.parametrize("name", ["", "."])
def test_demo_clean_refuses_an_empty_name_or_the_current_directory(name):
    assert make("demo-clean", f"DEMO_DIR={name}").returncode == 2  # make runs in the clone's root: "." is the clone
    assert (ROOT / "Makefile").exists()


def test_demo_clean_deletes_the_demos_own_directory(tmp_path):
    run = a_users_run(tmp_path / "demo")
    (run / MARKER).write_text("made by make demo\n")
    result = make("demo-clean", f"DEMO_DIR={run}")
    assert result.returncode == 0, result.stderr
    assert not run.exists() and tmp_path.exists()


def test_demo_clean_without_a_directory_does_nothing(tmp_path):
    assert make("demo-clean", f"DEMO_DIR={tmp_path / 'absent'}").returncode == 0
    assert list(tmp_path.iterdir()) == []


def fake_venv(tmp_path: Path) -> tuple[Path, Path]:
    """A VENV whose stamp is up to date and whose bin/tpflow records its arguments and the marker's presence."""
    venv, log = tmp_path / "venv", tmp_path / "tpflow.log"
    (venv / "bin").mkdir(parents=True)
    tpflow = venv / "bin" / "tpflow"
    tpflow.write_text(
        "#!/bin/sh\n"
        'while [ "$#" -gt 0 ]; do [ "$1" = --run-dir ] && dir="$2"; echo "$1" >> "' + str(log) + '"; shift; done\n'
        f'if [ -f "$dir/{MARKER}" ]; then echo marker-present >> "{log}"; fi\n'
        'echo trained > "$dir/metrics.jsonl"\n'
    )
    tpflow.chmod(0o755)
    (venv / ".tpflow-installed").touch()
    return venv, log


def test_make_demo_marks_its_directory_before_training_and_replaces_it_next_time(tmp_path):
    venv, log = fake_venv(tmp_path)
    demo = tmp_path / "make-demo"
    for _ in range(2):  # the second run deletes the first's directory (its marker) and trains afresh
        log.unlink(missing_ok=True)
        result = make("demo", f"VENV={venv}", f"DEMO_DIR={demo}")
        assert result.returncode == 0, result.stderr
        calls = log.read_text().split()
        assert calls[:2] == ["train", "recipes/shapes_tp.toml"] and str(demo) in calls and "marker-present" in calls
        assert (demo / MARKER).is_file() and (demo / "metrics.jsonl").read_text() == "trained\n"


def test_make_demo_on_a_users_run_refuses_before_training(tmp_path):
    venv, log = fake_venv(tmp_path)
    run = a_users_run(tmp_path / "make-demo")
    before = tree(run)
    result = make("demo", f"VENV={venv}", f"DEMO_DIR={run}")
    assert result.returncode == 2
    assert not log.exists() and tree(run) == before


def test_the_demos_time_is_one_figure_in_readme_and_the_makefile():
    """README and the Makefile once gave two times for the same demo (1 min 53 s, 1 min 59 s): one measurement."""
    import re

    said = {name: re.findall(r"\d+ min \d+ s", (ROOT / name).read_text()) for name in ("README.md", "Makefile")}
    assert said["README.md"] and set(said["Makefile"]) == set(said["README.md"][:1]), said
