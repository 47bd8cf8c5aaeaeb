"""The load test's sender: a publish that fails is sent again under the same task id."""

from __future__ import annotations

import threading
from types import SimpleNamespace
from typing import Any

import pytest

from workers import loadtest
from workers.loadtest import LoadConfig, WorkItem, _Progress, _send_all
from workers.tasks import TASK_FOR_MODE


class FlakyTask:
    """apply_async failing the first ``failures`` times as kombu 5.7 did across a broker
    restart (an AttributeError from a released connection), then accepting."""

    def __init__(self, failures: int) -> None:
        self.failures = failures
        self.sent: list[str] = []

    def apply_async(self, args: Any, *, task_id: str, **_: Any) -> None:
        if self.failures:
            self.failures -= 1
            raise AttributeError("'NoneType' object has no attribute 'client'")
        self.sent.append(task_id)


def send(task: FlakyTask, items: int) -> _Progress:
    app: Any = SimpleNamespace(tasks={name: task for name in TASK_FOR_MODE.values()})
    plan = [WorkItem("exclusive", "wait", f"key-{i}", 10) for i in range(items)]
    progress = _Progress(items)
    _send_all(app, "run", plan, LoadConfig(tasks=items, duration=0.0), progress,
              lambda: False, 1, threading.Event())  # fmt: skip
    return progress


def test_a_failed_publish_is_sent_again_with_the_same_task_id(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(loadtest, "SEND_RETRY_INTERVAL", 0.0)
    task = FlakyTask(failures=2)
    progress = send(task, 3)
    assert progress.send_error is None
    assert list(progress.submitted) == task.sent and len(task.sent) == 3
    assert len(progress.resent) == 2 and all(task.sent[0] in line for line in progress.resent)


def test_sending_stops_with_the_error_once_the_attempts_are_spent(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(loadtest, "SEND_RETRY_INTERVAL", 0.0)
    progress = send(FlakyTask(failures=loadtest.SEND_ATTEMPTS), 2)
    assert isinstance(progress.send_error, AttributeError)
    assert progress.submitted == {} and progress.sending_done.is_set()


class HoldRecorder:
    """apply_async keeping each section's hold (ms), its call settled at once (none in flight)."""

    def __init__(self, progress: _Progress) -> None:
        self.progress = progress
        self.holds: list[int] = []

    def apply_async(self, args: Any, *, task_id: str, **_: Any) -> None:
        self.holds.append(args[-1])
        self.progress.outcomes[task_id] = loadtest.TaskOutcome(task_id, "SUCCESS")


def test_the_reserve_stretches_its_holds_over_the_faults_still_due_up_to_half_the_wait() -> None:
    # The compose fleet's run ended before its last two Docker faults (a leader kill took 22 s,
    # a quorum loss 25 s): the reserve, at 2 s a hold, ran dry long before them.
    items, seconds_left = 8, [40.0] * 7 + [0.4]
    progress = _Progress(items)
    task = HoldRecorder(progress)
    app: Any = SimpleNamespace(tasks={name: task for name in TASK_FOR_MODE.values()})
    plan = [WorkItem("exclusive", "wait", f"key-{i}", 10) for i in range(items)]
    config = LoadConfig(tasks=items, duration=0.0, wait_timeout=10.0)
    _send_all(app, "run", plan, config, progress, lambda: True, 1, threading.Event(),
              faults_seconds_left=lambda: seconds_left[len(task.holds)])  # fmt: skip
    assert progress.send_error is None
    # The last quarter is the reserve: 40 s over 2 items, 2 in flight, is 40 s a hold, capped
    # at half the 10 s wait; 0.4 s over the last item is 0.8 s, raised to the least 2 s.
    assert task.holds == [10] * 6 + [5000, 2000]
