"""The lock state after a task's life goes off the happy path, in real `celery worker`s.

Retry from the body, redelivery of a running task's message, soft and hard time limits,
``kill -9`` of the process holding a lock, ZooKeeper unreachable when a worker starts; the
retry and the killed child's message on Redis and on RabbitMQ (the ``broker`` fixture). "Right"
means: released at once where the process survives, freed through session expiry (and not
before) where it dies, nothing left behind, and the task accounted for with a clear reason.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
from celery import Celery
from kazoo.client import KazooClient

from celery_zklock import is_skipped
from celery_zklock.testing import free_port
from celery_zklock.testing.rabbitmq import RabbitMQServer
from tests.conftest import SESSION_TIMEOUT, Broker
from tests.lockutil import wait_for
from tests.taskapp import read_records
from tests.workerproc import contenders, held_session, workers

TaskEnv = tuple[Celery, dict[str, str], Path]


def test_retry_from_the_body_waits_for_its_own_lock_and_keeps_call_options(
    taskenv: TaskEnv, broker: Broker, zk_client: KazooClient
) -> None:
    """On Redis and RabbitMQ: the retry is a new message, published while the lock is held."""
    app, _, tmp = taskenv
    env = broker.env
    from tests.taskapp import retry_once

    with workers(app, "prefork", 1, env, tmp) as (worker,):
        result = retry_once.apply_async(("rt",), queue=worker.queue, zklock={"on_busy": "raise"})
        value = result.get(timeout=30)
    attempts = read_records(tmp / "attempts-rt")
    assert [a["retries"] for a in attempts] == [0, 1]
    # the per-call override travelled with the retry, yet the retry did not fail LockBusy on
    # its own earlier attempt's lock: it waited for it
    assert [a["on_busy"] for a in attempts] == ["raise", "raise"]
    assert attempts[1]["token"] > attempts[0]["token"]
    assert value == {"token": attempts[1]["token"], "retries": 1}
    wait_for(lambda: not contenders(zk_client, "retry"), 5, "the retry's lock node to go")


def test_redelivered_message_of_a_running_task_is_ignored_not_run_twice(
    taskenv: TaskEnv, zk_client: KazooClient
) -> None:
    app, env, tmp = taskenv
    from tests.taskapp import acked_late

    # acks_late + a 1 s visibility timeout: Redis hands the unacknowledged message out again
    # while the first delivery is still running. A copy waits 1.5 session timeouts + 1 s for
    # the lock (in case the first delivery's process died), then finds it still held.
    env = {**env, "TASKAPP_VISIBILITY_TIMEOUT": "1"}
    hold = 1.5 * SESSION_TIMEOUT + 3.0
    with workers(app, "threads", 1, env, tmp) as (worker,):
        result = acked_late.apply_async(("rd", hold), queue=worker.queue)
        value = result.get(timeout=30)
        log = worker.log_text()
    assert "event=duplicate-ignored" in log and result.id in log
    starts = read_records(tmp / "starts-rd")
    assert [s["task_id"] for s in starts] == [result.id]  # the body ran once
    assert result.state == "SUCCESS" and not is_skipped(value) and value["token"] > 0
    wait_for(lambda: not contenders(zk_client, "late"), 5, "the lock node to go")


@pytest.mark.parametrize("broker", ["amqp"], indirect=True)
def test_copy_handed_out_when_rabbitmq_closed_the_channel_is_ignored_not_run_twice(
    taskenv: TaskEnv, broker: Broker, rabbitmq_server: RabbitMQServer, zk_client: KazooClient
) -> None:
    """RabbitMQ's redelivery of a running task's message: the node closes the worker's
    connection (as a passed ``consumer_timeout`` closes its channel) while an ``acks_late`` run
    holds the lock; the message goes back to the queue and the reconnected worker gets it
    again. The copy waits 1.5 session timeouts + 1 s for the lock (the first run's process
    might have died), finds it still held by a live run of the same task id, and is ignored."""
    app, _, tmp = taskenv
    from tests.taskapp import acked_late

    with workers(app, "threads", 1, broker.env, tmp, prefix="closed") as (worker,):
        result = acked_late.apply_async(("cc", 60.0), queue=worker.queue)
        wait_for(lambda: read_records(tmp / "starts-cc"), 30, "the first run to start")
        rabbitmq_server.close_connections("the test: as consumer_timeout would")
        wait_for(lambda: "event=duplicate-ignored" in worker.log_text(), 30, "the copy's end")
        (tmp / "release-cc").touch()  # the original holds until the copy was decided
        value = result.get(timeout=30)
        log = worker.log_text()
    assert log.count(f"[{result.id}] received") == 2, log[-6000:]
    starts = read_records(tmp / "starts-cc")
    assert [s["task_id"] for s in starts] == [result.id]  # the body ran once
    assert result.state == "SUCCESS" and not is_skipped(value) and value["token"] > 0
    wait_for(lambda: not contenders(zk_client, "late"), 5, "the lock node to go")


def test_message_of_a_killed_prefork_child_runs_again_once_its_lock_is_free(
    taskenv: TaskEnv, broker: Broker, zk_client: KazooClient
) -> None:
    """On Redis (the message restored to its list) and RabbitMQ (``basic_reject`` with requeue:
    back at the head of the queue at once, flagged redelivered)."""
    app, _, tmp = taskenv
    env = broker.env
    from tests.taskapp import acked_late

    # acks_late + reject_on_worker_lost: Celery hands the message out again at once, while the
    # dead child's lock node still holds the lock under this very task id
    with workers(app, "prefork", 1, env, tmp) as (worker,):
        result = acked_late.apply_async(("wl", 30.0), queue=worker.queue)
        wait_for(lambda: read_records(tmp / "starts-wl"), 30, "the first run to start")
        (first,) = read_records(tmp / "starts-wl")
        os.kill(first["pid"], signal.SIGKILL)
        (tmp / "release-wl").touch()  # the rerun need not hold for long
        value = result.get(timeout=SESSION_TIMEOUT * 4)
        log = worker.log_text()
    starts = read_records(tmp / "starts-wl")
    assert len(starts) == 2, (value, starts, log[-6000:])
    first_run, second_run = starts
    assert second_run["task_id"] == result.id and second_run["token"] > first_run["token"]
    assert result.state == "SUCCESS" and value == {"token": second_run["token"]}
    # The copy waits for the dead child's node (event=same-delivery-waits) unless the pool took
    # longer than the session timeout to hand it out again (seen under load): either way, never
    # ignored.
    assert "event=duplicate-ignored" not in log
    wait_for(lambda: not contenders(zk_client, "late"), 5, "the lock node to go")


def test_soft_time_limit_releases_the_lock_at_once(
    taskenv: TaskEnv, zk_client: KazooClient
) -> None:
    """The soft limit ends the body and the run releases its lock before the task's failure is
    reported: "at once" is that order of events in the worker's log (the run's ``released``
    event, not lost, then Celery's failure line), not a time bound. The child and its session
    live on, so a node the run left would stay: the wait for it to go is a hang guard."""
    app, env, tmp = taskenv
    from tests.taskapp import long_hold

    with workers(app, "prefork", 1, env, tmp) as (worker,):
        result = long_hold.apply_async(("sl", 30.0), queue=worker.queue, soft_time_limit=1)
        with pytest.raises(Exception, match="SoftTimeLimitExceeded"):
            result.get(timeout=30)
        released = f"zklock event=released task_id={result.id} "
        failed = f"[{result.id}] raised unexpected: SoftTimeLimitExceeded"
        wait_for(lambda: failed in worker.log_text(), 30, "the task's failure line")
        log = worker.log_text()
        assert released in log, log[-4000:]
        assert log.index(released) < log.index(failed), log[-4000:]
        (event,) = [line for line in log.splitlines() if released in line]
        assert "lost=False" in event, event
        wait_for(lambda: not contenders(zk_client, "long"), 30, "the released node to go")
        again = long_hold.apply_async(("sl", 0.1), queue=worker.queue)
        assert again.get(timeout=30) == "finished"


def test_hard_time_limit_frees_the_lock_through_the_session(
    taskenv: TaskEnv, zk_client: KazooClient
) -> None:
    app, env, tmp = taskenv
    from tests.taskapp import long_hold

    with workers(app, "prefork", 1, env, tmp) as (worker,):
        result = long_hold.apply_async(("hl", 30.0), queue=worker.queue, time_limit=2)
        victim = held_session(tmp, result.id)
        with pytest.raises(Exception, match="TimeLimitExceeded"):
            result.get(timeout=30)
        # the child was killed: its node lives until the server expires the session
        wait_for(lambda: not contenders(zk_client, "long"), SESSION_TIMEOUT * 3, "expiry")
        again = long_hold.apply_async(("hl", 0.1), queue=worker.queue)
        assert again.get(timeout=30) == "finished"
        assert held_session(tmp, again.id)["token"] > victim["token"]


@pytest.mark.parametrize("pool", ["prefork", "solo"])
def test_kill_9_of_the_holder_frees_the_lock_only_through_the_session(
    pool: str, taskenv: TaskEnv, zk_client: KazooClient
) -> None:
    app, env, tmp = taskenv
    from tests.taskapp import long_hold

    with workers(app, pool, 2, env, tmp) as (first, second):
        result = long_hold.apply_async(("kl", 60.0), queue=first.queue)
        victim = held_session(tmp, result.id)
        os.kill(victim["pid"], signal.SIGKILL)  # a prefork child, or the solo worker itself
        # until the server expires the dead session the lock stays held: a skip-mode
        # contender is told so, naming the dead holder
        probe = long_hold.apply_async(("kl", 0.1), queue=second.queue, zklock={"on_busy": "skip"})
        skipped = probe.get(timeout=30)
        assert is_skipped(skipped) and skipped["holder"] == result.id
        wait_for(lambda: not contenders(zk_client, "long"), SESSION_TIMEOUT * 3, "expiry")
        successor = long_hold.apply_async(("kl", 0.1), queue=second.queue)
        assert successor.get(timeout=30) == "finished"
        assert held_session(tmp, successor.id)["token"] > victim["token"]
    wait_for(lambda: not contenders(zk_client, "long"), 5, "nothing left behind")


def test_unreachable_zookeeper_at_start_retries_then_fails_with_the_reason(
    taskenv: TaskEnv,
) -> None:
    app, env, tmp = taskenv
    from tests.taskapp import needs_zk

    dead = f"127.0.0.1:{free_port()}"
    env = {**env, "ZKLOCK_HOSTS": dead, "ZKLOCK_CONNECT_TIMEOUT": "0.5"}
    with workers(app, "threads", 1, env, tmp) as (worker,):
        # Retried, not sent back to ride the outage out (tests/task/test_outage_rideout.py).
        ride_out = {"on_unavailable": "retry"}
        result = needs_zk.apply_async(("uz",), queue=worker.queue, zklock=ride_out)
        with pytest.raises(Exception) as failure:
            result.get(timeout=60)
        log = worker.log_text()
    assert type(failure.value).__name__ == "ZooKeeperUnavailable"
    assert f"could not connect to ZooKeeper at {dead!r}" in str(failure.value)
    assert result.state == "FAILURE"
    assert log.count("Retry in") == 2  # max_retries=2, then the failure: nothing lost
