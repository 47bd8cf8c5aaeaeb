"""Section 8 of ``python -m benchmarks``: what the gate saves unrelated tasks behind a hot key.

The load test's ``hot-key`` scenario (:mod:`workers.loadtest`) in the shape of issue 33: one
prefork worker, concurrency 2, prefetch multiplier 1, ``acks_late`` (the fleet's settings);
``tasks`` exclusive ``wait`` calls on one key, each holding exactly ``hold_ms``, and
``unrelated`` tasks of no lock spread among them, all sent at once. Per repetition one run with
the gate and one without, in an order alternating per repetition, each on a stack of its own
(the load test starts ZooKeeper, both Redis servers and the worker, and checks the run: a run
whose verdict is not clean fails the section). Per run: the unrelated tasks' time from send to
result (``date_done``), p50, p95, p99 and max, and the most messages the gate held at once. The
report gives each as median and spread over repetitions, and the target: p95 at most
:data:`TARGET_P95_S` with the gate. The section's own ZooKeeper is not used.
"""

from __future__ import annotations

import io
import json
import time
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from benchmarks.common import Progress, percentile, rotated, spread
from celery_zklock.testing.processes import make_temp_dir, remove_temp_dir
from workers.loadtest import LoadConfig, run_loadtest

#: Most the unrelated tasks' p95 (send to result) may be with the gate, in seconds (issue 33).
TARGET_P95_S = 2.0
#: Figures per run that the report gives as median and spread.
FIGURES = ("p50_s", "p95_s", "p99_s", "max_s", "held_max", "run_s")
GATES = (("on", True), ("off", False))


def hot_key_config(gate: bool, tasks: int, unrelated: int, hold_ms: int) -> LoadConfig:
    """The load test of one run: the hot-key scenario, every section on the hot key."""
    return LoadConfig(
        scenario="hot-key",
        hot_share=1.0,
        tasks=tasks,
        unrelated=unrelated,
        hold_ms=hold_ms,
        hold_spread=0.0,
        workers=1,
        pools=("prefork",),
        concurrency=2,
        gate=gate,
        progress=False,
        name="bench-gate",
    )


def one_run(config: LoadConfig) -> dict[str, Any]:
    """Run ``config``'s load test; its figures (see the module docstring). Raises
    RuntimeError, with the run's output, if its verdict is not clean or a latency is missing."""
    out_dir = make_temp_dir("zklock-bench-gate-")
    output = io.StringIO()
    try:
        started = time.monotonic()
        status = run_loadtest(replace(config, out_dir=out_dir), out=output, err=output)
        took = time.monotonic() - started
        report = json.loads((out_dir / "report.json").read_text())
    except (OSError, ValueError) as exc:
        raise RuntimeError(f"the load test left no report ({exc}):\n{output.getvalue()}") from exc
    finally:
        remove_temp_dir(out_dir)
    latencies: Sequence[float] = report["unrelated_latency_seconds"]
    if status != 0 or len(latencies) != config.effective_unrelated():
        raise RuntimeError(f"the load test did not end clean:\n{output.getvalue()}")
    return {
        "p50_s": percentile(latencies, 50),
        "p95_s": percentile(latencies, 95),
        "p99_s": percentile(latencies, 99),
        "max_s": max(latencies),
        "held_max": report["gate_held_max"] or 0,
        "run_s": took,
        "report_line": report["report_line"],
    }


def run_section(
    *, tasks: int, unrelated: int, hold_ms: int, repeats: int, progress: Progress
) -> dict[str, Any]:
    """``repeats`` repetitions of one run with the gate and one without; see the module doc."""
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name, _ in GATES}
    for rep in range(repeats):
        for name, gate in rotated(GATES, rep):
            figures = one_run(hot_key_config(gate, tasks, unrelated, hold_ms))
            runs[name].append(figures)
            progress(
                f"gate {name} rep {rep + 1}/{repeats}: unrelated p50 {figures['p50_s']:.3f} s, "
                f"p95 {figures['p95_s']:.3f} s, p99 {figures['p99_s']:.3f} s, "
                f"held at most {figures['held_max']}"
            )
    return {
        "config": {
            "tasks": tasks,
            "unrelated": unrelated,
            "hold_ms": hold_ms,
            "repeats": repeats,
            "worker": "1 prefork worker, concurrency 2, prefetch multiplier 1, acks_late",
        },
        "runs": runs,
        "results": {
            name: {figure: spread([run[figure] for run in runs[name]]) for figure in FIGURES}
            for name in runs
        },
    }
