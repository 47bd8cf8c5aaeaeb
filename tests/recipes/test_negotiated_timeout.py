"""The negotiated session timeout, learned from a real server: capped below what the client asked
for, and for a client whose handshake happened before celery_zklock could see it."""

from __future__ import annotations

import time

from kazoo.client import KazooClient

from celery_zklock import Mutex
from celery_zklock.testing.plugin import StackFactory
from celery_zklock.zk import adapter


def test_the_server_capped_timeout_is_known_for_a_client_started_first(
    zk_stack_factory: StackFactory, lock_root: str
) -> None:
    """Deliver 2: asked 20 s, the server caps at 4 s, client started before any lock object."""
    server = zk_stack_factory.server(max_session_timeout_ms=4000)
    client = KazooClient(server.hosts, timeout=20)
    client.start(timeout=15)
    try:
        assert Mutex(client, f"{lock_root}/k").session_timeout == 4.0
    finally:
        client.stop()
        client.close()


def test_an_unseen_handshake_is_learned_by_one_reconnect(
    zk_stack_factory: StackFactory, lock_root: str
) -> None:
    """A client whose handshake happened before the hook (simulated by forgetting it) is made
    to reconnect once, keeping its session; no lease is handed out before the timeout is known."""
    server = zk_stack_factory.server(max_session_timeout_ms=4000)
    client = KazooClient(server.hosts, timeout=20)
    client.start(timeout=15)
    try:
        del client._connection._zklock_negotiated_timeout
        assert adapter.negotiated_timeout(client) is None
        session = client.client_id
        mutex = Mutex(client, f"{lock_root}/k")
        started = time.monotonic()
        with mutex.acquire(timeout=10) as lease:
            assert lease.held
        assert adapter.negotiated_timeout(client) == 4.0
        assert client.client_id == session  # same session, one reconnect
        assert time.monotonic() - started < 10
    finally:
        client.stop()
        client.close()
