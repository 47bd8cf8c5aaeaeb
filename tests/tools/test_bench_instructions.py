"""``python -m benchmarks.instructions`` runs its cycles in a child that reaches into section 7's
module (:mod:`benchmarks.task_layer`); the child, run without valgrind against a real ZooKeeper,
still fits that module and makes its calls."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from benchmarks.instructions import CYCLES, child

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("cycle", CYCLES)
def test_the_child_makes_its_calls(cycle: str, zk_hosts: str) -> None:
    command, env = child(ROOT, cycle, 3, zk_hosts)
    done = subprocess.run(
        command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr[-2000:]
