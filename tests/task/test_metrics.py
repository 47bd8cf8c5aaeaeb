"""The metrics (celery_zklock.worker.metrics) on real `celery worker` processes and real
ZooKeeper: a prefork worker (pool processes record, the main process serves) and a threads
worker (in-process), each with
``ZKLOCK_METRICS_PORT``; the counts scraped over HTTP are checked against the task results."""

from __future__ import annotations

import os
import signal
import socket
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from billiard.exceptions import WorkerLostError
from celery import Celery
from kazoo.client import KazooClient
from prometheus_client.parser import text_string_to_metric_families

from celery_zklock import LockLost, is_skipped, signals
from celery_zklock.task.metrics import LOST_REASONS
from celery_zklock.testing.celery_worker import stop_all
from celery_zklock.testing.processes import StackError
from tests.lockutil import wait_for
from tests.taskapp import read_records
from tests.workerproc import STOP_GRACE, Worker, held_session, start_worker

EXCLUSIVE = "tests.taskapp.exclusive_section"
LONG = "tests.taskapp.long_hold"
LATE = "tests.taskapp.acked_late"
OUTCOMES = ("granted", "skipped", "timed_out", "busy_raised", "retried")


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


class Scrape:
    """One scrape of a worker's metrics endpoint."""

    def __init__(self, port: int) -> None:
        url = f"http://127.0.0.1:{port}/metrics"
        with urllib.request.urlopen(url, timeout=10) as answer:
            text = answer.read().decode()
        self.samples = {
            (s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(text)
            for s in family.samples
        }

    def value(self, name: str, **labels: str) -> float:
        """The sample's value; 0 for a series not (yet) exposed."""
        return self.samples.get((name, frozenset(labels.items())), 0.0)

    def total(self, name: str) -> float:
        return sum(v for (n, _), v in self.samples.items() if n == name)


@contextmanager
def metric_workers(
    app: Celery,
    env: dict[str, str],
    tmp: Path,
    pools: tuple[tuple[str, int], ...] = (("prefork", 2), ("threads", 4)),
) -> Iterator[dict[str, tuple[Worker, int]]]:
    """A worker of each ``(pool, concurrency)``, each serving metrics on a port of its own,
    with its temporary files (the multiprocess directory) under ``tmp/tmp-<pool>``."""
    started: dict[str, tuple[Worker, int]] = {}
    try:
        for i, (pool, concurrency) in enumerate(pools):
            port = free_port()
            tmpdir = tmp / f"tmp-{pool}"
            tmpdir.mkdir()
            worker_env = {**env, "ZKLOCK_METRICS_PORT": str(port),
                          "ZKLOCK_METRICS_ADDR": "127.0.0.1", "TMPDIR": str(tmpdir)}  # fmt: skip
            worker = start_worker(
                app, pool, f"m{i}-{pool}", worker_env, tmp, queue=f"q{i}", concurrency=concurrency
            )
            started[pool] = (worker, port)
        yield started
    finally:
        stop_all([worker for worker, _ in started.values()], STOP_GRACE)


def test_workers_count_what_their_locked_tasks_did(
    taskenv: tuple[Celery, dict[str, str], Path],
) -> None:
    app, env, tmp = taskenv
    from tests.taskapp import exclusive_section, long_hold

    with metric_workers(app, env, tmp) as fleet:
        (prefork, prefork_port), (threads, threads_port) = fleet["prefork"], fleet["threads"]
        pool_pids = prefork.process_ids() - {prefork.pid}
        # The multiprocess directory the prefork worker made; the threads worker made none.
        (multiproc_dir,) = (tmp / "tmp-prefork").glob("zklock-metrics-*")
        assert list((tmp / "tmp-threads").iterdir()) == []

        # A lease held in a pool process shows on the main process's endpoint.
        holder = long_hold.apply_async(("mk", 120.0), queue=prefork.queue)
        held = held_session(tmp, holder.id)
        assert held["pid"] in pool_pids
        assert Scrape(prefork_port).value("zklock_leases_held", task=LONG) == 1
        # Busy while it holds: two skipped attempts on each worker.
        skips = [
            long_hold.apply_async(("mk", 0.0), queue=w.queue, zklock={"on_busy": "skip"})
            for w in (prefork, prefork, threads, threads)
        ]
        assert all(is_skipped(r.get(timeout=60)) for r in skips)
        # The holder's pool process killed: its share of the gauge goes with it.
        os.kill(held["pid"], signal.SIGKILL)
        with pytest.raises(WorkerLostError):
            holder.get(timeout=60, propagate=True)
        wait_for(
            lambda: Scrape(prefork_port).value("zklock_leases_held", task=LONG) == 0,
            30,
            "the killed pool process's lease to leave the gauge",
        )

        # 100 short exclusive sections over 3 keys (skip when busy), half on each worker.
        queues = [prefork.queue, threads.queue]
        results = [
            exclusive_section.apply_async((f"k{i % 3}", 0.02), queue=queues[i % 2])
            for i in range(100)
        ]
        values = [r.get(timeout=120) for r in results]
        assert all(r.state == "SUCCESS" for r in results)

        for worker, port in ((prefork, prefork_port), (threads, threads_port)):
            mine = [v for r, v in zip(results, values, strict=True) if r.worker == worker.nodename]
            assert len(mine) == 50
            ran = [v for v in mine if not is_skipped(v)]
            skipped = len(mine) - len(ran)
            scrape = Scrape(port)
            counts = {
                o: scrape.value("zklock_acquisitions_total", task=EXCLUSIVE, outcome=o)
                for o in OUTCOMES
            }
            print(f"{worker.nodename}: ran {len(ran)}, skipped {skipped}, metrics {counts}")
            assert counts == {"granted": len(ran), "skipped": skipped, "timed_out": 0,
                              "busy_raised": 0, "retried": 0}  # fmt: skip
            assert scrape.value("zklock_wait_seconds_count", task=EXCLUSIVE) == len(ran)
            assert scrape.value("zklock_hold_seconds_count", task=EXCLUSIVE) == len(ran)
            assert scrape.value("zklock_hold_seconds_bucket", task=EXCLUSIVE, le="0.01") == 0
            assert scrape.value("zklock_leases_held", task=EXCLUSIVE) == 0
            assert scrape.total("zklock_leases_held") == 0
            assert scrape.total("zklock_lost_total") == 0
            long_counts = {
                o: scrape.value("zklock_acquisitions_total", task=LONG, outcome=o)
                for o in ("granted", "skipped")
            }
            assert long_counts == {"granted": 1 if worker is prefork else 0, "skipped": 2}
            if worker is prefork:  # recorded in pool processes, each in files of its own
                # (the killed pool process was replaced by a new one)
                assert {v["pid"] for v in ran} <= prefork.process_ids() - {prefork.pid}
                assert {f"counter_{pid}.db" for pid in {v["pid"] for v in ran}} <= {
                    p.name for p in multiproc_dir.iterdir()
                }
    # The worker removed its multiprocess directory at shutdown.
    assert not multiproc_dir.exists()


def test_a_worker_refuses_to_start_on_a_port_it_cannot_bind(
    taskenv: tuple[Celery, dict[str, str], Path],
) -> None:
    app, env, tmp = taskenv
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        worker_env = {**env, "ZKLOCK_METRICS_PORT": str(port), "ZKLOCK_METRICS_ADDR": "127.0.0.1"}
        with pytest.raises(StackError, match="exited") as raised:
            worker = start_worker(app, "threads", "busyport", worker_env, tmp, queue="qb")
            worker.stop()
    assert f"zklock_metrics_port: cannot serve metrics on 127.0.0.1:{port}" in str(raised.value)


def test_a_lease_lost_at_its_release_is_counted_once(
    taskenv: tuple[Celery, dict[str, str], Path], zk_client: KazooClient
) -> None:
    app, env, tmp = taskenv
    from tests.taskapp import acked_late

    with metric_workers(app, env, tmp, pools=(("prefork", 2),)) as fleet:
        worker, port = fleet["prefork"]
        holder = acked_late.apply_async(("dk", 60.0), queue=worker.queue)
        wait_for(lambda: read_records(tmp / "starts-dk"), 30, "the task to hold its lock")
        # Someone else deletes the holder's node: the holder learns it at once if it already
        # watches its node (held past T/8), else when it releases; counted once either way.
        (key,) = zk_client.get_children("/taskapp/late")
        (node,) = zk_client.get_children(f"/taskapp/late/{key}")
        zk_client.delete(f"/taskapp/late/{key}/{node}")
        (tmp / "release-dk").touch()
        with pytest.raises(LockLost, match="deleted"):
            holder.get(timeout=30, propagate=True)
        scrape = Scrape(port)
        assert scrape.total("zklock_lost_total") == 1
        # node_deleted, by the code lock_lost carries (also for a loss found at the release)
        found = {r: scrape.value("zklock_lost_total", task=LATE, reason=r) for r in LOST_REASONS}
        assert found["node_deleted"] == 1, found
        assert scrape.value("zklock_acquisitions_total", task=LATE, outcome="granted") == 1
        assert scrape.value("zklock_hold_seconds_count", task=LATE) == 1
        assert scrape.total("zklock_leases_held") == 0


@pytest.mark.skipif(
    not hasattr(signals, "lock_timeout"),
    reason="timed_out is counted from the lock_timeout signal, which this version does not send",
)
def test_a_wait_that_reaches_its_timeout_is_counted(
    taskenv: tuple[Celery, dict[str, str], Path],
) -> None:
    app, env, tmp = taskenv
    from tests.taskapp import acked_late

    with metric_workers(app, env, tmp, pools=(("threads", 4),)) as fleet:
        worker, port = fleet["threads"]
        holder = acked_late.apply_async(("tk", 60.0), queue=worker.queue)
        wait_for(lambda: read_records(tmp / "starts-tk"), 30, "the task to hold its lock")
        waiting = {"on_busy": "wait", "timeout": 0.2, "on_timeout": "skip"}
        waiters = [
            acked_late.apply_async(("tk", 0.0), queue=worker.queue, zklock=waiting)
            for _ in range(3)
        ]
        values = [r.get(timeout=30) for r in waiters]
        assert all(is_skipped(v) and v["reason"] == "timeout" for v in values), values
        (tmp / "release-tk").touch()
        assert not is_skipped(holder.get(timeout=30))
        scrape = Scrape(port)
        counts = {
            o: scrape.value("zklock_acquisitions_total", task=LATE, outcome=o) for o in OUTCOMES
        }
        assert counts == {"granted": 1, "skipped": 0, "timed_out": 3, "busy_raised": 0,
                          "retried": 0}  # fmt: skip
        assert scrape.value("zklock_wait_seconds_count", task=LATE) == 1
