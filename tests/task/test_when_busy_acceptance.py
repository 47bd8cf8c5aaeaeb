"""Issue 45's acceptance on real workers (two prefork workers, concurrency 2): a debounce of half
a second, ``replace`` behind a holder of 2 s, and the throttle at ``5/s`` beside plain tasks.

Each test asserts the issue's figures, timing bounds included (a body 0.4 to 1.5 s after the last
call, the plain tasks' p95 at most 2 s), so they are real-time tests that run alone: marked
``solo`` (run by ``make test-solo``, one test at a time, in .ci/run; neither ``make test`` nor
``make test-faults`` runs them). What each policy does
apart from these figures is tested in make test's tier: tests/task/test_debounce.py,
test_replace.py, test_throttle.py."""

from __future__ import annotations

import math
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from celery import Celery
from kazoo.client import KazooClient
from kazoo.recipe.watchers import DataWatch

from celery_zklock import is_skipped
from celery_zklock.task.latest import WAITER_NODE, parse
from tests.lockutil import wait_for
from tests.task.test_debounce import superseded_by_newer
from tests.task.test_rate_tasks import most_in_any_window
from tests.taskapp import read_records
from tests.workerproc import workers

pytestmark = [pytest.mark.fault, pytest.mark.solo]


def _bodies(tmp: Path, key: str) -> list[dict[str, Any]]:
    return read_records(tmp / f"debounced-half-{key}")


def _ten_calls_within_a_second(task: Any, key: str, queues: list[str]) -> tuple[list[Any], float]:
    """Ten calls of ``key``, one every 0.09 s, alternating over ``queues`` (the last on the
    second): the calls and when the last was sent (this host's clock)."""
    first = time.time()
    calls = []
    for i in range(10):
        time.sleep(max(0.0, first + 0.09 * i - time.time()))  # the pace, not a synchronisation
        calls.append(task.apply_async((key, i), queue=queues[i % 2]))
    last_sent = time.time()
    assert last_sent - first < 1.0, last_sent - first
    return calls, last_sent


def test_ten_calls_within_a_second_run_once_after_half_a_second_of_quiet(
    taskenv: tuple[Celery, dict[str, str], Path],
) -> None:
    """``lock_debounce=0.5``: one body, with the last call's arguments, 0.4 to 1.5 s after the
    last call; the other 9 end as ``debounced`` skips, each naming a newer call."""
    app, env, tmp = taskenv
    from tests.taskapp import debounced_half

    with workers(app, "prefork", 2, env, tmp) as pair:
        calls, last_sent = _ten_calls_within_a_second(debounced_half, "k", [w.queue for w in pair])
        assert calls[-1].get(timeout=30) == {"value": 9}
        outcomes = [call.get(timeout=10) for call in calls[:-1]]
    runs = _bodies(tmp, "k")
    assert [run["value"] for run in runs] == [9], runs
    assert 0.4 <= runs[0]["start"] - last_sent <= 1.5, runs[0]["start"] - last_sent
    superseded_by_newer(calls, outcomes)


def test_a_worker_killed_in_the_half_second_window_loses_no_call(
    taskenv: tuple[Celery, dict[str, str], Path],
) -> None:
    """The worker that took the last of the ten calls is SIGKILLed once that call waits for its
    window (sent back, its message held by that worker), before any body ran; a worker taking
    its place on the queue runs the last call once, after the broker hands its message out
    again (a 3 s visibility timeout), and the other 9 end as ``debounced`` skips."""
    app, env, tmp = taskenv
    from tests.taskapp import debounced_half

    env = {**env, "TASKAPP_VISIBILITY_TIMEOUT": "3"}
    with workers(app, "prefork", 2, env, tmp) as (keeper, victim):
        calls, _ = _ten_calls_within_a_second(debounced_half, "kill", [keeper.queue, victim.queue])
        waits = f"event=debounce-waits task_id={calls[-1].id}"
        wait_for(lambda: waits in victim.log_text(), 10, "the last call to wait for its window")
        victim.kill()  # SIGKILL to its main and pool processes
        assert _bodies(tmp, "kill") == []  # killed within the window: no body ran yet
        with workers(app, "prefork", 1, env, tmp, prefix="b", queues=[victim.queue]) as (second,):
            assert calls[-1].get(timeout=60) == {"value": 9}
            outcomes = [call.get(timeout=30) for call in calls[:-1]]
    runs = _bodies(tmp, "kill")
    assert [(run["value"], run["worker"]) for run in runs] == [(9, second.nodename)], runs
    superseded_by_newer(calls, outcomes)


class _Recorded:
    """Every call a key's waiter record named, in order, with the record's version: a
    :class:`DataWatch` on the node (each change read again before the next watch is set)."""

    def __init__(self, zk: KazooClient, node: str) -> None:
        self.names: list[tuple[int, str | None]] = []
        self._lock = threading.Lock()
        DataWatch(zk, node, self._changed)

    def _changed(self, data: bytes | None, stat: Any) -> None:
        if data is None or stat is None:
            return
        with self._lock:
            self.names.append((stat.version, parse(data, stat).task_id))

    def task_ids(self) -> list[str | None]:
        with self._lock:
            return [task_id for _, task_id in self.names]

    def versions(self) -> list[int]:
        with self._lock:
            return [version for version, _ in self.names]


def test_a_two_second_holder_and_five_calls_during_it_run_twice(
    taskenv: tuple[Celery, dict[str, str], Path], zk_client: KazooClient
) -> None:
    """``replace``: a holder of 2 s, and 5 calls 0.2 s apart sent during it to two workers:
    exactly 2 bodies (the holder's and the last call's) and 4 ``replaced`` skips, each naming
    the call that replaced it: the next call the key's waiter record named (watched in
    ZooKeeper, every version of the record seen), or, for a call that found a newer call
    named already and never recorded itself, that call."""
    app, env, tmp = taskenv
    from tests.taskapp import replacing

    node = f"{replacing.lock_path('h', 0, 0.0)}/{WAITER_NODE}"
    recorded = _Recorded(zk_client, node)
    with workers(app, "prefork", 2, env, tmp) as pair:
        holder = replacing.apply_async(("h", 0, 2.0), queue=pair[0].queue)
        wait_for(lambda: (tmp / "replacing-h").exists(), 30, "the holder's body")
        held_from = time.time()
        calls = []
        for seq in range(1, 6):
            if seq > 1:
                time.sleep(0.2)  # the pace of the calls, not a synchronisation
            calls.append(replacing.apply_async(("h", seq, 0.1), queue=pair[seq % 2].queue))
        assert time.time() - held_from < 2.0  # all sent while the holder holds
        assert holder.get(timeout=30) == 0
        assert calls[-1].get(timeout=30) == 5
        outcomes = [call.get(timeout=10) for call in calls[:-1]]
    assert [r["seq"] for r in read_records(tmp / "replacing-h")] == [0, 5]
    named = recorded.task_ids()
    versions = recorded.versions()
    assert versions == list(range(len(versions))), recorded.names  # no write of it missed
    assert named and named[-1] == calls[-1].id, (named, [c.id for c in calls])
    ids = [call.id for call in calls]
    for call, outcome in zip(calls[:-1], outcomes, strict=True):
        assert is_skipped(outcome) and outcome["reason"] == "replaced", outcome
        if call.id in named:
            assert outcome["holder"] == named[named.index(call.id) + 1], (call.id, named, outcome)
        else:  # it found a newer call waiting: that one replaced it
            assert outcome["holder"] in named, (call.id, named, outcome)
            assert ids.index(outcome["holder"]) > ids.index(call.id), (call.id, outcome)


def test_thirty_calls_at_five_a_second_wait_for_their_windows_beside_plain_tasks(
    taskenv: tuple[Celery, dict[str, str], Path],
) -> None:
    """The throttle: 30 calls of one key at ``lock_rate="5/s"`` with ``wait``, sent at once to
    two workers, while a plain task (no lock) is sent every 0.1 s: all 30 run, none retried, at
    most 5 admission ``ctime``s (ZooKeeper's clock, read back by each body) in any
    ``[t, t + 1 s)``, and the plain tasks' send-to-run p95 is at most 2 s (a call waiting for
    its window holds no pool slot)."""
    app, env, tmp = taskenv
    from tests.taskapp import throttled_fast, unlocked_noop

    with workers(app, "prefork", 2, env, tmp) as pair:
        queues = [w.queue for w in pair]
        calls = [throttled_fast.apply_async(("t", seq), queue=queues[seq % 2]) for seq in range(30)]
        plain: list[tuple[float, Any]] = []
        deadline = time.monotonic() + 120
        while not all(call.ready() for call in calls):
            assert time.monotonic() < deadline, "the throttled calls did not all end in 120 s"
            plain.append((time.time(), unlocked_noop.apply_async(queue=queues[len(plain) % 2])))
            time.sleep(0.1)  # the pace of the plain tasks, not a synchronisation
        assert [call.get(timeout=10) for call in calls] == list(range(30))
        latencies = sorted(result.get(timeout=30) - sent for sent, result in plain)
    runs = read_records(tmp / "throttled-fast-t")
    assert sorted(run["seq"] for run in runs) == list(range(30)), runs  # each ran, once
    assert all(run["retries"] == 0 for run in runs), runs
    admitted = [run["admitted"] for run in runs]
    assert None not in admitted, runs
    assert most_in_any_window(admitted, 1000) <= 5, sorted(admitted)
    assert len(latencies) >= 30, len(latencies)  # sent all along the throttled calls' 6 s
    p95 = latencies[max(0, math.ceil(0.95 * len(latencies)) - 1)]
    assert p95 <= 2.0, (p95, latencies)
