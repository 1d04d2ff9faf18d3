# tpflow: `make demo` runs the embedded job on the CPU, `make test` runs the offline test suite.
# Both create .venv (Python >= 3.10) and install tpflow into it when it is missing or pyproject.toml changed.

PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.tpflow-installed
# Keep BLAS threads to the cores we have (2 on the CI machines) so the tests do not oversubscribe.
export OMP_NUM_THREADS ?= 2
export HF_HUB_OFFLINE ?= 1

.PHONY: install test demo lint clean

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

test: $(STAMP)
	$(BIN)/python -m pytest

# TP-GRPO on the embedded shapes world, on the CPU: 10 of the recipe's 20 epochs, evaluated at epochs 0, 5 and 10 so
# that the eval reward shows while it runs (it moves by a few hundredths either way in 10 epochs: README). Measured on 2 cores: about 3 minutes on a fresh clone (the install included),
# 1.5 minutes after. runs/demo is the demo's own directory and is started afresh each time.
demo: $(STAMP)
	rm -rf runs/demo
	$(BIN)/tpflow train recipes/shapes_tp.toml --run-dir runs/demo --epochs 10 --set eval.every=5

lint: $(STAMP)
	$(BIN)/ruff check tpflow tests plugins benchmarks
	$(BIN)/ruff format --check tpflow tests plugins benchmarks

clean:
	rm -rf $(VENV) .pytest_cache
