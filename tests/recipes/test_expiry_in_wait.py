"""A session expiry met by the watch of a blocking acquire's wait starts the acquire over.

The same expiry met one request earlier (the listing) already made a new attempt with a new node;
met by the ``exists`` that sets the watch on the node in our way, it escaped as
ZooKeeperUnavailable although the holder was alive and the client reconnected at once.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import pytest
from kazoo.client import KazooClient
from kazoo.protocol.states import KazooState

from celery_zklock import Mutex
from celery_zklock.testing.proxy import TcpProxy
from tests.lockutil import expire_session_id, in_thread, wait_for


class ExpireBeforeWatch(KazooClient):
    """Cuts its connection, sends its first watched ``exists`` (queued while it reconnects) and
    expires its session on the server, once armed."""

    proxy: TcpProxy
    server_hosts: str

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.armed = threading.Event()
        self.fired = threading.Event()
        self.disconnected = threading.Event()
        self.add_listener(self._note_state)

    def _note_state(self, state: str) -> None:
        if state != KazooState.CONNECTED:
            self.disconnected.set()

    def exists_async(self, path: str, watch: Any = None) -> Any:
        if watch is None or not self.armed.is_set() or self.fired.is_set():
            return super().exists_async(path, watch=watch)
        session_id, password = self.client_id
        self.proxy.refuse = True
        self.proxy.cut()
        assert self.disconnected.wait(10), "the client did not see the cut"
        result = super().exists_async(path, watch=watch)
        expire_session_id(self.server_hosts, session_id, password)
        self.proxy.refuse = False
        self.fired.set()
        return result


@pytest.fixture
def waiter_client(zk_client: KazooClient) -> Iterator[ExpireBeforeWatch]:
    host, port = zk_client.hosts[0]
    with TcpProxy(host, port) as proxy:
        client = ExpireBeforeWatch(proxy.address, timeout=10)
        client.proxy = proxy
        client.server_hosts = f"{host}:{port}"
        client.start(timeout=15)
        try:
            yield client
        finally:
            client.stop()
            client.close()


def test_an_expiry_met_by_the_watch_starts_the_acquire_over(
    zk_client: KazooClient, waiter_client: ExpireBeforeWatch, lock_root: str
) -> None:
    """Before the fix: ZooKeeperUnavailable (SessionExpiredError) while the holder held."""
    path = f"{lock_root}/k"
    Mutex(waiter_client, f"{lock_root}/warm").acquire(timeout=5).release()  # timeout known
    holder = Mutex(zk_client, path).acquire(timeout=5)
    try:
        old_session = waiter_client.client_id[0]
        waiter_client.armed.set()
        thread, outcome = in_thread(lambda: Mutex(waiter_client, path).acquire(timeout=60))
        assert waiter_client.fired.wait(20), "the waiter never watched the holder"
        # The failed exists registered no watcher, and the expiry drops kazoo's watchers: a
        # watcher on the holder's node now is a new attempt's.
        wait_for(
            lambda: "error" in outcome or bool(waiter_client._data_watchers.get(holder.node)),
            30,
            "the waiter to start over (or fail)",
        )
        assert "error" not in outcome, repr(outcome)
        assert waiter_client.client_id[0] != old_session
    finally:
        holder.release()
    thread.join(30)
    lease = outcome.get("value")
    assert lease is not None, repr(outcome)
    assert lease.held, lease.lost_reason
    assert waiter_client.exists(lease.node).ephemeralOwner == waiter_client.client_id[0]
    lease.release()
