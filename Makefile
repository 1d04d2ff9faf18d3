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

$(STAMP): pyproject.toml
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e ".[dev]"
	@touch $(STAMP)

test: $(STAMP)
	$(BIN)/python -m pytest

# TP-GRPO on the embedded shapes world, on the CPU: 10 of the recipe's 20 epochs, evaluated at epochs 0, 5 and 10 so
# that learning shows while it runs. Measured on 2 cores: about 3 minutes on a fresh clone (the install included),
# 1.5 minutes after. runs/demo is the demo's own directory and is started afresh each time.
demo: $(STAMP)
	rm -rf runs/demo
	$(BIN)/tpflow train recipes/shapes_tp.toml --run-dir runs/demo --epochs 10 --set eval.every=5

lint: $(STAMP)
	$(BIN)/ruff check tpflow tests plugins benchmarks
	$(BIN)/ruff format --check tpflow tests plugins benchmarks

clean:
	rm -rf $(VENV) .pytest_cache
