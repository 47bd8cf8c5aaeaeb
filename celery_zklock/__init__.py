"""celery-zklock: Celery tasks under ZooKeeper locks."""

from celery_zklock.errors import (
    ConfigurationError,
    LockBusy,
    LockLost,
    LockTimeout,
    ZkLockError,
    ZooKeeperUnavailable,
)
from celery_zklock.fence import RedisFence
from celery_zklock.keys import LockKeyError
from celery_zklock.locks import Lease, LimitMismatch, Mutex, ReadWriteLock, Semaphore
from celery_zklock.policy import is_skipped
from celery_zklock.task import ZkLockTask

__all__ = [
    "ConfigurationError",
    "Lease",
    "LimitMismatch",
    "LockBusy",
    "LockKeyError",
    "LockLost",
    "LockTimeout",
    "Mutex",
    "ReadWriteLock",
    "RedisFence",
    "Semaphore",
    "ZkLockError",
    "ZkLockTask",
    "ZooKeeperUnavailable",
    "is_skipped",
]
