"""A call that meets an unreachable ZooKeeper rides the outage out, up to the outage budget.

With ``lock_on_unavailable="wait"`` (the default) a locked call that cannot reach ZooKeeper does
not spend its retries nor keep a pool slot: the worker's gate holds it while its own client is
disconnected (:mod:`celery_zklock.worker.gate`), and a run in the pool that finds ZooKeeper
unreachable ends at once, without a state, after sending its message back under the same task
id and retry count (:mod:`celery_zklock.task.sendback`; a retry it is not), so that a gate holds
it. The message carries since when the call has met the outage (:data:`UNAVAILABLE_SINCE`);
once the outage budget (``zklock_outage_budget``, at most the gate's broker bound) has passed
since then, the ``unavailable`` policy applies as without riding out: a retry with
``ZooKeeperUnavailable``.
"""

from __future__ import annotations

import time
from typing import Any, Final

from celery_zklock.task.sendback import SentBack, header_number, send_back

__all__ = [
    "SEND_BACK_AFTER",
    "UNAVAILABLE_SINCE",
    "ride_out",
    "unavailable_since",
]

UNAVAILABLE_SINCE: Final = "zklock_unavailable_since"
"""The message header (and request field) holding when the call first met the outage
(``time.time()``): the outage budget counts from there, across re-sends and workers."""
SEND_BACK_AFTER: Final = 1.0
"""Seconds after which a message sent back reaches a worker again (its ETA): a worker whose
gate is connected but whose pool process is not yet does not spin on it."""


def unavailable_since(request: Any) -> float | None:
    """When the call of ``request`` first met the outage, if it did (its message says so, or
    the gate that handed it to the pool past the budget)."""
    return header_number(request, UNAVAILABLE_SINCE)


def ride_out(task: Any, request: Any, since: float, due: float | None) -> SentBack:
    """Send the call of ``request`` back (:func:`~celery_zklock.task.sendback.send_back`)
    carrying ``since``, to wait at a gate for ZooKeeper; the :class:`SentBack` to raise."""
    waited = time.time() - since
    reason = (
        f"ZooKeeper unreachable for {waited:.1f}s; the call was sent back to wait at a "
        "worker's gate until it answers"
    )
    headers = {UNAVAILABLE_SINCE: since}
    return send_back(task, request, SEND_BACK_AFTER, reason, headers, due)
