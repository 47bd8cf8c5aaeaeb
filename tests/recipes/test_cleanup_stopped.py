"""A time limit landing in an acquire's clean-up is raised, and the node still goes.

A busy try-lock removes its node (``ContenderQueue.discard``); a failed blocking acquire removes
its attempt's nodes (``ContenderQueue.abandon``). Both hand the removal to the background when
ZooKeeper fails. They used to do that for any ``Exception``, so a soft time limit landing in the
removal (billiard raises it wherever the task's thread is) was swallowed: the try-lock answered
"busy" and the run went on under its busy policy, past its limit.
"""

from __future__ import annotations

import threading
from typing import Any

import pytest
from celery.exceptions import SoftTimeLimitExceeded
from kazoo.client import KazooClient
from kazoo.exceptions import ConnectionLoss

from celery_zklock import Lease, Mutex
from celery_zklock.locks.queue import ContenderQueue
from tests.lockutil import children, wait_for


def _once_on(thread: threading.Thread, error: BaseException, real: Any) -> Any:
    """``real``, except that its first call from ``thread`` raises ``error``."""
    raised = threading.Event()

    def call(*args: Any, **kwargs: Any) -> Any:
        if threading.current_thread() is thread and not raised.is_set():
            raised.set()
            raise error
        return real(*args, **kwargs)

    return call


def _wait_only_holder_left(client: KazooClient, path: str, holder: Lease, what: str) -> None:
    """The removal went on in the background: wait until the holder's node is the only one."""
    holder_node = holder.node.rsplit("/", 1)[1]
    wait_for(lambda: children(client, path) == [holder_node], what=what)


def test_a_time_limit_in_a_busy_try_locks_removal_is_raised(
    zk_client: KazooClient,
    other_client: KazooClient,
    lock_root: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    path = f"{lock_root}/busy"
    holder = Mutex(other_client, path).acquire(timeout=5)
    me = threading.current_thread()
    monkeypatch.setattr(
        ContenderQueue,
        "delete",
        _once_on(me, SoftTimeLimitExceeded("soft limit"), ContenderQueue.delete),
    )
    with pytest.raises(SoftTimeLimitExceeded):  # before the fix: None, i.e. "busy"
        Mutex(zk_client, path).acquire(blocking=False)
    _wait_only_holder_left(zk_client, path, holder, "the try-lock's node to go")
    holder.release()
    wait_for(lambda: children(zk_client, path) == [], what="the lock to be empty")


def test_a_time_limit_in_an_abandoned_acquires_removal_is_raised(
    zk_client: KazooClient,
    other_client: KazooClient,
    lock_root: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    path = f"{lock_root}/abandoned"
    holder = Mutex(other_client, path).acquire(timeout=5)
    me = threading.current_thread()
    real_listing = zk_client.get_children_async
    waited = threading.Event()

    def await_grant(*_: Any, **__: Any) -> bool:
        waited.set()
        raise ConnectionLoss("the wait failed")  # ZooKeeper failing: abandon removes our node

    def get_children_async(*args: Any, **kwargs: Any) -> Any:
        if waited.is_set() and threading.current_thread() is me:  # abandon's listing
            waited.clear()
            raise SoftTimeLimitExceeded("soft limit")
        return real_listing(*args, **kwargs)

    monkeypatch.setattr(ContenderQueue, "await_grant", await_grant)
    monkeypatch.setattr(zk_client, "get_children_async", get_children_async)
    with pytest.raises(SoftTimeLimitExceeded):  # before the fix: the ConnectionLoss
        Mutex(zk_client, path).acquire(timeout=5)
    _wait_only_holder_left(zk_client, path, holder, "the abandoned attempt's node to go")
    holder.release()
