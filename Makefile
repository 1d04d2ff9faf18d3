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

# The training demo (tpflow train recipes/shapes_tp.toml) lands with the shapes world and the trainer;
# until then the demo shows the credit assigners on ALGORITHM.md's worked examples.
demo: $(STAMP)
	$(BIN)/tpflow components
	$(BIN)/tpflow credit 50,46,40,47,52,55 30,50,40,48,34,36
	$(BIN)/tpflow credit 40,37,45,48,49,50 60,62,61,63,64,64 70,72,74,71,68,66

lint: $(STAMP)
	$(BIN)/ruff check tpflow tests
	$(BIN)/ruff format --check tpflow tests

clean:
	rm -rf $(VENV) .pytest_cache
