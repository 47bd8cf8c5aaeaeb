"""Where a locked task's worker CPU goes: per process and thread, CPU and context switches.

``python -m benchmarks.worker_threads [--tasks N]`` lays out section 4's worker (ZooKeeper on one
CPU, the prefork worker and Redis on the other), drains batches of ``plain``, ``plain-sleep``
(a plain task as long in the pool as a locked one) and ``zklock-skip`` no-op tasks in turn, and
prints, per task of the batch, each thread's CPU (``/proc``, clock ticks) and its voluntary and
involuntary context switches, and the worker's CPU in all (every thread of every process). A
diagnostic, not a section of ``make bench``: what it showed is in
``docs/benchmark-results.md`` (section 4).
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from pathlib import Path

TICK_MS = 1000.0 / os.sysconf("SC_CLK_TCK")
CONTENDERS = ("plain", "plain-sleep", "zklock-skip")


@dataclass(frozen=True)
class ThreadSample:
    """One thread's counters: CPU in clock ticks, voluntary and involuntary switches."""

    ticks: int
    voluntary: int
    involuntary: int


def sample_threads(pid: int) -> dict[int, ThreadSample]:
    """The counters of every thread of process ``pid`` (threads that end meanwhile are left
    out)."""
    samples: dict[int, ThreadSample] = {}
    for entry in Path(f"/proc/{pid}/task").iterdir():
        try:
            stat = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            status = dict(
                line.split(":\t", 1)
                for line in (entry / "status").read_text().splitlines()
                if ":\t" in line
            )
        except FileNotFoundError:
            continue
        samples[int(entry.name)] = ThreadSample(
            int(stat[11]) + int(stat[12]),  # utime + stime
            int(status["voluntary_ctxt_switches"]),
            int(status["nonvoluntary_ctxt_switches"]),
        )
    return samples


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.worker_threads")
    parser.add_argument("--tasks", type=int, default=1500, help="tasks per batch")
    parser.add_argument("--rounds", type=int, default=2, help="batches per contender")
    args = parser.parse_args(argv)
    # Here, not at the top: benchmarks.celery_app connects Celery signal receivers on import,
    # and the sampler above is imported by the unit tests.
    import redis

    from benchmarks import celery_fleet
    from benchmarks.celery_app import create_app
    from benchmarks.contenders import section_settings
    from celery_zklock.testing import ZooKeeperServer
    from celery_zklock.testing.celery_worker import wait_until_answering
    from celery_zklock.testing.processes import make_temp_dir, remove_temp_dir
    from celery_zklock.testing.redis_server import RedisServer

    zk, broker = ZooKeeperServer(), RedisServer()
    zk.start()
    broker.start()
    log_dir = make_temp_dir("zklock-worker-threads-")
    try:
        settings = section_settings(zk, broker.url, "/bench-threads", pool="prefork",
                                    concurrency=celery_fleet.CONCURRENCY)  # fmt: skip
        app = create_app(settings)
        client = redis.Redis.from_url(broker.url)
        layout = celery_fleet._layout(zk.pid, int(client.info("server")["process_id"]))
        worker = celery_fleet._start_worker(settings, log_dir, layout)
        try:
            wait_until_answering(app, [worker], celery_fleet.WORKER_READY_TIMEOUT_S)
            bench = celery_fleet.Bench(app, worker, client, zk.pid, None, zk.port)
            by_label = {c.label: c for c in celery_fleet.CONTENDERS}
            for label in CONTENDERS:
                celery_fleet._batch(bench, by_label[label], "warm", 300)
            for label in CONTENDERS * args.rounds:
                pids = sorted(worker.process_ids())
                before = {pid: sample_threads(pid) for pid in pids}
                celery_fleet._batch(bench, by_label[label], label, args.tasks)
                print(f"{label}: per task of the batch (CPU ms, voluntary, involuntary switches)")
                total = 0.0
                for pid in pids:
                    role = "main " if pid == pids[0] else "child"
                    for tid, now in sorted(sample_threads(pid).items()):
                        was = before[pid].get(tid, ThreadSample(0, 0, 0))
                        cpu = (now.ticks - was.ticks) * TICK_MS / args.tasks
                        vol = (now.voluntary - was.voluntary) / args.tasks
                        invol = (now.involuntary - was.involuntary) / args.tasks
                        total += cpu
                        if cpu > 0.005 or vol > 0.05:  # leave out threads that slept through
                            print(f"  {role} {pid} thread {tid}: CPU {cpu:.3f} ms, "
                                  f"{vol:.2f} voluntary, {invol:.2f} involuntary")  # fmt: skip
                print(f"  all threads: CPU {total:.3f} ms")
        finally:
            worker.stop(grace=10.0)
            celery_fleet._restore(layout, None)
            client.close()
            app.close()
    finally:
        remove_temp_dir(log_dir)
        broker.stop()
        zk.stop()


if __name__ == "__main__":
    main()
