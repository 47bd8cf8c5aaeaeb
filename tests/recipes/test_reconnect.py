"""A ZooKeeper that comes back after an outage: the library's clients are connected again, in the
session they had, within one reconnect of its answering (a bounded, jittered reconnect schedule,
not kazoo's, whose waits grow to an hour; a handshake the restarting server never answers is
given up after a third of the session timeout), and the process's log gives the outage's true
length (celery_zklock.zk.client, celery_zklock.zk.outages). On a real server, SIGKILLed and
started again on the same port and data."""

from __future__ import annotations

import logging
import re
import socket
import threading
import time

import pytest
from kazoo.client import KazooClient
from kazoo.protocol.states import KazooState
from kazoo.retry import KazooRetry

from celery_zklock.testing.plugin import StackFactory
from celery_zklock.zk import outages
from celery_zklock.zk.client import (
    HANDSHAKE_WAIT_SHARE,
    RECONNECT_JITTER,
    RECONNECT_MAX_DELAY,
    new_client,
)
from celery_zklock.zk.settings import ClientConfig

OUTAGE = 16.0
"""Seconds ZooKeeper is away: kazoo's own schedule would wait 6.4 then 12.8 s between tries by
then, ours at most 0.625 s."""
SESSION_TIMEOUT = 10.0
BACK_WITHIN = (
    SESSION_TIMEOUT * HANDSHAKE_WAIT_SHARE + RECONNECT_MAX_DELAY * (1 + RECONNECT_JITTER) + 0.75
)
"""Seconds after the port listens again: a handshake the restarting server did not answer, one
reconnect wait, 0.75 s for a busy machine (4.7 s; kazoo's schedule: 6.4 s or more)."""
ANSWERS_AGAIN = re.compile(r"answers again after ([\d.]+)s out of reach")


def test_the_clients_built_here_reconnect_on_a_bounded_schedule() -> None:
    client = new_client(ClientConfig(hosts="127.0.0.1:1"))
    policy = client._conn_retry
    assert policy.max_tries == -1  # never give up
    assert policy.max_delay * (1 + policy.max_jitter) <= 0.7
    assert (policy.max_delay, policy.max_jitter) == (RECONNECT_MAX_DELAY, RECONNECT_JITTER)
    own = KazooRetry(max_tries=3, max_delay=5.0)
    config = ClientConfig(hosts="127.0.0.1:1", extra=(("connection_retry", own),))
    assert new_client(config)._conn_retry is own  # the application's own policy wins


class _Listening:
    """A thread that notes the first instant (monotonic) a port accepts a TCP connection again:
    the earliest a client could reach the restarted server."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.at: float | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)

    def __enter__(self) -> _Listening:
        self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._stop.set()
        self._thread.join(5)

    def _poll(self) -> None:
        while not self._stop.is_set():
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.2).close()
            except OSError:
                time.sleep(0.005)
                continue
            self.at = time.monotonic()
            return


@pytest.mark.fault
def test_a_client_is_back_in_its_session_and_logs_the_outage_length(
    zk_stack_factory: StackFactory, caplog: pytest.LogCaptureFixture
) -> None:
    server = zk_stack_factory.server()
    caplog.set_level(logging.WARNING, logger="celery_zklock.session")
    outages.reset()
    config = ClientConfig(hosts=server.hosts, session_timeout=SESSION_TIMEOUT)
    client: KazooClient = new_client(config)
    connected: list[float] = []
    suspended = threading.Event()
    back = threading.Event()

    def listener(state: str) -> None:
        if state == KazooState.CONNECTED:
            connected.append(time.monotonic())
            back.set()
        else:
            suspended.set()

    client.add_listener(listener)
    client.start(timeout=10)
    session = client.client_id[0]
    try:
        back.clear()
        killed_at = time.monotonic()
        server.kill()
        assert suspended.wait(10)
        time.sleep(OUTAGE)  # the outage itself, not a wait for an event
        with _Listening(server.node.port) as listening:
            server.restart()
        assert listening.at is not None
        assert back.wait(10), "the client did not reconnect"
        client.exists("/")  # it serves
        assert client.client_id[0] == session, "the client connected in a new session"
    finally:
        client.stop()
        client.close()
    lag = connected[-1] - listening.at
    true_length = listening.at - killed_at
    logged = [ANSWERS_AGAIN.search(r.getMessage()) for r in caplog.records]
    lengths = [float(m.group(1)) for m in logged if m]
    print(f"\nreconnected {lag:.2f}s after the port listened; outage {true_length:.1f}s, "
          f"logged {lengths}")  # fmt: skip
    assert lag <= BACK_WITHIN
    assert len(lengths) == 1
    # The logged length is how long the client was out of reach, until it connected again
    # (the lag above is bounded): off by the lag it would not be the client's own outage.
    assert abs(lengths[0] - (connected[-1] - killed_at)) <= 0.5, (lengths, true_length, lag)
