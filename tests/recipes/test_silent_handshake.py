"""A server that takes a client's connection and never answers its handshake costs the client a
third of its session timeout, not the session (celery_zklock.zk.client.HANDSHAKE_WAIT_SHARE).

ZooKeeper does this in its first moments after a start: a connection made before it serves is
failed, and closing it throws (ZOOKEEPER-5051, in 3.8.0 as Debian ships it), so it stays open
and silent. kazoo waits the whole session timeout (over the number of hosts) for the answer; one
host, one reconnect that landed there, and the session the client carried had expired on the
server by the time it tried again (seen in tests/task/test_reconnect_worker.py, a pool process
back 4.5 s after a 4 s session's server). Here a proxy in front of a real ZooKeeper drops the
server's answer to the reconnect's handshake."""

from __future__ import annotations

import threading
import time

from kazoo.protocol.states import KazooState

from celery_zklock.testing.proxy import TcpProxy
from celery_zklock.zk.client import (
    HANDSHAKE_WAIT_SHARE,
    RECONNECT_JITTER,
    RECONNECT_MAX_DELAY,
    new_client,
)
from celery_zklock.zk.settings import ClientConfig
from tests.lockutil import wait_for

SESSION_TIMEOUT = 6.0
SLACK = 1.0
"""Seconds for a busy machine's scheduling, on top of the wait and one reconnect interval."""


def test_an_unanswered_handshake_is_given_up_before_the_session_is(proxy: TcpProxy) -> None:
    client = new_client(ClientConfig(hosts=proxy.address, session_timeout=SESSION_TIMEOUT))
    back, lost = threading.Event(), threading.Event()

    def listener(state: str) -> None:
        if state == KazooState.CONNECTED:
            back.set()
        elif state == KazooState.LOST:
            lost.set()

    client.start(timeout=10)
    client.add_listener(listener)
    try:
        session = client.client_id[0]
        accepted, dropped = proxy.connections_accepted, proxy.bytes_dropped
        proxy.drop_responses = True
        proxy.cut()
        # The client connects again and sends its handshake; ZooKeeper's answer is dropped.
        wait_for(lambda: proxy.bytes_dropped > dropped, 10, "the answer to the handshake")
        silent_from = time.monotonic()
        assert proxy.connections_accepted == accepted + 1
        proxy.drop_responses = False
        assert back.wait(2 * SESSION_TIMEOUT), "the client did not connect again"
        lag = time.monotonic() - silent_from
        client.exists("/")  # it serves
        assert client.client_id[0] == session and not lost.is_set(), "the session was lost"
    finally:
        client.stop()
        client.close()
    bound = SESSION_TIMEOUT * HANDSHAKE_WAIT_SHARE + RECONNECT_MAX_DELAY * (1 + RECONNECT_JITTER)
    print(f"\nconnected again {lag:.2f}s after the unanswered handshake (bound {bound:.2f}s)")
    assert lag <= bound + SLACK
