"""A task that locks several keys at once (``lock_key={"key": ["src", "dst"]}``) on a real
worker: it excludes the single-key task of the same lock name on each key, two such tasks
listing the keys in opposite orders do not deadlock, and a key listed twice counts once."""

from __future__ import annotations

from pathlib import Path

from celery import Celery

from celery_zklock import is_skipped
from celery_zklock.testing.witness import check_witness
from tests.lockutil import wait_for
from tests.workerproc import workers


def test_two_keys_exclude_the_single_key_task_on_each_without_deadlock(
    taskenv: tuple[Celery, dict[str, str], Path],
) -> None:
    app, env, tmp = taskenv
    from tests.taskapp import gated_section, transfer

    with workers(app, "threads", 1, env, tmp) as (worker,):
        queue = worker.queue
        calls = [
            transfer.apply_async(("a", "b", 0.4), queue=queue),
            gated_section.apply_async(("a", 0.3), queue=queue),
            transfer.apply_async(("b", "a", 0.4), queue=queue),
            gated_section.apply_async(("b", 0.3), queue=queue),
            transfer.apply_async(("a", "a", 0.2), queue=queue),
            transfer.apply_async(("b", "a", 0.2), queue=queue),
        ]
        results = [call.get(timeout=60) for call in calls]
    for key, sections in (("a", 5), ("b", 4)):
        report = check_witness(tmp / f"witness-{key}")
        assert report.sections == sections and report.overlaps == [], (key, report)
    both = {gated_section.lock_path("a"), gated_section.lock_path("b")}
    for result in (results[0], results[2], results[5]):
        tokens = result["tokens"]
        assert set(tokens) == both and all(isinstance(t, int) for t in tokens.values()), tokens
    assert set(results[4]["tokens"]) == {gated_section.lock_path("a")}  # listed twice: once


def test_a_busy_key_skips_naming_its_holder(taskenv: tuple[Celery, dict[str, str], Path]) -> None:
    app, env, tmp = taskenv
    from tests.taskapp import gated_section, transfer

    with workers(app, "threads", 1, env, tmp) as (worker,):
        holder = gated_section.apply_async(("y", 3.0), queue=worker.queue)
        wait_for(lambda: (tmp / "witness-y").exists(), 30, "the holder of y to start")
        skipped = transfer.apply_async(
            ("x", "y", 0.1), queue=worker.queue, zklock={"on_busy": "skip"}
        ).get(timeout=30)
        holder.get(timeout=30)
    assert is_skipped(skipped), skipped
    assert skipped["holder"] == holder.id, skipped
    report = check_witness(tmp / "witness-y")
    assert report.sections == 1 and report.overlaps == [], report
    assert not (tmp / "witness-x").exists()  # x was let go with y busy: no section ran on it
