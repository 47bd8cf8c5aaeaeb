"""What docs/operating-overview.md says Flower shows of a waiting and a skipped run, checked on
a real `celery worker -E`: the task events it sent, replayed in order into Celery's
``celery.events.state.State`` (what Flower keeps: its ``EventsState`` is that class, and its task
page lists a task's ``_fields``, its task list the state and the result)."""

from __future__ import annotations

import uuid
from pathlib import Path

from celery import Celery
from celery.events.state import State

from celery_zklock import is_skipped
from celery_zklock.task.visibility import SKIPPED_EVENT, WAITING_EVENT
from tests.lockutil import wait_for
from tests.task.test_lock_visibility import Events, events_worker  # noqa: F401 (a fixture)
from tests.taskapp import read_records
from tests.workerproc import Worker


def _replayed(events: Events, until: tuple[str, str] | None = None) -> State:
    """Celery's event state after every event captured so far, or up to and including the
    first of type ``until[0]`` for task ``until[1]``."""
    state = State()
    with events.changed:
        seen = list(events.seen)
    for event in seen:
        state.event(event)
        if until is not None and (event["type"], event.get("uuid")) == until:
            break
    return state


def test_what_flower_shows_of_a_waiting_and_a_skipped_run(
    taskenv: tuple[Celery, dict[str, str], Path],
    events_worker: tuple[Worker, Path],  # noqa: F811
) -> None:
    app, _, _ = taskenv
    worker, tmp = events_worker
    from tests.taskapp import acked_late

    key = f"flower-{uuid.uuid4().hex[:6]}"
    with Events(app) as events:
        holder = acked_late.apply_async((key, 60.0), queue=worker.queue)
        wait_for(lambda: bool(read_records(tmp / f"starts-{key}")), 30, "the holder to start")
        waiter = acked_late.apply_async(
            (key, 0.1), queue=worker.queue, zklock={"on_busy": "wait", "timeout": 60}
        )
        events.first(WAITING_EVENT, waiter.id)
        waiting = _replayed(events).tasks[waiter.id]
        # The state Flower shows is the custom event's name; the backend's stays PENDING.
        assert waiting.state == "LOCK-WAITING" and waiter.state == "PENDING"
        assert waiting.holder == holder.id and key in waiting.lock

        skipper = acked_late.apply_async((key, 0.1), queue=worker.queue)
        assert is_skipped(skipper.get(timeout=30))
        events.first("task-succeeded", skipper.id)
        assert events.first(SKIPPED_EVENT, skipper.id)["lock_skipped"] == "busy"
        skipped = _replayed(events).tasks[skipper.id]
        # SUCCESS, and the skip result in Flower's Result; the event's fields are no _fields of
        # a task, the only attributes Flower's task page lists.
        assert skipped.state == "SUCCESS"
        assert skipped.result.startswith("{'__zklock_skipped__': True, 'reason': 'busy', ")
        assert f"'holder': '{holder.id}'" in skipped.result
        assert not {"lock_skipped", "lock", "holder"} & set(skipped._fields)

        (tmp / f"release-{key}").touch()
        holder.get(timeout=30)
        waiter.get(timeout=30)
        events.first("task-succeeded", waiter.id)
        # Granted and running, the waiter still shows LOCK-WAITING (Celery's event state ranks
        # a custom state after STARTED); its end shows as usual.
        running = _replayed(events, until=("task-started", waiter.id)).tasks[waiter.id]
        assert running.state == "LOCK-WAITING" and running.started is not None
        assert _replayed(events).tasks[waiter.id].state == "SUCCESS"
