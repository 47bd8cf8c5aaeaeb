"""What stops a task's own thread (its soft time limit, a lost lease's interruption) is never
taken for the result backend, the broker or ZooKeeper failing.

Billiard raises ``SoftTimeLimitExceeded`` (an ``Exception``) wherever the task's thread is; the
lease's interruption raises ``LockLost`` the same way. Each place below catches ``Exception`` to
mean "the backend (or broker, or ZooKeeper) failed, go on": before ``interrupt.STOPPING`` was let
through there, a limit landing in it was swallowed and the run went on waiting for its lock or
retried instead of failing at its limit. Each test also checks that a real backend failure is
still taken as one.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
from celery.exceptions import SoftTimeLimitExceeded

from celery_zklock.errors import LockLost, ZooKeeperUnavailable
from celery_zklock.task import run, visibility
from celery_zklock.task.dedupe import _state_of
from celery_zklock.task.interrupt import STOPPING

STOPS = [SoftTimeLimitExceeded("soft time limit"), LockLost("lock lost")]


class _Task:
    """A task as seen from inside a worker, whose result backend and event sender fail with
    ``error``."""

    name = "tests.stub"
    ignore_result = False

    def __init__(self, error: BaseException) -> None:
        self.error = error
        self.request = SimpleNamespace(
            id="t-1", called_directly=False, is_eager=False, hostname="w@h"
        )
        self.app = SimpleNamespace(conf=SimpleNamespace(worker_send_task_events=True))

    def update_state(self, **_: Any) -> None:
        raise self.error

    def send_event(self, *_: Any, **__: Any) -> None:
        raise self.error

    def AsyncResult(self, task_id: str) -> Any:
        raise self.error


def test_stopping_is_the_soft_time_limit_and_lock_lost() -> None:
    assert set(STOPPING) == {SoftTimeLimitExceeded, LockLost}


@pytest.mark.parametrize("stop", STOPS, ids=lambda e: type(e).__name__)
@pytest.mark.parametrize(
    "report",
    [
        lambda task: visibility.waiting(task, "/l/k", "holder"),
        lambda task: visibility.skipped(task, "/l/k", "holder", "busy"),
    ],
    ids=["waiting", "skipped"],
)
def test_a_stop_in_the_visibility_reports_is_raised(stop: Exception, report: Any) -> None:
    with pytest.raises(type(stop)):
        report(_Task(stop))
    report(_Task(ConnectionError("backend down")))  # a failing backend: the run goes on


@pytest.mark.parametrize("stop", STOPS, ids=lambda e: type(e).__name__)
def test_a_stop_in_dedupes_state_read_is_raised(stop: Exception) -> None:
    """An enqueue with dedupe from inside a task body reads the marker's task state: a stop
    landing there is the body's, not an unreadable backend (which would read as PENDING)."""
    with pytest.raises(type(stop)):
        _state_of(_Task(stop))("t-0")
    assert _state_of(_Task(ConnectionError("backend down")))("t-0") == "PENDING"


def _run_connecting(monkeypatch: pytest.MonkeyPatch, error: BaseException) -> Any:
    def get_client(config: Any) -> Any:
        raise error

    monkeypatch.setattr(run, "get_client", get_client)
    locked = run.LockedRun.__new__(run.LockedRun)  # only what _client reads
    locked.settings = SimpleNamespace(client=SimpleNamespace(hosts="zk:2181", connect_timeout=1))
    locked.task, locked.in_worker = _Task(error), False
    locked.options = SimpleNamespace(on_unavailable="wait")
    return locked


@pytest.mark.parametrize("stop", STOPS, ids=lambda e: type(e).__name__)
def test_a_stop_while_connecting_is_raised_not_unavailable(
    monkeypatch: pytest.MonkeyPatch, stop: Exception
) -> None:
    """Taken for ZooKeeper being unreachable, a soft limit landing in the connect became a
    retry of the task instead of its failure at the limit."""
    with pytest.raises(type(stop)):
        _run_connecting(monkeypatch, stop)._client()
    with pytest.raises(ZooKeeperUnavailable, match="could not connect to ZooKeeper"):
        _run_connecting(monkeypatch, ConnectionError("refused"))._client()
