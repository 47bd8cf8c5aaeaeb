"""The gate's two bounds on a real prefork worker: ``zklock_gate_max_held`` (past it a locked
message waits in the broker, sent back with a short ETA, and the worker keeps fetching) and
``zklock_gate_max_hold`` (a message is held at most that long from its receipt, then goes back
to the broker, whatever its ``lock_timeout``: the broker never hands it out again while it is
held)."""

from __future__ import annotations

import time
from pathlib import Path

from celery import Celery

from tests.lockutil import wait_for
from tests.task.test_gate import held_at_gate
from tests.taskapp import read_records
from tests.workerproc import workers


def _held(app: Celery) -> int:
    return sum(counts["held"] for counts in held_at_gate(app).values())


def test_past_max_held_locked_messages_wait_in_the_broker_and_plain_tasks_still_run(
    taskenv: tuple[Celery, dict[str, str], Path],
) -> None:
    """``zklock_gate_max_held=2``, concurrency 2, prefetch multiplier 1: behind a holder that
    runs until the test lets it go, six waiters of its key. The gate holds two; the others go
    back to the broker with a short ETA (issue 44: the cap never stops the worker fetching), so
    plain tasks sent meanwhile run at once. Never more than 2 held; once the holder ends, the
    six run one at a time, in the order they were sent."""
    app, env, tmp = taskenv
    from tests.taskapp import gated_step, unlocked_noop

    with workers(app, "prefork", 1, {**env, "ZKLOCK_GATE_MAX_HELD": "2"}, tmp) as (worker,):
        holder = gated_step.apply_async(("bound", -1, 120.0), queue=worker.queue)
        wait_for(lambda: (tmp / "steps-bound").exists(), 30, "the holder to start")
        waiters = []
        for seq in range(6):
            waiters.append(gated_step.apply_async(("bound", seq, 0.1), queue=worker.queue))
            time.sleep(0.05)  # the order they are sent in, not a synchronisation
        wait_for(lambda: _held(app) >= 2, 30, "the gate to hold waiters")
        plain = [unlocked_noop.apply_async(queue=worker.queue) for _ in range(3)]
        for result in plain:
            result.get(timeout=10)  # before the cap sent them back: after the holder's 120 s
        seen = [_held(app) for _ in range(3)]
        assert not holder.ready(), "the holder ended before the plain tasks ran"
        (tmp / "release-bound").touch()
        assert holder.get(timeout=60) == -1
        assert [call.get(timeout=60) for call in waiters] == list(range(6))
    assert max(seen) <= 2, seen
    starts = [r["seq"] for r in read_records(tmp / "steps-bound") if r["at"] == "start"]
    assert starts == [-1, 0, 1, 2, 3, 4, 5], starts
    assert "over its cap of 2 held message(s)" in worker.log_text()


def test_a_message_is_held_no_longer_than_max_hold(
    taskenv: tuple[Celery, dict[str, str], Path],
) -> None:
    """``zklock_gate_max_hold=1.5`` and a waiter whose ``lock_timeout`` is 120 s, behind a
    holder that runs until the test lets it go: at 1.5 s from its receipt the gate gives the
    waiter back to the broker (never into the pool, where it would sit unacknowledged), the
    worker receives it again, and it runs once after the holder."""
    app, env, tmp = taskenv
    from tests.taskapp import gated_step

    with workers(app, "prefork", 1, {**env, "ZKLOCK_GATE_MAX_HOLD": "1.5"}, tmp) as (worker,):
        holder = gated_step.apply_async(("cap", -1, 120.0), queue=worker.queue)
        wait_for(lambda: (tmp / "steps-cap").exists(), 30, "the holder to start")
        waiter = gated_step.apply_async(("cap", 0, 0.1), queue=worker.queue)
        given_back = f"go back to the broker: {waiter.id}"
        wait_for(lambda: worker.log_text().count(given_back) >= 2, 60, "two give-backs")
        assert not holder.ready() and _held(app) <= 1
        (tmp / "release-cap").touch()
        assert holder.get(timeout=60) == -1 and waiter.get(timeout=60) == 0
    starts = [r["seq"] for r in read_records(tmp / "steps-cap") if r["at"] == "start"]
    assert starts == [-1, 0], starts
    received = worker.log_text().count(f"[{waiter.id}] received")
    assert received >= 3, received  # held, given back, received again (twice at least)


def test_a_call_given_back_keeps_its_lock_timeout(
    taskenv: tuple[Celery, dict[str, str], Path],
) -> None:
    """``zklock_gate_max_hold=1.5`` under a ``lock_timeout`` of 4 s, behind a holder that runs
    until the test lets it go: the call goes back to the broker at each bound, and back at
    the gate its timeout goes on from its first arrival (it restarted at each receipt, so the
    call circulated for as long as the key was busy). It ends skipped, ``timeout``."""
    app, env, tmp = taskenv
    from tests.taskapp import gated_step

    with workers(app, "prefork", 1, {**env, "ZKLOCK_GATE_MAX_HOLD": "1.5"}, tmp) as (worker,):
        holder = gated_step.apply_async(("keep", -1, 120.0), queue=worker.queue)
        wait_for(lambda: (tmp / "steps-keep").exists(), 30, "the holder to start")
        policy = {"timeout": 4, "on_timeout": "skip"}
        waiter = gated_step.apply_async(("keep", 0, 0.1), queue=worker.queue, zklock=policy)
        try:
            skipped = waiter.get(timeout=60)
        finally:
            (tmp / "release-keep").touch()
        assert holder.get(timeout=60) == -1
    assert skipped["__zklock_skipped__"] and skipped["reason"] == "timeout", skipped
    assert worker.log_text().count(f"go back to the broker: {waiter.id}") >= 2
