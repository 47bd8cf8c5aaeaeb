"""Section 4 of ``python -m benchmarks``: no-op task throughput on one real worker, plain vs
ZkLockTask vs celery-singleton and celery-once.

Each contender sends batches of tasks with distinct keys (no lock is ever busy) to the same
worker and waits for every result. Method: ``docs/benchmarks.md``, section 4.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from celery import Celery
from celery.result import ResultSet

from benchmarks.celery_app import (
    ONCE,
    PLAIN,
    SINGLETON,
    UNAVAILABLE,
    ZKLOCK_SKIP,
    ZKLOCK_WAIT,
    create_app,
)
from benchmarks.common import Progress, median, ratio, rotated
from celery_zklock import is_skipped
from celery_zklock.testing.celery_worker import CeleryWorker, celery_command
from celery_zklock.testing.processes import make_temp_dir, remove_temp_dir
from workers.settings import Settings

REPO_ROOT = Path(__file__).resolve().parent.parent
#: (label in the report, task name, package it comes from).
CONTENDERS: tuple[tuple[str, str, str], ...] = (
    ("plain", PLAIN, "celery"),
    ("zklock-skip", ZKLOCK_SKIP, "celery-zklock"),
    ("zklock-wait", ZKLOCK_WAIT, "celery-zklock"),
    ("celery-singleton", SINGLETON, "celery-singleton"),
    ("celery-once", ONCE, "celery-once"),
)
POOL = "prefork"
CONCURRENCY = 4
WORKER_READY_TIMEOUT_S = 120.0
#: The ZkLockTask no-op should reach this share of the plain task's throughput.
TARGET_VS_PLAIN = 0.85


class BatchFailed(RuntimeError):
    pass


def _batch(app: Celery, name: str, tag: str, count: int, timeout: float) -> dict[str, Any]:
    task = app.tasks[name]
    started = time.monotonic()
    results = [task.apply_async((f"{tag}-{i}",)) for i in range(count)]
    sent = time.monotonic()
    values = ResultSet(results, app=app).join_native(timeout=timeout, propagate=False)
    done = time.monotonic()
    failures = [v for v in values if isinstance(v, BaseException)]
    skipped = sum(1 for v in values if is_skipped(v))
    if failures:
        raise BatchFailed(f"{len(failures)} of {count} {name} tasks failed, e.g. {failures[0]!r}")
    return {
        "tasks": count,
        "send_s": sent - started,
        "seconds": done - started,
        "tasks_per_s": count / (done - started),
        "skipped": skipped,
    }


def _start_worker(settings: Settings, log_dir: Path) -> CeleryWorker:
    worker = CeleryWorker(
        celery_command("benchmarks.celery_app:app", POOL, CONCURRENCY, loglevel="warning"),
        nodename=f"bench-{uuid.uuid4().hex[:8]}@%h",
        log_path=log_dir / "worker.log",
        cwd=REPO_ROOT,
        env=settings.to_env(),
    )
    worker.spawn()
    return worker


def run_section(
    zk_hosts: str,
    redis_url: str,
    *,
    batch: int,
    warmup: int,
    repeats: int,
    progress: Progress,
) -> dict[str, Any]:
    """Section 4: one worker, every contender, ``repeats`` batches each."""
    settings = Settings(
        zk_hosts=zk_hosts,
        broker_url=redis_url,
        result_backend=redis_url,
        record_url=redis_url,
        pool=POOL,
        concurrency=CONCURRENCY,
        zk_root="/bench-celery",
    )
    app = create_app(settings)
    log_dir = make_temp_dir("zklock-bench-celery-")
    worker = _start_worker(settings, log_dir)
    status: dict[str, str] = {}
    samples: dict[str, list[dict[str, Any]]] = {}
    try:
        started = time.monotonic()
        try:
            _batch(app, PLAIN, "ready", 1, WORKER_READY_TIMEOUT_S)
        except Exception as exc:
            raise RuntimeError(
                f"the benchmark worker did not run a task within {WORKER_READY_TIMEOUT_S:.0f} s "
                f"({exc!r}); its log:\n{worker.log_tail()}"
            ) from exc
        progress(f"celery: worker ready in {time.monotonic() - started:.1f} s")
        measured: list[tuple[str, str]] = []
        for label, name, package in CONTENDERS:
            if name in UNAVAILABLE or name not in app.tasks:
                status[label] = f"not measured: {UNAVAILABLE.get(name, 'not registered')}"
                continue
            try:
                _batch(app, name, f"{label}-warm", warmup, 120.0)
            except Exception as exc:
                status[label] = f"not measured: {package} failed its warm-up batch: {exc!r}"[:500]
                continue
            status[label] = "ok"
            measured.append((label, name))
            samples[label] = []
        progress(f"celery: warm-up done; measuring {', '.join(label for label, _ in measured)}")
        for rep in range(repeats):
            for label, name in rotated(measured, rep):
                if status[label] != "ok":
                    continue
                try:
                    sample = _batch(app, name, f"{label}-r{rep}", batch, 600.0)
                except Exception as exc:
                    status[label] = f"failed during repetition {rep + 1}: {exc!r}"[:500]
                    continue
                samples[label].append(sample)
            progress(
                f"celery: repetition {rep + 1}/{repeats}: "
                + ", ".join(
                    f"{label} {samples[label][-1]['tasks_per_s']:.0f}/s"
                    for label, _ in measured
                    if samples[label] and len(samples[label]) == rep + 1
                )
            )
    finally:
        worker.stop(grace=10.0)
        remove_temp_dir(log_dir)
        app.close()
    results: dict[str, dict[str, Any]] = {}
    for label, _name, _package in CONTENDERS:
        runs = samples.get(label, [])
        ok = status.get(label) == "ok" and len(runs) == repeats
        results[label] = {
            "status": status.get(label, "not measured"),
            "tasks_per_s": median([r["tasks_per_s"] for r in runs]) if ok else None,
            "skipped": sum(r["skipped"] for r in runs),
            "per_repeat": runs,
        }
    plain = results["plain"]["tasks_per_s"]
    for entry in results.values():
        entry["vs_plain"] = ratio(entry["tasks_per_s"], plain)
    return {
        "config": {
            "batch": batch,
            "warmup": warmup,
            "repeats": repeats,
            "worker": f"1 celery worker, {POOL} pool, concurrency {CONCURRENCY}, fleet settings",
            "keys": "distinct per task (a lock is never busy)",
        },
        "results": results,
    }


def contenders() -> Sequence[str]:
    return [label for label, _, _ in CONTENDERS]
