"""A RabbitMQ ``consumer_timeout`` and the gate, on real prefork workers, RabbitMQ and ZooKeeper
(issue 42, Deliver 2). RabbitMQ does not tell clients its ``consumer_timeout``, so a gate whose
``zklock_gate_max_hold`` is above it holds messages until the server closes the worker's
channel. What happens then is asserted as measured (docs/brokers.md, "consumer_timeout"): the
worker exits, unless Celery's ``broker_channel_error_retry`` is on, in which case its consumer
reconnects and the worker runs on; either way the held messages go back to the queue (with
the worker gone, all of them run on another worker), and each body runs once, never beside
another. With ``zklock_gate_max_hold`` below the server's value the channel is never closed:
the gate gives its held messages back first.

The session's RabbitMQ node gets a short ``consumer_timeout``, checked every second (RabbitMQ
3.10 checks every 60 s), for the channels opened during the test, and its defaults back after.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from celery import Celery
from kazoo.client import KazooClient
from kombu import Connection

from celery_zklock import Mutex
from celery_zklock.testing import RabbitMQServer
from celery_zklock.testing.celery_worker import celery_command, wait_until_answering
from tests.conftest import Broker
from tests.lockutil import wait_for
from tests.task.test_gate import held_at_gate
from tests.taskapp import read_records
from tests.workerproc import ROOT, STOP_GRACE, Worker

pytestmark = pytest.mark.fault  # minutes of real time: make test-faults

CONSUMER_TIMEOUT = 6.0
"""Seconds the node lets a delivery stay unacknowledged in this module's tests: above the 2 s a
redelivered call spends in the pool before its body (its settle look) and the body's 0.2 s,
with room for a loaded machine."""
CHECK_EVERY = 1.0
"""Seconds between the node's looks at a channel's deliveries (``channel_tick_interval``)."""
BELOW = 2.0
"""A ``zklock_gate_max_hold`` below :data:`CONSUMER_TIMEOUT` (the right configuration)."""
ABOVE = 60.0
"""A ``zklock_gate_max_hold`` above it (the misconfiguration)."""
KEY = "ct"
CALLS = 4
GATE_CONNECTED = "MainProcess] Zookeeper connection established"
TIMED_OUT = "PRECONDITION_FAILED - delivery acknowledgement on channel"
CONNECTED = re.compile(r"MainProcess\] Connected to amqp://")


@pytest.fixture
def short_consumer_timeout(rabbitmq_server: RabbitMQServer) -> Iterator[None]:
    """:data:`CONSUMER_TIMEOUT` on the session's node while the test runs."""
    rabbitmq_server.set_consumer_timeout(CONSUMER_TIMEOUT, check_every=CHECK_EVERY)
    try:
        yield
    finally:
        rabbitmq_server.set_consumer_timeout(1800.0)


def start(
    app: Celery, name: str, env: dict[str, str], tmp: Path, max_hold: float, *settings: str
) -> Worker:
    """A prefork worker (concurrency 2) whose gate holds a message at most ``max_hold`` s,
    consuming ``q0`` once its gate is connected (until its client connects, the gate lets
    messages through to the pool); ``settings`` are Celery settings (``name=value``) for its
    command line."""
    command = [*celery_command("tests.taskapp", "prefork", 2), *settings]
    worker = Worker(
        command,
        nodename=f"{name}@%h",
        queues=[f"idle-{name}"],
        log_path=tmp / f"worker-{name}.log",
        cwd=ROOT,
        env={**env, "ZKLOCK_GATE_MAX_HOLD": str(max_hold)},
    )
    worker.spawn()
    try:
        wait_until_answering(app, [worker], timeout=60)
        wait_for(lambda: GATE_CONNECTED in worker.log_text(), 60, f"{name}'s gate to connect")
        answer = app.control.add_consumer("q0", destination=[worker.nodename], reply=True)
        assert answer and "ok" in answer[0][worker.nodename], answer
    except BaseException:
        worker.stop(STOP_GRACE)
        raise
    return worker


def hold_calls(broker: Broker, zk: KazooClient) -> tuple[Any, list[str]]:
    """Take the calls' lock from here and send :data:`CALLS` calls; the lease and their ids."""
    from tests.taskapp import gated_step

    lease = Mutex(zk, gated_step.lock_path(KEY, 0, 0.0)).acquire(timeout=10)
    ids = [broker.send("gated_step", (KEY, i, 0.2), "q0").id for i in range(CALLS)]
    return lease, ids


def held(app: Celery) -> int:
    return sum(counts["held"] for counts in held_at_gate(app).values())


def given_back(worker: Worker, task_id: str) -> int:
    """How many times ``worker``'s gate gave the call ``task_id`` back to the broker."""
    return sum(
        1
        for line in worker.log_text().splitlines()
        if "go back to the broker:" in line and task_id in line
    )


def settled(broker: Broker) -> Callable[[], bool]:
    """A predicate: no message of ``q0`` is left, in the queue or in a worker (held at its gate,
    reserved, scheduled or running), so no copy of a call can still run."""

    def check() -> bool:
        with Connection(broker.url) as conn:  # type: ignore[no-untyped-call]
            _, ready, _ = conn.default_channel.queue_declare("q0", passive=True)
        if ready or held(broker.sender):
            return False
        inspect = broker.sender.control.inspect(timeout=1.0)
        for answer in (inspect.active(), inspect.reserved(), inspect.scheduled()):
            if answer is None or any(answer.values()):
                return False
        return True

    return check


def ran_once_one_at_a_time(tmp: Path, ids: list[str]) -> list[dict[str, Any]]:
    """Assert that each call's body started and ended exactly once and that no two bodies
    overlapped (the records alternate: start, then end of the same call); the starts."""
    records = read_records(tmp / f"steps-{KEY}")
    starts = [r for r in records if r["at"] == "start"]
    assert Counter(r["task_id"] for r in starts) == Counter(ids), records
    for begun, ended in zip(records[::2], records[1::2], strict=True):
        assert (begun["at"], ended["at"], begun["task_id"]) == (
            "start",
            "end",
            ended["task_id"],
        ), records
    return starts


def ended(tmp: Path) -> int:
    return sum(1 for r in read_records(tmp / f"steps-{KEY}") if r["at"] == "end")


@pytest.mark.parametrize("broker", ["amqp"], indirect=True)
@pytest.mark.parametrize("channel_retry", [False, True], ids=["default", "channel_error_retry"])
def test_a_max_hold_above_consumer_timeout_loses_the_channel_and_no_call(
    broker: Broker,
    taskenv: tuple[Celery, dict[str, str], Path],
    short_consumer_timeout: None,
    zk_client: KazooClient,
    channel_retry: bool,
) -> None:
    """The misconfiguration: worker A's gate may hold a message 60 s, the server's
    ``consumer_timeout`` is 6 s. A holds four calls behind a lock taken here; worker B
    (``zklock_gate_max_hold`` 2 s) consumes the same queue. The server closes A's channel
    (406 PRECONDITION_FAILED): with Celery's defaults A exits with an error; with
    ``broker_channel_error_retry=True`` its consumer reconnects and it runs on. The held
    messages go back to the queue (B receives them: in the default case all of them run on B);
    once the lock is free each body runs once, one at a time."""
    _, _, tmp = taskenv
    sender = broker.sender
    settings = ["broker_channel_error_retry=true"] if channel_retry else []
    a = start(sender, "a", broker.env, tmp, ABOVE, *settings)
    b: Worker | None = None
    lease, ids = hold_calls(broker, zk_client)
    try:
        wait_for(lambda: held(sender) == CALLS, 60, "A's gate to hold the calls")
        b = start(sender, "b", broker.env, tmp, BELOW)
        wait_for(lambda: TIMED_OUT in a.log_text(), 120, "the server to close A's channel")
        if channel_retry:
            wait_for(lambda: len(CONNECTED.findall(a.log_text())) >= 2, 60,
                     "A's consumer to connect again")  # fmt: skip
        else:
            wait_for(lambda: not a.is_running(), 60, "A to exit")
        lease.release()
        wait_for(lambda: ended(tmp) >= CALLS, 120, "the calls to run")
        wait_for(settled(broker), 120, "every copy to be dealt with")
        if channel_retry:
            wait_until_answering(sender, [a], timeout=60)  # raises if A exited
    finally:
        lease.release()
        for worker in (a, b):
            if worker is not None:
                worker.stop(STOP_GRACE)
    starts = ran_once_one_at_a_time(tmp, ids)
    assert b is not None
    if not channel_retry:
        assert "Unrecoverable error: PreconditionFailed" in a.log_text()
        assert a.returncode == 1  # Celery's EX_FAILURE, after a warm shutdown
        assert {r["worker"] for r in starts} == {b.nodename}, starts


@pytest.mark.parametrize("broker", ["amqp"], indirect=True)
def test_a_max_hold_below_consumer_timeout_keeps_the_channel(
    broker: Broker,
    taskenv: tuple[Celery, dict[str, str], Path],
    short_consumer_timeout: None,
    zk_client: KazooClient,
) -> None:
    """The right configuration: ``zklock_gate_max_hold`` 2 s under a 6 s ``consumer_timeout``.
    The gate gives its held calls back before the server's bound, and again each time they
    come back, until the first was held four times (8 s, past the server's bound and its next
    check); the channel is never closed, the worker runs on, and each body runs once when the
    lock is free."""
    _, _, tmp = taskenv
    sender = broker.sender
    worker = start(sender, "a", broker.env, tmp, BELOW)
    lease, ids = hold_calls(broker, zk_client)
    try:
        wait_for(
            lambda: given_back(worker, ids[0]) >= 4 or TIMED_OUT in worker.log_text(),
            120,
            "the gate to give the calls back, again and again",
        )
        assert TIMED_OUT not in worker.log_text()
        lease.release()
        wait_for(lambda: ended(tmp) >= CALLS, 120, "the calls to run")
        wait_for(settled(broker), 120, "every copy to be dealt with")
        wait_until_answering(sender, [worker], timeout=60)  # raises if it exited
    finally:
        lease.release()
        worker.stop(STOP_GRACE)
    ran_once_one_at_a_time(tmp, ids)
    assert TIMED_OUT not in worker.log_text()
    assert len(CONNECTED.findall(worker.log_text())) == 1  # one connection, never lost
