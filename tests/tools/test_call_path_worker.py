"""``python -m benchmarks.call_path --worker`` counts one call in every process of a real worker:
the producer's ``apply_async``, the gate in the worker's main process and the run in the pool
process that took the call."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PROCESS_LINE = re.compile(r"^  (\S[^:]*): \d+ calls, \d+ distinct functions in \d+ modules$")


def sections(output: str) -> dict[str, str]:
    """Each process's label -> its lines (counts, modules, functions)."""
    found: dict[str, list[str]] = {}
    current: list[str] | None = None
    for line in output.splitlines():
        if match := PROCESS_LINE.match(line):
            current = found.setdefault(match[1], [])
        elif line.startswith("union:"):
            current = None
        elif current is not None:
            current.append(line)
    return {label: "\n".join(lines) for label, lines in found.items()}


@pytest.mark.slow
def test_one_call_is_counted_in_the_producer_the_main_process_and_a_pool_process() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.call_path", "--worker", "-v"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    union = re.search(r"^union: (\d+) distinct functions in (\d+) modules$", done.stdout, re.M)
    assert union is not None and int(union[1]) > 0 and int(union[2]) > 0, done.stdout
    by_process = sections(done.stdout)
    main = [text for label, text in by_process.items() if label.startswith("worker main")]
    pools = [text for label, text in by_process.items() if label.startswith("pool process")]
    assert len(main) == 1 and len(pools) == 2, done.stdout
    assert "celery_zklock.task.task: ZkLockTask.apply_async" in by_process["producer"]
    assert "celery_zklock.worker.gate.gate: " in main[0]
    ran = [label for label in by_process if "ran the call" in label]
    assert len(ran) == 1, done.stdout
    assert "celery_zklock.task.run: LockedRun.run " in by_process[ran[0]]
    # Read by kazoo's connection thread, not the pool process's main thread: every thread counts.
    assert "celery_zklock.zk.handler: " in by_process[ran[0]]
