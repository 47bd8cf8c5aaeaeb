"""A client whose kazoo connection loop gave up for good: locks fail with ZooKeeperUnavailable.

kazoo ends its connection loop without ``client.stop()`` when its ``connection_retry`` policy
runs out, or when authentication fails on a reconnect; the state then stays LOST and the client
never connects again unless it is restarted. A blocking acquire, new or already waiting, used to
wait for that reconnect forever. The ordinary reconnect (the loop keeps retrying) and a client
that is still starting must not be taken for a dead one.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import pytest
from kazoo.client import KazooClient
from kazoo.protocol.states import KazooState

from celery_zklock import Mutex, ZooKeeperUnavailable
from celery_zklock.testing.proxy import TcpProxy
from celery_zklock.zk import adapter
from tests.lockutil import children, in_thread, wait_for


@pytest.fixture
def proxied_finite_retry(zk_client: KazooClient) -> Iterator[tuple[KazooClient, TcpProxy]]:
    """A client through a proxy whose connection loop gives up after two failed tries."""
    host, port = zk_client.hosts[0]
    with TcpProxy(host, port) as proxy:
        client = KazooClient(
            proxy.address, timeout=10, connection_retry={"max_tries": 2, "delay": 0.1}
        )
        client.start(timeout=15)
        try:
            yield client, proxy
        finally:
            client.stop()
            client.close()


def _watched(client: KazooClient, node: str) -> bool:
    return bool(client._data_watchers.get(node))


@pytest.mark.parametrize("when", ["parked-waiter", "new-acquire"])
def test_a_blocking_acquire_on_a_client_that_gave_up_fails(
    zk_client: KazooClient,
    proxied_finite_retry: tuple[KazooClient, TcpProxy],
    lock_root: str,
    when: str,
) -> None:
    """Before the fix both blocked forever (no deadline, and check_usable looked only at
    ``_stopped``)."""
    client, proxy = proxied_finite_retry
    path = f"{lock_root}/k"
    holder = Mutex(zk_client, path).acquire(timeout=5)
    Mutex(client, f"{lock_root}/warm").acquire(timeout=5).release()  # timeout known
    try:
        if when == "parked-waiter":
            thread, outcome = in_thread(lambda: Mutex(client, path).acquire())
            wait_for(lambda: _watched(client, holder.node), 10, "the waiter to watch the holder")
        proxy.refuse = True
        proxy.cut()
        assert client._connection.connection_stopped.wait(30), "kazoo did not give up"
        assert client.state == KazooState.LOST and not client._stopped.is_set()
        if when == "new-acquire":
            thread, outcome = in_thread(lambda: Mutex(client, path).acquire())
        thread.join(10)
        assert not thread.is_alive(), "acquire() still blocked 10 s after kazoo gave up for good"
        error = outcome.get("error")
        assert isinstance(error, ZooKeeperUnavailable), repr(outcome)
        assert "gave up" in str(error) and "client.start()" in str(error), str(error)
    finally:
        holder.release()


def test_a_client_that_gave_up_works_again_once_started(
    zk_client: KazooClient, proxied_finite_retry: tuple[KazooClient, TcpProxy], lock_root: str
) -> None:
    """As the error says: start() connects it again. (kazoo's restart() would not: its stop()
    queues a close that the new connection sends first.)"""
    client, proxy = proxied_finite_retry
    proxy.refuse = True
    proxy.cut()
    assert client._connection.connection_stopped.wait(30), "kazoo did not give up"
    with pytest.raises(ZooKeeperUnavailable, match="gave up"):
        Mutex(client, f"{lock_root}/k").acquire(timeout=5)
    proxy.refuse = False
    client.start(timeout=15)
    assert not adapter.connection_gave_up(client)
    Mutex(client, f"{lock_root}/k").acquire(timeout=5).release()


def test_a_waiter_outlives_a_reconnect_within_the_retry_policy(
    zk_client: KazooClient, lock_root: str
) -> None:
    """The loop that keeps retrying is not a loop that gave up: the parked waiter is granted the
    lock once the connection is back and the holder releases."""
    host, port = zk_client.hosts[0]
    with TcpProxy(host, port) as proxy:
        client = KazooClient(proxy.address, timeout=10)
        client.start(timeout=15)
        path = f"{lock_root}/k"
        holder = Mutex(zk_client, path).acquire(timeout=5)
        try:
            thread, outcome = in_thread(lambda: Mutex(client, path).acquire(timeout=60))
            wait_for(lambda: _watched(client, holder.node), 10, "the waiter to watch the holder")
            proxy.refuse = True
            proxy.cut()
            wait_for(lambda: client.state != KazooState.CONNECTED, 10, "the client to see the cut")
            proxy.refuse = False
            wait_for(lambda: client.state == KazooState.CONNECTED, 15, "the reconnect")
            assert len(children(zk_client, path)) == 2, "the waiter's node went with the cut"
        finally:
            holder.release()
        thread.join(30)
        lease = outcome.get("value")
        assert lease is not None, repr(outcome)
        lease.release()
        client.stop()
        client.close()


def test_a_client_still_starting_is_not_taken_for_one_that_gave_up(
    zk_hosts: str, lock_root: str
) -> None:
    """Between start_async() and the first step of kazoo's loop the loop's stopped event is
    still set, as after it gave up."""
    client = KazooClient(zk_hosts, timeout=10)
    started = threading.Event()
    spawn = client.handler.spawn

    def spawn_held(func: Any, *args: Any, **kwargs: Any) -> Any:
        if getattr(func, "__name__", "") != "zk_loop":
            return spawn(func, *args, **kwargs)

        def held() -> None:
            started.wait(10)
            func(*args, **kwargs)

        return spawn(held)

    client.handler.spawn = spawn_held
    try:
        client.start_async()
        assert client._connection.connection_stopped.is_set()  # the loop has not begun
        assert not adapter.connection_gave_up(client)
        thread, outcome = in_thread(lambda: Mutex(client, f"{lock_root}/k").acquire(timeout=10))
        started.set()
        thread.join(20)
        lease = outcome.get("value")
        assert lease is not None, repr(outcome)
        lease.release()
    finally:
        started.set()
        client.stop()
        client.close()
