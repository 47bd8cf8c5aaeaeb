"""Interrupting a body whose lease was lost: one interruption per run, nested runs, the signal.

In this process (direct calls, ``apply()``) on a real ZooKeeper, and `celery worker`s for the
signal check at worker start.
"""

from __future__ import annotations

import ctypes
import signal
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from celery import Celery
from kazoo.client import KazooClient

from celery_zklock import ConfigurationError, LockLost, ZkLockTask, signals
from celery_zklock.task.interrupt import Interruption, _MainThreadSignal, arm, interrupt_signal
from tests.lockutil import (
    children,
    expire_session,
    let_interruption_land,
    task_client,
)
from tests.workerproc import start_worker


@pytest.fixture
def app(zk_hosts: str, lock_root: str) -> Iterator[Celery]:
    app = Celery("interrupt", set_as_current=False)
    app.conf.zklock_hosts = zk_hosts
    app.conf.zklock_root = lock_root
    yield app


def contenders(zk: KazooClient, root: str) -> list[str]:
    """Every contender node under ``root`` (``<root>/<lock name>/<key>/<node>``)."""
    return [
        node
        for name in children(zk, root)
        for key in children(zk, f"{root}/{name}")
        for node in children(zk, f"{root}/{name}/{key}")
    ]


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

    @app.task(bind=True, base=ZkLockTask, lock_key=["n"], lazy=False, shared=False)
    def inner(self: Any, n: int) -> int:
        return n

    @app.task(bind=True, base=ZkLockTask, lock_key=["n"], lazy=False, shared=False)
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

    @other.task(bind=True, base=ZkLockTask, lock_key=["n"], lazy=False, shared=False)
    def inner(self: Any, n: int) -> int:
        expire_session(zk_hosts, outer_client)
        assert outer_lost.wait(30)
        return n

    @app.task(bind=True, base=ZkLockTask, lock_key=["n"], lazy=False, shared=False)
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


class HookedInterruption:
    """A run's real interruption, with the test choosing when it fires and when it is disarmed.

    ``fire`` (on the thread that found the loss) says ``firing`` and waits for ``may_fire``
    before firing for real, then says ``fired``. ``before_disarm`` runs once, before the first
    disarm."""

    def __init__(self, real: Interruption, before_disarm: Callable[[], None] | None) -> None:
        self.real = real
        self.strategy = real.strategy
        self.before_disarm = before_disarm
        self.firing = threading.Event()  # the loss is recorded; fire waits for may_fire
        self.may_fire = threading.Event()
        self.fired = threading.Event()

    def fire(self, reason: str) -> None:
        self.firing.set()
        self.may_fire.wait(30)
        try:
            self.real.fire(reason)
        finally:
            self.fired.set()

    def stand_down(self) -> None:
        self.real.stand_down()

    def disarm(self) -> None:
        before, self.before_disarm = self.before_disarm, None
        if before is not None:
            before()
        self.real.disarm()


def hook_interruptions(
    monkeypatch: pytest.MonkeyPatch, before_disarm: Callable[[], None] | None = None
) -> list[HookedInterruption]:
    """Every run armed from now on gets a :class:`HookedInterruption`; the list holds them."""
    hooked: list[HookedInterruption] = []

    def arm_hooked() -> HookedInterruption:
        hooked.append(HookedInterruption(arm(), before_disarm))
        return hooked[-1]

    monkeypatch.setattr("celery_zklock.task.run.arm", arm_hooked)
    return hooked


def call_on(where: str, call: Callable[[], Any]) -> BaseException | Any:
    """``call()`` on the main thread (the signal) or a thread of its own (an async exception);
    what it returned or raised."""
    outcome: list[Any] = []

    def run() -> None:
        try:
            outcome.append(call())
        except BaseException as exc:
            outcome.append(exc)

    if where == "main thread":
        run()
    else:
        runner = threading.Thread(target=run)
        runner.start()
        runner.join(60)
    assert len(outcome) == 1
    return outcome[0]


@pytest.mark.parametrize("where", ["main thread", "worker thread"])
def test_a_body_told_by_check_is_not_interrupted_again(
    app: Celery, zk_hosts: str, monkeypatch: pytest.MonkeyPatch, where: str
) -> None:
    """The loss is recorded, the body's ``self.lock.check()`` raises, and only then does the
    lease clock's thread fire the interruption: the body, in its ``except`` and ``finally``,
    gets no second LockLost (it did before: a fleet task lost its exit record so)."""
    hooked = hook_interruptions(monkeypatch)
    told: list[str] = []

    @app.task(bind=True, base=ZkLockTask, lock_key=["n"], lazy=False, shared=False)
    def job(self: Any, n: int) -> str:
        expire_session(zk_hosts, client)
        assert hooked[0].firing.wait(30)  # lost, and its interruption not yet fired
        try:
            self.lock.check()
        except LockLost:
            told.append("by check")
            hooked[0].may_fire.set()
            try:
                assert hooked[0].fired.wait(30)
                let_interruption_land()
            except LockLost:
                told.append("interrupted")
            raise
        return "ran"

    client = client_of(job)
    before = signal.getsignal(signal.SIGUSR2)
    outcome = call_on(where, lambda: job(1))
    assert isinstance(outcome, LockLost) and "was lost while the task ran" in str(outcome)
    assert told == ["by check"]
    assert hooked[0].strategy == ("signal" if where == "main thread" else "async-exception")
    assert signal.getsignal(signal.SIGUSR2) is before


@pytest.mark.parametrize("where", ["main thread", "worker thread"])
def test_an_interruption_after_the_body_returned_ends_the_run_as_lost(
    app: Celery, zk_hosts: str, monkeypatch: pytest.MonkeyPatch, where: str
) -> None:
    """The lease is lost after the body returned, and the interruption lands before the run
    disarmed it: the run still ends under ``lock_on_lost`` (the verdict's message, not the raw
    LockLost of the interruption) and is disarmed."""
    returned: list[int] = []

    def lose_the_lease_now() -> None:
        expire_session(zk_hosts, client)
        hooked[0].may_fire.set()
        assert hooked[0].fired.wait(30)
        let_interruption_land()

    hooked = hook_interruptions(monkeypatch, before_disarm=lose_the_lease_now)

    @app.task(bind=True, base=ZkLockTask, lock_key=["n"], lazy=False, shared=False)
    def job(self: Any, n: int) -> str:
        returned.append(n)
        return "ran"

    client = client_of(job)
    before = signal.getsignal(signal.SIGUSR2)
    outcome = call_on(where, lambda: job(1))
    assert returned == [1]
    assert isinstance(outcome, LockLost), outcome
    assert "was lost while the task ran" in str(outcome)  # the lost verdict, not a raw LockLost
    assert signal.getsignal(signal.SIGUSR2) is before
    assert _MainThreadSignal._armed == []


@pytest.mark.parametrize("variable", ["ZKLOCK_INTERRUPT_SIGNAL", "ZKLOCK_REVOKE_SIGNAL"])
def test_a_signal_that_breaks_soft_time_limits_is_refused_at_the_first_task(
    app: Celery, zk_client: KazooClient, monkeypatch: pytest.MonkeyPatch, variable: str
) -> None:
    ran: list[int] = []

    @app.task(bind=True, base=ZkLockTask, lock_key=["n"], lazy=False, shared=False)
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
