"""The policy table's rows through a real locked task (called directly: the same code path as
in a worker); the pure table is tested row by row in tests/unit/test_policy_table.py.

A direct call's ``self.retry`` only re-raises the error, so a ``retry`` row is not shown by a
direct call: it runs through ``apply()`` (Celery's eager mode runs the retry in place, with its
``retries`` count one up) and through a real ``celery worker``, where the retry is a published
message that runs once the lock is free.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from celery import Celery
from celery.exceptions import Retry
from celery.signals import task_retry
from celery.utils.dispatch import Signal
from kazoo.client import KazooClient

from celery_zklock import (
    LockBusy,
    LockLost,
    LockTimeout,
    ReadWriteLock,
    ZkLockTask,
    ZooKeeperUnavailable,
    is_skipped,
    signals,
)
from celery_zklock.errors import ZkLockError
from celery_zklock.testing import free_port
from celery_zklock.testing.witness import check_witness
from tests.lockutil import expire_session, task_client, wait_for
from tests.workerproc import workers

TaskEnv = tuple[Celery, dict[str, str], Path]


@pytest.fixture
def app(zk_hosts: str, lock_root: str) -> Iterator[Celery]:
    app = Celery("policy", set_as_current=False)
    app.conf.zklock_hosts = zk_hosts
    app.conf.zklock_root = lock_root
    app.conf.zklock_session_timeout = 4.0
    yield app


def _task(app: Celery, **options: Any) -> Any:
    @app.task(bind=True, base=ZkLockTask, lock_key=["n"], lazy=False, **options)
    def job(self: Any, n: int) -> str:
        return "ran"

    return job


def _path(app: Celery, job: Any, n: int) -> str:
    spec = job._zklock_compile()
    return f"{app.conf.zklock_root}/{spec.options.name}/{spec.keys((n,), {})}"


def _hold(zk_client: KazooClient, app: Celery, job: Any, n: int) -> Any:
    """Take ``job``'s lock for argument ``n`` with another client (the write side)."""
    return ReadWriteLock(zk_client, _path(app, job, n)).write.acquire(timeout=5)


@pytest.mark.parametrize(
    ("options", "expect"),
    [
        ({"lock_on_busy": "skip"}, "skipped"),
        ({"lock_on_busy": "raise"}, LockBusy),
        ({"lock_on_busy": "wait", "lock_timeout": 0.2, "lock_on_timeout": "skip"}, "skipped"),
        ({"lock_on_busy": "wait", "lock_timeout": 0.2, "lock_on_timeout": "raise"}, LockTimeout),
    ],
    ids=["busy-skip", "busy-raise", "timeout-skip", "timeout-raise"],
)
def test_busy_and_timeout_rows_through_a_task(
    app: Celery, zk_client: KazooClient, options: dict[str, Any], expect: Any
) -> None:
    job = _task(app, **options)
    holder = _hold(zk_client, app, job, 1)
    try:
        if expect == "skipped":
            result = job(1)
            assert is_skipped(result)
            assert result["reason"] == ("busy" if options["lock_on_busy"] == "skip" else "timeout")
        else:
            with pytest.raises(expect):
                job(1)
    finally:
        holder.release()


RETRY_ROWS: dict[str, tuple[dict[str, Any], Signal, type[ZkLockError]]] = {
    "busy-retry": ({"lock_on_busy": "retry"}, signals.lock_busy, LockBusy),
    "timeout-retry": (
        {"lock_on_busy": "wait", "lock_timeout": 0.2, "lock_on_timeout": "retry"},
        signals.lock_timeout,
        LockTimeout,
    ),
}
"""Each ``retry`` row: the task's options, the signal its run sends when the row applies (busy,
or a wait that reached ``lock_timeout``), and the error its retry carries."""


@pytest.mark.parametrize("row", list(RETRY_ROWS))
def test_retry_rows_retry_the_call_which_runs_once_the_lock_is_free(
    app: Celery, zk_client: KazooClient, row: str
) -> None:
    """The first attempt meets the held lock and retries with the row's error; the holder lets
    go as that attempt applies the row, so the retry (``retries`` = 1) runs the body."""
    options, situation, error = RETRY_ROWS[row]
    runs: list[int] = []

    @app.task(bind=True, base=ZkLockTask, lock_key=["n"], lazy=False, max_retries=1, **options)
    def job(self: Any, n: int) -> str:
        runs.append(self.request.retries)
        return "ran"

    holder = _hold(zk_client, app, job, 1)
    met: list[str] = []
    retried: list[Retry] = []

    def let_go(sender: Any = None, **fields: Any) -> None:
        if sender is job:
            met.append(fields["policy"])
            holder.release()

    def on_retry(sender: Any = None, reason: Any = None, **_: Any) -> None:
        if sender is job:
            retried.append(reason)

    situation.connect(let_go, weak=False)
    task_retry.connect(on_retry, weak=False)
    try:
        result = job.apply((1,))
    finally:
        task_retry.disconnect(on_retry)
        situation.disconnect(let_go)
        holder.release()
    assert met == ["retry"]  # the row applied once, on the first attempt
    assert [type(reason.exc) for reason in retried] == [error]  # a Retry carrying the error
    assert result.get() == "ran" and runs == [1]  # the body ran once, on the retry


@pytest.mark.parametrize("row", list(RETRY_ROWS))
def test_retry_rows_give_up_after_max_retries_with_their_error(
    app: Celery, zk_client: KazooClient, row: str
) -> None:
    """A lock held throughout: ``max_retries`` retries (each attempt applies the row), then the
    call fails with the row's error, and the body never ran."""
    options, situation, error = RETRY_ROWS[row]
    runs: list[int] = []

    @app.task(bind=True, base=ZkLockTask, lock_key=["n"], lazy=False, max_retries=2, **options)
    def job(self: Any, n: int) -> str:
        runs.append(self.request.retries)
        return "ran"

    met: list[str] = []

    def count(sender: Any = None, **fields: Any) -> None:
        if sender is job:
            met.append(fields["policy"])

    holder = _hold(zk_client, app, job, 1)
    situation.connect(count, weak=False)
    try:
        result = job.apply((1,))
    finally:
        situation.disconnect(count)
        holder.release()
    assert met == ["retry"] * 3  # the first attempt and its 2 retries
    assert result.state == "FAILURE" and isinstance(result.result, error)
    assert runs == []


@pytest.mark.parametrize(
    ("row", "policy"),
    [
        ("busy-retry", {"on_busy": "retry"}),
        ("timeout-retry", {"on_busy": "wait", "timeout": 0.5, "on_timeout": "retry"}),
    ],
)
def test_retry_rows_in_a_worker_publish_a_retry_that_runs(
    taskenv: TaskEnv, zk_client: KazooClient, row: str, policy: dict[str, Any]
) -> None:
    """In a real ``celery worker``: the attempt that meets the held lock ends RETRY (a new
    message, sent with the row's error); once the holder lets go, a retry runs the body once
    and the call ends SUCCESS with its ``retries`` count above 0.

    Each retry waits 2 s (``retry_countdown``) and the task has Celery's 3: the test lets go as
    soon as it reads RETRY, before the third retry (6 s later) would give up."""
    app, env, tmp = taskenv
    from tests.taskapp import exclusive_section

    key = f"retry-{row}"
    holder = ReadWriteLock(zk_client, exclusive_section.lock_path(key, 0.0)).write.acquire(
        timeout=5
    )
    try:
        with workers(app, "prefork", 1, env, tmp) as (worker,):
            result = exclusive_section.apply_async(
                (key, 0.0), queue=worker.queue, zklock={**policy, "retry_countdown": 2.0}
            )
            wait_for(lambda: result.state in ENDED, 30, "the first attempt to end")
            assert result.state == "RETRY", (result.state, result.result)
            holder.release()
            value = result.get(timeout=60)
            log = worker.log_text()
    finally:
        holder.release()
    assert not is_skipped(value) and result.retries >= 1
    retries = [line for line in log.splitlines() if f"[{result.id}] retry" in line]
    assert retries and all(RETRY_ROWS[row][2].__name__ in line for line in retries), retries
    assert check_witness(tmp / f"witness-{key}").sections == 1  # the body ran once


ENDED = ("RETRY", "FAILURE", "SUCCESS")
"""The states an attempt ends in."""


def test_busy_wait_row_through_a_task(app: Celery, zk_client: KazooClient) -> None:
    job = _task(app, lock_on_busy="wait", lock_timeout=30)
    holder = _hold(zk_client, app, job, 1)
    outcome: list[Any] = []
    runner = threading.Thread(target=lambda: outcome.append(job(1)))
    runner.start()
    try:
        path = _path(app, job, 1)
        wait_for(lambda: len(zk_client.get_children(path)) == 2, 10, "the waiter's node")
    finally:
        holder.release()
    runner.join(10)
    assert outcome == ["ran"]


@pytest.mark.parametrize("on_lost", ["raise", "retry"])
def test_lost_rows_through_a_task(
    app: Celery, zk_hosts: str, on_lost: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    inside, leave = threading.Event(), threading.Event()

    @app.task(bind=True, base=ZkLockTask, lock_key=["n"], lock_on_lost=on_lost, lazy=False)
    def job(self: Any, n: int) -> str:
        inside.set()
        while not leave.is_set():
            leave.wait(0.01)
        return "ran"

    retried: list[BaseException] = []

    def retry(*args: Any, exc: BaseException | None = None, **kwargs: Any) -> BaseException:
        assert exc is not None
        retried.append(exc)
        return Retry(exc=exc)

    monkeypatch.setattr(job, "retry", retry)
    outcome: list[BaseException] = []

    def run() -> None:
        try:
            job(1)
        except BaseException as exc:
            outcome.append(exc)

    runner = threading.Thread(target=run)
    runner.start()
    try:
        assert inside.wait(10)
        expire_session(zk_hosts, task_client(job))
        runner.join(15)
    finally:
        leave.set()
        runner.join(10)
    if on_lost == "raise":
        assert isinstance(outcome[0], LockLost) and not retried
    else:
        assert isinstance(outcome[0], Retry) and isinstance(retried[0], LockLost)


def test_unavailable_row_through_a_task(app: Celery) -> None:
    app.conf.zklock_hosts = f"127.0.0.1:{free_port()}"
    app.conf.zklock_connect_timeout = 0.5
    job = _task(app)
    with pytest.raises(ZooKeeperUnavailable, match="could not connect"):
        job(1)
