"""What a locked run does when it cannot simply run: one table for every situation and policy.

A run that does not get, or does not keep, its lock (or, with ``lock_rate``, its admission) is
in one of six situations, and the task's options name a policy for each but ``superseded``:

============  ==============  =======================================================
situation     policy option   policies
============  ==============  =======================================================
busy          lock_on_busy    skip, wait, retry (LockBusy), raise (LockBusy), preempt (a wait
                              after asking the holders to end)
rate          lock_on_busy    skip, wait, retry (RateLimited), raise (RateLimited)
superseded    (none)          skip: a ``preempt`` call met a newer call of its task in the
                              lock's queue (see :mod:`celery_zklock.task.generation`)
timeout       lock_on_timeout skip, retry (LockTimeout), raise (LockTimeout)
lost          lock_on_lost    retry (LockLost), raise (LockLost)
unavailable   lock_on_        wait (ride the outage out at a gate, then retry: see
              unavailable     :mod:`celery_zklock.task.outage`), retry (ZooKeeperUnavailable),
                              raise (ZooKeeperUnavailable); raise outside a worker
============  ==============  =======================================================

``skip`` ends the task SUCCESS with a JSON-safe result for which :func:`is_skipped` is true
(chords and groups keep counting; what a chain or a chord's body then gets:
:mod:`celery_zklock.task.canvas`); ``wait`` blocks up to ``lock_timeout``; ``retry`` is
Celery's ``self.retry`` (``max_retries`` applies) carrying the error; ``raise`` fails the task
with it. ZooKeeper being unreachable is never taken for a busy lock or a timeout: in a worker
its policy applies, and it raises when the task is called directly or eagerly.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Final, Literal

from celery_zklock.errors import (
    LockBusy,
    LockLost,
    LockTimeout,
    RateLimited,
    ZkLockError,
    ZooKeeperUnavailable,
)

Situation = Literal["busy", "rate", "superseded", "timeout", "lost", "unavailable"]
Action = Literal["skip", "wait", "retry", "raise"]

SKIP_MARKER: Final = "__zklock_skipped__"


@dataclass(frozen=True)
class Verdict:
    """What to do: ``action``, and the error a ``retry`` carries or a ``raise`` raises."""

    action: Action
    error: type[ZkLockError] | None = None


TABLE: Final[Mapping[tuple[Situation, str], Verdict]] = MappingProxyType(
    {
        ("busy", "skip"): Verdict("skip"),
        ("busy", "wait"): Verdict("wait"),
        ("busy", "retry"): Verdict("retry", LockBusy),
        ("busy", "raise"): Verdict("raise", LockBusy),
        ("busy", "preempt"): Verdict("wait"),
        ("rate", "skip"): Verdict("skip"),
        ("rate", "wait"): Verdict("wait"),
        ("rate", "retry"): Verdict("retry", RateLimited),
        ("rate", "raise"): Verdict("raise", RateLimited),
        ("superseded", "skip"): Verdict("skip"),
        ("timeout", "skip"): Verdict("skip"),
        ("timeout", "retry"): Verdict("retry", LockTimeout),
        ("timeout", "raise"): Verdict("raise", LockTimeout),
        ("lost", "retry"): Verdict("retry", LockLost),
        ("lost", "raise"): Verdict("raise", LockLost),
        ("unavailable", "retry"): Verdict("retry", ZooKeeperUnavailable),
        ("unavailable", "raise"): Verdict("raise", ZooKeeperUnavailable),
    }
)
"""(situation, policy) -> verdict, for every policy a situation accepts."""


def decide(situation: Situation, policy: str, *, in_worker: bool) -> Verdict:
    """The verdict for ``situation`` under ``policy`` (``"retry"`` for ``unavailable``).

    Outside a worker (a direct call, ``apply()`` or eager mode) ZooKeeper being unavailable
    raises instead of retrying: retrying in place would only block the caller.
    """
    verdict = TABLE[(situation, policy)]
    if situation == "unavailable" and not in_worker:
        return Verdict("raise", verdict.error)
    return verdict


def skip_result(path: str, holder: Any, reason: Situation) -> dict[str, Any]:
    """The JSON-safe result of a skipped run: the lock, the holder's task id and why."""
    return {SKIP_MARKER: True, "reason": reason, "lock": path, "holder": holder}


def is_skipped(result: Any) -> bool:
    """True if ``result`` is the result of a run skipped because its lock was busy.

    Accepts the value itself (as returned by ``AsyncResult.get()``, after the backend's JSON
    round trip) or a ready ``AsyncResult``.
    """
    if hasattr(result, "ready") and hasattr(result, "result"):
        if not result.ready():
            return False
        result = result.result
    return isinstance(result, Mapping) and result.get(SKIP_MARKER) is True
