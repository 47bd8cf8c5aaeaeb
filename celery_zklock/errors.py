"""Exceptions raised by celery-zklock."""

from __future__ import annotations

import enum


class ZkLockError(Exception):
    """Base class of every error raised by celery-zklock."""


class LockTimeout(ZkLockError):
    """An acquire did not get the lock before its deadline; no contender node was left behind."""


class LossCode(str, enum.Enum):
    """Why a lease counts as lost, for programs (metrics, alerts); the text beside it is for
    people. Compares equal to its value (``LossCode.BROKEN == "broken"``); more codes may come,
    so a reader should treat one it does not know as "other"."""

    #: The lease clock ran out: no answer from the ZooKeeper leader in time to prove the
    #: session alive (a silent link, an unreachable leader, or the process was paused).
    LEASE_CLOCK = "lease_clock"
    #: The session behind the lease's node expired, or the client is in another session now.
    SESSION_EXPIRED = "session_expired"
    #: Someone else deleted the lease's node (``celery zklock break --force``, say).
    NODE_DELETED = "node_deleted"
    #: An operator asked the holder to let go (a break request in the node's data).
    BROKEN = "broken"
    #: A newer call of ``lock_on_busy="preempt"`` asked the holder to let go (a break request
    #: naming it): how the task layer tells a :class:`Preempted` run's loss (the lease itself
    #: says ``BROKEN``).
    PREEMPTED = "preempted"

    def __str__(self) -> str:
        return self.value


class LockLost(ZkLockError):
    """The ZooKeeper session behind a held lock was lost: another holder may exist from now on.

    ``code`` (a :class:`LossCode`, or None where the cause is not known) says why; the message
    says it for people. Constructed as any exception, with ``code`` as an optional keyword.
    Derives from ``Exception`` (not ``BaseException``) so that Celery's trace records it as the
    task's failure.
    """

    def __init__(self, *args: object, code: LossCode | None = None) -> None:
        super().__init__(*args)
        self.code = code


class Preempted(LockLost):
    """The run's lock was taken over by a newer call of ``lock_on_busy="preempt"`` (the message
    names it): the intended outcome, not a fault. Every ``ZkLockTask`` lists it in Celery's
    ``throws``, so the worker logs it at INFO without a traceback, beside one WARNING line of
    the ``lost`` event; the task ends FAILURE (or retries, under ``lock_on_lost="retry"``)."""


class LockBusy(ZkLockError):
    """The lock was held by someone else and the task's policy is ``raise``."""


class RateLimited(LockBusy):
    """The lock's key is over its ``lock_rate``: the window admits no run now."""


class ConfigurationError(ZkLockError, ValueError):
    """A lock option or setting is invalid; the message names the bad value and what to do."""


class ZooKeeperUnavailable(ZkLockError):
    """ZooKeeper could not be reached in time to take a task's lock; the task was not run."""
