"""One call per lock event: the structured log line and, for the four public events, the signal.

Every event is logged on the ``celery_zklock`` logger as ``zklock event=<name> k=v ...`` with the
same fields in ``record.zklock`` (a dict) for structured handlers. ``acquired``, ``busy``,
``lost`` and ``released`` also send their signal of :mod:`celery_zklock.task.signals` (sender = the
task; keywords ``task_id``, ``path`` and the event's fields). The ``lost`` event's fields are
``token``, ``reason`` and ``code`` (a :class:`~celery_zklock.errors.LossCode`, logged as its
value: ``code=lease_clock``).
"""

from __future__ import annotations

import logging
from typing import Any, Final

from celery.utils.dispatch import Signal

from celery_zklock.task import signals

logger = logging.getLogger("celery_zklock")

SIGNALS: Final[dict[str, Signal]] = {
    "acquired": signals.lock_acquired,
    "busy": signals.lock_busy,
    "lost": signals.lock_lost,
    "released": signals.lock_released,
    "timeout": signals.lock_timeout,
}
_WARNINGS: Final = frozenset({"lost", "duplicate-ignored", "marker-left"})


def emit(task: Any, event: str, path: str, *, task_id: Any, **fields: Any) -> None:
    """Log ``event`` of ``task``'s run ``task_id`` on lock ``path`` and send its signal.

    ``task_id`` is explicit: the lost event is emitted from the lease clock's thread, where
    ``task.request`` is not the run's. Nothing is built for a log level that is off or a
    signal without receivers: this runs twice per locked task.
    """
    level = logging.WARNING if event in _WARNINGS else logging.INFO
    if logger.isEnabledFor(level):
        record = {"task_id": task_id, **fields, "task": task.name, "path": path}
        text = " ".join(
            f"{k}={v:.4f}" if isinstance(v, float) else f"{k}={v}" for k, v in record.items()
        )
        logger.log(
            level, "zklock event=%s %s", event, text, extra={"zklock": {"event": event, **record}}
        )
    signal = SIGNALS.get(event)
    if signal is not None and signal.receivers:
        signal.send(sender=task, task_id=task_id, path=path, **fields)
