#!/usr/bin/env bash
# A sweep that spans sessions keeps its finished runs in git: a new checkout has none of runs/, so the small files of
# every finished run (its metrics.jsonl, which `tpflow compare` reads, its sweep_done.json, which tells `tpflow sweep`
# to skip it, and its log) and the sweep's registration.json are copied into a committed folder, and copied back
# before the sweep resumes. Checkpoints stay behind: a run cut off mid-way in a lost checkout restarts from epoch 0.
#   experiments/keep_runs.sh keep    RUNS_DIR KEPT_DIR   # finished runs → KEPT_DIR (then git add KEPT_DIR)
#   experiments/keep_runs.sh restore RUNS_DIR KEPT_DIR   # KEPT_DIR → RUNS_DIR, before `tpflow sweep` resumes
# RUNS_DIR is the sweep's folder (runs/experiments/<name>), holding <arm>/seed_<s>/.
set -euo pipefail
mode=${1:?keep or restore}; runs=${2:?RUNS_DIR}; kept=${3:?KEPT_DIR}
case $mode in
  keep) src=$runs; dst=$kept ;;
  restore) src=$kept; dst=$runs ;;
  *) echo "keep_runs.sh: the mode is 'keep' or 'restore', not '$mode'." >&2; exit 2 ;;
esac
[ -d "$src" ] || { echo "keep_runs.sh: $src is not a folder." >&2; exit 2; }
mkdir -p "$dst"
[ -e "$src/registration.json" ] && cp "$src/registration.json" "$dst/"  # the pre-registration, with its time
n=0
for done in "$src"/*/seed_*/sweep_done.json; do
  [ -e "$done" ] || continue
  run=$(dirname "$done"); arm=$(basename "$(dirname "$run")"); seed=$(basename "$run")
  mkdir -p "$dst/$arm/$seed"
  cp "$run/metrics.jsonl" "$run/sweep_done.json" "$dst/$arm/$seed/"
  [ -e "$src/$arm/$seed.log" ] && cp "$src/$arm/$seed.log" "$dst/$arm/"
  n=$((n + 1))
done
echo "$mode: $n finished runs, $src → $dst"
