# celery-zklock: `make demo` and `make test` each do all set-up on a fresh Debian/Ubuntu machine.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
PYTEST_ARGS ?=

.PHONY: test test-unit test-recipes test-task test-fleet demo fleet lint bench docs system-deps venv clean

test: system-deps $(STAMP)
	$(BIN)/python -m pytest $(PYTEST_ARGS)

# The tiers: unit (no server, seconds), recipes (ZooKeeper, Redis), task (celery workers), fleet.
test-unit: $(STAMP)
	$(BIN)/python -m pytest tests/unit $(PYTEST_ARGS)

test-recipes test-task test-fleet: system-deps $(STAMP)
	$(BIN)/python -m pytest tests/$(@:test-%=%) $(PYTEST_ARGS)

demo: system-deps $(STAMP)
	$(BIN)/python -m workers demo

# The fleet on Docker Compose, start to end: dockerd (started as root if none runs, stopped
# again), images from Debian packages, N worker containers, faults through Docker, a report.
# FLEET_ARGS passes load test options, e.g. FLEET_ARGS="--workers 8 --tasks 2000".
FLEET_ARGS ?=
fleet: system-deps $(STAMP)
	$(BIN)/python -m workers fleet $(FLEET_ARGS)

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

bench: system-deps $(STAMP)
	$(BIN)/python -c 'import celery_singleton, celery_once' 2>/dev/null || $(BIN)/python -m pip install -q --disable-pip-version-check -e '.[bench]'
	$(BIN)/python -m benchmarks $(BENCH_ARGS)

# The documentation site into site/ (mkdocs.yml); warnings are errors. Installs the `docs` extra first if missing.
docs: $(STAMP)
	$(BIN)/python -c 'import mkdocs, material, mkdocstrings_handlers.python' 2>/dev/null || $(BIN)/python -m pip install -q --disable-pip-version-check -e '.[docs]'
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --site-dir site

# Debian packages (ZooKeeper, Redis, Java, docker-compose, Curator): checked every run, installed only when missing.
system-deps:
	@.ci/system-deps

venv: $(STAMP)

# Rebuilt only when pyproject.toml changes, so a second run installs nothing.
$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --disable-pip-version-check -e '.[test,dev]'
	touch $@

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache *.egg-info
