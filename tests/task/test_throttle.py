"""The throttle (issue 45): a ``wait`` call over its ``lock_rate`` waits for its window without
a pool slot and without its lock held, in call order per key, without spending a retry."""

from __future__ import annotations

import itertools
import time
from pathlib import Path

import pytest
from celery import Celery
from kazoo.client import KazooClient

from celery_zklock import is_skipped
from celery_zklock.locks.rate import RATE_NODE
from tests.lockutil import children, wait_for
from tests.taskapp import read_records
from tests.workerproc import start_worker


def test_a_call_over_its_rate_waits_for_its_window_without_a_slot_or_its_lock(
    taskenv: tuple[Celery, dict[str, str], Path], zk_client: KazooClient
) -> None:
    """One run per 3 s, three calls on one key, a worker with one pool slot: the second and
    third calls wait for their windows with nothing of the key held in ZooKeeper, a plain
    task sent meanwhile runs at once, and the three start in call order, a window apart, none
    retried. Before: the waiting call slept in the only slot holding its lock."""
    app, env, tmp = taskenv
    from tests.taskapp import throttled, unlocked_noop

    path = throttled.lock_path("t", 0)
    worker = start_worker(app, "prefork", "throttle", env, tmp, queue="q0", concurrency=1)
    try:
        calls = [throttled.apply_async(("t", seq), queue="q0") for seq in range(3)]
        wait_for(lambda: read_records(tmp / "throttled-t"), 30, "the first run")
        first = read_records(tmp / "throttled-t")[0]["start"]
        # The next window opens 3 s after the first run; from 1 s to 2 s into it the calls
        # waiting for it hold nothing of the key (looked at every 0.1 s: pacing, not waiting).
        time.sleep(max(0.0, first + 1.0 - time.time()))
        seen = []
        while time.time() < first + 2.0:
            seen.append([c for c in children(zk_client, path) if c != RATE_NODE])
            time.sleep(0.1)
        assert seen and not any(seen), seen
        sent = time.time()
        plain = unlocked_noop.apply_async(queue="q0").get(timeout=30)
        assert plain - sent < 1.5, plain - sent  # not behind a call waiting in the pool slot
        assert [call.get(timeout=60) for call in calls] == [0, 1, 2]
    finally:
        worker.stop()
    runs = read_records(tmp / "throttled-t")
    assert [r["seq"] for r in runs] == [0, 1, 2], runs
    assert all(r["retries"] == 0 for r in runs), runs
    starts = [r["start"] for r in runs]
    # A window apart on ZooKeeper's clock; a body starts a moment after its admission.
    assert all(b - a >= 2.8 for a, b in itertools.pairwise(starts)), starts


@pytest.mark.parametrize("gate", ["on", "off"])
def test_a_throttled_calls_lock_timeout_counts_from_its_first_arrival(
    taskenv: tuple[Celery, dict[str, str], Path], gate: str
) -> None:
    """docs/rate-limits.md: a throttled call's ``lock_timeout`` counts from when it first came,
    and a window that opens after it applies ``lock_on_timeout`` at once. One run per 3 s,
    three calls of one key at once with a 4 s ``lock_timeout`` (skip): one runs, one more in
    the next window, and the third, whose window then opens 6 s after it came, is skipped
    ``timeout`` without a run. Without the gate each send-back counted the timeout from its
    own arrival again, and the third ran 6 s after it came."""
    app, env, tmp = taskenv
    from tests.taskapp import throttled

    key = f"timeout-{gate}"
    env = env if gate == "on" else {**env, "ZKLOCK_GATE": "false"}
    worker = start_worker(app, "prefork", f"throttle-{gate}", env, tmp, queue="q0")
    try:
        call = {"queue": "q0", "zklock": {"timeout": 4, "on_timeout": "skip"}}
        calls = [throttled.apply_async((key, seq), **call) for seq in range(3)]
        values = [result.get(timeout=60) for result in calls]
    finally:
        worker.stop()
    skipped = [value for value in values if is_skipped(value)]
    assert len(skipped) == 1 and skipped[0]["reason"] == "timeout", values
    assert len(read_records(tmp / f"throttled-{key}")) == 2


def test_a_retry_of_a_throttled_call_waits_its_own_lock_timeout(
    taskenv: tuple[Celery, dict[str, str], Path],
) -> None:
    """A call sent back to wait for its window carries when it first came; its retry is another
    attempt, whose ``lock_timeout`` counts from its own arrival. One run per 3 s, a 4 s
    ``lock_timeout`` (skip): the second of two calls waits for the next window, runs, and
    retries; the retry meets the window it just used and waits 3 s more (within its own 4 s),
    then runs. Celery copies a request's headers into its retry: the retry counted from its
    first attempt's arrival, 6 s before its window, and was skipped ``timeout``."""
    app, env, tmp = taskenv
    from tests.taskapp import throttled_retrying

    worker = start_worker(app, "prefork", "throttle-retry", env, tmp, queue="q0")
    try:
        calls = [throttled_retrying.apply_async(("rt", seq), queue="q0") for seq in range(2)]
        values = [result.get(timeout=60) for result in calls]
    finally:
        worker.stop()
    assert values == [0, 1], values
    runs = [(r["seq"], r["retries"]) for r in read_records(tmp / "throttled-rt")]
    assert runs == [(0, 0), (1, 0), (1, 1)], runs
