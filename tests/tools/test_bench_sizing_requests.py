"""Benchmark section 9, part 1 (requests per locked task) run for real, at its smallest: the
gate's stand-in request must be one the real gate takes (it reads ``request.id`` and keys its
sent runs by the request), and the figures the docs quote must come out."""

from __future__ import annotations

from benchmarks.sizing import TASK_KINDS, requests_per_task
from celery_zklock.testing import ZooKeeperEnsemble


def test_requests_per_task_runs_every_case_through_the_real_gate(
    zk_ensemble: ZooKeeperEnsemble,
) -> None:
    figures = requests_per_task(
        zk_ensemble, calls=3, warmup=1, repeats=1, progress=lambda line: None
    )
    results = figures["results"]
    assert set(results) == set(TASK_KINDS)
    # A free key: one create (with its parent) and one delete per call (docs/sizing.md).
    assert results["exclusive"]["client"]["total"]["median"] == 2.0
    # The gate reads the free key's queue once before it lets the call into the pool.
    gate = figures["runs"]["exclusive+gate"][0]["gate"]
    assert gate.get("total", 0.0) >= 1.0
