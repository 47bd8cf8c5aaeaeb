"""A lost lease carries the code of its cause (``Lease.lost_code``, ``LockLost.code``), for each
cause on a real ZooKeeper: the lease clock running out (a black-hole link), the session's
expiry (server-side), the node's deletion by someone else, and an operator's break request."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Iterator

import pytest
from kazoo.client import KazooClient

from celery_zklock import Lease, LockLost, Mutex
from celery_zklock.errors import LossCode
from celery_zklock.locks.clock import LeaseTiming
from celery_zklock.locks.holders import request_break
from celery_zklock.testing.proxy import TcpProxy
from tests.lockutil import expire_session, wait_for, watches_by_path

SESSION_TIMEOUT = 4.0
IDENTITY = json.dumps({"task_id": "loss-codes", "task": "none", "worker": "here", "pid": 1})


@pytest.fixture
def holder(proxy: TcpProxy) -> Iterator[KazooClient]:
    """The holder's client, reaching ZooKeeper through ``proxy``."""
    client = KazooClient(proxy.address, timeout=SESSION_TIMEOUT)
    client.start(timeout=15)
    try:
        yield client
    finally:
        proxy.stop()  # a black-holed client's goodbye goes nowhere
        client.stop()
        client.close()


def _watched(hosts: str, lease: Lease, client: KazooClient) -> bool:
    """True once the holder's break watch is on the lease's node."""
    session_id = client.client_id[0]
    return any(int(s, 16) == session_id for s in watches_by_path(hosts).get(lease.node, []))


def _lose(
    holder: KazooClient, lock_root: str, cause: Callable[[Lease], None]
) -> tuple[Lease, list[str]]:
    """Acquire on ``holder``, bring ``cause`` about, and wait for the lease to be told lost."""
    lease = Mutex(holder, f"{lock_root}/k").acquire(timeout=5, data=IDENTITY.encode())
    told: list[str] = []
    lost = threading.Event()
    lease.on_lost(lambda reason: (told.append(reason), lost.set()))
    cause(lease)
    assert lost.wait(30), "the lease was not told lost"
    return lease, told


@pytest.mark.parametrize(
    ("cause", "code", "text"),
    [
        ("blackhole", LossCode.LEASE_CLOCK, "no answer from the ZooKeeper leader"),
        ("expire", LossCode.SESSION_EXPIRED, "session expired"),
        ("delete", LossCode.NODE_DELETED, "deleted by someone else"),
        ("break", LossCode.BROKEN, "broken by operator alice@ops: stuck"),
    ],
)
def test_a_lost_lease_carries_the_code_of_its_cause(
    cause: str,
    code: LossCode,
    text: str,
    holder: KazooClient,
    proxy: TcpProxy,
    zk_client: KazooClient,
    zk_hosts: str,
    lock_root: str,
) -> None:
    def bring_about(lease: Lease) -> None:
        assert lease.lost_code is None and not lease.lost
        if cause == "blackhole":
            proxy.blackhole = True  # silent: kazoo stays CONNECTED, the clock runs out
        elif cause == "expire":
            expire_session(zk_hosts, holder)
        else:  # the node's watch is read after a renewal interval: wait for it
            interval = LeaseTiming(SESSION_TIMEOUT).renew_interval
            wait_for(lambda: _watched(zk_hosts, lease, holder), interval * 4, "the break watch")
            if cause == "delete":
                zk_client.delete(lease.node)
            else:
                assert request_break(zk_client, lease.node, "alice@ops", "stuck").status == (
                    "requested"
                )

    lease, told = _lose(holder, lock_root, bring_about)
    assert lease.lost_code is code and lease.lost_code == code.value
    assert told == [lease.lost_reason] and text in told[0]
    with pytest.raises(LockLost, match=text) as raised:
        lease.check()
    assert raised.value.code is code
    lease.release()
    assert lease.lost_code is code  # the first cause stays


def test_a_loss_found_at_the_release_carries_its_code(
    zk_client: KazooClient, lock_root: str
) -> None:
    """The node deleted before the holder's watch was set: the release finds it gone."""
    lease = Mutex(zk_client, f"{lock_root}/k").acquire(timeout=5)
    zk_client.delete(lease.node)
    lease.release()
    assert lease.lost_code is LossCode.NODE_DELETED
    with pytest.raises(LockLost) as raised:
        lease.check()
    assert raised.value.code is LossCode.NODE_DELETED
