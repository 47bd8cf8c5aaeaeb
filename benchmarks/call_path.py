"""``python -m benchmarks.call_path [--worker] [-v]``: the library functions one locked task call
crosses.

Alone (the default): one exclusive, free-key call of a bound ``ZkLockTask``
(``lock_key=["account_id"]``, run eagerly in this process against a standalone ZooKeeper this
module starts), from ``ZkLockTask.__call__`` to the release, with caches warm (the second call is
the one counted). Prints the calls, the distinct functions and the modules of ``celery_zklock``
they belong to (``-v``: each function in the order first called): the measure behind "one task,
easy to follow" (docs/how-it-fits-together.md).

``--worker`` (issue 43's measure): one default call on a free key as production makes it. This
process starts a standalone ZooKeeper, a Redis (broker and result backend) and one real
``celery worker`` of :mod:`benchmarks.call_path_app` (prefork, concurrency 2, the gate on: the
default), warms it up with calls on other keys until each pool process ran one (client
connected, parent node made, settings read), then counts one call of a never-used key: in this
process (the producer) and in the worker's main process and each pool process, every thread,
from just before ``apply_async`` to :data:`AFTER_RESULT_S` after ``result.get()`` returned
(periodic work in that window counts, as a reader meets it). The worker's windows open a few
milliseconds before and close a few after the producer's (:mod:`benchmarks.call_path_probe`:
signals and their answers). Prints per process and for their union the distinct functions
(``(module, qualname)``) and modules (``-v``: each process's functions in the order first
entered, with their calls).
"""

from __future__ import annotations

import argparse
import collections
import sys
import time
import uuid
from pathlib import Path
from types import FrameType
from typing import Any

from celery import Celery

from benchmarks import call_path_app
from benchmarks import call_path_probe as probe
from benchmarks.common import redis_server, zookeeper
from benchmarks.contenders import section_settings
from celery_zklock import ZkLockTask
from celery_zklock.testing.celery_worker import CeleryWorker, celery_command, wait_until_answering
from celery_zklock.testing.processes import descendants, make_temp_dir, remove_temp_dir
from celery_zklock.testing.zookeeper import ZooKeeperServer
from celery_zklock.zk.client import close_clients

REPO_ROOT = Path(__file__).resolve().parent.parent
CONCURRENCY = 2
#: How long the counted window stays open after the call's result came back.
AFTER_RESULT_S = 0.3
#: How long each warm-up call holds its pool process, so that the next goes to another one.
WARM_HOLD_S = 0.3
WARM_ROUNDS = 5
#: Seconds between the warm-up and the counted call (the warm-up's releases and results settle).
SETTLE_S = 0.5
#: The counted call's key: the warm-up's keys count up from 1.
COUNTED_KEY = 1_000_000
RESULT_TIMEOUT_S = 30.0


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.call_path", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--worker", action="store_true", help="count in a real worker's processes")
    parser.add_argument("-v", dest="verbose", action="store_true", help="list every function")
    args = parser.parse_args(argv)
    if args.worker:
        return count_in_worker(args.verbose)
    return count_alone(args.verbose)


# ------------------------------------------------------------------------------- alone


def count_alone(verbose: bool) -> int:
    with ZooKeeperServer() as zk:
        app = Celery("call-path", set_as_current=False)
        app.conf.zklock_hosts = zk.hosts
        app.conf.task_always_eager = True

        @app.task(bind=True, base=ZkLockTask, lock_key=["account_id"], lazy=False)  # type: ignore[untyped-decorator]
        def sync_account(self: Any, account_id: int, full: bool = False) -> int:
            return int(self.lock.token)

        sync_account(1)  # warm: client, settings, parent node
        calls: list[tuple[str, str]] = []

        def profile(frame: FrameType, event: str, arg: Any) -> None:
            module = frame.f_globals.get("__name__", "")
            ours = module.startswith("celery_zklock") and ".testing" not in module
            if event == "call" and ours:
                code = frame.f_code  # co_qualname: Python 3.11 and later
                calls.append((module, getattr(code, "co_qualname", code.co_name)))

        sys.setprofile(profile)
        try:
            sync_account(2)
        finally:
            sys.setprofile(None)
            close_clients()  # before its ZooKeeper stops: no reconnect warning at exit
    distinct = list(dict.fromkeys(calls))
    modules = collections.Counter(module for module, _ in distinct)
    print(f"{len(calls)} calls, {len(distinct)} distinct functions, {len(modules)} modules")
    for module, count in modules.most_common():
        print(f"  {count:3d} {module}")
    if verbose:
        for module, function in distinct:
            print(f"    {module}: {function}")
    return 0


# -------------------------------------------------------------------- in a real worker


def count_in_worker(verbose: bool) -> int:
    probe.install()  # before this process starts any thread
    with zookeeper("celery") as zk, redis_server() as redis:
        settings = section_settings(
            zk, redis.url, "/callpath", pool="prefork", concurrency=CONCURRENCY
        )
        app = call_path_app.create_app(settings)
        directory = make_temp_dir("zklock-callpath-")
        worker = CeleryWorker(
            celery_command(
                "benchmarks.call_path_app:app", "prefork", CONCURRENCY, loglevel="warning"
            ),
            nodename=f"callpath-{uuid.uuid4().hex[:8]}@%h",
            log_path=directory / "worker.log",
            cwd=REPO_ROOT,
            env={**settings.to_env(), probe.DIR_ENV: str(directory)},
        )
        worker.spawn()
        try:
            wait_until_answering(app, [worker], 60)
            assert worker.pid is not None
            pools = warm_up(app, worker.pid)
            time.sleep(SETTLE_S)
            counted = count_one_call(app, worker.pid, pools, directory)
        finally:
            worker.stop()
            close_clients()
            remove_temp_dir(directory)
    report(counted, verbose)
    return 0


def warm_up(app: Celery, main_pid: int) -> list[int]:
    """Calls on keys other than the counted one, until each pool process ran one; the pool
    processes' pids."""
    task = app.tasks[call_path_app.TASK]
    pools = sorted(descendants(main_pid))
    if len(pools) != CONCURRENCY:
        raise RuntimeError(f"expected {CONCURRENCY} pool processes, found {pools}")
    ran: set[int] = set()
    key = 0
    for _ in range(WARM_ROUNDS):
        results = []
        for _ in range(CONCURRENCY):
            key += 1
            results.append(task.apply_async((key,), {"hold": WARM_HOLD_S}))
        ran.update(result.get(timeout=RESULT_TIMEOUT_S) for result in results)
        if ran >= set(pools):
            break
    else:
        raise RuntimeError(f"the warm-up reached only pool processes {sorted(ran)} of {pools}")
    for _ in range(2):  # and a call that holds nothing, as the counted one
        key += 1
        task.apply_async((key,)).get(timeout=RESULT_TIMEOUT_S)
    assert key < COUNTED_KEY
    return pools


Counts = dict[probe.Function, int]


def count_one_call(
    app: Celery, main_pid: int, pools: list[int], directory: Path
) -> list[tuple[str, Counts]]:
    """The counted call; each process's label and counts (producer, worker main, pools)."""
    task = app.tasks[call_path_app.TASK]
    probe.open_windows([main_pid, *pools], directory)
    probe.start()
    try:
        result = task.apply_async((COUNTED_KEY,))
        ran_in = result.get(timeout=RESULT_TIMEOUT_S)
        time.sleep(AFTER_RESULT_S)
    finally:
        producer = probe.stop()
        workers = probe.close_windows([main_pid, *pools], directory)
    counted = [("producer", producer), (f"worker main (pid {main_pid})", workers[main_pid])]
    for n, pid in enumerate(pools, 1):
        ran = ", ran the call" if pid == ran_in else ""
        counted.append((f"pool process {n} (pid {pid}{ran})", workers[pid]))
    return counted


def report(counted: list[tuple[str, Counts]], verbose: bool) -> None:
    print(
        "One default call on a free key, every thread, from just before apply_async to "
        f"{AFTER_RESULT_S:g} s after its result:"
    )
    union: dict[probe.Function, None] = {}
    for label, counts in counted:
        union.update(dict.fromkeys(counts))
        modules = collections.Counter(module for module, _ in counts)
        print(
            f"  {label}: {sum(counts.values())} calls, {len(counts)} distinct functions "
            f"in {len(modules)} modules"
        )
        for module, count in modules.most_common():
            print(f"    {count:3d} {module}")
        if verbose:
            for (module, function), calls in counts.items():
                print(f"        {module}: {function} ({calls})")
    modules = collections.Counter(module for module, _ in union)
    print(f"union: {len(union)} distinct functions in {len(modules)} modules")
    for module, count in modules.most_common():
        print(f"  {count:3d} {module}")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
