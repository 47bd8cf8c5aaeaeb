"""What a locked run does when it cannot simply run: one table for every situation and policy.

A run that does not get, or does not keep, its lock (or, with ``lock_rate``, its admission) is
in one of these situations, and the task's options name a policy for each but the skips that a
newer call causes (``superseded``, ``debounced``, ``replaced``):

============  ==============  =======================================================
situation     policy option   policies
============  ==============  =======================================================
busy          lock_on_busy    skip, wait, retry (LockBusy), raise (LockBusy), preempt (a wait
                              after asking the holders to end)
rate          lock_on_busy    skip, wait, retry (RateLimited), raise (RateLimited)
superseded    (none)          skip: a ``preempt`` call met a newer call of its task in the
                              lock's queue (see :mod:`celery_zklock.task.generation`)
debounced     (none)          skip: a newer call of the key came within its ``lock_debounce``
                              window (:mod:`celery_zklock.task.debounce`)
replaced      (none)          skip: a newer ``replace`` call took this one's place as the key's
                              waiting call (:mod:`celery_zklock.task.replace`)
timeout       lock_on_timeout skip, retry (LockTimeout), raise (LockTimeout)
lost          lock_on_lost    retry (LockLost), raise (LockLost)
preempted     lock_on_lost    retry (Preempted), raise (Preempted): the lock was lost to a
                              newer ``preempt`` call; ``Preempted`` is in every locked task's
                              ``throws`` (:func:`expect_preempted`): logged without a traceback
unavailable   lock_on_        wait (ride the outage out at a gate, then retry: see
              unavailable     :mod:`celery_zklock.task.sendback`), retry (ZooKeeperUnavailable),
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
    Preempted,
    RateLimited,
    ZkLockError,
    ZooKeeperUnavailable,
)

Situation = Literal[
    "busy",
    "rate",
    "superseded",
    "debounced",
    "replaced",
    "timeout",
    "lost",
    "preempted",
    "unavailable",
]
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
        ("busy", "replace"): Verdict("wait"),
        ("rate", "skip"): Verdict("skip"),
        ("rate", "wait"): Verdict("wait"),
        ("rate", "retry"): Verdict("retry", RateLimited),
        ("rate", "raise"): Verdict("raise", RateLimited),
        ("superseded", "skip"): Verdict("skip"),
        ("debounced", "skip"): Verdict("skip"),
        ("replaced", "skip"): Verdict("skip"),
        ("timeout", "skip"): Verdict("skip"),
        ("timeout", "retry"): Verdict("retry", LockTimeout),
        ("timeout", "raise"): Verdict("raise", LockTimeout),
        ("lost", "retry"): Verdict("retry", LockLost),
        ("lost", "raise"): Verdict("raise", LockLost),
        ("preempted", "retry"): Verdict("retry", Preempted),
        ("preempted", "raise"): Verdict("raise", Preempted),
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


def expect_preempted(task_class: Any) -> None:
    """Add :class:`~celery_zklock.errors.Preempted` to ``task_class``'s Celery ``throws``
    (unless an exception it derives from is there): Celery then logs a run that ends with it
    at INFO ("raised expected") without a traceback, not as an ERROR that pages people for the
    outcome a ``preempt`` call asked for. The lock's own ``lost`` event says it at WARNING,
    naming the newer call."""
    throws = tuple(getattr(task_class, "throws", None) or ())
    if not any(isinstance(t, type) and issubclass(Preempted, t) for t in throws):
        task_class.throws = (*throws, Preempted)


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
