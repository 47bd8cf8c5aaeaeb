"""What Flower sees of a run's lock, beyond Celery's own states: task events, never the result.

With task events on (``worker_send_task_events = True``, or ``celery worker -E``), a call that
waits for its lock (held at the worker's gate, or waiting in the pool) sends the custom event
``task-lock-waiting`` (``lock``, ``holder``), and a skipped run ``task-lock-skipped`` (``lock``,
``holder``, ``reason``). Flower lists them in the task's events and shows their fields on the
task (``lock_skipped``: the reason).

No waiting state is written into the task's own result: Celery's backends guard a final state
only by a read then a set, so a state written there can land on a FAILURE (or REVOKED) that was
just stored, and a copy of the message handed out again would then find no final state and run
the body a second time. (Up to round 3 a waiting call was ``LOCK_WAITING`` in the backend.) For
the same reason a locked task's STARTED (``track_started``) is written by its run once it holds
its lock and knows it is no copy of a call that ended (:func:`take_over_started`), not by
Celery as the message's run begins.

Nothing here may fail a run: a broker error is logged at debug level and ignored.
"""

from __future__ import annotations

import logging
import os
from typing import Any, Final

from celery import states

from celery_zklock.task.interrupt import STOPPING

__all__ = [
    "SKIPPED_EVENT",
    "WAITING_EVENT",
    "held",
    "skipped",
    "started",
    "take_over_started",
    "waiting",
]

WAITING_EVENT: Final = "task-lock-waiting"
SKIPPED_EVENT: Final = "task-lock-skipped"

logger = logging.getLogger("celery_zklock.visibility")


def waiting(task: Any, path: str, holder: Any) -> None:
    """``task``'s run is about to wait in the pool for lock ``path``, held by task ``holder``."""
    _send(task, WAITING_EVENT, lock=path, holder=holder)


def held(request: Any, path: str, holder: Any) -> None:
    """The worker's gate holds ``request`` (a worker request, in the worker's main process)
    until lock ``path``, held by task ``holder``, can be granted."""
    try:
        request.send_event(WAITING_EVENT, lock=path, holder=holder)
    except Exception:
        logger.debug("could not send %s for %s", WAITING_EVENT, request.id, exc_info=True)


TRACKS_STARTED: Final = "_zklock_track_started"
"""The class attribute in which :func:`take_over_started` keeps a task's ``track_started``."""


def take_over_started(task_class: Any) -> None:
    """Keep Celery from writing STARTED for a locked task as its message's run begins, and let
    the run write it (:func:`started`) once it holds its lock and knows it is no copy of a call
    that ended. Celery lets STARTED overwrite a FAILURE, and guards a SUCCESS only by a read
    then a write: a copy of a finished call erased the final state it was about to look for,
    and ran the body again. Called when the class is bound to an app, after Celery read
    ``task_track_started``."""
    if TRACKS_STARTED not in task_class.__dict__:
        setattr(task_class, TRACKS_STARTED, bool(task_class.track_started))
        task_class.track_started = False


def started(task: Any) -> None:
    """The run holds its lock and its body starts: STARTED (``pid``, ``hostname``, as Celery
    writes it), for a task with ``track_started``."""
    if not getattr(task, TRACKS_STARTED, False) or task.ignore_result:
        return
    request = task.request
    meta = {"pid": os.getpid(), "hostname": request.hostname}
    try:
        task.backend.store_result(request.id, meta, states.STARTED, request=request)
    except STOPPING:
        raise
    except Exception:  # the backend failed: the run goes on
        logger.debug("could not store STARTED for %s", request.id, exc_info=True)


def skipped(task: Any, path: str, holder: Any, reason: str) -> None:
    """``task``'s run is skipped (``reason``: busy, timeout, lost) on lock ``path``."""
    _send(task, SKIPPED_EVENT, lock=path, holder=holder, lock_skipped=reason)


def _send(task: Any, event: str, **fields: Any) -> None:
    request = task.request
    in_worker = bool(request.id) and not request.called_directly and not request.is_eager
    if not in_worker or not task.app.conf.worker_send_task_events:
        return
    try:
        task.send_event(event, retry=False, **fields)
    except STOPPING:
        raise
    except Exception:
        logger.debug("could not send %s for %s", event, request.id, exc_info=True)
