"""How a redelivered copy reads its original's result (delivery.finished_already)."""

from __future__ import annotations

from typing import Any

import pytest
from celery.exceptions import SoftTimeLimitExceeded

from celery_zklock.task.delivery import finished_already


class _ResultRead:
    def __init__(self, error: BaseException | None, state: str = "PENDING") -> None:
        self.error, self._state = error, state

    @property
    def state(self) -> str:
        if self.error is not None:
            raise self.error
        return self._state


class _Task:
    def __init__(self, read: _ResultRead) -> None:
        self.read = read

    def AsyncResult(self, task_id: str) -> Any:
        return self.read


def test_a_soft_time_limit_landing_in_the_result_read_is_not_swallowed() -> None:
    """The soft time limit is raised by a signal handler wherever the run is, also inside the
    result backend's read. Taken for the backend failing ("cannot tell, so run"), it let the copy
    run its body past its limit (a task-tier test waited 30 s for a result at double load)."""
    task = _Task(_ResultRead(SoftTimeLimitExceeded("soft time limit")))
    with pytest.raises(SoftTimeLimitExceeded):
        finished_already(task, "t-1", settle=0.0)


def test_a_backend_that_cannot_be_read_means_run() -> None:
    task = _Task(_ResultRead(ConnectionError("backend down")))
    assert finished_already(task, "t-1", settle=0.0) is False
    assert finished_already(_Task(_ResultRead(None, "SUCCESS")), "t-1", settle=0.0) is True
