"""``CeleryWorker.stop`` on a real process group (celery_zklock/testing/celery_worker.py)."""

from __future__ import annotations

from pathlib import Path

from celery_zklock.testing.celery_worker import CeleryWorker
from celery_zklock.testing.processes import descendants, group_alive, process_state, wait_until


def test_stop_returns_once_every_process_of_the_group_is_dead(tmp_path: Path) -> None:
    """A worker whose main process leaves children behind at a warm shutdown (the pool
    processes a worker's SIGTERM orphans): stop SIGKILLs the group and returns once none of it
    lives. What is left may be zombies until PID 1 reaps them (about 2 s on these machines),
    which the demo's test took for live processes (``.ci/run`` at a7e5d1d)."""
    worker = CeleryWorker(
        ["sh", "-c", "sleep 60 & sleep 60 & sleep 60 & wait", "sh"],
        nodename="stop-test",
        log_path=tmp_path / "worker.log",
    )
    worker.spawn()
    group = worker.pid
    assert group is not None
    assert wait_until(lambda: len(descendants(group)) == 3, 10.0)
    children = descendants(group)
    worker.stop(grace=0.2)
    assert not group_alive(group)
    assert all(process_state(pid) in (None, "Z", "X") for pid in children)
