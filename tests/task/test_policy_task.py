"""The policy table's rows through a real locked task (called directly: the same code path as
in a worker); the pure table is tested row by row in tests/unit/test_policy_table.py."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import pytest
from celery import Celery
from celery.exceptions import Retry
from kazoo.client import KazooClient

from celery_zklock import (
    LockBusy,
    LockLost,
    LockTimeout,
    ReadWriteLock,
    ZkLockTask,
    ZooKeeperUnavailable,
    is_skipped,
)
from celery_zklock.testing import free_port
from tests.lockutil import expire_session, task_client, wait_for


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
        ({"lock_on_busy": "retry"}, LockBusy),  # a direct call's retry raises the error
        ({"lock_on_busy": "raise"}, LockBusy),
        ({"lock_on_busy": "wait", "lock_timeout": 0.2, "lock_on_timeout": "skip"}, "skipped"),
        ({"lock_on_busy": "wait", "lock_timeout": 0.2, "lock_on_timeout": "retry"}, LockTimeout),
        ({"lock_on_busy": "wait", "lock_timeout": 0.2, "lock_on_timeout": "raise"}, LockTimeout),
    ],
    ids=["busy-skip", "busy-retry", "busy-raise", "timeout-skip", "timeout-retry", "timeout-raise"],
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
