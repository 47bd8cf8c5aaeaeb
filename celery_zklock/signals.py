"""The lock signals, at their documented path: defined in :mod:`celery_zklock.task.signals`."""

from celery_zklock.task.signals import (
    lock_acquired,
    lock_busy,
    lock_lost,
    lock_released,
    lock_timeout,
)

__all__ = ["lock_acquired", "lock_busy", "lock_lost", "lock_released", "lock_timeout"]
