"""celery-zklock: Celery tasks under ZooKeeper locks."""

from celery_zklock.errors import LockBusy, LockLost, LockTimeout, ZkLockError
from celery_zklock.locks import Lease, Mutex, ReadWriteLock

__all__ = ["Lease", "LockBusy", "LockLost", "LockTimeout", "Mutex", "ReadWriteLock", "ZkLockError"]
