"""Duplicate delivery in real `celery worker`s: a copy of a message whose task already has a node
in the lock's queue never runs the body beside or after a live original, and a copy whose
original died runs (see celery_zklock/task/delivery.py)."""

from __future__ import annotations

import os
import re
import signal
from pathlib import Path
from typing import Any

import pytest
from celery import Celery
from kazoo.client import KazooClient

from celery_zklock import Mutex
from celery_zklock.testing.plugin import StackFactory
from tests.lockutil import wait_for
from tests.taskapp import read_records
from tests.workerproc import Worker, contenders, start_worker, workers

TaskEnv = tuple[Celery, dict[str, str], Path]


def deliveries(worker: Worker, task_id: str) -> tuple[int, int]:
    """How many deliveries of ``task_id`` the worker received, and how many of them ended."""
    log = worker.log_text()
    received = len(re.findall(rf"\[{task_id}\] received", log))
    ended = len(re.findall(rf"\[{task_id}\] (succeeded|ignored|raised|retry)", log))
    return received, ended


def all_deliveries_ended(worker: Worker, *task_ids: str) -> bool:
    counts = [deliveries(worker, task_id) for task_id in task_ids]
    return all(received == ended for received, ended in counts)


def decided(worker: Worker, task_id: str, events: tuple[str, ...]) -> int:
    """Lines where a delivery of ``task_id`` logged one of the zklock ``events``."""
    lines = worker.log_text().splitlines()
    return sum(
        1
        for line in lines
        if f"task_id={task_id}" in line and any(f"event={e} " in line for e in events)
    )


def test_copy_of_an_exclusive_original_waiting_in_the_queue_is_ignored(
    taskenv: TaskEnv, zk_client: KazooClient
) -> None:
    """The original waits behind another holder (not at the head); its message comes back
    (Redis visibility timeout) while it waits. Only the original may run the body."""
    app, env, tmp = taskenv
    from tests.taskapp import acked_late

    # Without the gate: the gate would give the held original back to the broker at 80 % of
    # the visibility timeout, again and again, and never let it wait in the queue (where a
    # copy can meet it), which is the case under test.
    env = {**env, "TASKAPP_VISIBILITY_TIMEOUT": "1", "ZKLOCK_GATE": "false"}
    worker = start_worker(app, "threads", "dupx", env, tmp, queue="dupx", concurrency=10)
    try:
        blocker = acked_late.apply_async(("fx", 60.0), queue=worker.queue)
        wait_for(lambda: read_records(tmp / "starts-fx"), 30, "the blocker to hold the lock")
        wait = {"on_busy": "wait", "timeout": 60}
        original = acked_late.apply_async(("fx", 60.0), queue=worker.queue, zklock=wait)
        # the original waits, and a copy of its message made its own decision
        events = ("busy", "same-delivery-waits")
        wait_for(lambda: decided(worker, original.id, events) >= 2, 30, "a copy to arrive")
        (tmp / "release-fx").touch()
        assert original.get(timeout=60)["token"] > 0
        wait_for(lambda: all_deliveries_ended(worker, blocker.id, original.id), 60, "every copy")
        log = worker.log_text()
    finally:
        worker.stop()
    starts = [s["task_id"] for s in read_records(tmp / "starts-fx")]
    assert starts == [blocker.id, original.id]  # each body once: no copy ran after its original
    assert "event=duplicate-ignored" in log
    wait_for(lambda: not contenders(zk_client, "late"), 10, "the lock nodes to go")


def test_copy_of_a_shared_original_never_runs_beside_it(
    taskenv: TaskEnv, zk_client: KazooClient
) -> None:
    """A shared (read) run's copy would be granted beside it: it must see its original."""
    app, env, tmp = taskenv
    from tests.taskapp import acked_late_shared

    env = {**env, "TASKAPP_VISIBILITY_TIMEOUT": "1"}
    with workers(app, "threads", 1, env, tmp, prefix="dups") as (worker,):
        original = acked_late_shared.apply_async(("sh", 60.0), queue=worker.queue)
        wait_for(lambda: read_records(tmp / "starts-sh"), 30, "the original to start")
        wait_for(
            lambda: (
                decided(worker, original.id, ("same-delivery-waits",)) >= 1
                or len(read_records(tmp / "starts-sh")) > 1
            ),
            30,
            "a copy to arrive",
        )
        (tmp / "release-sh").touch()
        assert original.get(timeout=60)["token"] > 0
        wait_for(lambda: all_deliveries_ended(worker, original.id), 60, "every copy")
    starts = [s["task_id"] for s in read_records(tmp / "starts-sh")]
    assert starts == [original.id]
    wait_for(lambda: not contenders(zk_client, "late"), 10, "the lock nodes to go")


def test_copy_of_a_killed_child_runs_under_a_session_timeout_raised_by_the_server(
    taskenv: TaskEnv, zk_stack_factory: StackFactory
) -> None:
    """The workers ask for 1 s sessions; the server's minimum (2 ticks of 4 s) makes them 8 s.
    The dead child's node lives up to 8 s + a tick: the requeued copy must wait that long (the
    negotiated timeout, not the requested one) and then run, not be ignored."""
    app, env, tmp = taskenv
    from tests.taskapp import acked_late

    server = zk_stack_factory.server(tick_time_ms=4000)
    env = {**env, "ZKLOCK_HOSTS": server.hosts, "ZKLOCK_SESSION_TIMEOUT": "1"}
    with workers(app, "prefork", 1, env, tmp, prefix="neg") as (worker,):
        result = acked_late.apply_async(("ng", 60.0), queue=worker.queue)
        wait_for(lambda: read_records(tmp / "starts-ng"), 30, "the first run to start")
        (first,) = read_records(tmp / "starts-ng")
        os.kill(first["pid"], signal.SIGKILL)
        (tmp / "release-ng").touch()  # the rerun need not hold for long
        value: Any = result.get(timeout=60)
        log = worker.log_text()
    first_run, second_run = read_records(tmp / "starts-ng")
    assert second_run["task_id"] == result.id and second_run["token"] > first_run["token"]
    assert result.state == "SUCCESS" and value == {"token": second_run["token"]}
    waits = re.findall(r"event=same-delivery-waits .*grace=([0-9.]+)", log)
    assert waits and float(waits[0]) >= 1.5 * 8 + 1
    assert "event=duplicate-ignored" not in log


@pytest.mark.parametrize("where", ["same-worker", "other-worker"])
def test_a_resend_under_the_same_task_id_held_at_the_gate_behind_its_run_is_ignored(
    taskenv: TaskEnv, where: str
) -> None:
    """docs/brokers.md: send a lost task again under the same task id; "a locked task's copy
    that meets a run of the same id still going is ignored, so a resend too many does not run
    twice". With the gate (the default) the resend is held behind its own call's run, on that
    worker or another, and goes to the pool once that run released the lock, a moment before
    its result is stored: it must be ignored, not run the body again. Before the fix the gate's
    resend took the free lock and ran a second time (the check was the pool run's, which with
    the gate never meets the original's node)."""
    app, env, tmp = taskenv
    from tests.taskapp import acked_late

    with workers(app, "prefork", 2, env, tmp, prefix="resend") as fleet:
        first, second = fleet
        other = first if where == "same-worker" else second
        original = acked_late.apply_async(("rs", 2.0), queue=first.queue)
        wait_for(lambda: read_records(tmp / "starts-rs"), 30, "the original to hold the lock")
        wait = {"on_busy": "wait", "timeout": 60}
        acked_late.apply_async(("rs", 2.0), queue=other.queue, task_id=original.id, zklock=wait)
        assert original.get(timeout=60)["token"] > 0
        wait_for(
            lambda: all(deliveries(w, original.id)[0] == deliveries(w, original.id)[1] >= 1
                        for w in {first, other}),
            60, "both deliveries to end",
        )  # fmt: skip
        log = other.log_text()
    starts = [s["task_id"] for s in read_records(tmp / "starts-rs")]
    assert starts == [original.id], starts  # the body ran once
    assert f"event=duplicate-ignored task_id={original.id}" in log, log[-3000:]


@pytest.mark.parametrize("on_busy", ["retry", "skip"])
def test_a_copy_of_a_finished_call_that_meets_a_busy_key_is_ignored(
    taskenv: tuple[Celery, dict[str, str], Path],
    redis_url: str,
    zk_client: KazooClient,
    on_busy: str,
) -> None:
    """docs/brokers.md: a copy of a call that already ended "finds the final state and is
    ignored", whatever the key is doing. The broker hands a failing call's message out again
    while its body runs (its consumer cancelled, so the copy waits in the queue); the body
    fails; the copy is fetched while another holder has the key. It must be ignored: before,
    it applied its busy policy first, writing RETRY (``retry``: then its retry found no final
    state and ran the failed body again) or a skip (``skip``) over the FAILURE."""
    app, env, tmp = taskenv
    from tests.task.test_debounce import _hand_out_again
    from tests.task.test_gate_faults import settled
    from tests.taskapp import gated_failing

    key = f"bf-{on_busy}"
    with workers(app, "prefork", 1, env, tmp) as (worker,):
        overrides = {"on_busy": on_busy, "retry_countdown": 0.5}
        call = gated_failing.apply_async((key, 2.0), queue=worker.queue, zklock=overrides)
        wait_for(lambda: read_records(tmp / f"starts-{key}"), 30, "the body")
        app.control.cancel_consumer(worker.queue, destination=[worker.nodename], reply=True)
        _hand_out_again(app, call.id)
        with pytest.raises(ValueError):
            call.get(timeout=30, propagate=True)
        lease = Mutex(zk_client, gated_failing.lock_path(key, 2.0)).acquire(timeout=10)
        try:
            app.control.add_consumer(worker.queue, destination=[worker.nodename], reply=True)
            wait_for(
                lambda: (
                    "event=duplicate-ignored" in worker.log_text()
                    or gated_failing.AsyncResult(call.id).state != "FAILURE"
                ),
                30,
                "the copy to end",
            )
        finally:
            lease.release()
        wait_for(settled(app, redis_url, worker.queue), 60, "every copy to be dealt with")
    assert [r["task_id"] for r in read_records(tmp / f"starts-{key}")] == [call.id]
    assert gated_failing.AsyncResult(call.id).state == "FAILURE"
