"""``lock_debounce``: the calls of one key within a quiet period coalesce, fleet-wide, into one
run with the last call's arguments.

A key's window lives in one record (:mod:`celery_zklock.task.latest`, node
:data:`~celery_zklock.task.latest.DEBOUNCE_NODE` under the key's lock path) naming its latest
call; the node's ``ctime`` is when the window began and ``at`` when its latest call was recorded,
both on ZooKeeper's clock. A debounced call's run, in a worker, before it contends for its lock
(:func:`before_lock`, deciding with :func:`settle`):

1. no record: it records itself; a window begins;
2. a record of an older call (a lower generation, :mod:`celery_zklock.task.generation`): it
   records itself instead. The older call is *superseded*: its result is stored at once, a
   skip (reason ``debounced``) naming this call;
3. a record of a newer call: this call is superseded: it ends with that skip;
4. a record of this very call (its message came back): a write that keeps the data tells
   ZooKeeper's time now; if the window is over (``now >= min(at + lock_debounce,
   first + lock_debounce_max)``) the run deletes the record and goes on to its lock and body.

A call that must wait for its window's end (1, 2, 4 too early) is sent back (same task id,
arguments, options, retry count and generation: not a retry) with an ETA at that end, and its
run ends without a state (:mod:`celery_zklock.task.sendback`): the message waits in a worker's
main process, as Celery keeps ETA messages, never in a pool slot. Every write is versioned
(:mod:`~celery_zklock.task.latest`): a call recorded while the latest one checks makes that
check's delete fail, so the run that deletes the record is the latest call, and a call whose
skip another run stored never runs (storing follows only a write that succeeded over its
record, which its own delete would then need).

What survives a worker that dies mid-window: the record (persistent) and the sent-back message
(unacknowledged in that worker: the broker hands it out again), so the latest call still runs
once, later by the broker's redelivery. A message sent back comes again carrying
:data:`DEBOUNCE_HEADER`; one that finds its result final (its skip stored by the call that
superseded it) ends with it, and one that finds no record (deleted by a later call's run, or by
its own earlier run) ends without a state, unless it finds no final state of its call: then
its own earlier run ended the window and died before the call ended (a call a newer one
superseded has that call's skip stored), and it runs, at least once (with ``ignore_result``
it cannot tell, and ends without a state). A message handed out again whose call already
contends for its lock (it won its window, and its run holds or waits) is a copy of that run, not
a call of a newer window: it goes on to its lock, where the delivery checks
(:mod:`celery_zklock.task.delivery`) ignore it while its original lives or once the call ended,
and run the call if its original died. Called directly or eagerly, and for retries, there is no
window: the call runs at once.

An older version's worker ignores ``lock_debounce``: a call it takes runs at once, under its
lock, like any call of the task, and is never recorded; a new worker's window goes on.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final, Literal

from celery import states
from celery.backends.base import DisabledBackend
from kazoo.client import KazooClient
from kazoo.exceptions import KazooException

from celery_zklock.errors import ZooKeeperUnavailable
from celery_zklock.task import delivery, latest, sendback
from celery_zklock.task.delivery import DuplicateDelivery, finished_already
from celery_zklock.task.generation import is_newer
from celery_zklock.task.metrics import count_outcome
from celery_zklock.task.policy import is_skipped, skip_result

__all__ = ["DEBOUNCE_HEADER", "Settled", "before_lock", "due_in", "settle"]

DEBOUNCE_HEADER: Final = "zklock_debounce"
"""The header of a message sent back to wait for its debounce window's end."""

logger = logging.getLogger("celery_zklock")


@dataclass(frozen=True)
class Settled:
    """What :func:`settle` decided: ``run`` (the record was deleted: go on to the lock),
    ``wait`` (``seconds``), ``skip`` (superseded ``by`` a newer call) or ``gone`` (a message
    sent back that finds no record). ``superseded``: the call this one superseded, if any."""

    action: Literal["run", "wait", "skip", "gone"]
    seconds: float = 0.0
    by: str | None = None
    superseded: str | None = None


def due_in(record: latest.Record, now: int, quiet: float, cap: float) -> float:
    """Seconds from ZooKeeper's ``now`` (ms) until the window of ``record`` is over: quiet for
    ``quiet`` seconds since its latest call, or ``cap`` seconds since it began; 0 if it is."""
    end = min(record.at + round(quiet * 1000), record.first + round(cap * 1000))
    return max(0.0, (end - now) / 1000.0)


def settle(
    client: KazooClient,
    path: str,
    call: tuple[str, int | None],
    quiet: float,
    cap: float,
    resent: bool,
) -> Settled:
    """Record ``call`` (task id, generation) in the debounce window of the key at ``path`` and
    decide (see the module docstring). Raises ``ZooKeeperUnavailable`` or a ``KazooException``
    when ZooKeeper fails."""
    node = f"{path}/{latest.DEBOUNCE_NODE}"
    task_id, generation = call
    window = (quiet, cap)

    def step(record: latest.Record | None) -> Settled:
        if record is None:
            if resent:
                return Settled("gone")
            made = latest.create(client, node, latest.encode(task_id, generation, None, window))
            return Settled("wait", due_in(made, made.mtime, quiet, cap))
        if record.task_id == task_id:
            data = latest.encode(task_id, generation, record.at, window)
            checked = latest.write(client, node, data, record.version)
            left = due_in(checked, checked.mtime, quiet, cap)
            if left > 0:
                return Settled("wait", left)
            latest.delete(client, node, checked.version)
            return Settled("run")
        if record.task_id is not None and not is_newer(generation, record.generation):
            return Settled("skip", by=record.task_id)
        data = latest.encode(task_id, generation, None, window)
        mine = latest.write(client, node, data, record.version)
        return Settled("wait", due_in(mine, mine.mtime, quiet, cap), superseded=record.task_id)

    return latest.versioned(client, node, step)


def before_lock(run: Any, client: KazooClient) -> Any:
    """The debounce of ``run`` (a :class:`~celery_zklock.task.run.LockedRun` whose task has
    ``lock_debounce``): None when the window is over and this call goes on to its lock; a skip
    result when a newer call superseded it; raises ``SentBack`` (sent back to wait, see
    :mod:`celery_zklock.task.sendback`)."""
    task, request = run.task, run.request
    resent = _header(request, DEBOUNCE_HEADER)
    again = resent or (request.delivery_info or {}).get("redelivered")
    if again and finished_already(task, run.task_id, settle=0.0):
        return _ended(run)
    options = run.options
    try:
        if again and _contends(run, client):
            return None  # a copy of a call past its window: the lock's delivery checks decide
        settled = settle(client, run.path, (run.task_id, run.generation), options.debounce,
                         options.debounce_cap, resent)  # fmt: skip
    except (ZooKeeperUnavailable, KazooException) as exc:
        run._unavailable(f"ZooKeeper failed while debouncing lock {run.path}: {exc}", exc)
    if settled.superseded is not None:
        _store_skip(task, settled.superseded, skip_result(run.path, run.task_id, "debounced"))
    if settled.action == "skip":
        if again and finished_already(task, run.task_id):
            return _ended(run)  # its own run won and ended: its result comes after its release
        return _skip(run, settled.by)
    if settled.action == "gone":
        if delivery.results_stored(task) and not finished_already(task, run.task_id):
            # Its own earlier run ended the window and died before the call ended (a call a
            # newer one superseded has its skip stored): the call runs, at least once.
            run._log("debounce-won", run.path)
            return None
        run._log("debounce-gone", run.path)
        raise DuplicateDelivery(
            f"task {run.task_id}: its debounce window's record is gone (a later call's run "
            "ended the window, or this call's own run did): nothing to do"
        )
    if settled.action == "wait":
        run._log("debounce-waits", run.path, due_in=round(settled.seconds, 3),
                 superseded=settled.superseded)  # fmt: skip
        reason = f"waits {settled.seconds:.3f}s for its debounce window's end"
        raise sendback.send_back(task, request, settled.seconds, reason, {DEBOUNCE_HEADER: True})
    return None


def _contends(run: Any, client: KazooClient) -> bool:
    """Whether the call of ``run`` holds or waits for its lock already: this message is a
    copy of a call that won its window, whatever window a newer call began since."""
    queue = delivery.read_queue(client, run.path, latest.IO_TIMEOUT)
    return delivery.first_of_task(queue, run.task_id) is not None


def _ended(run: Any) -> Any:
    """A copy of a call whose final state is stored: the skip it stores (superseded), else
    raise :class:`DuplicateDelivery` (the call ran)."""
    stored = run.task.AsyncResult(run.task_id).result
    if is_skipped(stored) and isinstance(stored, Mapping):
        return _skip(run, stored.get("holder"))
    raise DuplicateDelivery(f"task {run.task_id} already finished: debounce copy ignored")


def _skip(run: Any, by: Any) -> Any:
    count_outcome(run.task.name, "debounced")
    message = f"task {run.task.name!r}: a newer call {by} of lock {run.path} came within its window"
    return run._apply("debounced", "skip", message, by)


def _store_skip(task: Any, task_id: str, result: dict[str, Any]) -> None:
    """Store ``result`` (a skip) as the SUCCESS of the superseded call ``task_id`` now, so that
    its ``get()`` returns at once; its own message, when it comes, ends with the same skip."""
    if task.ignore_result or isinstance(task.backend, DisabledBackend):
        return
    try:
        task.backend.store_result(task_id, result, states.SUCCESS)
    except Exception:
        logger.warning("zklock: could not store the debounced result of %s", task_id, exc_info=True)


def _header(request: Any, name: str) -> bool:
    value = getattr(request, name, None)
    if value is None:
        headers = getattr(request, "headers", None)
        value = headers.get(name) if isinstance(headers, Mapping) else None
    return bool(value)
