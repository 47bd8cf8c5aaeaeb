"""The fleet's section records its exit although the lease's interruption lands while the exit is
being written.

A body that sees the loss first (``lock.check()`` raises LockLost) stays armed until its run
ends, so the signal the lease clock sends a moment later raises LockLost once more, and it can
land in the section's ``finally``. CI failed so once at double load
(``test_pause_past_the_session_timeout_ends_the_task_with_lock_lost``: the task ended LockLost,
no ``exit`` on record). Here the second LockLost is raised at the exit's append, before and after
Redis took it, on a real Redis.
"""

from __future__ import annotations

import uuid
from types import SimpleNamespace
from typing import Any

import pytest
import redis
from celery import Celery

from celery_zklock import LockLost
from workers.record import SectionEvent, SectionRecorder
from workers.tasks import RECORD_URL_SETTING, run_section


class LostLease:
    """What a body's ``task.lock`` is after its loss: ``check()`` raises."""

    token = 7
    node = "/zklock/workers.section/key=k~0/_c_0-write-0000000000"

    def check(self) -> None:
        raise LockLost("lock lost (test)")


@pytest.mark.parametrize("landed", ["before Redis took the exit", "after Redis took the exit"])
def test_the_exit_is_recorded_once_when_a_second_lock_lost_lands_on_it(
    redis_url: str, redis_client: redis.Redis, monkeypatch: pytest.MonkeyPatch, landed: str
) -> None:
    app = Celery("section-exit", set_as_current=False)
    app.conf[RECORD_URL_SETTING] = redis_url
    task: Any = SimpleNamespace(
        app=app, lock=LostLease(), request=SimpleNamespace(id="task-1", hostname="w@h")
    )
    appended = SectionRecorder.record
    landings: list[SectionEvent] = []

    def record(self: SectionRecorder, event: SectionEvent) -> None:
        if event.kind == "exit" and not landings:  # the interruption fires once per loss
            landings.append(event)
            if landed.startswith("after"):
                appended(self, event)
            raise LockLost("the interruption, after the body saw the loss")
        appended(self, event)

    monkeypatch.setattr(SectionRecorder, "record", record)
    run_id = uuid.uuid4().hex

    with pytest.raises(LockLost):
        run_section(task, run_id, "k", 1000, "exclusive")

    assert landings, "the exit's append was never interrupted: the test proves nothing"
    events = SectionRecorder(redis_client, run_id).events()
    assert [(e.kind, e.outcome) for e in events] == [("enter", None), ("exit", "lost")]
