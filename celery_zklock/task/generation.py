"""A call's generation: which of two calls of a lock is the newer, for ``preempt``.

Every call sent through a ``ZkLockTask`` (``delay``, ``apply_async``, a canvas) carries a
generation in its message header :data:`GENERATION_HEADER`: the sending process's wall clock,
in nanoseconds since the Unix epoch, when the call was first sent (:func:`next_generation`:
strictly increasing within one process, also when its clock steps back). Its retries and the
re-sends of its message keep it unchanged (``ZkLockTask.signature_from_request``), and its run
stores it in its contender node (:func:`celery_zklock.locks.identity.identity`), where a
``preempt`` run compares it with the holders' (:func:`is_newer`). The higher generation is the
newer call. Calls sent from one process are ordered as they were sent; calls sent from
different hosts by their clocks, so two calls sent within the clocks' skew of each other may
count the other way round. The skew never lets two runs preempt each other (a run only preempts
a strictly older generation, and keeps its own), it only decides which of the two wins.

A call that arrives without one (sent by name with ``app.send_task``, or by an older version)
takes one when its first attempt runs (:func:`of_request` with ``run``: the worker's clock at
that moment), kept by its retries. A retry of a call that never had one (sent by an older
version and first run by an older version's worker) has none, nor has such a message handed
out again (its first run's generation died with that run): it counts as older than every call
with one.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Mapping
from typing import Any, Final

GENERATION_HEADER: Final = "zklock_generation"
"""The message header (and, in a worker, the request attribute) of a call's generation."""

_last = 0
_lock = threading.Lock()


def next_generation() -> int:
    """A new generation: this process's clock in nanoseconds, above every one it gave before."""
    global _last
    with _lock:
        now = time.time_ns()
        _last = now if now > _last else _last + 1
        return _last


def _after_fork() -> None:
    global _lock
    _lock = threading.Lock()  # a lock held by another thread at the fork is never released


os.register_at_fork(after_in_child=_after_fork)


def of_request(request: Any, *, run: bool = False) -> int | None:
    """The generation ``request``'s message carries, or None (in a worker a message's custom
    headers become request attributes; elsewhere they stay in ``headers``). With ``run`` (the
    generation of the run of ``request``): a first attempt sent without one takes a new one,
    set on ``request`` so that its retries keep it; a retry, or a message handed out again
    (flagged redelivered), sent without one stays None."""
    value = getattr(request, GENERATION_HEADER, None)
    if value is None:
        headers = getattr(request, "headers", None)
        value = headers.get(GENERATION_HEADER) if isinstance(headers, Mapping) else None
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    # A message handed out again may have run before: a generation taken now would be newer
    # than calls sent since, which it must never preempt.
    handed_out_again = (getattr(request, "delivery_info", None) or {}).get("redelivered")
    if run and not request.retries and not handed_out_again:
        value = next_generation()
        setattr(request, GENERATION_HEADER, value)
        return value
    return None


def is_newer(generation: int | None, than: int | None) -> bool:
    """Whether a call of ``generation`` is strictly newer than one of ``than``. No generation
    is older than any: an older version's run, a holder that is not a task run."""
    return generation is not None and (than is None or generation > than)
