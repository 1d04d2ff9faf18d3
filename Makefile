# tpflow: `make demo` runs the embedded job on the CPU, `make test` runs the offline test suite.
# Both create .venv (Python >= 3.10) and install tpflow into it when it is missing or pyproject.toml changed.

PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.tpflow-installed
# Keep BLAS threads to the cores we have (2 on the CI machines) so the tests do not oversubscribe.
export OMP_NUM_THREADS ?= 2
export HF_HUB_OFFLINE ?= 1

.PHONY: install test demo demo-clean lint clean

install: $(STAMP)

# pip installs torch's CUDA build from PyPI: about 5.6 GB of the venv's 6.5 GB. Say so before pip fails half-way with
# "No space left on device" (as a CI machine with little free disk once did). NEED_MB=0 skips the check.
NEED_MB ?= 6600

$(STAMP): pyproject.toml
	@mkdir -p $(VENV); free=$$(df -Pm $(VENV) | awk 'NR==2 {print $$4}'); \
	if ! $(BIN)/python -c "import torch" 2>/dev/null && [ "$$free" -lt "$(NEED_MB)" ]; then \
	  echo "make install: $$free MB are free where $(VENV) goes, and installing tpflow (torch and its CUDA libraries" \
	       "from PyPI, then diffusers, transformers and the reward models' packages) needs about $(NEED_MB) MB." \
	       "Free some disk, or put the venv elsewhere (make VENV=/path/with/room test), or run with NEED_MB=0" \
	       "to try anyway." >&2; exit 2; fi
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e ".[dev]"
	@touch $(STAMP)

# The suite runs on TEST_WORKERS processes (pytest-xdist), one test file per worker at a time (--dist loadfile: a
# module's fixtures, its 2-process runs among them, are built once), one BLAS thread each: the tiny models gain
# nothing from a second thread, and two files at once keep both cores busy. TEST_WORKERS=0 runs it in this process.
TEST_WORKERS ?= 2
test: $(STAMP)
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest -n $(TEST_WORKERS) --dist loadfile

# TP-GRPO on the embedded shapes world, on the CPU: 10 of the recipe's 20 epochs, evaluated at epochs 0, 5 and 10 so
# that the eval reward shows while it runs (it moves by a few hundredths either way in 10 epochs: README). Measured on
# 2 cores: about 2 minutes once installed (1 min 52 s measured on a fresh clone: README); the first install (torch with its
# CUDA libraries, about 6.5 GB) adds several minutes, depending on the network.
# DEMO_DIR is the demo's own directory, named by no example in the docs, and started afresh each time: the demo writes
# DEMO_MARKER into it before training (tpflow train keeps files it does not know), and demo-clean deletes the
# directory only when that marker is there. A directory without it (a run of yours) is left alone: demo-clean says so
# in one line and exits 2.
DEMO_DIR ?= runs/make-demo
DEMO_MARKER := .made-by-make-demo

demo: $(STAMP) demo-clean
	@mkdir -p "$(DEMO_DIR)" && echo "made by make demo: the next make demo deletes this directory" > "$(DEMO_DIR)/$(DEMO_MARKER)"
	$(BIN)/tpflow train recipes/shapes_tp.toml --run-dir "$(DEMO_DIR)" --epochs 10 --set eval.every=5

# Delete DEMO_DIR if the demo made it (DEMO_MARKER inside) or it is empty; refuse (exit 2) if it holds anything else,
# or if it is or contains the current directory. Needs no venv.
demo-clean:
	@dir="$(DEMO_DIR)"; \
	if [ -z "$$dir" ]; then echo "make demo: DEMO_DIR is empty; nothing deleted." >&2; exit 2; fi; \
	if [ ! -e "$$dir" ] && [ ! -L "$$dir" ]; then exit 0; fi; \
	if [ -d "$$dir" ] && [ ! -L "$$dir" ]; then \
	  abs=$$(cd "$$dir" && pwd -P); \
	  case "$$(pwd -P)/" in "$${abs%/}/"*) \
	    echo "make demo: $$dir is or contains the current directory; nothing deleted." >&2; exit 2;; esac; \
	fi; \
	if [ -f "$$dir/$(DEMO_MARKER)" ]; then rm -rf -- "$$dir"; \
	elif [ -d "$$dir" ] && [ ! -L "$$dir" ] && [ -z "$$(ls -A "$$dir")" ]; then rmdir -- "$$dir"; \
	else echo "make demo: $$dir was not made by make demo (no $(DEMO_MARKER) in it), so it is left as it is; move it, or give the demo another directory: make demo DEMO_DIR=runs/another" >&2; exit 2; fi

lint: $(STAMP)
	$(BIN)/ruff check tpflow tests plugins benchmarks
	$(BIN)/ruff format --check tpflow tests plugins benchmarks

clean:
	rm -rf $(VENV) .pytest_cache
