"""ZooKeeper gone while a task waits for its lock: the task meets ZooKeeperUnavailable (a retry in
a worker, the error itself when called directly), never its timeout policy."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest
from celery import Celery

from celery_zklock import ZkLockTask, ZooKeeperUnavailable, is_skipped, signals
from celery_zklock.testing.plugin import StackFactory
from tests.lockutil import task_client, wait_for
from tests.workerproc import held_session, workers


def test_zookeeper_stopped_during_a_wait_is_unavailable_not_a_timeout_skip(
    zk_stack_factory: StackFactory, lock_root: str
) -> None:
    server = zk_stack_factory.server()
    app = Celery("unavailable", set_as_current=False)
    app.conf.zklock_hosts = server.hosts
    app.conf.zklock_root = lock_root
    app.conf.zklock_session_timeout = 4.0
    inside, leave, waiting = threading.Event(), threading.Event(), threading.Event()
    shared = {"lock_name": "one-lock", "lock_key": [], "lazy": False}

    @app.task(bind=True, base=ZkLockTask, **shared)
    def holder(self: Any) -> str:
        inside.set()
        while not leave.is_set():  # interruptible: its lease is lost once ZooKeeper is gone
            leave.wait(0.01)
        return "held"

    @app.task(
        bind=True, base=ZkLockTask, lock_on_busy="wait", lock_timeout=3.0,
        lock_on_timeout="skip", **shared,
    )  # fmt: skip
    def waiter(self: Any) -> str:
        return "ran"

    def on_busy(sender: Any, **_: Any) -> None:
        if sender is waiter:
            waiting.set()

    outcomes: dict[str, Any] = {}

    def run(name: str, task: Any) -> None:
        try:
            outcomes[name] = task()
        except BaseException as exc:
            outcomes[name] = exc

    signals.lock_busy.connect(on_busy, weak=False)
    threads = [threading.Thread(target=run, args=("holder", holder))]
    try:
        threads[0].start()
        assert inside.wait(30)
        threads.append(threading.Thread(target=run, args=("waiter", waiter)))
        threads[1].start()
        assert waiting.wait(30)  # the waiter waits for the holder's lock
        server.stop()
        threads[1].join(60)
    finally:
        signals.lock_busy.disconnect(on_busy)
        leave.set()
        for thread in threads:
            thread.join(60)
        task_client(holder).stop()
    outcome = outcomes["waiter"]
    assert not is_skipped(outcome), "a ZooKeeper outage was taken for a lock timeout"
    assert isinstance(outcome, ZooKeeperUnavailable), outcome
    assert "ZooKeeper" in str(outcome) and "one-lock" in str(outcome)


def test_in_a_worker_an_outage_during_a_wait_retries_then_fails_unavailable(
    taskenv: tuple[Celery, dict[str, str], Path], zk_stack_factory: StackFactory
) -> None:
    app, env, tmp = taskenv
    from tests.taskapp import long_hold

    server = zk_stack_factory.server()
    env = {**env, "ZKLOCK_HOSTS": server.hosts, "ZKLOCK_CONNECT_TIMEOUT": "1"}
    # The wait must be the pool run's (the gate's own: tests/task/test_gate.py).
    env["ZKLOCK_GATE"] = "false"
    with workers(app, "threads", 1, env, tmp, prefix="outage") as (worker,):
        holder = long_hold.apply_async(("zo", 60.0), queue=worker.queue)
        held_session(tmp, holder.id)
        policy = {"timeout": 3.0, "on_timeout": "skip", "retry_countdown": 0.2}
        policy["on_unavailable"] = "retry"  # riding the outage out: test_outage_rideout.py
        waiter = long_hold.apply_async(("zo", 0.1), queue=worker.queue, zklock=policy)
        wait_for(lambda: f"event=busy task_id={waiter.id}" in worker.log_text(), 30, "the wait")
        server.stop()
        with pytest.raises(Exception) as failure:
            waiter.get(timeout=120)
        log = worker.log_text()
    assert type(failure.value).__name__ == "ZooKeeperUnavailable"  # not a skip, no timeout
    assert waiter.state == "FAILURE"
    retries = [line for line in log.splitlines() if f"[{waiter.id}] retry" in line]
    assert len(retries) == 3, retries  # Celery's max_retries (3), each with the reason
    assert all("ZooKeeperUnavailable" in line for line in retries)


def test_in_a_worker_a_long_wait_gives_up_on_a_dead_zookeeper(
    taskenv: tuple[Celery, dict[str, str], Path], zk_stack_factory: StackFactory
) -> None:
    """Issue 34: a run waiting under lock_timeout 120 s (session timeout 4 s) leaves its wait
    within 5 session timeouts of ZooKeeper dying, naming ZooKeeperUnavailable, and goes on
    under the ``unavailable`` policy (retries, then FAILURE). Before the fix: it sat in its
    wait for the full 120 s."""
    app, env, tmp = taskenv
    from tests.conftest import SESSION_TIMEOUT
    from tests.taskapp import long_hold

    server = zk_stack_factory.server()
    env = {**env, "ZKLOCK_HOSTS": server.hosts, "ZKLOCK_CONNECT_TIMEOUT": "1"}
    env["ZKLOCK_GATE"] = "false"  # the wait must be the pool run's (the gate's: test_gate.py)
    with workers(app, "threads", 1, env, tmp, prefix="dead") as (worker,):
        holder = long_hold.apply_async(("zd", 60.0), queue=worker.queue)
        held_session(tmp, holder.id)
        policy = {"timeout": 120.0, "retry_countdown": 0.2, "on_unavailable": "retry"}
        waiter = long_hold.apply_async(("zd", 0.1), queue=worker.queue, zklock=policy)
        wait_for(lambda: f"event=busy task_id={waiter.id}" in worker.log_text(), 30, "the wait")
        server.stop()
        stopped = time.monotonic()
        first_retry = f"[{waiter.id}] retry"
        wait_for(lambda: first_retry in worker.log_text(), 5 * SESSION_TIMEOUT, "the wait to end")
        left = time.monotonic() - stopped
        with pytest.raises(Exception) as failure:
            waiter.get(timeout=60)
        log = worker.log_text()
    retries = [line for line in log.splitlines() if first_retry in line]
    assert "ZooKeeperUnavailable" in retries[0] and "session timeout" in retries[0], retries[0]
    assert left < 5 * SESSION_TIMEOUT, left
    assert type(failure.value).__name__ == "ZooKeeperUnavailable"
    assert waiter.state == "FAILURE"
    assert len(retries) == 3, retries  # Celery's max_retries (3), each with the reason
