# Two commands: `make lab` and `make test`. Each bootstraps .venv by itself.
PYTHON ?= python3.11
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.kvlab-installed
# Test workers (pytest-xdist): three on the 2-core machines we test on -- a browser test spends
# part of its time waiting for the page, and a third worker keeps both cores busy meanwhile.
WORKERS ?= 3
# `make lab` opens the learner's working copies here (outputs cleared, never overwritten).
WORKDIR ?= my-kvlab
# JupyterLab refuses to start as root without this (Docker, Codespaces, cloud notebooks).
ALLOW_ROOT := $(if $(filter 0,$(shell id -u)),--allow-root,)

.PHONY: install test test-full test-busy test-fast lab lab-reset gpu-check bench exercises clean

# Machines like ours set PYTHONDONTWRITEBYTECODE=1, so every Python process compiles kvlab's
# modules from source again. A test run starts some hundred of them (notebook kernels, engine
# replicas, workers): the tests write __pycache__ (git-ignored) and compile each module once.
test test-full test-fast: export PYTHONDONTWRITEBYTECODE :=

install: $(STAMP)

$(STAMP): pyproject.toml scripts/install.sh
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	scripts/install.sh $(BIN)/python dev
	$(BIN)/python -m kvlab.workspace settings
	touch $(STAMP)

# Where Chromium is, every lesson runs once, in JupyterLab (tests/browser: every output renders,
# and the cells marked NBVAL_CHECK_OUTPUT reproduce their stored output, nbval's rules); without
# it, nbval runs the lessons in a plain kernel instead, so their claims are checked either way.
LESSONS_BY_NBVAL := $(if $(wildcard /usr/bin/chromium),,notebooks)

# The layer contracts (import-linter), the lint and the format (ruff) -- a second each -- then
# one pytest run of the unit/property/kernel/browser tests and the lessons (above), on
# $(WORKERS) workers: a notebook's cells stay together on one worker (the root conftest.py's
# scheduler), every other test goes to whichever worker is free. The types are checked inside
# that run: tests/test_layers.py runs mypy over the files pyproject.toml's [tool.mypy] names
# (~20 s of one core, beside the other tests instead of before them; `$(BIN)/mypy` alone
# does the same check).
test: install
	$(BIN)/lint-imports --no-cache
	$(BIN)/ruff check kvlab kernels tests
	$(BIN)/ruff format --check kvlab kernels tests
	$(BIN)/python -m pytest -n $(WORKERS) --nbval-lax -p no:cacheprovider tests $(LESSONS_BY_NBVAL)

# The same, with the exhaustive interrupt sweeps: an interrupt at *every* event of each run
# (`make test` takes a seeded sample of them, the same points every run), and the fault soak
# over 5,000 requests instead of 2,500.
test-full: install
	$(BIN)/lint-imports --no-cache
	$(BIN)/ruff check kvlab kernels tests
	$(BIN)/ruff format --check kvlab kernels tests
	KVLAB_SWEEP=full $(BIN)/python -m pytest -n $(WORKERS) --nbval-lax -p no:cacheprovider tests $(LESSONS_BY_NBVAL)

# Every lesson in JupyterLab as on a slow Binder pod: one lesson at a time, each run beside six
# CPU-bound processes that the test starts and stops (tests/browser: every plot draws its
# traces, no widget fails to start, the checked outputs reproduce). About 4x the quiet time.
test-busy: install
	KVLAB_BROWSER_BUSY=6 $(BIN)/python -m pytest -p no:cacheprovider -q -s tests/browser/test_browser.py -k "lesson_runs_clean or capstone_player"

# The quick loop while coding: everything but the slow tests (soak, browser) and the
# notebook executions; `make test` runs them all.
test-fast: install
	$(BIN)/python -m pytest -m "not slow and not notebook" -n $(WORKERS) -q

lab: install
	$(BIN)/python -m kvlab.workspace prepare --dest $(WORKDIR)
	$(BIN)/jupyter lab $(ALLOW_ROOT) --ServerApp.root_dir=$(WORKDIR) --LabApp.default_url=/lab/tree/notebooks/00_start_here.ipynb --ip=127.0.0.1 --no-browser

# Start over: your working copies are moved to $(WORKDIR)-backup-<time>, fresh ones made.
lab-reset: install
	$(BIN)/python -m kvlab.workspace reset --dest $(WORKDIR)

# For sessions lent a GPU: GPU tests + kernel benchmark in one run.
gpu-check: install
	timeout 480 sh -c '$(BIN)/python -m pytest -m gpu -q -rs tests && $(BIN)/python -m kvlab.bench kernel'

bench: install
	$(BIN)/python -m kvlab.bench all

exercises: install
	$(BIN)/python -m kvlab.exercises build

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
