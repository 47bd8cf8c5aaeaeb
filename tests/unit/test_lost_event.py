"""The ``lost`` event carries the loss's code in its log line, its structured record and the
``lock_lost`` signal (celery_zklock.task.events.emit, as the task's run calls it)."""

from __future__ import annotations

import logging
from typing import Any

import pytest

from celery_zklock import signals
from celery_zklock.errors import LossCode
from celery_zklock.task.events import emit


class _Task:
    name = "tests.t"


def test_the_lost_event_carries_its_code(caplog: pytest.LogCaptureFixture) -> None:
    received: list[dict[str, Any]] = []

    def receiver(sender: Any = None, **kwargs: Any) -> None:
        received.append(kwargs)

    signals.lock_lost.connect(receiver, weak=False)
    try:
        with caplog.at_level(logging.WARNING, logger="celery_zklock"):
            emit(_Task(), "lost", "/p", task_id="t1", token=7, reason="r", code=LossCode.BROKEN)
    finally:
        signals.lock_lost.disconnect(receiver)
    [record] = [r for r in caplog.records if r.name == "celery_zklock"]
    assert " code=broken " in f"{record.getMessage()} "
    assert record.zklock["code"] == "broken"  # type: ignore[attr-defined]
    assert len(received) == 1 and received[0]["code"] is LossCode.BROKEN
    assert received[0]["reason"] == "r"
