"""Interrupting a body whose lease was lost: one interruption per run, nested runs, the signal.

In this process (direct calls, ``apply()``) on a real ZooKeeper, and `celery worker`s for the
signal check at worker start.
"""

from __future__ import annotations

import ctypes
import signal
import threading
import time
from collections.abc import Iterator
from contextlib import suppress
from pathlib import Path
from typing import Any

import pytest
from celery import Celery
from kazoo.client import KazooClient
from kazoo.exceptions import NoNodeError

from celery_zklock import ConfigurationError, LockLost, ZkLockTask, signals
from celery_zklock.interrupt import interrupt_signal
from tests.lockutil import expire_session, task_client
from tests.workerproc import start_worker


@pytest.fixture
def app(zk_hosts: str, lock_root: str) -> Iterator[Celery]:
    app = Celery("interrupt", set_as_current=False)
    app.conf.zklock_hosts = zk_hosts
    app.conf.zklock_root = lock_root
    yield app


def contenders(zk: KazooClient, root: str) -> list[str]:
    """Every contender node under ``root`` (``<root>/<lock name>/<key>/<node>``)."""
    found: list[str] = []
    for name in zk.get_children(root) if zk.exists(root) else []:
        for key in zk.get_children(f"{root}/{name}") if zk.exists(f"{root}/{name}") else []:
            with suppress(NoNodeError):
                found += zk.get_children(f"{root}/{name}/{key}")
    return found


def client_of(task: Any) -> KazooClient:
    """The kazoo client the task's runs in this process take their locks with."""
    return task_client(task)


def test_nested_run_leaves_the_outer_interruption_armed(app: Celery, zk_hosts: str) -> None:
    """Prefork/solo path (the main thread, a signal): a locked task called directly and with
    ``apply()`` inside a body arms and disarms its own run; the outer run's body is still
    interrupted when the outer lease is lost afterwards."""
    assert threading.current_thread() is threading.main_thread()
    nested_done = threading.Event()
    reached_end: list[bool] = []

    @app.task(bind=True, base=ZkLockTask, lock_key=["n"], lazy=False)
    def inner(self: Any, n: int) -> int:
        return n

    @app.task(bind=True, base=ZkLockTask, lock_key=["n"], lazy=False)
    def outer(self: Any, n: int) -> str:
        assert inner(n + 1) == n + 1
        assert inner.apply((n + 2,)).get() == n + 2
        nested_done.set()
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:  # the interruption lands between these sleeps
            time.sleep(0.01)
        reached_end.append(True)
        return "ran"

    client = client_of(outer)
    before = signal.getsignal(signal.SIGUSR2)

    def expire_after_nested_runs() -> None:
        if nested_done.wait(30):
            expire_session(zk_hosts, client)

    expirer = threading.Thread(target=expire_after_nested_runs)
    expirer.start()
    started = time.monotonic()
    try:
        with pytest.raises(LockLost, match="was lost while the task ran"):
            outer(1)
    finally:
        expirer.join()
    assert reached_end == []  # interrupted, not run to its end and failed only at release
    assert time.monotonic() - started < 15
    assert signal.getsignal(signal.SIGUSR2) is before


def test_nested_run_does_not_withdraw_the_outer_runs_pending_interruption(
    app: Celery, zk_hosts: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Threads path (an exception set into the task's thread): the outer lease is lost while a
    nested run's body runs; the nested run's end must not withdraw the exception set for the
    outer run, and the interruption is set before the ``lock_lost`` receivers run."""
    other = Celery("interrupt-inner", set_as_current=False)
    other.conf.zklock_hosts = app.conf.zklock_hosts
    other.conf.zklock_root = app.conf.zklock_root
    other.conf.zklock_session_timeout = 9.0  # another client: only the outer lease is lost
    calls: list[tuple[int, Any]] = []  # PyThreadState_SetAsyncExc(thread, exception or None)

    def set_async_exc(thread_id: Any, exc: Any) -> int:
        calls.append((thread_id.value, None if exc is None else exc.value))
        return 1  # recorded, not delivered: the test decides what happens when

    monkeypatch.setattr(ctypes.pythonapi, "PyThreadState_SetAsyncExc", set_async_exc)
    outer_lost = threading.Event()
    calls_when_told: list[int] = []
    nested_end = "nested run ended"

    @other.task(bind=True, base=ZkLockTask, lock_key=["n"], lazy=False)
    def inner(self: Any, n: int) -> int:
        expire_session(zk_hosts, outer_client)
        assert outer_lost.wait(30)
        return n

    @app.task(bind=True, base=ZkLockTask, lock_key=["n"], lazy=False)
    def outer(self: Any, n: int) -> str:
        inner(n)
        calls.append((threading.get_ident(), nested_end))
        return "ran"

    outer_client = client_of(outer)

    def on_lost(sender: Any, path: str = "", **_: Any) -> None:
        if sender is outer:
            calls_when_told.append(len(calls))
            outer_lost.set()

    signals.lock_lost.connect(on_lost, weak=False)
    outcome: list[BaseException | str] = []

    def run() -> None:
        try:
            outcome.append(outer(1))
        except BaseException as exc:
            outcome.append(exc)

    try:
        runner = threading.Thread(target=run)
        runner.start()
        runner.join(60)
    finally:
        signals.lock_lost.disconnect(on_lost)
    assert len(outcome) == 1 and isinstance(outcome[0], LockLost)  # lost: never SUCCESS
    thread_id = runner.ident
    assert thread_id is not None
    assert calls[0] == (thread_id, LockLost)  # the outer run's interruption
    assert calls_when_told == [1]  # set before the lock_lost receivers ran
    ended = calls.index((thread_id, nested_end))
    assert (thread_id, None) not in calls[:ended]  # the nested run withdrew nothing


@pytest.mark.parametrize("variable", ["ZKLOCK_INTERRUPT_SIGNAL", "ZKLOCK_REVOKE_SIGNAL"])
def test_a_signal_that_breaks_soft_time_limits_is_refused_at_the_first_task(
    app: Celery, zk_client: KazooClient, monkeypatch: pytest.MonkeyPatch, variable: str
) -> None:
    ran: list[int] = []

    @app.task(bind=True, base=ZkLockTask, lock_key=["n"], lazy=False)
    def job(self: Any, n: int) -> None:
        ran.append(n)

    monkeypatch.setenv(variable, "SIGUSR1")
    with pytest.raises(ConfigurationError) as refused:
        job(1)
    message = str(refused.value)
    assert f"{variable}='SIGUSR1'" in message and "soft time limits" in message
    assert "SIGUSR2" in message and "SIGRTMIN" in message
    assert ran == []
    assert contenders(zk_client, app.conf.zklock_root) == []  # the lock was released
    for name in ("SIGTERM", "SIGALRM", "SIGKILL", "SIGCHLD", "NOPE"):
        monkeypatch.setenv(variable, name)
        with pytest.raises(ConfigurationError, match=f"{variable}='{name}'"):
            interrupt_signal()
    monkeypatch.setenv(variable, "SIGRTMIN+2")
    assert interrupt_signal() == signal.SIGRTMIN + 2
    job(2)
    assert ran == [2]


def test_a_worker_does_not_start_with_a_refused_signal(
    taskenv: tuple[Celery, dict[str, str], Path],
) -> None:
    app, env, tmp = taskenv
    env = {**env, "ZKLOCK_REVOKE_SIGNAL": "SIGUSR1"}
    with pytest.raises(RuntimeError, match="exited") as refused:
        worker = start_worker(app, "prefork", "badsignal", env, tmp, queue="badsignal")
        worker.stop()
    assert "ZKLOCK_REVOKE_SIGNAL='SIGUSR1'" in str(refused.value)
