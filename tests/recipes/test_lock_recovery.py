"""The lock recipes off the happy path: review findings 4a, 4d, 4g, 4h, 4i and 4k of issue 10.

Each test here failed on the code before its fix (commit c374eb0), as noted per test.
"""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import textwrap
import threading
import weakref
from collections.abc import Iterator
from typing import Any

import pytest
from kazoo.client import KazooClient
from kazoo.protocol.states import KazooState
from kazoo.security import make_acl

from celery_zklock import LockTimeout, Mutex, ZooKeeperUnavailable
from celery_zklock.testing.proxy import TcpProxy
from tests.lockutil import children, in_thread, wait_for


@pytest.fixture
def proxied(zk_client: KazooClient) -> Iterator[tuple[KazooClient, TcpProxy]]:
    """A client (session timeout 10 s) that reaches ZooKeeper through a proxy the test controls."""
    host, port = zk_client.hosts[0]
    with TcpProxy(host, port) as proxy:
        client = KazooClient(proxy.address, timeout=10)
        client.start(timeout=15)
        try:
            yield client, proxy
        finally:
            client.stop()
            client.close()


def test_a_grant_seen_just_before_a_disconnect_is_kept(
    zk_client: KazooClient,
    other_client: KazooClient,
    proxied: tuple[KazooClient, TcpProxy],
    lock_root: str,
) -> None:
    """4a. The listing that grants us the lock arrives, then the connection drops for a moment
    (same session): the waiter must keep its granted node, not abandon it at the queue's head
    and wait behind itself. Before the fix: LockTimeout, with an orphan left at the head.

    A contender between the holder and the waiter makes the waiter list the queue when the node
    it watches goes (the one next in line is granted on the deletion alone)."""
    client, proxy = proxied
    path = f"{lock_root}/k"
    holder = Mutex(zk_client, path).acquire(timeout=5)
    between, _ = in_thread(lambda: Mutex(other_client, path).acquire(timeout=8).release())
    wait_for(lambda: len(children(zk_client, path)) == 2, 5, "the contender's node")
    original = client.get_children_async
    armed = threading.Event()

    def listing_then_drop(*args: Any, **kwargs: Any) -> Any:
        result = original(*args, **kwargs)
        if armed.is_set() and args and args[0] == path:
            armed.clear()
            result.wait(5)
            # Down for a second (the fault's length, not a synchronisation): the waiter decides
            # while the client is between connections.
            proxy.refuse = True
            proxy.cut()
            wait_for(lambda: client.state != KazooState.CONNECTED, 5, "the drop to be seen")
            threading.Timer(1.0, setattr, (proxy, "refuse", False)).start()
        return result

    client.get_children_async = listing_then_drop  # type: ignore[method-assign]
    thread, outcome = in_thread(lambda: Mutex(client, path).acquire(timeout=8))
    wait_for(lambda: len(children(zk_client, path)) == 3, 5, "the waiter's node")
    armed.set()
    holder.release()
    between.join(15)
    thread.join(15)
    assert not armed.is_set(), "the waiter was not granted by a listing"
    assert "error" not in outcome, f"the waiter failed: {outcome.get('error')!r}"
    lease = outcome["value"]
    assert children(zk_client, path) == [lease.node.rsplit("/", 1)[1]]
    lease.release()
    assert not lease.lost
    wait_for(lambda: children(zk_client, path) == [], 5, "no node left")


def test_d_an_ambiguous_delete_at_release_is_a_release(
    zk_client: KazooClient, proxied: tuple[KazooClient, TcpProxy], lock_root: str
) -> None:
    """4d. The release's delete runs but its answer is lost; the retry on the same session gets
    NoNode: that is our own delete, not a loss. Before the fix: the lease was marked lost."""
    client, proxy = proxied
    path = f"{lock_root}/k"
    lease = Mutex(client, path).acquire(timeout=5)
    proxy.drop_responses = True
    thread, outcome = in_thread(lease.release)
    wait_for(lambda: children(zk_client, path) == [], 5, "the delete to run on the server")
    proxy.drop_responses = False
    proxy.cut()
    thread.join(15)
    assert "error" not in outcome, repr(outcome.get("error"))
    assert lease.released and not lease.lost, lease.lost_reason


@pytest.mark.parametrize("started", [False, True], ids=["never-started", "stopped"])
def test_g_a_stopped_client_fails_at_once(zk_hosts: str, lock_root: str, started: bool) -> None:
    """4g. A stopped or never started client: a clear error at once. Before the fix: acquire
    hung forever (kazoo's ConnectionClosedError is a SessionExpiredError, taken for an expiry)."""
    client = KazooClient(zk_hosts, timeout=10)
    if started:
        client.start(timeout=15)
        client.stop()
    thread, outcome = in_thread(lambda: Mutex(client, f"{lock_root}/k").acquire())
    thread.join(5)
    assert not thread.is_alive(), "acquire on a stopped client hangs"
    error = outcome.get("error")
    assert isinstance(error, ZooKeeperUnavailable), repr(error)
    assert "client.start()" in str(error)
    client.close()


GEVENT_SCRIPT = textwrap.dedent(
    """
    from gevent import monkey
    monkey.patch_all()
    import sys, gevent
    from kazoo.client import KazooClient
    from kazoo.handlers.gevent import SequentialGeventHandler
    from celery_zklock import Mutex
    client = KazooClient(sys.argv[1], timeout=10, handler=SequentialGeventHandler())
    client.start(timeout=15)
    print("connected", flush=True)
    sys.stdin.readline()  # the test now drops ZooKeeper's answers
    try:
        with gevent.Timeout(1.0):
            Mutex(client, sys.argv[2]).acquire()
        print("acquired", flush=True)
    except gevent.Timeout:
        print("timeout-propagated", flush=True)
    """
)


def test_h_a_gevent_timeout_is_not_swallowed(
    zk_client: KazooClient, lock_root: str, tmp_path: Any
) -> None:
    """4h. A gevent.Timeout that is not ours (the gevent pool's time limit) must reach the task
    while an acquire waits for ZooKeeper. Before the fix: swallowed, the acquire hung."""
    pytest.importorskip("gevent")
    host, port = zk_client.hosts[0]
    script = tmp_path / "gevent_acquire.py"
    script.write_text(GEVENT_SCRIPT)
    with TcpProxy(host, port) as proxy:
        child = subprocess.Popen(
            [sys.executable, str(script), proxy.address, f"{lock_root}/k"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env={**os.environ, "PYTHONPATH": os.getcwd()},
        )
        try:
            assert child.stdout is not None and child.stdin is not None
            assert child.stdout.readline().strip() == "connected"
            proxy.drop_responses = True
            child.stdin.write("go\n")
            child.stdin.flush()
            out, _ = child.communicate(timeout=20)
        finally:
            if child.poll() is None:
                child.kill()
                child.wait()
    assert out.strip() == "timeout-propagated"


def test_i_an_orphan_purge_is_retried_while_connected(
    zk_client: KazooClient, proxied: tuple[KazooClient, TcpProxy], lock_root: str
) -> None:
    """4i. A purge of an abandoned contender that fails while connected is retried (with
    backoff), not only after a reconnect; and the kazoo error is not raised raw (4k).
    Before the fix: NoAuthError escaped, and the node stayed until the next reconnect."""
    from kazoo.exceptions import KazooException

    client, _ = proxied
    path = f"{lock_root}/k"
    no_read = make_acl("world", "anyone", create=True, delete=True, write=True, admin=True)
    zk_client.ensure_path(lock_root)
    zk_client.create(path, acl=[no_read])
    zk_client.delete(zk_client.create(f"{path}/x"))  # our node's sequence is not 0: it lists
    try:
        with pytest.raises(ZooKeeperUnavailable) as raised:
            Mutex(client, path).acquire(timeout=5)
        assert not isinstance(raised.value, KazooException)
        stat = zk_client.exists(path)
        assert stat is not None and stat.numChildren == 1  # the create ran, the listing did not
    finally:
        zk_client.set_acls(path, [make_acl("world", "anyone", all=True)])
    connections = proxied[1].connections_accepted
    wait_for(lambda: zk_client.get_children(path) == [], 10, "the orphan to be purged")
    assert proxied[1].connections_accepted == connections  # without a reconnect


def test_k_timeout_zero_grants_a_free_lock(zk_client: KazooClient, lock_root: str) -> None:
    """4k. ``acquire(timeout=0)`` on a free lock is granted (the timeout bounds the wait for
    other holders, not the answers). Before the fix: LockTimeout."""
    path = f"{lock_root}/k"
    with Mutex(zk_client, path).acquire(timeout=0) as lease:
        assert lease.held
        with pytest.raises(LockTimeout):  # busy: another thread does not wait at all
            _other_thread(lambda: Mutex(zk_client, path).acquire(timeout=0))


def _other_thread(target: Any) -> Any:
    thread, outcome = in_thread(target)
    thread.join(10)
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]


def test_k_contexts_do_not_keep_clients_alive(zk_hosts: str, lock_root: str) -> None:
    """4k. A client used for locks is freed once the application drops it. Before the fix: a
    module-level registry kept every client (and its context) alive forever."""
    client = KazooClient(zk_hosts, timeout=10)
    client.start(timeout=15)
    Mutex(client, f"{lock_root}/k").acquire(timeout=5).release()
    client.stop()
    client.close()
    ref = weakref.ref(client)
    del client
    for _ in range(3):
        gc.collect()
    assert ref() is None


def test_k_an_outage_during_a_wait_is_not_a_lock_timeout(
    zk_client: KazooClient, proxied: tuple[KazooClient, TcpProxy], lock_root: str
) -> None:
    """4k. ZooKeeper becomes unreachable while we wait for a holder: the acquire ends with
    ZooKeeperUnavailable, not LockTimeout (which a task could turn into a SUCCESS skip).
    Before the fix: LockTimeout."""
    client, proxy = proxied
    path = f"{lock_root}/k"
    holder = Mutex(zk_client, path).acquire(timeout=5)
    try:
        thread, outcome = in_thread(lambda: Mutex(client, path).acquire(timeout=3))
        wait_for(lambda: len(children(zk_client, path)) == 2, 5, "the waiter's node")
        proxy.refuse = True
        proxy.cut()
        thread.join(20)
        assert isinstance(outcome.get("error"), ZooKeeperUnavailable), repr(outcome)
    finally:
        holder.release()
