"""``python -m benchmarks.instructions [--calls N] [--repeats R] [TREE ...]``: section 7's two
locked cycles counted in CPU instructions, for this checkout and others, side by side.

A CPU-time figure moves with the machine's load and speed; an instruction count does not:
``valgrind --tool=callgrind`` counts the user-space instructions of every thread of a process
(kazoo's included), the same to within 1% from run to run on a busy machine. So a
before/after question ("what did this change cost per call?") is answered here even where
section 7's CPU times spread by tens of percent. What it does not count: system calls' time in
the kernel and thread wake-ups, which section 7 and section 4 do.

For each TREE (a checkout's root, for example ``git worktree add /tmp/before <commit>``; none:
this checkout) and each cycle, a child process of that tree runs 50 warm-up calls and then N
calls (and once 0 calls), under callgrind, against one standalone ZooKeeper this module starts;
instructions per call = (count with N - count with 0) / N, per repetition. The cycles, as
section 7 (:mod:`benchmarks.task_layer`) defines them, on keys never used before:

- ``recipe``: a write-side ``Mutex`` try-lock and release;
- ``zklock``: a no-op ``ZkLockTask`` called as a prefork worker calls it.

The child uses only what section 7 has had since before issue 32's re-cut, so older trees can be
counted too. Needs ``valgrind`` (Debian package ``valgrind``).
"""

from __future__ import annotations

import argparse
import os
import random
import re
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from benchmarks.common import spread
from celery_zklock.testing import ZooKeeperServer

CYCLES = ("recipe", "zklock")
WARMUP = 50
_HOSTS_VARIABLE = "ZKLOCK_BENCH_HOSTS"
_COLLECTED = re.compile(r"Collected : (\d+)")

# Run in the tree counted (its own celery_zklock and benchmarks): python -c CHILD CYCLE N BASE.
CHILD = f"""
import itertools, os, sys, types
from celery.app.trace import setup_worker_optimizations
from benchmarks import task_layer
from celery_zklock.zk.client import close_clients
cycle, calls, base = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
app = task_layer._app(types.SimpleNamespace(hosts=os.environ[{_HOSTS_VARIABLE!r}]))
setup_worker_optimizations(app, hostname="bench@instructions")
if cycle == "zklock":
    call = task_layer._as_worker(app.tasks[task_layer.LOCKED_TASK])
else:
    call = task_layer._recipe(app, b"x" * 160)
numbers = itertools.count(base)
for _ in range({WARMUP} + calls):
    call(next(numbers))
close_clients()
"""


def child(tree: Path, cycle: str, calls: int, hosts: str) -> tuple[list[str], dict[str, str]]:
    """The command and environment of a child of ``tree`` making ``calls`` calls of ``cycle``
    (after the warm-up) against ZooKeeper at ``hosts``, on keys never used before."""
    env = {**os.environ, "PYTHONPATH": str(tree), "PYTHONHASHSEED": "0", _HOSTS_VARIABLE: hosts}
    base = random.randrange(10**12)
    return [sys.executable, "-c", CHILD, cycle, str(calls), str(base)], env


def count(tree: Path, cycle: str, calls: int, hosts: str) -> int:
    """Instructions callgrind counts in one child of ``tree`` making ``calls`` calls."""
    command, env = child(tree, cycle, calls, hosts)
    argv = ["valgrind", "--tool=callgrind", "--callgrind-out-file=/dev/null", *command]
    done = subprocess.run(argv, cwd=tree, env=env, capture_output=True, text=True, check=False)
    found = _COLLECTED.search(done.stderr)
    if done.returncode != 0 or found is None:
        raise RuntimeError(f"{tree}: the {cycle} child failed:\n{done.stderr[-2000:]}")
    return int(found.group(1))


def per_call(tree: Path, cycle: str, calls: int, repeats: int, hosts: str) -> list[float]:
    """Instructions per call, one figure per repetition (the children run a CPU each: a count
    does not depend on what else runs)."""
    sizes = [calls, 0] * repeats
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        counts = list(pool.map(lambda n: count(tree, cycle, n, hosts), sizes))
    return [(counts[i] - counts[i + 1]) / calls for i in range(0, len(counts), 2)]


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.instructions")
    parser.add_argument("trees", nargs="*", type=Path, help="checkouts to count (default: this)")
    parser.add_argument("--calls", type=int, default=400, help="calls counted (default 400)")
    parser.add_argument("--repeats", type=int, default=2, help="repetitions (default 2)")
    args = parser.parse_args(argv)
    if shutil.which("valgrind") is None:
        parser.error("valgrind is not installed: apt-get install valgrind")
    if args.calls < 1 or args.repeats < 1:
        parser.error("--calls and --repeats must be at least 1")
    trees = [t.resolve() for t in args.trees] or [Path(__file__).resolve().parents[1]]
    for tree in trees:
        if not (tree / "benchmarks" / "task_layer.py").is_file():
            parser.error(f"{tree} is not a celery-zklock checkout with section 7")
    print(f"instructions per call (thousands), {args.calls} calls after {WARMUP} warm-up, "
          f"median [min .. max] of {args.repeats}; change against the first tree")  # fmt: skip
    with ZooKeeperServer() as zk:
        for cycle in CYCLES:
            first: float | None = None
            for tree in trees:
                figure = spread(per_call(tree, cycle, args.calls, args.repeats, zk.hosts))
                median = figure["median"] / 1e3
                first = median if first is None else first
                print(f"  {cycle:6s} {median:8.1f}k [{figure['min'] / 1e3:.1f} .. "
                      f"{figure['max'] / 1e3:.1f}] {100 * (median / first - 1):+6.1f}%  {tree}",
                      flush=True)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
