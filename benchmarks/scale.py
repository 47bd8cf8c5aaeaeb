"""Section 5 of ``python -m benchmarks``: many distinct keys through the lock, and what is left
on the server afterwards (znodes, data size, JVM memory), ours vs kazoo's Lock.

Method: ``docs/benchmarks.md``, section 5.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from kazoo.client import KazooClient
from kazoo.recipe.lock import Lock as KazooLock

from benchmarks.common import (
    WORKER_SESSION_TIMEOUT_S,
    Progress,
    mntr,
    rss_bytes,
    serve_client,
    start_workers,
    stop_workers,
    wait_for,
)
from celery_zklock import Mutex
from celery_zklock.testing import ZooKeeperServer

ROOT = "/scale"
ACQUIRE_TIMEOUT_S = 60.0
REAP_DEADLINE_S = 300.0
KAZOO_FRACTION = 10


def _cycle_keys(client: KazooClient, recipe: str, keys: range) -> None:
    for i in keys:
        if recipe == "ours":
            Mutex(client, f"{ROOT}/ours/k{i}").acquire(timeout=ACQUIRE_TIMEOUT_S).release()
        else:
            lock = KazooLock(client, f"{ROOT}/kazoo/k{i}")
            if not lock.acquire(timeout=ACQUIRE_TIMEOUT_S):
                raise RuntimeError(f"kazoo Lock k{i} not acquired")
            lock.release()


def _worker(conn: Any, hosts: str) -> None:
    serve_client(conn, hosts, _handle)


def _handle(client: KazooClient, command: tuple[Any, ...]) -> float:
    _, recipe, first, last, step = command
    started = time.monotonic()
    _cycle_keys(client, recipe, range(first, last, step))
    return time.monotonic() - started


def _children(client: KazooClient, path: str) -> int:
    return len(client.get_children(path))


def _server_state(server: ZooKeeperServer) -> dict[str, Any]:
    values = mntr(server.port)

    def number(name: str) -> int | None:
        value = values.get(name)
        return int(value) if value is not None else None

    return {
        "rss_bytes": rss_bytes(server.pid),
        "znode_count": number("zk_znode_count"),
        "approximate_data_size": number("zk_approximate_data_size"),
        "ephemerals_count": number("zk_ephemerals_count"),
    }


def _pass(
    server: ZooKeeperServer,
    admin: KazooClient,
    workers: Sequence[Any],
    recipe: str,
    keys: int,
    progress: Progress,
) -> dict[str, Any]:
    root = f"{ROOT}/{recipe}"
    admin.ensure_path(root)
    time.sleep(1.0)
    before = _server_state(server)
    count = len(workers)
    started = time.monotonic()
    # Worker w takes keys w, w + count, w + 2 * count, ...: all interleave on the server.
    for index, worker in enumerate(workers):
        worker.send("run", recipe, index, keys, count)
    for worker in workers:
        worker.reply(timeout=3600)
    elapsed = time.monotonic() - started
    left_at_end = _children(admin, root)
    after_run = _server_state(server)
    progress(
        f"scale: {recipe}: {keys} keys in {elapsed:.1f} s ({keys / elapsed:.0f}/s); "
        f"{left_at_end} children of {root} right after"
    )
    reap_started = time.monotonic()
    if recipe == "ours":
        wait_for(lambda: _children(admin, root) == 0, REAP_DEADLINE_S, interval=0.1)
    reap_s = time.monotonic() - reap_started
    left = _children(admin, root)
    time.sleep(1.0)
    after = _server_state(server)
    if recipe == "ours":
        progress(f"scale: {recipe}: {left} children left after {reap_s:.1f} s of reaping")
    return {
        "keys": keys,
        "seconds": elapsed,
        "keys_per_s": keys / elapsed,
        "children_right_after": left_at_end,
        "children_left": left,
        "reap_wait_s": reap_s if recipe == "ours" else None,
        "server_before": before,
        "server_right_after": after_run,
        "server_after": after,
    }


def run_section(
    server: ZooKeeperServer, *, keys: int, processes: int, progress: Progress
) -> dict[str, Any]:
    """Section 5: ``keys`` distinct keys through our Mutex, a tenth through kazoo's Lock."""
    admin = KazooClient(hosts=server.hosts, timeout=WORKER_SESSION_TIMEOUT_S)
    admin.start(timeout=60)
    workers = start_workers(_worker, [(server.hosts,)] * processes, ready_timeout=300)
    try:
        ours = _pass(server, admin, workers, "ours", keys, progress)
        kazoo = _pass(server, admin, workers, "kazoo", max(1, keys // KAZOO_FRACTION), progress)
    finally:
        stop_workers(workers)
        admin.stop()
        admin.close()
    return {
        "config": {
            "keys": keys,
            "processes": processes,
            "kazoo_keys": max(1, keys // KAZOO_FRACTION),
            "reap_deadline_s": REAP_DEADLINE_S,
            "repetitions": "one pass (a count, not a latency)",
        },
        "ours": ours,
        "kazoo": kazoo,
    }
