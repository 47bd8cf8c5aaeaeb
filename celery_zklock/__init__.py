"""celery-zklock: Celery tasks under ZooKeeper locks."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from celery_zklock.errors import (
    ConfigurationError,
    LockBusy,
    LockLost,
    LockTimeout,
    Preempted,
    ZkLockError,
    ZooKeeperUnavailable,
)
from celery_zklock.locks import (
    LeaderLatch,
    Lease,
    LimitMismatch,
    MultiLock,
    Mutex,
    RateLimit,
    ReadWriteLock,
    Semaphore,
)
from celery_zklock.task.dedupe import AlreadyQueued
from celery_zklock.task.keys import LockKeyError
from celery_zklock.task.policy import is_skipped
from celery_zklock.task.task import ZkLockTask, when_bound
from celery_zklock.worker import wiring
from celery_zklock.worker.leader import on_leader

# Nothing is connected at import: the worker wiring is installed when a ZkLockTask is first bound
# to an app (a worker binds its app's tasks before it starts).
when_bound(wiring.install)

if TYPE_CHECKING:
    from celery_zklock.fence import RedisFence as RedisFence

__all__ = [
    "AlreadyQueued",
    "ConfigurationError",
    "LeaderLatch",
    "Lease",
    "LimitMismatch",
    "LockBusy",
    "LockKeyError",
    "LockLost",
    "LockTimeout",
    "MultiLock",
    "Mutex",
    "Preempted",
    "RateLimit",
    "ReadWriteLock",
    "Semaphore",
    "ZkLockError",
    "ZkLockTask",
    "ZooKeeperUnavailable",
    "is_skipped",
    "on_leader",
]


def __getattr__(name: str) -> Any:
    # RedisFence needs the redis client (the `redis` extra), which the rest of the library does
    # not: it is imported on first use, so `import celery_zklock` works without redis. It is left
    # out of __all__ so that `from celery_zklock import *` does too.
    if name == "RedisFence":
        from celery_zklock.fence import RedisFence

        return RedisFence
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
