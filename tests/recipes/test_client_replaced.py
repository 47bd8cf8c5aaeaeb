"""A process's cached ZooKeeper client whose connection loop gave up for good is replaced by
the next get_client, instead of failing every call until the process ends."""

from __future__ import annotations

import time
from typing import Any

from kazoo.retry import KazooRetry

from celery_zklock.zk import adapter
from celery_zklock.zk.client import get_client
from celery_zklock.zk.settings import ClientConfig


def test_a_client_that_gave_up_is_replaced(zk_stack_factory: Any) -> None:
    server = zk_stack_factory.server()
    # A retry policy that gives up at once, so the loop ends while the server is down.
    retry = KazooRetry(max_tries=1, delay=0.05, max_delay=0.05)
    config = ClientConfig(hosts=server.hosts, connect_timeout=10,
                          extra=(("connection_retry", retry),))  # fmt: skip
    first = get_client(config)
    port = server.port
    server.stop()
    deadline = time.monotonic() + 30
    while not adapter.connection_gave_up(first):
        assert time.monotonic() < deadline, "the connection loop did not give up"
        time.sleep(0.05)
    again = zk_stack_factory.server(port_picker=lambda: port)
    second = get_client(config)
    assert second is not first and second.connected
    assert second.exists("/") is not None
    second.stop()
    del again
