"""Celery signals sent by :class:`~celery_zklock.ZkLockTask` around its lock.

Every signal is sent with ``sender`` = the task and keywords ``task_id``, ``path`` (the lock
path) and what the event adds (see each). Receivers run on the task's thread, except
``lock_lost`` for a loss while the body runs, which runs on the thread that detected the loss
(the lease clock's), after the interruption of the body was fired: keep receivers short. A
receiver that raises is logged by Celery and otherwise ignored; ``lock_acquired`` receivers
run before the body, and a lease lost while they run is seen before the body starts. For a
task that locks several keys, ``path`` is their paths joined by `` + `` and ``token`` a tuple of
their fencing tokens in the same order.
"""

from __future__ import annotations

from celery.utils.dispatch import Signal

#: The lock was granted. Adds ``token``, ``mode``, ``waited`` (seconds).
lock_acquired = Signal(name="zklock_lock_acquired")
#: The lock was busy. Adds ``policy`` (what the task does) and ``holder`` (task id or None).
lock_busy = Signal(name="zklock_lock_busy")
#: A ``wait`` for the lock reached ``lock_timeout`` (the lock was not granted). Adds ``policy``
#: (``lock_on_timeout``: skip, retry or raise) and ``holder`` (task id or None).
lock_timeout = Signal(name="zklock_lock_timeout")
#: The lease was lost (sent once per lease): while the task held it, on the lease clock's thread
#: after the body's interruption was fired; or found at the release, on the task's thread
#: before ``lock_released``. Adds ``token``, ``reason`` (text for people) and ``code`` (why, a
#: :class:`~celery_zklock.errors.LossCode`: compare with its members or their values, and treat
#: one you do not know as "other"; None if the cause is not known).
lock_lost = Signal(name="zklock_lock_lost")
#: The lease was released. Adds ``token``, ``held`` (seconds) and ``lost`` (True if it had been
#: lost first).
lock_released = Signal(name="zklock_lock_released")
