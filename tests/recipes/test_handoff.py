"""The handoff to the waiter next in line: granted on the deletion it watched, without listing the
queue again, and never with a node of its own that is gone."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from kazoo.client import KazooClient

from celery_zklock import Lease, Mutex, ReadWriteLock
from tests.lockutil import children, wait_for, watches_by_path


class Waiter:
    """An acquire of ``make_lock()`` in a thread; its lease or error once :meth:`join` ran."""

    def __init__(self, make_lock: Callable[[], Mutex]) -> None:
        self.lease: Lease | None = None
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._acquire, args=(make_lock,), daemon=True)
        self._thread.start()

    def _acquire(self, make_lock: Callable[[], Mutex]) -> None:
        try:
            self.lease = make_lock().acquire(timeout=60)
        except BaseException as exc:
            self.error = exc

    def join(self) -> Lease:
        self._thread.join(60)
        assert not self._thread.is_alive(), "the waiter was not granted"
        assert self.error is None, self.error
        assert self.lease is not None
        return self.lease


def watched_by(hosts: str, session_id: int) -> set[str]:
    """The paths ``session_id`` watches (``wchp``)."""
    return {
        path
        for path, sessions in watches_by_path(hosts).items()
        if session_id in (int(s, 16) for s in sessions)
    }


@pytest.fixture
def waiting_client(zk_hosts: str) -> Iterator[KazooClient]:
    """The waiter's session. Its timeout is long, so that a lease it holds goes unwatched for
    break requests (which only a lease held for T/8 gets) while a test looks at its watches."""
    client = KazooClient(zk_hosts, timeout=60)
    client.start(timeout=15)
    yield client
    client.stop()
    client.close()


@pytest.fixture
def listings(waiting_client: KazooClient) -> Iterator[list[str]]:
    """The paths ``waiting_client`` lists from now on (every ``getChildren`` it sends)."""
    listed: list[str] = []
    send = waiting_client.get_children_async

    def counted(path: str, *args: Any, **kwargs: Any) -> Any:
        listed.append(path)
        return send(path, *args, **kwargs)

    waiting_client.get_children_async = counted
    yield listed
    del waiting_client.get_children_async


def parked(hosts: str, waiting: KazooClient, held: Lease, admin: KazooClient) -> Callable[[], bool]:
    """True once the contender of ``waiting`` behind ``held`` waits: its session watches the
    holder's node and its own (looked at through ``admin``)."""
    path = held.node.rsplit("/", 1)[0]

    def check() -> bool:
        names = [n for n in children(admin, path) if f"{path}/{n}" != held.node]
        watched = watched_by(hosts, waiting.client_id[0])
        return len(names) == 1 and {held.node, f"{path}/{names[0]}"} <= watched

    return check


@pytest.mark.parametrize(
    ("holder_side", "waiter_side"), [("mutex", "mutex"), ("write", "read"), ("write", "write")]
)
def test_the_waiter_next_in_line_is_granted_on_the_deletion_alone(
    zk_hosts: str,
    zk_client: KazooClient,
    waiting_client: KazooClient,
    lock_root: str,
    listings: list[str],
    holder_side: str,
    waiter_side: str,
) -> None:
    def lock(client: KazooClient, side: str) -> Mutex:
        if side == "mutex":
            return Mutex(client, lock_root)
        rw = ReadWriteLock(client, lock_root)
        return rw.read if side == "read" else rw.write

    held = lock(zk_client, holder_side).acquire(timeout=5)
    waiter = Waiter(lambda: lock(waiting_client, waiter_side))
    wait_for(parked(zk_hosts, waiting_client, held, zk_client), 10, "the waiter to park")
    listed_while_queuing = len(listings)
    held.release()
    lease = waiter.join()
    # One listing, sent with the create; the deletion of the holder's node tells the rest.
    assert listed_while_queuing == 1
    assert listings == [lock_root]
    assert children(zk_client, lock_root) == [lease.node.rsplit("/", 1)[1]]
    # Its watch on its own node goes when it stops waiting: else the release would fire it.
    session = waiting_client.client_id[0]
    wait_for(lambda: not watched_by(zk_hosts, session), 10, "the waiter's watches to go")
    lease.release()


def test_a_waiter_whose_node_was_deleted_is_not_granted_on_the_holders_deletion(
    zk_hosts: str,
    zk_client: KazooClient,
    waiting_client: KazooClient,
    lock_root: str,
    listings: list[str],
) -> None:
    """Its node deleted by someone else while it waits, then the holder's: the waiter must not
    take the holder's deletion as its grant (it would hold with no node, beside the next
    contender): it lists the queue, finds its node gone and queues again with a new one."""
    held = Mutex(zk_client, lock_root).acquire(timeout=5)
    waiter = Waiter(lambda: Mutex(waiting_client, lock_root))
    wait_for(parked(zk_hosts, waiting_client, held, zk_client), 10, "the waiter to park")
    (first,) = (n for n in children(zk_client, lock_root) if f"{lock_root}/{n}" != held.node)
    zk_client.delete(f"{lock_root}/{first}")
    held.release()
    lease = waiter.join()
    assert lease.node != f"{lock_root}/{first}"
    assert children(zk_client, lock_root) == [lease.node.rsplit("/", 1)[1]]
    assert len(listings) >= 2  # the one sent with each create
    third = Mutex(zk_client, lock_root).acquire(blocking=False)
    assert third is None  # the lease excludes others: its node is in the queue
    lease.release()
