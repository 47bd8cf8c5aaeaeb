"""Lock recipes on ZooKeeper, usable with any kazoo client and without Celery."""

from celery_zklock.locks.contenders import LimitMismatch
from celery_zklock.locks.lease import Lease
from celery_zklock.locks.mutex import Mutex
from celery_zklock.locks.rwlock import ReadWriteLock
from celery_zklock.locks.semaphore import Semaphore

__all__ = ["Lease", "LimitMismatch", "Mutex", "ReadWriteLock", "Semaphore"]
