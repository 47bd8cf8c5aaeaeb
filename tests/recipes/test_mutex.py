"""Mutex and ReadWriteLock on a real ZooKeeper: the contract of acquire, release and the lease."""

from __future__ import annotations

import ctypes
import threading
import time
from typing import Any

import pytest
from kazoo.client import KazooClient

from celery_zklock import (
    Lease,
    LockLost,
    LockTimeout,
    Mutex,
    ReadWriteLock,
    ZkLockError,
    ZooKeeperUnavailable,
)
from celery_zklock.locks.queue import CONTAINER_ROUNDS, make_containers
from celery_zklock.testing.proxy import TcpProxy
from celery_zklock.zk import adapter
from celery_zklock.zk.calls import Deadline
from tests.lockutil import children, expire_session, wait_for, watches_by_path


def test_lease_layout_token_and_release(zk_client: KazooClient, lock_root: str) -> None:
    path = f"{lock_root}/report-42"
    lease = Mutex(zk_client, path).acquire(timeout=5)
    (name,) = children(zk_client, path)
    assert lease.node == f"{path}/{name}"
    assert name.startswith("_c_") and name[39] == "-" and name[40:50] == "lock-00000"
    assert len(name) == len("_c_") + 36 + len("-lock-") + 10
    stat = zk_client.exists(lease.node)
    assert stat is not None and stat.ephemeralOwner == zk_client.client_id[0]
    assert lease.token == stat.czxid
    # Held: the lease clock's bound, within the 5T/12 - margin of a fresh grant, renewed onward.
    timeout = 10.0  # kazoo's default session timeout, which the suite's servers grant
    first = lease.valid_for
    assert 0 < first <= 5 * timeout / 12
    wait_for(lambda: lease.valid_for > first, timeout=timeout, what="a renewal extends it")
    lease.release()
    lease.release()  # idempotent
    assert children(zk_client, path) == []
    assert not lease.held and not lease.lost and lease.valid_for == 0.0


def test_parents_are_containers(zk_client: KazooClient, lock_root: str) -> None:
    path = f"{lock_root}/a/b"
    with Mutex(zk_client, path).acquire(timeout=5):
        for parent in (lock_root, f"{lock_root}/a", path):
            stat = zk_client.exists(parent)
            assert stat is not None and stat.ephemeralOwner == 0
    # containers: the server removes them once empty (check interval 300 ms in the fixture)
    wait_for(lambda: zk_client.exists(lock_root) is None, 10, "container parents to be reaped")


def test_try_lock_on_held_lock_returns_none_and_leaves_no_node(
    zk_client: KazooClient, other_client: KazooClient, lock_root: str
) -> None:
    held = Mutex(zk_client, lock_root).acquire(timeout=5)
    before = children(zk_client, lock_root)
    assert Mutex(other_client, lock_root).acquire(blocking=False) is None
    assert children(zk_client, lock_root) == before
    held.release()
    lease = Mutex(other_client, lock_root).acquire(blocking=False)
    assert lease is not None
    lease.release()


def test_timed_out_acquire_raises_and_leaves_no_node(
    zk_client: KazooClient, other_client: KazooClient, lock_root: str
) -> None:
    held = Mutex(zk_client, lock_root).acquire(timeout=5)
    before = children(zk_client, lock_root)
    started = time.monotonic()
    with pytest.raises(LockTimeout):
        Mutex(other_client, lock_root).acquire(timeout=0.4)
    elapsed = time.monotonic() - started
    assert 0.4 <= elapsed < 2.0
    assert children(zk_client, lock_root) == before
    held.release()


def test_timeout_is_one_total_deadline_across_waits(
    zk_hosts: str, zk_client: KazooClient, other_client: KazooClient, lock_root: str
) -> None:
    """Predecessors that come and go must not restart the clock (kazoo's Lock does)."""
    first = Mutex(zk_client, lock_root).acquire(timeout=5)
    stop = threading.Event()

    def churn() -> None:
        # a second holder-in-waiting that keeps being replaced ahead of the waiter
        client = KazooClient(zk_hosts, timeout=10)
        client.start()
        while not stop.is_set():
            try:
                lease = Mutex(client, lock_root).acquire(timeout=0.1)
                lease.release()
            except LockTimeout:
                pass
        client.stop()
        client.close()

    churner = threading.Thread(target=churn)
    churner.start()
    wait_for(lambda: len(children(zk_client, lock_root)) == 2, 5, "the churning contender")
    started = time.monotonic()
    with pytest.raises(LockTimeout):
        Mutex(other_client, lock_root).acquire(timeout=1.0)
    elapsed = time.monotonic() - started
    stop.set()
    churner.join()
    first.release()
    assert elapsed < 1.6


def _throw_into(thread: threading.Thread, exc: type[BaseException]) -> None:
    assert thread.ident is not None
    count = ctypes.pythonapi.PyThreadState_SetAsyncExc(
        ctypes.c_ulong(thread.ident), ctypes.py_object(exc)
    )
    assert count == 1


class Interrupt(BaseException):
    """Not an Exception: like KeyboardInterrupt, must still clean up."""


def test_exception_thrown_into_waiting_acquire_leaves_no_node(
    zk_client: KazooClient, other_client: KazooClient, lock_root: str, zk_hosts: str
) -> None:
    held = Mutex(zk_client, lock_root).acquire(timeout=5)
    raised: list[BaseException] = []

    def waiter() -> None:
        try:
            Mutex(other_client, lock_root).acquire(timeout=30)
        except BaseException as exc:
            raised.append(exc)

    thread = threading.Thread(target=waiter)
    thread.start()
    # Throw once the waiter is parked on its watch: an exception thrown into kazoo's own
    # request wait can break the client's lock state, which no lock recipe can repair.
    wait_for(lambda: held.node in watches_by_path(zk_hosts), 5, "the waiter's watch")
    _throw_into(thread, Interrupt)
    thread.join(10)
    assert not thread.is_alive()
    assert len(raised) == 1 and isinstance(raised[0], Interrupt)
    assert children(zk_client, lock_root) == [held.node.rsplit("/", 1)[1]]
    held.release()


def test_reentrant_per_thread_counted(zk_client: KazooClient, lock_root: str) -> None:
    outer = Mutex(zk_client, lock_root).acquire(timeout=5)
    inner = Mutex(zk_client, lock_root).acquire(timeout=5)
    assert inner.node == outer.node and inner.token == outer.token
    inner.release()
    inner.release()
    assert zk_client.exists(outer.node) is not None
    outer.release()
    assert zk_client.exists(outer.node) is None


def test_read_to_write_upgrade_is_refused_not_deadlocked(
    zk_client: KazooClient, lock_root: str
) -> None:
    rw = ReadWriteLock(zk_client, lock_root)
    with rw.read.acquire(timeout=5), pytest.raises(ZkLockError, match="upgrading would deadlock"):
        rw.write.acquire(timeout=5)
    # and a writer may read (reentrant, like Curator)
    with rw.write.acquire(timeout=5) as write, rw.read.acquire(timeout=5) as read:
        assert read.node == write.node


def test_readers_share_writer_excludes(
    zk_hosts: str, zk_client: KazooClient, other_client: KazooClient, lock_root: str
) -> None:
    third = KazooClient(zk_hosts, timeout=10)
    third.start()
    try:
        r1 = ReadWriteLock(zk_client, lock_root).read.acquire(timeout=5)
        r2 = ReadWriteLock(other_client, lock_root).read.acquire(timeout=5)
        assert r1.held and r2.held
        assert ReadWriteLock(third, lock_root).write.acquire(blocking=False) is None
        names = children(zk_client, lock_root)
        assert len(names) == 2 and all("__READ__" in n for n in names)
        r1.release()
        r2.release()
        with ReadWriteLock(third, lock_root).write.acquire(timeout=5) as w:
            assert "__WRIT__" in w.node
            assert ReadWriteLock(zk_client, lock_root).read.acquire(blocking=False) is None
    finally:
        third.stop()
        third.close()


def test_session_expiry_while_held(
    zk_hosts: str, other_client: KazooClient, lock_root: str
) -> None:
    client = KazooClient(zk_hosts, timeout=10)
    client.start()
    try:
        lease = Mutex(client, lock_root).acquire(timeout=5)
        lost = threading.Event()
        lease.on_lost(lambda reason: lost.set())
        expire_session(zk_hosts, client)
        successor = Mutex(other_client, lock_root).acquire(timeout=10)
        assert successor.token > lease.token
        assert lost.wait(10)
        assert lease.lost and not lease.held and lease.valid_for == 0.0
        with pytest.raises(LockLost):
            lease.check()
        lease.release()  # must not remove the successor's node
        assert children(other_client, lock_root) == [successor.node.rsplit("/", 1)[1]]
        assert successor.held
        # the expired client works again with a new session; tokens keep rising
        successor.release()
        third = Mutex(client, lock_root).acquire(timeout=10)
        assert third.token > successor.token
        third.release()
    finally:
        client.stop()
        client.close()


def test_context_manager_raises_lock_lost_after_loss(zk_hosts: str, lock_root: str) -> None:
    client = KazooClient(zk_hosts, timeout=10)
    client.start()
    try:
        with pytest.raises(LockLost), Mutex(client, lock_root).acquire(timeout=5) as lease:
            expire_session(zk_hosts, client)
            wait_for(lambda: lease.lost, 10, "the lease to turn lost")
    finally:
        client.stop()
        client.close()


def test_connection_drop_during_create_keeps_one_node(
    zk_server: object, zk_client: KazooClient, lock_root: str
) -> None:
    """The create runs on the server but its answer is lost: the node is found again by uuid."""
    # The lock's parent must exist already, and this client must know it: with answers dropped,
    # an acquire that first has to learn whether it is there never gets to its create.
    zk_client.ensure_path(lock_root)
    host, port = zk_client.hosts[0]
    with TcpProxy(host, port) as proxy:
        client = KazooClient(proxy.address, timeout=10)
        client.start()
        try:
            Mutex(client, lock_root).acquire(timeout=5).release()
            proxy.drop_responses = True
            result: list[object] = []
            thread = threading.Thread(
                target=lambda: result.append(Mutex(client, lock_root).acquire(timeout=20))
            )
            thread.start()
            wait_for(lambda: len(children(zk_client, lock_root)) == 1, 5, "the create to run")
            proxy.drop_responses = False
            assert proxy.cut() == 1
            thread.join(20)
            (lease,) = result
            assert isinstance(lease, Lease)
            assert children(zk_client, lock_root) == [lease.node.rsplit("/", 1)[1]]
            lease.release()
            assert children(zk_client, lock_root) == []
        finally:
            client.stop()
            client.close()


def test_try_lock_while_disconnected_leaves_no_node(zk_client: KazooClient, lock_root: str) -> None:
    """A try-lock whose answer never comes raises ZooKeeperUnavailable (not LockTimeout: nobody
    else holds the lock); its node goes on reconnect."""
    host, port = zk_client.hosts[0]
    zk_client.ensure_path(lock_root)
    with TcpProxy(host, port) as proxy:
        client = KazooClient(proxy.address, timeout=10)
        client.start()
        try:
            proxy.drop_responses = True
            with pytest.raises(ZooKeeperUnavailable):
                Mutex(client, f"{lock_root}/k").acquire(blocking=False, timeout=0.5)
            assert len(children(zk_client, f"{lock_root}/k")) == 1  # created, answer lost
            proxy.drop_responses = False
            proxy.cut()
            wait_for(lambda: children(zk_client, f"{lock_root}/k") == [], 10, "orphan removal")
        finally:
            client.stop()
            client.close()


def test_acquire_recreates_parent_reaped_after_we_saw_it(
    zk_client: KazooClient, lock_root: str
) -> None:
    path = f"{lock_root}/k"
    Mutex(zk_client, path).acquire(timeout=5).release()  # this client now "knows" the parent
    wait_for(lambda: zk_client.exists(path) is None, 10, "the container to be reaped")
    with Mutex(zk_client, path).acquire(timeout=5) as lease:
        assert lease.held


def test_acquire_makes_the_parents_again_when_one_is_reaped_while_they_are_made(
    zk_client: KazooClient,
    other_client: KazooClient,
    lock_root: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An empty container may be reaped at any moment: also between its create, answered
    NodeExists, and its child's, in the one pipelined round that makes a lock's missing parents.
    The acquire then makes them again (before, the child's NoNodeError escaped make_containers
    and failed the acquire as ZooKeeperUnavailable: seen once in ``make test``)."""
    ancestor, parent = f"{lock_root}/a", f"{lock_root}/a/b"
    make_containers(other_client, ancestor, Deadline(5))  # a key's ancestor, left empty
    made = adapter.create_container_async
    sent: list[tuple[str, Any]] = []
    reaped: list[str] = []

    def reaped_between(client: Any, path: str, *args: Any, **kwargs: Any) -> Any:
        if path == parent and not reaped:
            last, answer = sent[-1]
            assert last == ancestor
            answer.wait(5)  # the ancestor's create is answered (NodeExists) ...
            other_client.delete(ancestor)  # ... and the reaper takes it before the child's
            reaped.append(ancestor)
        result = made(client, path, *args, **kwargs)
        sent.append((path, result))
        return result

    monkeypatch.setattr(adapter, "create_container_async", reaped_between)
    with Mutex(zk_client, f"{parent}/lock").acquire(timeout=5) as lease:
        assert lease.held
        assert reaped == [ancestor]
        assert len(children(zk_client, f"{parent}/lock")) == 1


def test_parents_reaped_at_every_round_give_up_with_a_lock_error(
    zk_client: KazooClient,
    other_client: KazooClient,
    lock_root: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """make_containers sends its chain again only :data:`CONTAINER_ROUNDS` times."""
    ancestor, parent = f"{lock_root}/a", f"{lock_root}/a/b"
    made = adapter.create_container_async
    sent: list[tuple[str, Any]] = []

    def reaped_each_time(client: Any, path: str, *args: Any, **kwargs: Any) -> Any:
        if path == parent:
            sent[-1][1].wait(5)  # the ancestor is there (made or found) ...
            other_client.delete(ancestor)  # ... and goes before its child is made
        result = made(client, path, *args, **kwargs)
        sent.append((path, result))
        return result

    monkeypatch.setattr(adapter, "create_container_async", reaped_each_time)
    with pytest.raises(ZkLockError, match="kept being reaped"):
        make_containers(zk_client, f"{parent}/lock", Deadline(5))
    assert [path for path, _ in sent].count(parent) == CONTAINER_ROUNDS


def test_bad_paths_are_refused(zk_client: KazooClient) -> None:
    for bad in ("relative", "/", "/a//b", "/a/", "/a/../b"):
        with pytest.raises(ValueError, match="lock path"):
            Mutex(zk_client, bad)


def test_acquire_while_the_session_is_expired_waits_for_the_reconnect_without_spinning(
    zk_hosts: str, lock_root: str
) -> None:
    """Until kazoo reconnects, requests on an expired session fail at once: retrying them in a
    loop would spin (and under gevent starve the reconnecting greenlet forever)."""
    # Reconnect only 1.5 s after the expiry, so the acquire starts inside that window.
    client = KazooClient(
        zk_hosts, connection_retry={"max_tries": -1, "delay": 1.5, "backoff": 1, "max_jitter": 0}
    )
    client.start(timeout=10)
    creates = 0
    create_async = client.create_async

    def counting_create(*args: object, **kwargs: object) -> object:
        nonlocal creates
        creates += 1
        return create_async(*args, **kwargs)

    client.create_async = counting_create  # type: ignore[method-assign]
    try:
        Mutex(client, f"{lock_root}/warm").acquire().release()  # the client knows the session
        lost = threading.Event()
        client.add_listener(lambda state: lost.set() if state == "LOST" else None)
        expire_session(zk_hosts, client)
        assert lost.wait(10)
        assert client.state == "LOST"
        creates = 0
        lease = Mutex(client, f"{lock_root}/after-expiry").acquire(timeout=10)
        assert lease is not None and client.state == "CONNECTED"
        assert creates <= 3, f"{creates} create requests: the acquire spun while disconnected"
        lease.release()
    finally:
        client.stop()
        client.close()


def test_a_fresh_key_takes_one_request_and_its_token_is_its_node_s_czxid(
    zk_client: KazooClient, lock_root: str
) -> None:
    """Under a parent the client has not seen, the parent and the node are made by one
    ``multi``; the token (the node's czxid, which ZooKeeper does not answer inside a multi) is
    the transaction's zxid. A parent that was there after all costs one more request, and a
    missing grandparent is made first."""
    zk_client.ensure_path(lock_root)
    sent: list[str] = []
    real_call = zk_client._call

    def counting(request: object, result: object) -> object:
        sent.append(type(request).__name__)
        return real_call(request, result)

    zk_client._call = counting  # type: ignore[method-assign]
    try:
        for path, made_before in ((f"{lock_root}/fresh", False), (f"{lock_root}/there", True)):
            if made_before:
                zk_client.create(path)  # persistent: the client has never seen it
            sent.clear()
            lease = Mutex(zk_client, path).acquire(timeout=5)
            acquire_requests = list(sent)
            stat = zk_client.exists(lease.node)
            assert stat is not None and lease.token == stat.czxid
            assert children(zk_client, path) == [lease.node.rsplit("/", 1)[1]]
            lease.release()
            if made_before:
                assert acquire_requests == ["CreateWithParent", "Create2", "GetChildren"]
            else:
                assert acquire_requests == ["CreateWithParent"]
        sent.clear()
        deep = f"{lock_root}/missing/parent/key"
        lease = Mutex(zk_client, deep).acquire(timeout=5)
        stat = zk_client.exists(lease.node)
        assert stat is not None and lease.token == stat.czxid
        assert sent[0] == "CreateWithParent" and "CreateContainer" in sent
        lease.release()
    finally:
        del zk_client._call
