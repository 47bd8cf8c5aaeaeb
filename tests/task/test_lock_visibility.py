"""What monitors see of a run's lock (celery_zklock.task.visibility), on a real `celery worker -E`:
a call waiting for its lock sends ``task-lock-waiting`` and writes nothing into its result; a
skipped run sends ``task-lock-skipped`` with the reason."""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from celery import Celery

from celery_zklock import is_skipped
from celery_zklock.task.visibility import SKIPPED_EVENT, WAITING_EVENT
from celery_zklock.testing.celery_worker import celery_command, wait_until_answering
from tests.lockutil import wait_for
from tests.taskapp import read_records
from tests.workerproc import ROOT, Worker


class Events:
    """Every task event on the broker, captured from before the test sends anything."""

    def __init__(self, app: Celery) -> None:
        self.app = app
        self.seen: list[dict[str, Any]] = []
        self.changed = threading.Condition()
        self._receiver: Any = None
        self._thread = threading.Thread(target=self._capture, daemon=True)

    def _capture(self) -> None:
        with self.app.connection_for_read() as connection:
            self._receiver = self.app.events.Receiver(connection, handlers={"*": self._on_event})
            self._receiver.capture(limit=None, timeout=None, wakeup=False)

    def _on_event(self, event: dict[str, Any]) -> None:
        with self.changed:
            self.seen.append(event)
            self.changed.notify_all()

    def first(self, kind: str, task_id: str, timeout: float = 30.0) -> dict[str, Any]:
        def found() -> dict[str, Any] | None:
            return next(
                (e for e in self.seen if e["type"] == kind and e.get("uuid") == task_id), None
            )

        with self.changed:
            assert self.changed.wait_for(lambda: found() is not None, timeout), (kind, self.seen)
            event = found()
        assert event is not None
        return event

    def __enter__(self) -> Events:
        self._thread.start()
        probe = f"probe-{uuid.uuid4().hex}"
        deadline = time.monotonic() + 30
        # The receiver's queue exists once it consumes: send probes until one comes back.
        while not any(e.get("uuid") == probe for e in self.seen):
            assert time.monotonic() < deadline, "the event receiver never started"
            with self.app.events.default_dispatcher(hostname="test") as dispatcher:
                dispatcher.send("task-probe", uuid=probe)
            with self.changed:
                self.changed.wait(0.2)
        return self

    def __exit__(self, *_: object) -> None:
        if self._receiver is not None:
            self._receiver.should_stop = True
        self._thread.join(10)


@pytest.fixture
def events_worker(taskenv: tuple[Celery, dict[str, str], Path]) -> Iterator[tuple[Worker, Path]]:
    app, env, tmp = taskenv
    queue = f"vis-{uuid.uuid4().hex[:6]}"
    command = [*celery_command("tests.taskapp", "prefork", 3), "-E"]
    worker = Worker(
        command, nodename="vis@%h", queues=[queue], log_path=tmp / "worker-vis.log", cwd=ROOT,
        env=env,
    )  # fmt: skip
    worker.spawn()
    try:
        wait_until_answering(app, [worker], timeout=30)
        yield worker, tmp
    finally:
        worker.stop()


def test_waiting_and_skipped_runs_are_visible(
    taskenv: tuple[Celery, dict[str, str], Path], events_worker: tuple[Worker, Path]
) -> None:
    app, _, _ = taskenv
    worker, tmp = events_worker
    from tests.taskapp import acked_late

    key = f"vis-{uuid.uuid4().hex[:6]}"
    with Events(app) as events:
        holder = acked_late.apply_async((key, 60.0), queue=worker.queue)
        wait_for(lambda: bool(read_records(tmp / f"starts-{key}")), 30, "the holder to start")
        waiter = acked_late.apply_async(
            (key, 0.1), queue=worker.queue, zklock={"on_busy": "wait", "timeout": 60}
        )
        waiting = events.first(WAITING_EVENT, waiter.id)
        assert waiting["holder"] == holder.id and key in waiting["lock"]
        # Nothing is written into the waiting call's result (it could land on a final state).
        assert waiter.state == "PENDING"

        skipper = acked_late.apply_async((key, 0.1), queue=worker.queue)
        assert is_skipped(skipper.get(timeout=30))
        skipped = events.first(SKIPPED_EVENT, skipper.id)
        assert skipped["lock_skipped"] == "busy" and skipped["holder"] == holder.id
        # A run that did not wait and was not skipped sends neither event.
        assert not [e for e in events.seen if e.get("uuid") == holder.id and "lock" in e]

        (tmp / f"release-{key}").touch()
        assert holder.get(timeout=30)["token"] > 0
        assert waiter.get(timeout=30)["token"] > holder.result["token"]
        assert waiter.state == "SUCCESS"
