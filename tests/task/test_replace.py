"""``lock_on_busy="replace"`` on real prefork workers (tests.taskapp.replacing): while a run
holds the key, calls sent to two workers replace one another as its one waiting call; each
replaced call ends at once with a skip (reason ``replaced``) naming a newer call, and only the
newest runs after the holder. A crash of the waiting call's worker leaves the newer call as the
waiter."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from celery import Celery
from kazoo.client import KazooClient

from celery_zklock import is_skipped
from celery_zklock.ops.holders import KeyState, read_locks
from celery_zklock.task.latest import WAITER_NODE, read
from celery_zklock.testing.witness import check_witness
from tests.lockutil import wait_for
from tests.workerproc import workers


def bodies(tmp: Path, key: str) -> list[int]:
    from tests.taskapp import read_records

    return [record["seq"] for record in read_records(tmp / f"replacing-{key}")]


def waiter(zk: KazooClient, key: str) -> str | None:
    """The task id the key's waiter record names, if any."""
    from tests.taskapp import replacing

    record = read(zk, f"{replacing.lock_path(key)}/{WAITER_NODE}")
    return None if record is None else record.task_id


def test_only_the_newest_waiting_call_runs_after_the_holder(
    taskenv: tuple[Celery, dict[str, str], Path], zk_client: KazooClient
) -> None:
    app, env, tmp = taskenv
    from tests.taskapp import replacing

    with workers(app, "prefork", 2, env, tmp) as pair:
        holder = replacing.apply_async(("r", 0, 60.0), queue=pair[0].queue)
        wait_for(lambda: bodies(tmp, "r") == [0], 30, "the holder's body")
        calls = []
        for seq in range(1, 6):
            calls.append(replacing.apply_async(("r", seq, 0.1), queue=pair[seq % 2].queue))
            time.sleep(0.1)  # the pace of the calls, not a synchronisation
        # Replaced calls end while the holder still holds: at once, not after it.
        wait_for(lambda: all(call.ready() for call in calls[:-1]), 20, "the replaced calls")
        wait_for(lambda: waiter(zk_client, "r") == calls[-1].id, 10, "the newest to wait")
        assert not holder.ready() and not calls[-1].ready()
        (state,) = read_locks(zk_client, "/taskapp", names=["replacing"])  # `zklock locks`
        assert isinstance(state, KeyState) and state.waiting is not None
        assert state.waiting.task_id == calls[-1].id and state.debounce is None
        (tmp / "release-r").touch()
        assert holder.get(timeout=30) == 0
        assert calls[-1].get(timeout=30) == 5
        outcomes = [call.get(timeout=5) for call in calls[:-1]]
    assert bodies(tmp, "r") == [0, 5]
    ids = [call.id for call in calls]
    for index, outcome in enumerate(outcomes):
        assert is_skipped(outcome) and outcome["reason"] == "replaced", outcome
        assert ids.index(outcome["holder"]) > index, (index, outcome)
    report = check_witness(tmp / "witness-r")
    assert report.sections == 2 and report.overlaps == [], report
    assert waiter(zk_client, "r") is None  # the granted waiter took its record away


def test_a_crash_of_the_waiting_calls_worker_leaves_the_newer_call_waiting(
    taskenv: tuple[Celery, dict[str, str], Path], zk_client: KazooClient
) -> None:
    """The waiting call's worker is SIGKILLed; a newer call, on the holder's worker, takes the
    waiting place and runs after the holder (the dead waiter's message is not handed out again
    meanwhile: nothing consumes its queue)."""
    app, env, tmp = taskenv
    from tests.taskapp import replacing

    with workers(app, "prefork", 2, env, tmp) as (keeper, victim):
        holder = replacing.apply_async(("c", 0, 60.0), queue=keeper.queue)
        wait_for(lambda: bodies(tmp, "c") == [0], 30, "the holder's body")
        older = replacing.apply_async(("c", 1, 0.1), queue=victim.queue)
        wait_for(lambda: waiter(zk_client, "c") == older.id, 20, "the older call to wait")
        victim.kill()
        newer = replacing.apply_async(("c", 2, 0.1), queue=keeper.queue)
        wait_for(lambda: waiter(zk_client, "c") == newer.id, 20, "the newer call to wait")
        (tmp / "release-c").touch()
        assert holder.get(timeout=30) == 0
        assert newer.get(timeout=60) == 2
        assert not older.ready()
    assert bodies(tmp, "c") == [0, 2]
    outcome: Any = check_witness(tmp / "witness-c")
    assert outcome.sections == 2 and outcome.overlaps == [], outcome


def test_the_waiting_call_ends_at_its_lock_timeout_and_takes_its_record_away(
    taskenv: tuple[Celery, dict[str, str], Path], zk_client: KazooClient
) -> None:
    """docs/debounce-and-replace.md: the waiting call "waits in the lock's queue as a `wait`
    call does, up to `lock_timeout` (then `lock_on_timeout`)", and its run deletes the record
    that still names it: a 2 s ``lock_timeout`` with ``skip`` ends it ``timeout`` while the
    holder holds, no record is left, and a later call waits and runs after the holder."""
    app, env, tmp = taskenv
    from tests.taskapp import replacing

    with workers(app, "prefork", 1, env, tmp) as (worker,):
        holder = replacing.apply_async(("t", 0, 60.0), queue=worker.queue)
        wait_for(lambda: bodies(tmp, "t") == [0], 30, "the holder's body")
        short = {"timeout": 2, "on_timeout": "skip"}
        timed_out = replacing.apply_async(("t", 1, 0.1), queue=worker.queue, zklock=short)
        outcome = timed_out.get(timeout=30)
        assert not holder.ready()
        assert is_skipped(outcome) and outcome["reason"] == "timeout", outcome
        assert waiter(zk_client, "t") is None  # its run took its record away
        later = replacing.apply_async(("t", 2, 0.1), queue=worker.queue)
        wait_for(lambda: waiter(zk_client, "t") == later.id, 20, "the later call to wait")
        (tmp / "release-t").touch()
        assert holder.get(timeout=30) == 0
        assert later.get(timeout=30) == 2
    assert bodies(tmp, "t") == [0, 2]
