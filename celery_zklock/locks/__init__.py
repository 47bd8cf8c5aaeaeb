"""Lock recipes on ZooKeeper, usable with any kazoo client and without Celery."""

from celery_zklock.locks.contenders import LimitMismatch
from celery_zklock.locks.leader import LeaderLatch
from celery_zklock.locks.lease import Lease
from celery_zklock.locks.multi import MultiLease, MultiLock
from celery_zklock.locks.mutex import Mutex
from celery_zklock.locks.rate import RateLimit
from celery_zklock.locks.revoke import attempt_revoke, on_revoke
from celery_zklock.locks.rwlock import ReadWriteLock
from celery_zklock.locks.semaphore import Semaphore

__all__ = [
    "LeaderLatch",
    "Lease",
    "LimitMismatch",
    "MultiLease",
    "MultiLock",
    "Mutex",
    "RateLimit",
    "ReadWriteLock",
    "Semaphore",
    "attempt_revoke",
    "on_revoke",
]
