"""What Flower sees of a run's lock, beyond Celery's own states: task events, never the result.

With task events on (``worker_send_task_events = True``, or ``celery worker -E``), a call that
waits for its lock (held at the worker's gate, or waiting in the pool) sends the custom event
``task-lock-waiting`` (``lock``, ``holder``), and a skipped run ``task-lock-skipped`` (``lock``,
``holder``, ``reason``). Flower lists them in the task's events and shows their fields on the
task (``lock_skipped``: the reason).

Nothing is written into the task's own result: Celery's backends guard a final state only by a
read then a set, so a waiting state written there can land on a FAILURE (or REVOKED) that was
just stored, and a copy of the message handed out again would then find no final state and run
the body a second time. (Up to round 3 a waiting call was ``LOCK_WAITING`` in the backend.)

Nothing here may fail a run: a broker error is logged at debug level and ignored.
"""

from __future__ import annotations

import logging
from typing import Any, Final

from celery_zklock.task.interrupt import STOPPING

__all__ = ["SKIPPED_EVENT", "WAITING_EVENT", "held", "skipped", "waiting"]

WAITING_EVENT: Final = "task-lock-waiting"
SKIPPED_EVENT: Final = "task-lock-skipped"

logger = logging.getLogger("celery_zklock.visibility")


def waiting(task: Any, path: str, holder: Any) -> None:
    """``task``'s run is about to wait in the pool for lock ``path``, held by task ``holder``."""
    _send(task, WAITING_EVENT, lock=path, holder=holder)


def held(request: Any, path: str, holder: Any) -> None:
    """The worker's gate holds ``request`` (a worker request, in the worker's main process)
    until lock ``path``, held by task ``holder``, can be granted."""
    _send_request(request, WAITING_EVENT, lock=path, holder=holder)


def skipped(task: Any, path: str, holder: Any, reason: str) -> None:
    """``task``'s run is skipped (``reason``: busy, timeout, lost) on lock ``path``."""
    _send(task, SKIPPED_EVENT, lock=path, holder=holder, lock_skipped=reason)


def _in_worker(task: Any) -> bool:
    request = task.request
    return bool(request.id) and not request.called_directly and not request.is_eager


def _send(task: Any, event: str, **fields: Any) -> None:
    if not _in_worker(task) or not task.app.conf.worker_send_task_events:
        return
    try:
        task.send_event(event, retry=False, **fields)
    except STOPPING:
        raise
    except Exception:
        logger.debug("could not send %s for %s", event, task.request.id, exc_info=True)


def _send_request(request: Any, event: str, **fields: Any) -> None:
    try:
        request.send_event(event, **fields)
    except Exception:
        logger.debug("could not send %s for %s", event, request.id, exc_info=True)
