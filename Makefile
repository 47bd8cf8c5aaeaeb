# celery-zklock: `make demo` and `make test` each do all set-up on a fresh Debian/Ubuntu machine.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
PYTEST_ARGS ?=
# The suite runs on TEST_WORKERS pytest-xdist processes, each with its own ZooKeeper and Redis
# (celery_zklock.testing.plugin). Most tests wait (session expiries, workers starting), so a
# 2-core machine runs 5 well (measured: 4 took 622 s, 5 took 537 s of pytest). --dist loadgroup keeps an xdist_group's tests on one process, one
# after the other; --no-loadscope-reorder keeps tests/conftest.py's order (slowest first).
# TEST_WORKERS=0 runs everything in pytest's own process, one test at a time.
TEST_WORKERS ?= 5
XDIST = -n $(TEST_WORKERS) --dist loadgroup --no-loadscope-reorder

.PHONY: test test-faults test-solo test-acceptance test-fast test-unit test-recipes test-task test-fleet test-tools demo fleet lint bench docs test-compat test-kazoo system-deps venv clean

test: system-deps $(STAMP)
	$(BIN)/python -m pytest $(XDIST) -m "not fault and not acceptance" $(PYTEST_ARGS)

# The fault tier: long real-time fault tests (marked `fault`, in any tier's folder: ZooKeeper
# outages, the gate under redelivery and broker timeouts, a paused leader's 20 trials). .ci/run
# runs it after make test; make test leaves it out to stay within its 10 minutes.
test-faults: system-deps $(STAMP)
	$(BIN)/python -m pytest $(XDIST) -m "fault and not solo" $(PYTEST_ARGS)

# The fault tests whose figures hold only on a machine not busy with other tests (issue 45's
# when-busy acceptance: a body 0.4-1.5 s after the last call, plain tasks' p95 <= 2 s beside a
# throttle): one at a time, in pytest's own process. .ci/run runs it after make test-faults.
test-solo: system-deps $(STAMP)
	$(BIN)/python -m pytest -m solo $(PYTEST_ARGS)

# The fleets' every-fault runs, one at a time: over an ensemble with ETA calls, a 6 s visibility
# timeout and the rate and completed-twice checks, debounced and replace calls in the mix (the
# acceptance run of issues 42, 44 and 45), and the compose fleet under every Docker fault (in
# make test until 2026-11-29). .ci/run runs it too (about 6 minutes): after the fixes of
# 2026-11-28 (5ad4d44, 68c4f6d) its next 5 runs here gave four zeros, the broker's own drops
# apart (kombu's Redis transport, counted and bounded).
test-acceptance: system-deps $(STAMP)
	$(BIN)/python -m pytest -m acceptance $(PYTEST_ARGS)

# The unit and recipes tiers: what a change to the lock recipes needs, within 2 minutes.
test-fast: system-deps $(STAMP)
	$(BIN)/python -m pytest $(XDIST) tests/unit tests/recipes $(PYTEST_ARGS)

# The tiers: unit (the library, no server, seconds), recipes (ZooKeeper, Redis), task (celery
# workers), fleet (the fleet and the library under faults), tools (the tests of workers/ and
# benchmarks/ themselves: the fleet checker's verdicts, the reports, the load test's sender, the
# compose files, the benchmarks' figures). make test runs every tier, tools included: the fleet
# checker judges the fault runs' acceptance, and the tier costs well under a minute.
test-unit: $(STAMP)
	$(BIN)/python -m pytest $(XDIST) tests/unit $(PYTEST_ARGS)

test-recipes test-task test-fleet test-tools: system-deps $(STAMP)
	$(BIN)/python -m pytest $(XDIST) tests/$(@:test-%=%) $(PYTEST_ARGS)

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

# The oldest supported versions (tests/compat/constraints.txt: celery, kombu, kazoo, redis, ...)
# in their own venv: the unit tier, the fence and the library without redis, and two task tests on
# real prefork workers. tests/compat/plugin.py works around a teardown hang of Celery < 5.7.
COMPAT_VENV  := .venv-compat
COMPAT_BIN   := $(COMPAT_VENV)/bin
COMPAT_STAMP := $(COMPAT_VENV)/.installed
COMPAT_TESTS := tests/unit tests/compat tests/recipes/test_fence.py \
	'tests/task/test_task_worker.py::test_skip_wait_and_shared_modes[prefork-redis]' \
	'tests/task/test_task_worker.py::test_session_expired_from_outside_revokes_the_running_task[prefork]'
test-compat: system-deps $(COMPAT_STAMP)
	@$(COMPAT_BIN)/python -c 'from importlib.metadata import version as v; print("test-compat:", ", ".join(f"{p} {v(p)}" for p in ("celery", "kombu", "billiard", "vine", "kazoo", "redis")))'
	$(COMPAT_BIN)/python -m pytest -p tests.compat.plugin $(COMPAT_TESTS) $(PYTEST_ARGS)

$(COMPAT_STAMP): pyproject.toml tests/compat/constraints.txt
	test -x $(COMPAT_BIN)/python || $(PYTHON) -m venv $(COMPAT_VENV)
	$(COMPAT_BIN)/python -m pip install -q --disable-pip-version-check -c tests/compat/constraints.txt -e '.[test]'
	$(COMPAT_BIN)/python -m pip check
	touch $@

# The contract of kazoo's private hooks (locks/adapter.py: that they exist; the socket I/O that
# overrides _read and _write, on a real ZooKeeper) against each supported kazoo minor version, as test-compat does:
# one venv each (.venv-kazoo-2.9, ...), kazoo pinned, the rest as resolved for the `test` extra.
KAZOO_VERSIONS := 2.9 2.10 2.11
KAZOO_TESTS    := tests/recipes/test_kazoo_contract.py tests/unit/test_direct_socket_io.py tests/unit/test_lease_clock.py
test-kazoo: system-deps $(KAZOO_VERSIONS:%=.venv-kazoo-%/.installed)
	@set -e; for v in $(KAZOO_VERSIONS); do \
		.venv-kazoo-$$v/bin/python -c 'from importlib.metadata import version; print("test-kazoo: kazoo", version("kazoo"))'; \
		.venv-kazoo-$$v/bin/python -m pytest -q -p no:cacheprovider $(KAZOO_TESTS) $(PYTEST_ARGS); \
	done

.venv-kazoo-%/.installed: pyproject.toml
	test -x .venv-kazoo-$*/bin/python || $(PYTHON) -m venv .venv-kazoo-$*
	.venv-kazoo-$*/bin/python -m pip install -q --disable-pip-version-check -e '.[test]' 'kazoo==$*.*'
	.venv-kazoo-$*/bin/python -m pip check
	touch $@

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
