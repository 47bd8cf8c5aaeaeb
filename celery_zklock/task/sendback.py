"""A run that must wait without a pool slot sends its call back to the broker and ends.

Two situations make a run in the pool end at once, without a state, after publishing its call
again under the same task id, arguments, options, retry count and generation (a retry it is
not: ``max_retries`` is untouched), with an ETA: ZooKeeper unreachable (:func:`ride_out`) and,
with ``lock_rate`` and a ``wait`` policy, a window that has not opened yet (the throttle: the
lock is released first, so that nothing is held while the call waits). The message carries the
instant its call first reached a gate (:data:`FIRST_DUE`): back at a gate, it takes its place in
its key's line by that instant (ahead of calls made after it) and its ``lock_timeout`` goes on
counting from there. The message is published before the run's own is acknowledged: a worker
that dies between the two leaves both, and the run of the second looks once for a final state
first (:meth:`celery_zklock.task.run.LockedRun._acquire`).

**Riding an outage out.** With ``lock_on_unavailable="wait"`` (the default) a locked call that
cannot reach ZooKeeper does not spend its retries nor keep a pool slot: the worker's gate holds
it while its own client is disconnected (:mod:`celery_zklock.worker.gate`), and a run in the pool
that finds ZooKeeper unreachable sends its message back (:func:`ride_out`), so that a gate holds
it. The message carries since when the call has met the outage (:data:`UNAVAILABLE_SINCE`); once
the outage budget (``zklock_outage_budget``, at most the gate's broker bound) has passed since
then, the ``unavailable`` policy applies as without riding out: a retry with
``ZooKeeperUnavailable``.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any, Final

from celery.exceptions import Ignore

__all__ = [
    "FIRST_DUE",
    "SEND_BACK_AFTER",
    "UNAVAILABLE_SINCE",
    "SentBack",
    "first_due",
    "header_number",
    "ride_out",
    "send_back",
    "unavailable_since",
]

FIRST_DUE: Final = "zklock_first_due"
"""The message header holding when the call first reached a worker's gate (``time.time()``)."""
UNAVAILABLE_SINCE: Final = "zklock_unavailable_since"
"""The message header (and request field) holding when the call first met the outage
(``time.time()``): the outage budget counts from there, across re-sends and workers."""
SEND_BACK_AFTER: Final = 1.0
"""Seconds after which a message sent back by :func:`ride_out` reaches a worker again (its ETA):
a worker whose gate is connected but whose pool process is not yet does not spin on it."""


class SentBack(Ignore):  # type: ignore[misc]
    """The run ended without a state: its call was sent back to wait without a pool slot."""


def first_due(request: Any) -> float | None:
    """When the call of ``request`` first reached a gate, if its message says so."""
    return header_number(request, FIRST_DUE)


def unavailable_since(request: Any) -> float | None:
    """When the call of ``request`` first met the outage, if it did (its message says so, or
    the gate that handed it to the pool past the budget)."""
    return header_number(request, UNAVAILABLE_SINCE)


def send_back(
    task: Any,
    request: Any,
    countdown: float,
    reason: str,
    headers: Mapping[str, Any] | None = None,
    due: float | None = None,
) -> SentBack:
    """Publish the call of ``request`` again, ``countdown`` seconds from now, with ``headers``
    added and ``due`` (when it first reached a gate) carried; returns the :class:`SentBack`
    (saying ``reason``) for the run to raise, which acknowledges this message."""
    signature = task.signature_from_request(request, countdown=countdown)
    carried = dict(signature.options.get("headers") or {})
    carried.update(headers or {})
    if due is not None:
        carried[FIRST_DUE] = min(due, first_due(request) or due)
    signature.options["headers"] = carried
    signature.apply_async()
    return SentBack(f"task {task.name!r} [{request.id}]: {reason}")


def header_number(request: Any, name: str) -> float | None:
    """A number a message header carries, from a task's request (a request attribute in a
    worker, else in ``headers``) or a worker's ``Request`` in the main process (its
    ``request_dict``)."""
    carried = getattr(request, "request_dict", None)
    value = carried.get(name) if isinstance(carried, Mapping) else getattr(request, name, None)
    if value is None:
        headers = getattr(request, "headers", None)
        value = headers.get(name) if isinstance(headers, Mapping) else None
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def ride_out(task: Any, request: Any, since: float, due: float | None) -> SentBack:
    """Send the call of ``request`` back (:func:`send_back`) carrying ``since``, to wait at a
    gate for ZooKeeper; the :class:`SentBack` to raise."""
    waited = time.time() - since
    reason = (
        f"ZooKeeper unreachable for {waited:.1f}s; the call was sent back to wait at a "
        "worker's gate until it answers"
    )
    headers = {UNAVAILABLE_SINCE: since}
    return send_back(task, request, SEND_BACK_AFTER, reason, headers, due)
