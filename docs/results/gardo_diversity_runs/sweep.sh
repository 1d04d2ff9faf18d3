#!/usr/bin/env bash
# The GARDO diversity sweep (docs/results.md §2.10), as `tpflow sweep experiments/gardo_diversity.toml` runs it
# (registration on the first run, seed-major, one run at a time, a killed run resumed from its checkpoint), with one
# addition: before each run starts it waits while /tmp/cpu_busy exists (the machine's test-suite timing), and it
# copies the finished runs into KEPT (experiments/keep_runs.sh keep). Run from a checkout of the protocol commit:
#   cd CHECKOUT && nohup nice -n 19 env OMP_NUM_THREADS=1 PYTHONPATH=$PWD sweep.sh PYTHON KEPT &
set -euo pipefail
python=${1:?python of a tpflow environment}; kept=${2:?folder the finished runs are copied to}
"$python" - "$kept" <<'PY'
import os, subprocess, sys, time
from pathlib import Path

from tpflow.experiments import lock
from tpflow.experiments.spec import load_experiment
from tpflow.experiments.sweep import _subprocess, state, sweep

path, kept = Path("experiments/gardo_diversity.toml"), sys.argv[1]
experiment = load_experiment(path)
existing = [f"{r.arm}/seed_{r.seed}" for r in experiment.runs() if state(r) != "missing"]
record = lock.register(path, experiment.out, existing, None)
print("registered", record["registered"], record["git_commit"], flush=True)


def keep() -> None:
    subprocess.run(["experiments/keep_runs.sh", "keep", str(experiment.out), kept], check=False)


def launch(args, env, log):
    while os.path.exists("/tmp/cpu_busy"):
        time.sleep(15)
    keep()
    print(time.strftime("%H:%M:%S"), "start", log, flush=True)
    return _subprocess(args, env, log)


result = sweep(experiment, jobs=1, launch=launch)
time.sleep(1)
keep()
print(time.strftime("%H:%M:%S"), result, flush=True)
PY
