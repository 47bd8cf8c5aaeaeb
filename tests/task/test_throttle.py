"""The throttle (issue 45): a ``wait`` call over its ``lock_rate`` waits for its window without
a pool slot and without its lock held, in call order per key, without spending a retry."""

from __future__ import annotations

import itertools
import time
from pathlib import Path

from celery import Celery
from kazoo.client import KazooClient

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
