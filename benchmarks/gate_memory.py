"""What the gate keeps alive: a worker's main process after many gated calls on one hot key.

``python -m benchmarks.gate_memory [--warmup N] [--calls N] [--repeats R]``

One prefork worker (concurrency 2) of :mod:`benchmarks.celery_app` on its own ZooKeeper and
Redis takes ``--warmup`` calls of the ``wait`` no-op task on one key, then ``--calls`` more, sent
at once so that most are held at the gate; after each batch has run, the worker's
``zklock_live`` command (:mod:`celery_zklock.testing.introspect`) reports its main process's
live request objects, timer entries, held messages and RSS. Printed: those figures after the
warm-up and after each further batch of ``--calls`` (``--repeats`` of them), and the RSS
growth from the warm-up with its spread over the batches. Issue 42's target: after a
1,000-call warm-up, 10,000 more calls grow the RSS by under 5 MiB, and live requests and timer
entries return to their warm-up counts.
"""

from __future__ import annotations

import argparse
import json
import time
import uuid
from pathlib import Path
from typing import Any

from celery import Celery

from benchmarks.celery_app import ZKLOCK_WAIT, create_app
from benchmarks.common import redis_server, zookeeper
from benchmarks.contenders import section_settings
from celery_zklock.testing.celery_worker import CeleryWorker, celery_command, wait_until_answering
from celery_zklock.testing.processes import make_temp_dir

REPO_ROOT = Path(__file__).resolve().parent.parent
QUEUE = "zklock-gate-memory"


def live(app: Celery, worker: CeleryWorker) -> dict[str, int]:
    replies = app.control.broadcast(
        "zklock_live", destination=[worker.nodename], reply=True, timeout=10.0
    )
    return dict(replies[0][worker.nodename])


def send_and_drain(app: Celery, worker: CeleryWorker, count: int) -> tuple[float, int]:
    """Send ``count`` calls on one key, wait until every one has ended; the seconds it took
    and how many ended otherwise than SUCCESS (a call still held when its 30 s
    ``lock_timeout`` runs out goes to the pool and fails ``LockTimeout``: it passed the gate
    all the same)."""
    task = app.tasks[ZKLOCK_WAIT]
    started = time.monotonic()
    results = [task.apply_async(("hot",), queue=QUEUE) for _ in range(count)]
    failed = 0
    for result in results:
        result.get(timeout=600, propagate=False)
        failed += result.state != "SUCCESS"
        result.forget()
    while live(app, worker)["held"]:
        time.sleep(0.1)
    return time.monotonic() - started, failed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--warmup", type=int, default=1000)
    parser.add_argument("--calls", type=int, default=10000)
    parser.add_argument("--repeats", type=int, default=1)
    args = parser.parse_args(argv)
    report: dict[str, Any] = {"warmup": args.warmup, "calls": args.calls, "batches": []}
    with zookeeper() as zk, redis_server() as redis:
        settings = section_settings(zk, redis.url, "/bench-gate-memory", pool="prefork",
                                    concurrency=2)  # fmt: skip
        app = create_app(settings)
        log_dir = make_temp_dir("zklock-bench-gate-memory-")
        worker = CeleryWorker(
            celery_command("benchmarks.celery_app:app", "prefork", 2, loglevel="warning"),
            nodename=f"bench-gate-memory-{uuid.uuid4().hex[:8]}@%h",
            log_path=log_dir / "worker.log",
            queues=[QUEUE],
            cwd=REPO_ROOT,
            env=settings.to_env(),
        )
        worker.spawn()
        try:
            wait_until_answering(app, [worker], 60)
            seconds, failed = send_and_drain(app, worker, args.warmup)
            warm = live(app, worker)
            report["after_warmup"] = {**warm, "seconds": round(seconds, 1), "failed": failed}
            print(f"after {args.warmup} calls ({seconds:.0f} s): {json.dumps(warm)}", flush=True)
            for rep in range(args.repeats):
                seconds, failed = send_and_drain(app, worker, args.calls)
                now = live(app, worker)
                growth = (now["rss_bytes"] - warm["rss_bytes"]) / 2**20
                report["batches"].append({**now, "seconds": round(seconds, 1), "failed": failed,
                                          "rss_growth_mib": round(growth, 2)})  # fmt: skip
                batch = f"after {args.calls} more calls, batch {rep + 1} ({seconds:.0f} s)"
                print(f"{batch}: {json.dumps(now)}; RSS +{growth:.2f} MiB since the warm-up",
                      flush=True)  # fmt: skip
        finally:
            worker.stop()
    growths = [b["rss_growth_mib"] for b in report["batches"]]
    print(json.dumps({**report, "rss_growth_mib": {"min": min(growths), "max": max(growths)}}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
