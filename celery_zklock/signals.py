"""Celery signals sent by :class:`~celery_zklock.ZkLockTask` around its lock.

Every signal is sent with ``sender`` = the task and keywords ``task_id``, ``path`` (the lock
path) and what the event adds (see each). Receivers run on the task's thread, except
``lock_lost``, which runs on the thread that detected the loss (the lease clock's), after the
interruption of the body was fired: keep receivers short. A receiver that raises is logged by
Celery and otherwise ignored; ``lock_acquired`` receivers run before the body, and a lease lost
while they run is seen before the body starts.
"""

from __future__ import annotations

from celery.utils.dispatch import Signal

#: The lock was granted. Adds ``token``, ``mode``, ``waited`` (seconds).
lock_acquired = Signal(name="zklock_lock_acquired")
#: The lock was busy. Adds ``policy`` (what the task does) and ``holder`` (task id or None).
lock_busy = Signal(name="zklock_lock_busy")
#: The lease was lost while the task held it (sent once per lease, on the lease clock's thread,
#: after the body's interruption was fired). Adds ``token`` and ``reason``.
lock_lost = Signal(name="zklock_lock_lost")
#: The lease was released. Adds ``token`` and ``held`` (seconds).
lock_released = Signal(name="zklock_lock_released")
