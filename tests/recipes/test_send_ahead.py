"""A contender node's create sent ahead of ``acquire`` (``Mutex._send_ahead``, which the task
layer sends at ``task_prerun``), on a real ZooKeeper: the next acquire takes that very node up,
and every other way the create can end - dropped, a reentrant acquire, a refused acquire, a
session gone in between - leaves no node of it behind."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from kazoo.client import KazooClient
from kazoo.exceptions import NoNodeError

from celery_zklock import Mutex, ReadWriteLock
from celery_zklock.config import ClientConfig
from celery_zklock.session import new_client
from tests.lockutil import expire_session, wait_for


@pytest.fixture
def client(zk_hosts: str, zk_client: KazooClient, lock_root: str) -> Iterator[KazooClient]:
    # The lock paths' parent exists, as an application's lock root does: else a create sent
    # ahead fails (NoNode) and the acquire makes the parents and creates again.
    zk_client.ensure_path(lock_root)
    client = new_client(ClientConfig(hosts=zk_hosts, session_timeout=10.0))
    client.start(timeout=15)
    yield client
    client.stop()
    client.close()


def _children(zk_client: KazooClient, path: str) -> list[str]:
    """The children of ``path``; none once its container is gone."""
    try:
        return list(zk_client.get_children(path))
    except NoNodeError:
        return []


def _sent(zk_client: KazooClient, lock: Mutex) -> None:
    """Wait until the create ``lock`` sent ahead made its node."""
    prefix = _sent_prefix(lock)
    wait_for(
        lambda: any(c.startswith(prefix) for c in _children(zk_client, lock.path)),
        what="the node sent ahead",
    )


def _sent_prefix(lock: Mutex) -> str:
    sent = lock._sent
    assert sent is not None, "the create was not sent"
    return sent.prefix


def test_acquire_takes_up_the_node_sent_ahead(
    client: KazooClient, zk_client: KazooClient, lock_root: str
) -> None:
    path = f"{lock_root}/taken-up"
    lock = Mutex(client, path)
    assert lock._send_ahead(b"who")
    prefix = _sent_prefix(lock)
    _sent(zk_client, lock)
    lease = lock.acquire(blocking=False, data=b"who")
    assert lease is not None
    assert lease.node.rsplit("/", 1)[1].startswith(prefix)
    assert zk_client.get_children(path) == [lease.node.rsplit("/", 1)[1]]  # one node, not two
    assert zk_client.get(lease.node)[0] == b"who"
    lease.release()
    assert zk_client.exists(lease.node) is None
    assert lock._sent is None
    # The next acquire on the same object sends its own create.
    again = lock.acquire(blocking=False)
    assert again is not None and not again.node.rsplit("/", 1)[1].startswith(prefix)
    again.release()


def test_a_node_sent_ahead_and_dropped_is_removed(
    client: KazooClient, zk_client: KazooClient, lock_root: str
) -> None:
    path = f"{lock_root}/dropped"
    lock = ReadWriteLock(client, path).read
    assert lock._send_ahead(b"")
    _sent(zk_client, lock)
    lock._drop_sent_ahead()
    assert lock._sent is None
    assert _children(zk_client, path) == []


def test_a_reentrant_acquire_removes_the_node_sent_ahead(
    client: KazooClient, zk_client: KazooClient, lock_root: str
) -> None:
    path = f"{lock_root}/reentered"
    holder = Mutex(client, path)
    outer = holder.acquire()
    again = Mutex(client, path)
    assert again._send_ahead(b"")
    _sent(zk_client, again)
    inner = again.acquire()  # this thread holds the path: the same node, one more count
    assert inner.node == outer.node
    assert zk_client.get_children(path) == [outer.node.rsplit("/", 1)[1]]
    inner.release()
    outer.release()
    assert _children(zk_client, path) == []


def test_a_refused_acquire_removes_the_node_sent_ahead(
    client: KazooClient, zk_client: KazooClient, lock_root: str
) -> None:
    path = f"{lock_root}/refused"
    lock = Mutex(client, path)
    assert lock._send_ahead(b"")
    _sent(zk_client, lock)
    with pytest.raises(ValueError, match="timeout must be >= 0"):
        lock.acquire(timeout=-1)
    assert lock._sent is None
    assert _children(zk_client, path) == []


def test_a_busy_try_lock_removes_the_node_sent_ahead(
    client: KazooClient, zk_client: KazooClient, lock_root: str
) -> None:
    path = f"{lock_root}/busy"
    holder = Mutex(zk_client, path).acquire()
    lock = Mutex(client, path)
    assert lock.acquire(blocking=False) is None  # busy; and now the client knows the parent
    assert lock._send_ahead(b"")
    _sent(zk_client, lock)
    assert lock.acquire(blocking=False) is None
    assert zk_client.get_children(path) == [holder.node.rsplit("/", 1)[1]]
    holder.release()


def test_a_session_gone_after_the_send_gets_a_new_node(
    zk_hosts: str, zk_client: KazooClient, lock_root: str
) -> None:
    zk_client.ensure_path(lock_root)
    client = new_client(ClientConfig(hosts=zk_hosts, session_timeout=4.0))
    client.start(timeout=15)
    try:
        path = f"{lock_root}/expired"
        lock = Mutex(client, path)
        assert lock._send_ahead(b"")
        prefix = _sent_prefix(lock)
        _sent(zk_client, lock)
        expire_session(zk_hosts, client)
        lease = lock.acquire(timeout=30)
        assert not lease.node.rsplit("/", 1)[1].startswith(prefix)
        assert zk_client.get_children(path) == [lease.node.rsplit("/", 1)[1]]
        lease.release()
    finally:
        client.stop()
        client.close()


def test_no_send_while_the_client_is_stopped(zk_hosts: str, lock_root: str) -> None:
    client = new_client(ClientConfig(hosts=zk_hosts, session_timeout=10.0))
    lock = Mutex(client, f"{lock_root}/stopped")
    assert not lock._send_ahead(b"")
    assert lock._sent is None
