"""``lock_on_busy="preempt"`` on a real prefork worker: the newest call wins, and the older
body has exited before the newer one enters."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from celery import Celery

from celery_zklock import LockLost
from celery_zklock.testing.witness import check_witness
from tests.lockutil import wait_for
from tests.workerproc import workers


def test_a_newer_call_ends_the_holder_first(taskenv: tuple[Celery, dict[str, str], Path]) -> None:
    app, env, tmp = taskenv
    from tests.taskapp import gated_section

    with workers(app, "prefork", 1, env, tmp) as (worker,):
        older = gated_section.apply_async(("pk", 30.0), queue=worker.queue)
        wait_for(lambda: (tmp / "witness-pk").exists(), 30, "the older body to start")
        sent = time.monotonic()
        newer = gated_section.apply_async(
            ("pk", 0.2), queue=worker.queue, zklock={"on_busy": "preempt"}
        )
        with pytest.raises(LockLost, match="preempted by a newer call") as lost:
            older.get(timeout=30)
        ended = time.monotonic() - sent
        assert newer.id in str(lost.value)  # it names the preempting task
        token = newer.get(timeout=30)["token"]
    assert ended < 10, ended
    report = check_witness(tmp / "witness-pk")
    assert report.sections == 2 and report.overlaps == [], report
    assert token > 0
