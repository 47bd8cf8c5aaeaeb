"""``lock_debounce`` on real prefork workers (tests.taskapp.debounced: 1 s of quiet, a 3 s cap):
calls of one key sent to two workers coalesce into one run with the last call's arguments, the
others end as skips (reason ``debounced``) naming a newer call as soon as it supersedes them; a
window ends at its cap; a worker killed mid-window loses no call."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from celery import Celery
from kazoo.client import KazooClient

from celery_zklock import is_skipped
from celery_zklock.ops.holders import KeyState, read_locks
from tests.lockutil import wait_for
from tests.workerproc import workers


def bodies(tmp: Path, key: str) -> list[dict[str, Any]]:
    from tests.taskapp import read_records

    return read_records(tmp / f"debounced-{key}")


def superseded_by_newer(calls: list[Any], outcomes: list[Any]) -> None:
    """Each of ``outcomes`` (of ``calls[:len(outcomes)]``) is a ``debounced`` skip naming a
    call sent after it."""
    ids = [call.id for call in calls]
    for index, outcome in enumerate(outcomes):
        assert is_skipped(outcome) and outcome["reason"] == "debounced", outcome
        assert ids.index(outcome["holder"]) > index, (index, outcome)


def test_calls_within_the_quiet_period_run_once_with_the_last_arguments(
    taskenv: tuple[Celery, dict[str, str], Path],
) -> None:
    app, env, tmp = taskenv
    from tests.taskapp import debounced

    with workers(app, "prefork", 2, env, tmp) as pair:
        calls = [debounced.apply_async(("k", i), queue=pair[i % 2].queue) for i in range(10)]
        last_sent = time.time()
        # Superseded calls end when a newer call is recorded, not at the window's end.
        wait_for(lambda: all(call.ready() for call in calls[:-1]), 10, "the superseded calls")
        assert bodies(tmp, "k") == []
        assert calls[-1].get(timeout=30) == {"value": 9}
        outcomes = [call.get(timeout=5) for call in calls[:-1]]
    runs = bodies(tmp, "k")
    assert [run["value"] for run in runs] == [9], runs
    assert runs[0]["start"] - last_sent >= 0.9  # a second of quiet after the last call
    superseded_by_newer(calls, outcomes)


def test_a_window_ends_at_its_cap_while_calls_keep_coming(
    taskenv: tuple[Celery, dict[str, str], Path],
) -> None:
    """A call every 0.25 s for 4.5 s never leaves a second of quiet: the first window ends at
    its 3 s cap with the call that was latest then, a second window with the last call. (The
    cap counts from the first call's record, made after a fresh pool process connected: with
    calls for only 3.5 s, a slow connect once left no call after the cap, and one window.)"""
    app, env, tmp = taskenv
    from tests.taskapp import debounced

    with workers(app, "prefork", 2, env, tmp) as pair:
        calls = []
        for i in range(18):
            calls.append(debounced.apply_async(("cap", i), queue=pair[i % 2].queue))
            time.sleep(0.25)  # the pace of the calls, not a synchronisation
        last_sent = time.time()
        assert calls[-1].get(timeout=30) == {"value": 17}
        outcomes = {call.id: call.get(timeout=10) for call in calls[:-1]}
    runs = bodies(tmp, "cap")
    assert len(runs) == 2 and runs[-1]["value"] == 17, runs
    assert runs[0]["start"] < last_sent  # the cap ended the first window amid the calls
    capped = calls[runs[0]["value"]]
    assert outcomes.pop(capped.id) == {"value": runs[0]["value"]}
    skipped = [(i, outcomes[c.id]) for i, c in enumerate(calls[:-1]) if c.id in outcomes]
    for index, outcome in skipped:
        superseded_by_newer(calls[index:], [outcome])


def test_a_worker_killed_mid_window_loses_no_call(
    taskenv: tuple[Celery, dict[str, str], Path], zk_client: KazooClient
) -> None:
    """The worker holding the latest call's message (sent back to wait for its window) is
    SIGKILLed; the broker hands the message to another worker, whose run finds the window
    over and runs the last call once."""
    app, env, tmp = taskenv
    from tests.taskapp import debounced

    env = {**env, "TASKAPP_VISIBILITY_TIMEOUT": "3"}
    with workers(app, "prefork", 1, env, tmp, prefix="a", queues=["dq"]) as (first,):
        calls = [debounced.apply_async(("kill", i), queue="dq") for i in range(5)]
        last = f"event=debounce-waits task_id={calls[-1].id}"
        wait_for(lambda: last in first.log_text(), 10, "the last call to wait for its window")
        first.kill()  # SIGKILL to its main and pool processes
    assert bodies(tmp, "kill") == []
    (state,) = read_locks(zk_client, "/taskapp", names=["debounced"])  # `zklock locks`
    assert isinstance(state, KeyState) and state.debounce is not None
    assert state.debounce.task_id == calls[-1].id and state.debounce.ends is not None
    with workers(app, "prefork", 1, env, tmp, prefix="b", queues=["dq"]) as (second,):
        assert calls[-1].get(timeout=60) == {"value": 4}
        outcomes = [call.get(timeout=30) for call in calls[:-1]]
    runs = bodies(tmp, "kill")
    assert [(run["value"], run["worker"]) for run in runs] == [(4, second.nodename)], runs
    superseded_by_newer(calls, outcomes)


def _hand_out_again(app: Celery, task_id: str) -> None:
    """What Redis does to a message delivered longer ago than its visibility timeout: kombu's
    restore of its unacknowledged record (the message goes back to its queue, flagged
    redelivered, and the record goes until a worker takes the copy)."""
    with app.connection_for_read() as conn:
        channel: Any = conn.default_channel
        for tag, raw in channel.client.hgetall(channel.qos.unacked_key).items():
            if json.loads(raw)[0]["headers"]["id"] == task_id:
                channel.qos.restore_by_tag(tag)
                return
    raise AssertionError(f"no unacknowledged message of task {task_id} in the broker")


def test_a_copy_of_a_call_past_its_window_is_ignored_not_debounced(
    taskenv: tuple[Celery, dict[str, str], Path],
) -> None:
    """A call won its window and runs its body; a newer call begins a window of its own; then
    the broker hands the first call's message out again (its visibility timeout passed while
    the body ran). The copy is one of a call that runs, not of a call the newer one
    superseded: it is ignored, it stores no ``debounced`` skip, and each call runs its body
    once (issue 45's fault run at d72df47 stored a skip for a call whose body ran)."""
    app, env, tmp = taskenv
    from tests.taskapp import debounced_hold, read_records

    # No gate: the copy goes straight to a free pool slot, as one does past a gate whose
    # view of the key lags (the fault run's case).
    with workers(app, "prefork", 1, {**env, "ZKLOCK_GATE": "false"}, tmp) as (worker,):
        first = debounced_hold.apply_async(("copy", 0), queue=worker.queue)
        wait_for(lambda: read_records(tmp / "debounced-hold-copy"), 30, "the first call's body")
        newer = debounced_hold.apply_async(("copy", 1), queue=worker.queue)
        waits = f"event=debounce-waits task_id={newer.id}"
        wait_for(lambda: waits in worker.log_text(), 10, "the newer call's window")
        ignored = f"[{first.id}] ignored"  # its first message, sent back, ended so too
        before = worker.log_text().count(ignored)
        _hand_out_again(app, first.id)

        def copy_ended() -> bool:
            log = worker.log_text()
            return log.count(ignored) > before or f"[{first.id}] succeeded" in log

        wait_for(copy_ended, 20, "the copy to end")
        assert not first.ready(), "the first call ended before its copy did"
        (tmp / "release-copy").touch()
        assert first.get(timeout=30) == {"value": 0}
        assert newer.get(timeout=30) == {"value": 1}
        log = worker.log_text()
    assert [r["value"] for r in read_records(tmp / "debounced-hold-copy")] == [0, 1]
    skips = [line for line in log.splitlines() if first.id in line and "'debounced'" in line]
    assert skips == [], skips


def test_a_call_killed_after_it_won_its_window_still_runs(
    taskenv: tuple[Celery, dict[str, str], Path],
) -> None:
    """A call won its window (its run ended the window and took the lock) and its worker is
    SIGKILLed mid-body. The broker hands its message out again once the dead run's lock node
    is gone (a 15 s visibility timeout, a 4 s session): the copy finds no window (the call's
    own run ended it) and no contender of its call, and no final state: the call runs again,
    Celery's at-least-once (issue 45's fault run at 79cabdc ignored such a copy as "gone" and
    lost the call)."""
    app, env, tmp = taskenv
    from tests.taskapp import debounced_hold, read_records

    env = {**env, "TASKAPP_VISIBILITY_TIMEOUT": "15"}
    with workers(app, "prefork", 1, env, tmp, prefix="a", queues=["dq"]) as (first,):
        call = debounced_hold.apply_async(("won", 7), queue="dq")
        wait_for(lambda: read_records(tmp / "debounced-hold-won"), 30, "the body")
        first.kill()  # SIGKILL to its main and pool processes, mid-body
    (tmp / "release-won").touch()  # the next body returns at once
    with workers(app, "prefork", 1, env, tmp, prefix="b", queues=["dq"]) as (second,):
        assert call.get(timeout=60) == {"value": 7}
        assert "event=debounce-gone" not in second.log_text()
    assert [r["task_id"] for r in read_records(tmp / "debounced-hold-won")] == [call.id] * 2
