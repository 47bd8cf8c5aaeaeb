"""Exceptions raised by celery-zklock."""

from __future__ import annotations


class ZkLockError(Exception):
    """Base class of every error raised by celery-zklock."""


class LockTimeout(ZkLockError):
    """An acquire did not get the lock before its deadline; no contender node was left behind."""


class LockLost(ZkLockError):
    """The ZooKeeper session behind a held lock was lost: another holder may exist from now on.

    Derives from ``Exception`` (not ``BaseException``) so that Celery's trace records it as the
    task's failure.
    """


class LockBusy(ZkLockError):
    """The lock was held by someone else and the task's policy is ``raise``."""


class ConfigurationError(ZkLockError, ValueError):
    """A lock option or setting is invalid; the message names the bad value and what to do."""


class ZooKeeperUnavailable(ZkLockError):
    """ZooKeeper could not be reached in time to take a task's lock; the task was not run."""
