# Two commands: `make lab` and `make test`. Each bootstraps .venv by itself.
PYTHON ?= python3.11
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.kvlab-installed
# The CPU torch wheel lies on this disk; elsewhere pip takes torch from its index.
WHEELS := $(if $(wildcard /opt/wheels),--find-links /opt/wheels,)

.PHONY: install test test-fast lab gpu-check bench exercises clean

install: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	# torch FIRST and pinned: an unpinned torch pulled in by another package is a multi-GB CUDA build.
	$(BIN)/pip install --quiet $(WHEELS) torch==2.13.0
	$(BIN)/pip install --quiet $(WHEELS) -e '.[dev]'
	touch $(STAMP)

# Unit/property/kernel/browser tests, then every lesson notebook top to bottom (nbval:
# cells marked NBVAL_CHECK_OUTPUT must reproduce their stored output).
test: install
	$(BIN)/python -m pytest
	$(BIN)/python -m pytest --nbval-lax -p no:cacheprovider notebooks

lab: install
	$(BIN)/jupyter lab --ServerApp.root_dir=. --ip=127.0.0.1 --no-browser notebooks/00_start_here.ipynb

# For sessions lent a GPU: GPU tests + kernel benchmark in one run.
gpu-check: install
	timeout 480 sh -c '$(BIN)/python -m pytest -m gpu -q tests && $(BIN)/python -m kvlab.bench kernel'

bench: install
	$(BIN)/python -m kvlab.bench all

exercises: install
	$(BIN)/python -m kvlab.exercises build

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
