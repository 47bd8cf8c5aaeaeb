"""Duplicate delivery: another copy of a message whose task already has a node in the lock queue.

Celery delivers at least once. A message comes back while the run it started still goes on (a
Redis visibility timeout with ``acks_late``), or after the process that ran it died (a killed
prefork child with ``task_reject_on_worker_lost``); and ``self.retry()`` publishes the next
attempt before the current one has released its lock. Every contender node of a task carries the
task's identity (``task_id``, ``retries``, worker, pid) as JSON, so a run can find the nodes of
its own task id anywhere in the lock's queue - holding, waiting, exclusive or shared - and tell:

- **its own previous attempt** (fewer retries): still finishing; the run waits for the lock,
  whatever its busy policy.
- **another delivery of the same message** (as many retries or more), *ahead of this run*: the
  *original*. This run is the copy, and never runs beside it or after it while it lives: it
  waits up to the lock's :attr:`~celery_zklock.Mutex.dead_holder_bound` for the original's node
  to go (see below).

  - Still there: the original is alive (holding or waiting); the copy is a duplicate and is
    ignored (``Ignore``: no state is written, so the original's result stands).
  - Gone: the original either finished (it releases just before Celery stores its result) or
    died (its session expired). The copy waits up to :data:`RESULT_SETTLE_SECONDS` for a final
    state of the task: found, it is ignored; not found, the original died and the copy runs the
    task as a new run, under the task's own busy policy. Without a result backend, or with one
    slower than that, a finished original's copy runs the task a second time: after it, never
    beside it (at-least-once).

"Ahead" is the queue order: an exclusive run that got the lock with a try-lock is the head, so
no node of its task id is ahead of it and it does not look; a shared run is granted beside other
readers, so it looks at the nodes ahead of its own; a run that found the lock busy looks at
every node. Two copies that arrive at the same moment, each finding the lock busy, may both take
the other's brief try-lock node for an original that went: both then run, one after the other.

A message the broker marks as redelivered that gets the lock with no original in the queue may
come after its original finished (a copy restored just before the original's ack): it too
waits up to :data:`RESULT_SETTLE_SECONDS` for a final state, holding the lock, and is ignored
if one appears.

Reading the queue costs one listing and one read per contender node; only a run that finds the
lock busy, or a shared run, pays it.

The dead holder bound is an upper bound, in seconds, on how long the node of a holder whose
process died can outlive it. The leader expires a session ``T`` (the *negotiated* timeout, which
the server may have raised above the requested one to its ``minSessionTimeout``) after it last
heard of it, rounded up to the next tick; the last it heard is no later than the death, and the
copy starts after it. ZooKeeper's default ``minSessionTimeout`` is ``2 * tickTime``, so ``tick <=
T/2``, and the node is gone ``1.5 * T`` after the death plus the time to apply the expiry (delete
the ephemeral nodes, notify the watchers): ``1.5 * T + 1`` seconds. A server configured with
``minSessionTimeout`` below ``2 * tickTime`` can exceed it. The lock layer owns the formula, with
``T`` from its client's handshake.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

from celery import states
from celery.backends.base import DisabledBackend
from celery.exceptions import Ignore
from kazoo.client import KazooClient

from celery_zklock.locks.contenders import Contender
from celery_zklock.locks.queue import read_queues
from celery_zklock.task.interrupt import STOPPING
from celery_zklock.zk.calls import Deadline, wait_result, wait_slice

logger = logging.getLogger("celery_zklock")

RESULT_SETTLE_SECONDS = 2.0
"""How long a copy whose original's node went waits for the original's result to appear."""
Event = Callable[..., None]
"""How the task logs an event: ``event(name, path, **fields)``."""


def read_queue(
    client: KazooClient, path: str, timeout: float, *, before: str | None = None
) -> list[Contender]:
    """The contender nodes of the lock at ``path``, in queue order, read with their identities
    (:func:`celery_zklock.locks.queue.read_queues`; a node that goes meanwhile is left out).

    With ``before`` (the name of a node of the queue), only the nodes ahead of it. Raises
    ZooKeeperUnavailable when ZooKeeper does not answer within ``timeout`` seconds.
    """

    def ahead(queue: list[Contender]) -> list[Contender]:
        ours = next((c.seq for c in queue if c.name == before), None)
        return [c for c in queue if ours is not None and c.seq < ours]

    pick = None if before is None else ahead
    [(_, queue)] = read_queues(client, [path], Deadline(timeout), pick)
    return queue if pick is None else pick(queue)


def first_of_task(queue: Sequence[Contender], task_id: str | None) -> Contender | None:
    """The first node of ``queue`` that belongs to ``task_id`` (any attempt), if any."""
    if task_id is None:
        return None
    return next((c for c in queue if c.task_id == task_id), None)


def wait_gone(client: KazooClient, node: str, timeout: float) -> bool:
    """Wait up to ``timeout`` seconds for ``node`` to be deleted; True once it is gone.

    Watches the node and looks again when the watch fires and once more at the end (a watch
    set on a session that then expired never fires). That last look, which decides False,
    follows a ``sync``: the server the client talks to may be a follower that lags behind the
    leader (it rejoined after a partition, or is slow under load) and still shows a node the
    leader deleted long ago. Raises ZooKeeperUnavailable when ZooKeeper does not answer.
    """
    deadline = Deadline(timeout)
    fired = client.handler.event_object()
    what = f"waiting for {node} to go"
    while True:
        fired.clear()
        watched = client.exists_async(node, watch=lambda _: fired.set())
        if wait_result(watched, Deadline((deadline.remaining() or 0.0) + 5), what):
            while not deadline.expired() and not fired.is_set():
                fired.wait(wait_slice(deadline))
            if fired.is_set() and not deadline.expired():
                continue
            wait_result(client.sync_async(node), Deadline(5.0), what)
            return wait_result(client.exists_async(node), Deadline(5.0), what) is None
        return True


class DuplicateDelivery(Ignore):  # type: ignore[misc]
    """The run is a copy of a delivery whose original still runs or already finished: Celery
    ignores it (no state is written). The lock's dedupe marker is the original's to remove."""


class OriginalAlive(DuplicateDelivery):
    """The copy's original still runs or waits: its message must stay in the broker until the
    original ends (:class:`celery_zklock.task.request.LockedRequest` keeps it there)."""


def await_original(
    task: Any, client: KazooClient, side: Any, path: str, original: Contender, event: Event
) -> bool:
    """The running ``task`` is a copy of ``original``'s delivery: True once it may run (its
    original died), else raise :class:`DuplicateDelivery` (see the module docstring)."""
    task_id = task.request.id
    grace = float(side.dead_holder_bound)
    event("same-delivery-waits", path, holder=task_id, node=original.name, grace=grace)
    if not wait_gone(client, f"{path}/{original.name}", grace):
        event("duplicate-ignored", path, holder=task_id)
        raise OriginalAlive(
            f"another delivery of task {task_id} still runs or waits under lock {path}: "
            "duplicate delivery ignored"
        )
    ignore_if_finished(task, path, event)
    return True


def ignore_if_finished(
    task: Any, path: str, event: Event, settle: float = RESULT_SETTLE_SECONDS
) -> None:
    """Raise :class:`DuplicateDelivery` if the task's result becomes final within ``settle``
    seconds. A retry looks once (``settle=0``): an earlier attempt's copy, handed out again by
    the broker while that attempt waited, may have run the call to its end before the attempt
    gave up and retried (the retry was published all the same)."""
    task_id = task.request.id
    if finished_already(task, task_id, settle):
        event("duplicate-ignored", path, holder=task_id, finished=True)
        raise DuplicateDelivery(f"task {task_id} already finished: duplicate delivery ignored")


def finished_already(task: Any, task_id: str, settle: float = RESULT_SETTLE_SECONDS) -> bool:
    """True if the result backend holds a final state for ``task_id`` within ``settle`` s.

    A run releases its lock just before Celery stores its result: a copy that saw its original's
    node go sees the result a moment later, one whose original died never. A call whose result
    is not stored (``ignore_result``, on the task or the call) can tell nothing, and does not
    wait: its message would spend that time of its broker's redelivery bound for nothing.
    """
    if not results_stored(task):
        return False
    deadline = time.monotonic() + settle
    while True:
        try:
            if task.AsyncResult(task_id).state in states.READY_STATES:
                return True
        except STOPPING:
            raise  # the run's own time limit, landed during the read: not the backend's failure
        except Exception:  # no result backend, or it is unreachable: we cannot tell, so run
            logger.debug("zklock: could not read the state of %s", task_id, exc_info=True)
            return False
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.05)


def results_stored(task: Any) -> bool:
    """Whether a final state of ``task``'s current call can be read: the app has a result
    backend, and neither the task nor the call (its request) ignores its result."""
    request = getattr(task, "request", None)
    if getattr(task, "ignore_result", False) or getattr(request, "ignore_result", False):
        return False
    return not isinstance(getattr(task, "backend", None), DisabledBackend)
