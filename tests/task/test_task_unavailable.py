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
from tests.workerproc import held_at_gates, held_session, workers


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


@pytest.mark.parametrize("gate", ["on", "off"])
def test_in_a_worker_raise_on_unavailable_fails_at_once_without_a_retry(
    taskenv: tuple[Celery, dict[str, str], Path], zk_stack_factory: StackFactory, gate: str
) -> None:
    """docs/concepts.md: ``lock_on_unavailable="raise"`` fails the call at once. ZooKeeper is
    killed; a call with that policy, at a gate or (gate off) straight in the pool, ends FAILURE
    ZooKeeperUnavailable, neither held until ZooKeeper answers nor retried, and its body never
    runs."""
    app, env, tmp = taskenv
    from tests.taskapp import needs_zk

    server = zk_stack_factory.server()
    env = {**env, "ZKLOCK_HOSTS": server.hosts, "ZKLOCK_GATE": "true" if gate == "on" else "false"}
    with workers(app, "prefork", 1, env, tmp, prefix=f"raise-{gate}") as (worker,):
        assert needs_zk.apply_async(("ur",), queue=worker.queue).get(timeout=30) == "ran"
        server.kill()
        if gate == "on":
            wait_for(lambda: "ZooKeeper is away" in worker.log_text(), 30, "the gate to see it")
        call = needs_zk.apply_async(("ur",), queue=worker.queue, zklock={"on_unavailable": "raise"})
        with pytest.raises(ZooKeeperUnavailable):
            call.get(timeout=60)
        log = worker.log_text()
        server.restart()
    assert call.state == "FAILURE"
    assert not [line for line in log.splitlines() if f"[{call.id}] retry" in line]
    assert log.count(f"[{call.id}] received") == 1  # not sent back to ride the outage out


def test_a_held_call_that_raises_on_unavailable_leaves_the_gate_when_zookeeper_goes(
    taskenv: tuple[Celery, dict[str, str], Path], zk_stack_factory: StackFactory
) -> None:
    """A ``wait`` call with ``lock_on_unavailable="raise"`` held at the gate behind a holder
    when ZooKeeper is killed goes to the pool and fails ZooKeeperUnavailable at once, instead
    of riding the outage out at the gate (the budget is 600 s)."""
    app, env, tmp = taskenv
    from tests.taskapp import gated_section

    server = zk_stack_factory.server()
    env = {**env, "ZKLOCK_HOSTS": server.hosts}
    with workers(app, "prefork", 1, env, tmp, prefix="raise-held") as (worker,):
        holder = gated_section.apply_async(("uh", 60.0), queue=worker.queue)
        wait_for(lambda: (tmp / "witness-uh").exists(), 30, "the holder's body")
        call = gated_section.apply_async(
            ("uh", 0.1), queue=worker.queue, zklock={"on_unavailable": "raise"}
        )
        wait_for(lambda: held_at_gates(app) == 1, 30, "the call held at the gate")
        server.kill()
        with pytest.raises(ZooKeeperUnavailable):
            call.get(timeout=60)
        server.restart()
        holder.get(timeout=60, propagate=False)
    assert call.state == "FAILURE"
