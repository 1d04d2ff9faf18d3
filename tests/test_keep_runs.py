"""experiments/keep_runs.sh: a sweep's finished runs survive a lost checkout (kept in git, restored, skipped)."""

import subprocess
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "experiments" / "keep_runs.sh"


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True)


def test_keep_copies_only_finished_runs_and_restore_brings_them_back(tmp_path):
    runs, kept, fresh = tmp_path / "runs", tmp_path / "kept", tmp_path / "fresh"
    done = runs / "outcome" / "seed_20"
    done.mkdir(parents=True)
    (done / "metrics.jsonl").write_text('{"epoch": 0}\n')
    (done / "sweep_done.json").write_text('{"seconds": 1.0}')
    (done / "checkpoint-8").mkdir()
    (runs / "outcome" / "seed_20.log").write_text("log\n")
    (runs / "registration.json").write_text('{"registered": "then"}')
    unfinished = runs / "tempflow" / "seed_20"  # a checkpoint, no marker: stays behind
    unfinished.mkdir(parents=True)
    (unfinished / "metrics.jsonl").write_text('{"epoch": 0}\n')

    kept_run = _run("keep", str(runs), str(kept))
    assert kept_run.returncode == 0, kept_run.stderr
    assert sorted(p.relative_to(kept).as_posix() for p in kept.rglob("*") if p.is_file()) == [
        "outcome/seed_20.log",
        "outcome/seed_20/metrics.jsonl",
        "outcome/seed_20/sweep_done.json",
        "registration.json",
    ]
    assert _run("restore", str(fresh), str(kept)).returncode == 0
    assert (fresh / "outcome" / "seed_20" / "metrics.jsonl").read_text() == '{"epoch": 0}\n'
    assert (fresh / "outcome" / "seed_20" / "sweep_done.json").exists()
    assert (fresh / "registration.json").read_text() == '{"registered": "then"}'
    assert not (fresh / "tempflow").exists()


def test_a_bad_mode_or_a_missing_folder_exits_2_with_a_message(tmp_path):
    bad = _run("copy", str(tmp_path), str(tmp_path))
    assert bad.returncode == 2 and "'keep' or 'restore'" in bad.stderr
    missing = _run("keep", str(tmp_path / "nope"), str(tmp_path / "kept"))
    assert missing.returncode == 2 and "is not a folder" in missing.stderr
