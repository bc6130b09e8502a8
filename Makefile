# Two commands do all the set-up on a fresh machine:
#   make demo   -- build, install and run the main job
#   make test   -- build, install and run the test suite
# Both install into the active virtualenv, or create and use ./.venv when none is active,
# so no system Python is ever touched (PEP 668 interpreters refuse that anyway).
export CARGO_TARGET_DIR ?= $(HOME)/.cache/pushtable/target
BOOTSTRAP_PYTHON ?= python3
ifdef VIRTUAL_ENV
VENV := $(VIRTUAL_ENV)
else
VENV := $(CURDIR)/.venv
endif
PYTHON := $(VENV)/bin/python
PIP := $(PYTHON) -m pip --disable-pip-version-check
# The interpreter that runs pushtable is also the one Spark's Python workers start
# (pushtable.spark sets PYSPARK_PYTHON to it unless the caller did).

.PHONY: setup demo test test-slow test-all lint bench wheel

$(PYTHON):
	$(BOOTSTRAP_PYTHON) -m venv $(VENV)

setup: $(PYTHON)
	# setuptools>=70.1 carries bdist_wheel: sdists among the dependencies build in this venv.
	$(PIP) install --quiet "maturin>=1.8,<2" "setuptools>=70.1" wheel
	$(PIP) install --quiet --no-build-isolation -e ".[dev]"

demo: setup
	$(PYTHON) -m pushtable demo

test: setup
	$(PYTHON) -m pytest -q

# The sweeps under -m slow (crash matrices, the quick benchmarks); test-all is what CI runs.
test-slow: setup
	$(PYTHON) -m pytest -q -m slow

test-all: test test-slow

lint:
	$(PYTHON) -m ruff check .
	$(PYTHON) -m ruff format --check .
	$(PYTHON) -m mypy
	$(VENV)/bin/lint-imports

bench: setup
	$(PYTHON) -m pushtable bench --json bench.json --plots docs/img

# An abi3 wheel (one file for every CPython >= 3.10) for machines without Rust: pip install dist/*.whl
wheel: $(PYTHON)
	$(PIP) install --quiet "maturin>=1.8,<2"
	$(PYTHON) -m maturin build --release --out dist
