"""The fleet's broker settings on a real Redis: what a dead worker held comes back."""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import time
from typing import Any

from kombu import Connection
from kombu.transport.redis import Mutex

from workers.settings import broker_transport_options

VISIBILITY = 1.0
QUEUE = "redelivery-test"


def _die_holding_a_message_and_the_restore_mutex(url: str, options: dict[str, Any]) -> None:
    """A worker killed inside kombu's sweep: it received a message (not acknowledged) and holds
    the restore mutex when it dies, with no clean-up (no close, no release)."""
    with Connection(url, transport_options=options) as conn:
        queue = conn.SimpleQueue(QUEUE)
        queue.get(timeout=10)  # unacknowledged: kombu keeps it in its unacked index
        qos = conn.default_channel.qos
        client = conn.default_channel.client
        with Mutex(client, qos.unacked_mutex_key, qos.unacked_mutex_expire):
            os._exit(0)


def test_a_worker_killed_inside_the_restore_sweep_delays_redelivery_seconds_not_minutes(
    redis_url: str,
) -> None:
    """kombu's sweep for overdue messages holds a Redis mutex that lapses after
    ``unacked_mutex_expire`` (300 s by default). A fleet worker SIGKILLed inside the sweep left it
    held, so no message came back for five minutes and a fault run lost its task at double load.
    With the fleet's options the message is back within seconds (before: not within 30 s)."""
    options = broker_transport_options(VISIBILITY)
    with Connection(redis_url, transport_options=options) as conn:
        conn.SimpleQueue(QUEUE).put({"n": 1})
    child = multiprocessing.get_context("spawn").Process(
        target=_die_holding_a_message_and_the_restore_mutex, args=(redis_url, options)
    )
    child.start()
    child.join(30)
    assert child.exitcode == 0
    with Connection(redis_url, transport_options=options) as conn:
        queue = conn.SimpleQueue(QUEUE)
        qos = conn.default_channel.qos
        assert qos.channel.client.exists(qos.unacked_mutex_key), "the dead sweeper's mutex"
        started = time.monotonic()
        message = None
        while message is None and time.monotonic() - started < 30:
            qos.restore_visible(num=100, interval=1)  # what every live worker's sweep does
            with contextlib.suppress(queue.Empty):
                message = queue.get(timeout=0.2)
        assert message is not None, "the dead worker's message did not come back within 30 s"
        assert message.payload == {"n": 1}
        message.ack()
        assert time.monotonic() - started < options["unacked_mutex_expire"] + VISIBILITY + 5
