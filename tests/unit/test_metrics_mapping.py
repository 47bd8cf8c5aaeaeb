"""The pure parts of the metrics (celery_zklock.task.metrics, celery_zklock.worker.metrics):
outcome and lost-reason mapping, the settings, and the signal-to-metric bookkeeping in a registry
of the test's own (no server, no worker); the real workers are in tests/task/test_metrics.py."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

import celery_zklock
from celery_zklock import ConfigurationError, signals
from celery_zklock.errors import LossCode
from celery_zklock.task import metrics as recorder
from celery_zklock.task.metrics import (
    BUCKETS,
    LOST_REASONS,
    OUTCOMES,
    Recorder,
    busy_outcome,
    lost_reason,
)
from celery_zklock.task.policy import TABLE
from celery_zklock.worker import metrics as server
from celery_zklock.worker.metrics import INSTALL_HINT
from celery_zklock.zk.settings import settings_of
from tests.lockutil import app_with

LOCKS = Path(celery_zklock.__file__).parent / "locks"


# -- outcomes --------------------------------------------------------------------------------
def test_every_busy_policy_maps_to_an_outcome_or_waits() -> None:
    busy_policies = {policy for situation, policy in TABLE if situation == "busy"}
    assert busy_policies == {"skip", "wait", "retry", "raise", "preempt", "replace"}
    mapped = {policy: busy_outcome(policy) for policy in busy_policies}
    assert mapped == {
        "skip": "skipped", "retry": "retried", "raise": "busy_raised", "wait": None,
        "preempt": None,  # a wait, after asking the holders to end
        "replace": None,  # a wait as the key's one waiter: granted, timed_out or replaced
    }  # fmt: skip
    assert {o for o in mapped.values() if o is not None} < set(OUTCOMES)
    assert busy_outcome("no-such-policy") is None


# -- lost reasons ----------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("code", "kind"),
    [
        *((code, code.value) for code in LossCode),
        ("session_expired", "session_expired"),  # a value, as after a JSON round trip
        ("broken", "broken"),
        ("the ZooKeeper session expired", "other"),  # a reason text is no code
        ("a code from a newer version", "other"),
        ("", "other"),
        (None, "other"),
        (7, "other"),
    ],
)
def test_lost_reason(code: Any, kind: str) -> None:
    assert lost_reason(code) == kind
    assert kind in LOST_REASONS


def test_every_loss_code_is_a_label_of_its_own() -> None:
    assert {code.value for code in LossCode} | {"other"} == set(LOST_REASONS)
    assert len(LOST_REASONS) == len(set(LOST_REASONS))


def _codes_given_by_the_lease_code() -> set[str]:
    """The LossCode members celery_zklock/locks names; and a check that every call of
    ``mark_lost`` / ``record_lost`` / ``declare_lost`` there passes a ``LossCode.X`` (or a
    variable carrying one) as its code."""
    named: set[str] = set()
    for source in sorted(LOCKS.glob("*.py")):
        tree = ast.parse(source.read_text())
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Attribute)
                and isinstance(node.value, ast.Name)
                and node.value.id == "LossCode"
            ):
                named.add(node.attr)
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr in ("mark_lost", "record_lost", "declare_lost")
            ):
                assert node.args, f"{source.name}: {ast.unparse(node)} passes no code"
                code = node.args[0]
                assert isinstance(code, ast.Name) or (
                    isinstance(code, ast.Attribute)
                    and isinstance(code.value, ast.Name)
                    and code.value.id == "LossCode"
                ), f"{source.name}: {ast.unparse(node)} passes no LossCode"
    return named


def test_every_loss_the_lease_code_declares_carries_a_code() -> None:
    """Each cause has its code where the lease code declares it; tests/recipes/
    test_loss_codes.py checks on a real ZooKeeper that each cause gives its code."""
    # PREEMPTED is the task layer's name for a BROKEN loss that a preempt call asked for
    # (celery_zklock.task.run.loss_code): no recipe gives it.
    assert _codes_given_by_the_lease_code() == set(LossCode.__members__) - {"PREEMPTED"}


# -- settings --------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("value", "port"), [(None, None), ("", None), ("  ", None), ("9808", 9808), (9808, 9808)]
)
def test_metrics_port(value: Any, port: int | None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("ZKLOCK_METRICS_PORT", raising=False)
    app = app_with({"zklock_metrics_port": value})
    assert settings_of(app, connection=False).metrics_port == port


@pytest.mark.parametrize("value", ["0", "65536", "-1", "http", "9808.5", True])
def test_a_bad_port_is_refused_naming_the_setting(value: Any) -> None:
    app = app_with({"zklock_metrics_port": value})
    with pytest.raises(ConfigurationError, match="zklock_metrics_port must be a port number"):
        _ = settings_of(app, connection=False).metrics_port


def test_settings_fall_back_to_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ZKLOCK_METRICS_PORT", "9100")
    monkeypatch.setenv("ZKLOCK_METRICS_ADDR", "127.0.0.1")
    apps = app_with({}), app_with({"zklock_metrics_port": 9200}), app_with({})
    first, other, later = (settings_of(app, connection=False) for app in apps)
    assert first.metrics_port == 9100 and first.metrics_addr == "127.0.0.1"
    assert other.metrics_port == 9200  # the app's setting wins
    monkeypatch.delenv("ZKLOCK_METRICS_ADDR")
    assert first.metrics_addr == "127.0.0.1"  # read once per app
    assert later.metrics_addr == "0.0.0.0"


def test_the_buckets_span_1_ms_to_10_min() -> None:
    assert BUCKETS[0] == 0.001 and BUCKETS[-1] == 600.0
    assert list(BUCKETS) == sorted(set(BUCKETS))


def test_only_the_prefork_pool_forks() -> None:
    from celery.concurrency.prefork import TaskPool
    from celery.concurrency.thread import TaskPool as ThreadPool

    assert server._forks("prefork") and server._forks(TaskPool)
    assert not any(server._forks(p) for p in ("threads", "solo", ThreadPool, None))


# -- signals to metrics ----------------------------------------------------------------------
class _Task:
    name = "tests.t"


TASK = _Task()


@pytest.fixture
def registry(monkeypatch: pytest.MonkeyPatch) -> Iterator[CollectorRegistry]:
    """The library's signal receivers recording into a registry of this test's own."""
    registry = CollectorRegistry()
    recorder.use_recorder(Recorder(registry))
    try:
        yield registry
    finally:
        recorder.use_recorder(None)


def sample(registry: CollectorRegistry, name: str, **labels: str) -> float:
    return registry.get_sample_value(name, {"task": "tests.t", **labels}) or 0.0


def grant(task_id: str, token: int, waited: float = 0.002) -> None:
    signals.lock_acquired.send(
        sender=TASK, task_id=task_id, path="/p", token=token, mode="exclusive", waited=waited
    )


def release(task_id: str, token: int, held: float = 0.3, lost: bool = False) -> None:
    signals.lock_released.send(
        sender=TASK, task_id=task_id, path="/p", token=token, held=held, lost=lost
    )


def lose(task_id: str, token: int, code: LossCode | None) -> None:
    signals.lock_lost.send(
        sender=TASK, task_id=task_id, path="/p", token=token, reason=f"text of {code}", code=code
    )


def test_signals_become_metrics(registry: CollectorRegistry) -> None:
    grant("a", 1, waited=0.002)
    grant("b", 2, waited=3.0)
    assert sample(registry, "zklock_leases_held") == 2
    for policy in ("skip", "skip", "wait", "retry", "raise"):
        signals.lock_busy.send(sender=TASK, task_id="c", path="/p", policy=policy, holder="a")
    release("a", 1, held=0.3)
    release("b", 2, held=0.01)
    counts = {o: sample(registry, "zklock_acquisitions_total", outcome=o) for o in OUTCOMES}
    recorder.count_outcome(TASK.name, "debounced")
    counts = {o: sample(registry, "zklock_acquisitions_total", outcome=o) for o in OUTCOMES}
    assert counts == {"granted": 2, "skipped": 2, "retried": 1, "busy_raised": 1, "timed_out": 0,
                      "debounced": 1, "replaced": 0}  # fmt: skip
    assert sample(registry, "zklock_wait_seconds_count") == 2
    assert sample(registry, "zklock_wait_seconds_bucket", le="0.0025") == 1
    assert sample(registry, "zklock_wait_seconds_sum") == pytest.approx(3.002)
    assert sample(registry, "zklock_hold_seconds_count") == 2
    assert sample(registry, "zklock_hold_seconds_bucket", le="0.01") == 1
    assert sample(registry, "zklock_leases_held") == 0
    assert sample(registry, "zklock_lost_total", reason="other") == 0


def test_a_loss_is_counted_once_whichever_signal_tells_it_first(
    registry: CollectorRegistry,
) -> None:
    # told while held, then released lost: counted with its reason
    grant("a", 1)
    lose("a", 1, LossCode.SESSION_EXPIRED)
    release("a", 1, lost=True)
    # found at the release only (no lock_lost): counted, reason unknown
    grant("b", 2)
    release("b", 2, lost=True)
    # told after the release (the lease clock's thread was late): not counted again
    grant("c", 3)
    release("c", 3, lost=True)
    lose("c", 3, LossCode.LEASE_CLOCK)
    # told with a code this version does not know (or none): counted as other
    grant("d", 4)
    lose("d", 4, None)
    release("d", 4, lost=True)
    assert sample(registry, "zklock_lost_total", reason="session_expired") == 1
    assert sample(registry, "zklock_lost_total", reason="other") == 3
    assert sample(registry, "zklock_lost_total", reason="lease_clock") == 0
    assert sample(registry, "zklock_leases_held") == 0


def test_a_lost_signal_is_counted_by_its_code_not_its_text(registry: CollectorRegistry) -> None:
    for token, code in enumerate(LossCode, start=1):
        grant("a", token)
        signals.lock_lost.send(
            sender=TASK, task_id="a", path="/p", token=token, reason="a cosmic ray", code=code
        )
        release("a", token, lost=True)
    for code in LossCode:
        assert sample(registry, "zklock_lost_total", reason=code.value) == 1, code
    assert sample(registry, "zklock_lost_total", reason="other") == 0


def test_a_timeout_signal_counts_timed_out(registry: CollectorRegistry) -> None:
    """Receives the library's ``lock_timeout`` signal where there is one; the receiver itself
    is checked either way."""
    timeout_signal = getattr(signals, "lock_timeout", None)
    if timeout_signal is not None:
        timeout_signal.send(sender=TASK, task_id="a", path="/p", policy="skip", holder=None)
    else:
        recorder._on_timeout(sender=TASK, task_id="a", path="/p", policy="skip", holder=None)
    assert sample(registry, "zklock_acquisitions_total", outcome="timed_out") == 1


def test_no_receiver_is_connected_when_metrics_are_off() -> None:
    """Without a recorder the lock signals have no metrics receiver, so a locked task sends
    none of them (celery_zklock.task.events skips a signal without receivers); each receiver also
    does nothing if called without one."""
    recorder.use_recorder(Recorder(CollectorRegistry()))
    recorder.use_recorder(None)
    for signal, receiver in recorder._RECEIVERS:
        assert receiver not in signal._live_receivers(TASK), signal.name
        assert receiver(sender=TASK, task_id="a", path="/p", token=1, policy="skip") is None


# -- without prometheus-client ---------------------------------------------------------------
def test_a_port_without_prometheus_client_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "prometheus_client", None)  # import fails
    with pytest.raises(ConfigurationError, match=r"celery-zklock\[prometheus\]") as raised:
        server.serve(app_with({"zklock_metrics_port": 9808}), multiprocess=False)
    assert INSTALL_HINT in str(raised.value)
    assert server._serving is None

    class Sender:
        app = type("App", (), {"conf": {"zklock_metrics_port": 9808}})()
        pool_cls = "threads"

    with pytest.raises(SystemExit, match=r"pip install celery-zklock\[prometheus\]"):
        server._on_worker_init(sender=Sender())


def _python(code: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ZKLOCK_METRICS")}
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=env
    )


def test_importing_the_package_needs_no_prometheus_client() -> None:
    done = _python(
        "import sys; sys.modules['prometheus_client'] = None\n"
        "import celery_zklock, celery_zklock.worker.metrics\n"
        "from celery_zklock import signals\n"
        "signals.lock_acquired.send(sender=None, task_id='a', path='/p', token=1, waited=0.0)\n"
    )
    assert done.returncode == 0, done.stderr


def test_binding_a_locked_task_connects_the_receivers_and_importing_does_not() -> None:
    """Importing celery_zklock connects no worker receiver; the first ZkLockTask bound to an app
    (a worker finalizes its app before worker_init) connects them all, the metrics' included."""
    done = _python(
        "import celery_zklock\n"
        "from celery import Celery\n"
        "from celery.signals import worker_init, worker_process_init\n"
        "def ours(signal):\n"
        "    return sorted(getattr(r, '__module__', '') for _, r in signal.receivers\n"
        "                  if getattr(r, '__module__', '').startswith('celery_zklock'))\n"
        "print(ours(worker_init), ours(worker_process_init))\n"
        "app = Celery(set_as_current=False)\n"
        "@app.task(base=celery_zklock.ZkLockTask, shared=False)\n"
        "def locked(): pass\n"
        "app.finalize()\n"
        "print(ours(worker_init), ours(worker_process_init))\n"
    )
    assert done.returncode == 0, done.stderr
    before, after = done.stdout.strip().splitlines()
    assert before == "[] []"
    assert "'celery_zklock.worker.metrics'" in after
    assert "'celery_zklock.worker.gate.step'" in after
    assert after.count("celery_zklock.worker.wiring") == 3  # settings afresh, two start checks


def test_the_live_gauge_files_of_gone_processes_are_found(tmp_path: Path) -> None:
    gone = subprocess.Popen(["true"])
    gone.wait()  # reaped: its pid names no process now
    for pid in (os.getpid(), gone.pid):
        (tmp_path / f"gauge_livesum_{pid}.db").touch()
        (tmp_path / f"counter_{pid}.db").touch()
    assert server._gone_pids(str(tmp_path)) == [gone.pid]
    assert server._gone_pids(str(tmp_path / "missing")) == []
