"""The fleet's ``broker_restart`` fault on a RabbitMQ broker (``--broker-kind amqp``): the node
is SIGKILLed and started again with its database, and every message the fleet's app published
(publisher confirms, persistent messages, durable queues) is still in its queue afterwards.
No workers: what happens to a running fleet is the load test's to show."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest
import redis
from kombu import Connection

from celery_zklock.testing.rabbitmq import RabbitMQServer
from workers.app import create_app
from workers.faults import FaultEnvironment, FaultInjector
from workers.settings import Settings


@pytest.fixture
def rabbitmq() -> Iterator[RabbitMQServer]:
    """A node of this test's own: the fault kills it (the session's node serves other tests)."""
    with RabbitMQServer() as server:
        yield server


def test_broker_restart_of_rabbitmq_keeps_every_confirmed_message(
    rabbitmq: RabbitMQServer, redis_url: str, zk_hosts: str
) -> None:
    run_id = uuid.uuid4().hex[:10]
    settings = Settings(
        zk_hosts=zk_hosts, broker_url=rabbitmq.url, result_backend=redis_url, record_url=redis_url
    )
    app = create_app(settings, main=f"restart-{run_id}")
    assert app.conf.broker_transport_options == {"confirm_publish": True}
    queue = f"restart-{run_id}"
    sent = [app.send_task("workers.noop", (i,), queue=queue).id for i in range(20)]
    records = redis.Redis.from_url(redis_url)
    env = FaultEnvironment(run_id, records, zk_hosts, 10.0, broker=rabbitmq)
    try:
        # No section will open (no workers): the fault goes ahead after target_timeout.
        record = FaultInjector(env, {"broker_restart": 1}, target_timeout=0.1).inject(
            "broker_restart"
        )
        assert record.ran, record
        assert record.target == f"broker RabbitMQ on port {rabbitmq.port}", record
        assert "SIGKILL and restart of the broker RabbitMQ; down" in record.detail, record
        assert record.ended is not None and record.ended >= record.time
        with Connection(rabbitmq.url) as conn:  # type: ignore[no-untyped-call]
            bound = app.amqp.queues[queue](conn.default_channel)
            kept = []
            while (message := bound.get(no_ack=True)) is not None:
                kept.append(message.headers["id"])
        assert kept == sent
    finally:
        records.close()
        app.close()
