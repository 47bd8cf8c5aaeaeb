"""What Flower and the result backend see of a run's lock, beyond Celery's own states.

- A run that waits for its lock stores the state ``LOCK_WAITING`` in the result backend (meta:
  ``lock``, ``holder``, ``since``) and, once granted, ``STARTED`` again (meta ``pid``,
  ``hostname``, as Celery's own), so ``AsyncResult.state`` says which runs are queued behind a
  lock rather than running. Only waits write: a run granted at once costs nothing here.
- With task events on (``worker_send_task_events = True``, or ``celery worker -E``), a run sends
  the custom events ``task-lock-waiting`` (``lock``, ``holder``) and ``task-lock-skipped``
  (``lock``, ``holder``, ``reason``). Flower lists them in the task's events and shows their
  fields on the task (``lock_skipped``: the reason), so a skipped run is told apart from one
  that ran without reading its result.

Nothing here may fail a run: a backend or broker error is logged at debug level and ignored.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any, Final

from celery import states

from celery_zklock.interrupt import STOPPING

__all__ = [
    "SKIPPED_EVENT",
    "WAITING_EVENT",
    "WAITING_STATE",
    "granted_after_wait",
    "held",
    "skipped",
    "unheld",
    "waiting",
]

WAITING_STATE: Final = "LOCK_WAITING"
WAITING_EVENT: Final = "task-lock-waiting"
SKIPPED_EVENT: Final = "task-lock-skipped"

logger = logging.getLogger("celery_zklock.visibility")


def waiting(task: Any, path: str, holder: Any) -> None:
    """``task``'s run is about to wait for lock ``path``, held by task ``holder``."""
    _store(task, WAITING_STATE, {"lock": path, "holder": holder, "since": time.time()})
    _send(task, WAITING_EVENT, lock=path, holder=holder)


def held(request: Any, path: str, holder: Any) -> None:
    """The worker's gate holds ``request`` (a worker request, in the worker's main process)
    until lock ``path``, held by task ``holder``, can be granted: ``LOCK_WAITING``, as for a
    run that waits."""
    _store_request(request, WAITING_STATE, {"lock": path, "holder": holder, "since": time.time()})
    _send_request(request, WAITING_EVENT, lock=path, holder=holder)


def unheld(request: Any) -> None:
    """The gate handed ``request`` to the pool: ``RECEIVED`` again until it starts."""
    _store_request(request, states.RECEIVED, {})


def granted_after_wait(task: Any) -> None:
    """The run that waited holds its lock now: back to ``STARTED`` in the result backend."""
    _store(task, states.STARTED, {"pid": os.getpid(), "hostname": task.request.hostname})


def skipped(task: Any, path: str, holder: Any, reason: str) -> None:
    """``task``'s run is skipped (``reason``: busy, timeout, lost) on lock ``path``."""
    _send(task, SKIPPED_EVENT, lock=path, holder=holder, lock_skipped=reason)


def _in_worker(task: Any) -> bool:
    request = task.request
    return bool(request.id) and not request.called_directly and not request.is_eager


def _store(task: Any, state: str, meta: dict[str, Any]) -> None:
    if not _in_worker(task) or task.ignore_result:
        return
    try:
        task.update_state(state=state, meta=meta)
    except STOPPING:
        raise
    except Exception:  # no result backend, or it failed: the run goes on
        logger.debug("could not store state %s for %s", state, task.request.id, exc_info=True)


def _send(task: Any, event: str, **fields: Any) -> None:
    if not _in_worker(task) or not task.app.conf.worker_send_task_events:
        return
    try:
        task.send_event(event, retry=False, **fields)
    except STOPPING:
        raise
    except Exception:
        logger.debug("could not send %s for %s", event, task.request.id, exc_info=True)


def _store_request(request: Any, state: str, meta: dict[str, Any]) -> None:
    task = request.task
    if task.ignore_result:
        return
    try:
        task.backend.store_result(request.id, meta, state)
    except Exception:
        logger.debug("could not store state %s for %s", state, request.id, exc_info=True)


def _send_request(request: Any, event: str, **fields: Any) -> None:
    try:
        request.send_event(event, **fields)
    except Exception:
        logger.debug("could not send %s for %s", event, request.id, exc_info=True)
