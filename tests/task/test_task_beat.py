"""A singleton periodic job: real `celery beat` fires it faster than it runs, it never overlaps."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import redis
from celery import Celery
from kazoo.client import KazooClient

from celery_zklock import is_skipped
from celery_zklock.testing.witness import check_witness
from tests.lockutil import children, wait_for
from tests.workerproc import ROOT, workers

BEAT_EVERY = 0.3
"""Seconds between firings; each run holds the lock for 1 s."""


def stored_results(redis_url: str) -> list[dict[str, object]]:
    """Every task result the backend holds (the beat-sent ids are not known to the test)."""
    client = redis.Redis.from_url(redis_url)
    try:
        return [
            json.loads(raw)
            for key in client.scan_iter("celery-task-meta-*")
            if (raw := client.get(key)) is not None
        ]
    finally:
        client.close()


def test_beat_singleton_never_overlaps_and_records_its_skips(
    taskenv: tuple[Celery, dict[str, str], Path], redis_url: str, zk_client: KazooClient
) -> None:
    app, env, tmp = taskenv
    queue = f"beat-{tmp.name}"
    env = {**env, "TASKAPP_BEAT_EVERY": str(BEAT_EVERY), "TASKAPP_BEAT_QUEUE": queue}

    def singleton_results() -> list[dict[str, object]]:
        return [
            r
            for r in stored_results(redis_url)
            if r.get("name") == "tests.taskapp.singleton" and r.get("status") == "SUCCESS"
        ]

    with (
        workers(app, "prefork", 1, env, tmp, prefix="b", queues=[queue]),
        workers(app, "threads", 1, env, tmp, prefix="c", queues=[queue]),
    ):
        log = (tmp / "beat.log").open("wb")
        beat = subprocess.Popen(
            [sys.executable, "-m", "celery", "-A", "tests.taskapp", "beat",
             "-s", str(tmp / "beat-schedule"), "-l", "info"],
            cwd=ROOT, env={**os.environ, **env, "PYTHONPATH": str(ROOT)},
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
        try:
            wait_for(
                lambda: sum(not is_skipped(r["result"]) for r in singleton_results()) >= 3,
                60, "three runs of the singleton job",
            )  # fmt: skip
        finally:
            os.killpg(beat.pid, signal.SIGTERM)
            beat.wait(15)
            log.close()
        # let the fired runs finish before the workers stop (in-flight ones end SUCCESS too)
        wait_for(
            lambda: not children(zk_client, "/taskapp/singleton"), 30, "the last run to release",
        )  # fmt: skip
    results = singleton_results()
    ran = [r for r in results if not is_skipped(r["result"])]
    skipped = [r for r in results if is_skipped(r["result"])]
    assert len(ran) >= 3
    # fired every 0.3 s, running 1 s each: most firings found the job running and skipped,
    # each skip recorded as a SUCCESS result naming the lock and the running holder
    assert len(skipped) >= len(ran)
    for record in skipped:
        result = record["result"]
        assert isinstance(result, dict)
        assert result["reason"] == "busy" and result["lock"].startswith("/taskapp/singleton/")
        assert result["holder"] in {r["task_id"] for r in ran}
    report = check_witness(tmp / "witness-singleton")
    assert report.overlaps == [] and report.sections == len(ran)
