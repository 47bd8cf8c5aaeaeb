"""Skips inside Celery's canvas: what follows a skipped run in a chain, a group and a chord.

A skipped run ends SUCCESS with a skip marker (:func:`celery_zklock.is_skipped`). Celery would
hand that marker to whatever follows as if it were the run's result; instead, in a worker:

- **chain** (and ``link`` callbacks): a skipped run stops its chain. The tasks after it do not
  run; each of their results is recorded as SUCCESS with the same marker, so the chain's
  ``AsyncResult.get()`` returns a skip marker instead of hanging, and a chord waiting on the
  chain keeps counting. Complex steps are followed as Celery follows them when it propagates a
  failure down a chain (a chord step's body, a group step's members).
- **group**: each member's own result stands; a skipped member's is its marker.
- **chord**: the body runs with ``None`` in place of each skipped member's result.

A task that wants the markers opts in with the attribute ``zklock_accepts_skipped = True``
(``@app.task(zklock_accepts_skipped=True)``): a chain then goes on into it with the marker as its
argument, and as a chord's body it gets the markers. Any task may opt in, locked or not.

How: :func:`stop_after_skip` runs in the skipped run (it empties the request's chain and
callbacks before Celery's trace reads them); :func:`hide_markers` is a ``task_prerun``
receiver that replaces markers in a task's first positional argument when that is a list (a
chord body's results), in the worker that runs the body. Direct calls, ``apply()`` and eager
mode run a chain in the caller, step by step: there the marker is passed on as before.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Mapping
from typing import Any, Final

from celery import states
from celery.app.task import Context
from celery.backends.base import DisabledBackend

from celery_zklock.task.policy import is_skipped

logger = logging.getLogger("celery_zklock")

ACCEPTS_SKIPPED: Final = "zklock_accepts_skipped"
"""The task attribute by which a task opts in to receive skip markers."""


def accepts_skipped(app: Any, signature: Any) -> bool:
    """True if the task ``signature`` (a signature or its dict) names opted in to markers."""
    name = signature.get("task") if isinstance(signature, Mapping) else None
    task = app.tasks.get(name) if isinstance(name, str) else None
    return bool(getattr(task, ACCEPTS_SKIPPED, False))


def stop_after_skip(task: Any, request: Any, marker: dict[str, Any]) -> None:
    """In a worker, stop the chain and ``link`` callbacks of ``request``'s skipped run (see
    the module docstring); steps that opt in are left to Celery. The skipped steps' results are
    recorded unless the app has no result backend; a backend failing is logged, never raised."""
    if request.called_directly or request.is_eager:
        return
    app = task.app
    chain = list(request.chain or ())
    stopped: list[Any] = []
    if chain and not accepts_skipped(app, chain[-1]):  # Celery pops the next step from the end
        stopped += reversed(chain)
        request.chain = None
    callbacks = list(request.callbacks or ())
    if callbacks:
        kept = [c for c in callbacks if accepts_skipped(app, c)]
        stopped += [c for c in callbacks if not accepts_skipped(app, c)]
        request.callbacks = kept or None
    if stopped and not isinstance(task.backend, DisabledBackend):  # no backend: nothing waits
        try:
            _record_skipped(task.backend, stopped, marker)
        except Exception:  # no result backend, or it failed: the steps just do not run
            logger.warning("could not record the skipped steps after %s", request.id, exc_info=True)


def _record_skipped(backend: Any, steps: list[Any], marker: dict[str, Any]) -> None:
    """Store ``marker`` as the SUCCESS result of every task in ``steps`` (signature dicts),
    descending into groups and chord bodies; a step that is a chord member returns its part."""
    pending = deque(steps)
    while pending:
        step = dict(pending.popleft())
        options = dict(step.get("options") or {})
        kwargs = step.get("kwargs") or {}
        kind = step.get("subtask_type")
        if kind in ("group", "chain"):
            pending.extend(kwargs.get("tasks") or ())
            continue
        if kind == "chord":
            body = kwargs.get("body")
            if body is not None:
                pending.append(body)
            continue
        context = Context(step)  # a request for a step that never ran, as Celery fails a chain's
        context.update(options)
        context.id = options.get("task_id")
        context.group = options.get("group_id")
        if context.id is not None:
            backend.store_result(context.id, marker, states.SUCCESS, request=context)
        if "chord" in options:
            backend.on_chord_part_return(context, states.SUCCESS, marker)


def hide_markers(task: Any = None, args: Any = None, **_: Any) -> None:
    """``task_prerun``: a task that did not opt in gets None for the skip markers in a list
    passed as its first positional argument (a chord's body gets its members' results so)."""
    if task is None or getattr(task, ACCEPTS_SKIPPED, False) or not args:
        return
    results = args[0]
    if isinstance(results, list):
        for index, result in enumerate(results):
            if is_skipped(result):
                results[index] = None
