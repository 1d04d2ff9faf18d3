#!/usr/bin/env bash
# A long sweep, stopped and resumed, as `tpflow sweep EXPERIMENT --jobs JOBS` runs it (registration on the first run,
# seed-major, a killed run resumed from its checkpoint), with two additions: before each run starts it waits while
# /tmp/cpu_busy exists (the machine's test-suite timing), and it copies the finished runs into KEPT
# (experiments/keep_runs.sh keep) as they finish. Run from a checkout of the protocol commit, after
# `experiments/keep_runs.sh restore runs/experiments/NAME KEPT` when resuming:
#   cd CHECKOUT && nohup nice -n 19 env OMP_NUM_THREADS=1 PYTHONPATH=$PWD \
#       experiments/sweep_kept.sh PYTHON EXPERIMENT KEPT JOBS &
set -euo pipefail
python=${1:?python of a tpflow environment}; experiment=${2:?experiment TOML}; kept=${3:?folder for finished runs}
jobs=${4:-1}
"$python" - "$experiment" "$kept" "$jobs" <<'PY'
import os, subprocess, sys, threading, time
from pathlib import Path

from tpflow.experiments import lock
from tpflow.experiments.spec import load_experiment
from tpflow.experiments.sweep import _subprocess, state, sweep

path, kept, jobs = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3])
experiment = load_experiment(path)
existing = [f"{r.arm}/seed_{r.seed}" for r in experiment.runs() if state(r) != "missing"]
record = lock.register(path, experiment.out, existing, None)
print("registered", record["registered"], record["git_commit"], flush=True)
guard = threading.Lock()


def keep() -> None:
    with guard:
        subprocess.run(["experiments/keep_runs.sh", "keep", str(experiment.out), kept], check=False)


def launch(args, env, log):
    while os.path.exists("/tmp/cpu_busy"):
        time.sleep(15)
    keep()
    print(time.strftime("%H:%M:%S"), "start", log, flush=True)
    return _subprocess(args, env, log)


result = sweep(experiment, jobs=jobs, launch=launch)
time.sleep(1)
keep()
print(time.strftime("%H:%M:%S"), result, flush=True)
PY
