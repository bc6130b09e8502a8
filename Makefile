# Two commands do all the set-up on a fresh machine:
#   make demo   -- build, install and run the main job
#   make test   -- build, install and run the test suite
PYTHON ?= python3
export CARGO_TARGET_DIR ?= $(HOME)/.cache/pushtable/target

.PHONY: setup demo test lint bench

setup:
	$(PYTHON) -m pip install --quiet --disable-pip-version-check "maturin>=1.8,<2"
	$(PYTHON) -m pip install --quiet --disable-pip-version-check --no-build-isolation -e ".[dev]"

demo: setup
	$(PYTHON) -m pushtable demo

test: setup
	$(PYTHON) -m pytest -q

lint:
	$(PYTHON) -m ruff check .
	$(PYTHON) -m ruff format --check .
	$(PYTHON) -m mypy

bench: setup
	$(PYTHON) -m pushtable bench --json bench.json --plots docs/img
