"""A task's lock: its path for a call's arguments, and who holds it now (what
``task.lock_path(...)`` and ``task.lock_holder(...)`` answer).

A task's lock is the znode ``<root>/<lock_name>/<key>``, the same computation a run makes; it
is read as :func:`celery_zklock.locks.holders.read_lock` reads any lock.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Any

from celery_zklock.locks.holders import Holder, read_lock
from celery_zklock.task.options import TaskLockSpec
from celery_zklock.zk.client import get_client
from celery_zklock.zk.settings import settings_of

__all__ = ["Holder", "lock_holder", "lock_holders", "lock_path"]


def lock_path(
    task: Any, args: Sequence[Any], kwargs: Mapping[str, Any], *, whole_call: bool = False
) -> str:
    """The lock path a call of ``task`` (a ZkLockTask) with these arguments takes: the app's
    ``zklock_root``, the task's lock name and the key its own key builder computes. When
    ``lock_key`` names parameters, the arguments of those are enough (``task.lock_path("x")``
    for ``hold(k, seconds)`` with ``lock_key=["k"]``), unless ``whole_call`` (a call being sent
    must fit the task's signature whole).

    Raises TypeError naming a missing key argument or one that fits no parameter, LockKeyError
    (or what a callable ``lock_key`` raises) for arguments that make no key.
    """
    spec: TaskLockSpec = task._zklock_compile(task.name)
    root = settings_of(task.app).root
    return spec.path(root, args, kwargs) if whole_call else spec.key_path(root, args, kwargs)


def lock_holders(task: Any, args: Sequence[Any], kwargs: Mapping[str, Any]) -> tuple[Holder, ...]:
    """Who holds the lock a call of ``task`` with these arguments takes, in queue order (several
    readers of a shared lock), read with the process's ZooKeeper client for the app's settings.

    Raises ZooKeeperUnavailable when ZooKeeper does not answer in time.
    """
    path = lock_path(task, args, kwargs)
    client = get_client(settings_of(task.app).client)
    return read_lock(client, path).holder_records(time.time())


def lock_holder(task: Any, args: Sequence[Any], kwargs: Mapping[str, Any]) -> Holder | None:
    """The first of :func:`lock_holders` (the one a writer would wait for first), or None."""
    holders = lock_holders(task, args, kwargs)
    return holders[0] if holders else None
