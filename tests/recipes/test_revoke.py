"""Cooperative revocation on real ZooKeeper: a holder that listens releases when asked."""

from __future__ import annotations

import threading

import pytest
from kazoo.client import KazooClient

from celery_zklock import LockTimeout, Mutex
from celery_zklock.locks import attempt_revoke, on_revoke
from celery_zklock.locks.lease import Lease


def test_a_listening_holder_releases_when_asked(
    zk_client: KazooClient, other_client: KazooClient, lock_root: str
) -> None:
    path = f"{lock_root}/doc"
    lease = Mutex(zk_client, path).acquire()
    asked = threading.Event()

    def release(revoked: Lease) -> None:
        asked.set()
        revoked.release()

    on_revoke(zk_client, lease, release)
    assert Mutex(other_client, path).acquire(blocking=False) is None
    assert attempt_revoke(other_client, lease.node)
    taken = Mutex(other_client, path).acquire(timeout=10)  # granted once the holder released
    assert asked.is_set() and lease.released and not lease.lost
    taken.release()
    assert attempt_revoke(other_client, lease.node) is False  # gone


def test_a_holder_that_does_not_listen_keeps_the_lock(
    zk_client: KazooClient, other_client: KazooClient, lock_root: str
) -> None:
    path = f"{lock_root}/deaf"
    lease = Mutex(zk_client, path).acquire()
    assert attempt_revoke(other_client, lease.node)
    with pytest.raises(LockTimeout):  # nothing forced: the request is only a request
        Mutex(other_client, path).acquire(timeout=1.0)
    assert lease.held
    lease.release()
