"""``python -m benchmarks [--quick]``: the whole benchmark suite on a local stack it starts itself.

Sections (each in its own module, each on a fresh standalone ZooKeeper with the same settings,
all on one Redis; see :mod:`benchmarks.common`):

1. :mod:`benchmarks.recipes` - uncontended acquire+release: floor, our recipes, kazoo, redis-py;
2. :mod:`benchmarks.contention` - 8 and 32 processes on one key, ours vs kazoo's Lock;
3. :mod:`benchmarks.herd` - notifications per release with 100/500/1,000 waiters, ours vs naive;
4. :mod:`benchmarks.celery_fleet` - task throughput, worker CPU and span per task on a real
   worker, ZooKeeper pinned to one CPU and the worker with Redis to the other;
5. :mod:`benchmarks.scale` - 100,000 distinct keys, znodes left, ZooKeeper memory;
6. :mod:`benchmarks.enqueue` - what ``apply_async`` costs the caller with enqueue-time dedupe,
   ours vs plain, celery-singleton and celery-once (no worker);
7. :mod:`benchmarks.task_layer` - the CPU a locked task call adds over the recipe's own cycle,
   in one process, ZooKeeper pinned to one CPU and the caller to the other;
8. :mod:`benchmarks.gate` - unrelated tasks' latency behind a hot key of ``wait`` tasks, the
   worker's gate on and off (the load test's hot-key scenario, a stack of its own per run);
9. :mod:`benchmarks.sizing` - the figures of ``docs/sizing.md`` on a 3-member ensemble of its
   own: requests per locked task, the lease clock's traffic, lock cycles per second against a
   bare create+delete, ZooKeeper's CPU per idle and per holding session.

It writes ``benchmarks/results/latest.json`` (every figure, every repetition, the machine) and
``benchmarks/results/latest.md`` (the tables, the targets first), and prints the Markdown. A
section that fails is reported as failed and the others still run; the exit status is then 1.
``--quick`` runs every section with small sizes (under two minutes) to check the suite works;
``--sections enqueue`` (any comma-separated subset) runs only those sections.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from dataclasses import asdict, dataclass, replace
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import redis

from benchmarks import (
    celery_fleet,
    contention,
    enqueue,
    gate,
    herd,
    recipes,
    scale,
    sizing,
    task_layer,
    variants,
)
from benchmarks.common import (
    MIN_REPEATS,
    ZK_SETTINGS,
    ZK_SETTINGS_OF_SECTION,
    machine_info,
    progress,
    redis_server,
    zookeeper,
)
from benchmarks.report import render_markdown, targets
from celery_zklock.zk.validate import argument, positive_int

#: Sections that start their own ZooKeeper (and get None for the section's server).
OWN_STACK = frozenset({"gate", "sizing"})
RESULTS = Path(__file__).resolve().parent / "results"
SECTIONS = (
    "recipes",
    "contention",
    "herd",
    "celery",
    "scale",
    "enqueue",
    "tasklayer",
    "gate",
    "sizing",
)


@dataclass(frozen=True)
class Sizes:
    """How big each section runs."""

    repeats: int = 5
    recipe_iterations: int = 300
    recipe_warmup: int = 150
    contention_processes: tuple[int, ...] = (8, 32)
    contention_seconds: float = 5.0
    herd_waiters: tuple[int, ...] = (100, 500, 1000)
    herd_releases: int = 10
    herd_processes: int = 8
    celery_batch: int = 1000
    celery_warmup: int = 100
    scale_keys: int = 100_000
    scale_processes: int = 8
    enqueue_calls: int = 1000
    enqueue_warmup: int = 100
    task_layer_calls: int = 2000
    task_layer_warmup: int = 300
    gate_tasks: int = 8
    gate_unrelated: int = 20
    gate_hold_ms: int = 1000
    sizing_calls: int = 200
    sizing_warmup: int = 50
    sizing_window_s: float = 10.0
    sizing_cpu_window_s: float = 20.0
    sizing_cycle_processes: tuple[int, ...] = (1, 8)
    sizing_cycle_seconds: float = 5.0
    sizing_sessions: int = 300
    sizing_session_processes: int = 4


FULL = Sizes()
QUICK = Sizes(
    recipe_iterations=30,
    recipe_warmup=10,
    contention_processes=(4, 8),
    contention_seconds=0.5,
    herd_waiters=(20, 50),
    herd_releases=5,
    herd_processes=2,
    celery_batch=50,
    celery_warmup=10,
    scale_keys=1000,
    scale_processes=4,
    enqueue_calls=50,
    enqueue_warmup=10,
    task_layer_calls=100,
    task_layer_warmup=20,
    gate_tasks=4,
    gate_unrelated=10,
    gate_hold_ms=300,
    sizing_calls=20,
    sizing_warmup=5,
    sizing_window_s=3.0,
    sizing_cpu_window_s=3.0,
    sizing_cycle_processes=(2,),
    sizing_cycle_seconds=1.0,
    sizing_sessions=40,
    sizing_session_processes=2,
)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks",
        description="Side-by-side benchmarks of celery-zklock on a local ZooKeeper and Redis "
        "started for the run: recipes, contention, herd, Celery task throughput, scale, "
        "apply_async with enqueue-time dedupe, the task layer, the gate on and off, sizing "
        "figures on a 3-member ensemble.",
    )
    parser.add_argument(
        "--quick", action="store_true", help="small sizes, under two minutes (a smoke run)"
    )
    parser.add_argument(
        "--sections",
        default=",".join(SECTIONS),
        help=f"comma-separated subset of {','.join(SECTIONS)} (default: all)",
    )
    parser.add_argument(
        "--repeats",
        type=argument(positive_int),
        default=None,
        help=f"repetitions per figure, at least {MIN_REPEATS} (default 5)",
    )
    parser.add_argument(
        "--scale-keys",
        type=argument(positive_int),
        default=None,
        help="distinct keys in the scale section",
    )
    parser.add_argument(
        "--contenders",
        default="",
        help="comma-separated extra contenders for sections celery and tasklayer, timed "
        "beside the normal configuration: "
        + ", ".join(f"{name} ({what})" for name, what in variants.VARIANTS.items())
        + " (default: none)",
    )
    parser.add_argument(
        "--json", type=Path, default=RESULTS / "latest.json", help="where to write the JSON"
    )
    parser.add_argument(
        "--md", type=Path, default=RESULTS / "latest.md", help="where to write the Markdown"
    )
    args = parser.parse_args(argv)
    chosen = [s.strip() for s in args.sections.split(",") if s.strip()]
    unknown = sorted(set(chosen) - set(SECTIONS))
    if unknown or not chosen:
        parser.error(f"--sections: unknown {unknown}; choose from {', '.join(SECTIONS)}")
    args.sections = [s for s in SECTIONS if s in chosen]
    try:
        args.contenders = variants.check(
            [c.strip() for c in args.contenders.split(",") if c.strip()]
        )
    except ValueError as exc:
        parser.error(f"--contenders: {exc}")
    if args.repeats is not None and args.repeats < MIN_REPEATS:
        parser.error(f"--repeats must be at least {MIN_REPEATS} (medians over repetitions)")
    return args


def _sizes(args: argparse.Namespace) -> Sizes:
    sizes = QUICK if args.quick else FULL
    if args.repeats is not None:
        sizes = replace(sizes, repeats=args.repeats)
    if args.scale_keys is not None:
        sizes = replace(sizes, scale_keys=args.scale_keys)
    return sizes


def _run_sections(
    names: Sequence[str],
    sizes: Sizes,
    redis_url: str,
    sections: dict[str, Any],
    variant_names: Sequence[str] = (),
) -> None:
    runners: dict[str, Callable[[Any], dict[str, Any]]] = {
        "recipes": lambda zk: recipes.run_section(
            zk.hosts,
            redis_url,
            iterations=sizes.recipe_iterations,
            repeats=sizes.repeats,
            warmup=sizes.recipe_warmup,
            progress=progress,
        ),
        "contention": lambda zk: contention.run_section(
            zk,
            process_counts=sizes.contention_processes,
            duration=sizes.contention_seconds,
            repeats=sizes.repeats,
            progress=progress,
        ),
        "herd": lambda zk: herd.run_section(
            zk,
            waiter_counts=sizes.herd_waiters,
            releases=sizes.herd_releases,
            repeats=sizes.repeats,
            processes=sizes.herd_processes,
            progress=progress,
        ),
        "celery": lambda zk: celery_fleet.run_section(
            zk,
            redis_url,
            batch=sizes.celery_batch,
            warmup=sizes.celery_warmup,
            repeats=sizes.repeats,
            progress=progress,
            variant_names=variant_names,
        ),
        "scale": lambda zk: scale.run_section(
            zk, keys=sizes.scale_keys, processes=sizes.scale_processes, progress=progress
        ),
        "enqueue": lambda zk: enqueue.run_section(
            zk,
            redis_url,
            calls=sizes.enqueue_calls,
            warmup=sizes.enqueue_warmup,
            repeats=sizes.repeats,
            progress=progress,
        ),
        "tasklayer": lambda zk: task_layer.run_section(
            zk,
            calls=sizes.task_layer_calls,
            warmup=sizes.task_layer_warmup,
            repeats=sizes.repeats,
            progress=progress,
            variant_names=variant_names,
        ),
        "gate": lambda zk: gate.run_section(
            tasks=sizes.gate_tasks,
            unrelated=sizes.gate_unrelated,
            hold_ms=sizes.gate_hold_ms,
            repeats=sizes.repeats,
            progress=progress,
        ),
        "sizing": lambda zk: sizing.run_section(
            calls=sizes.sizing_calls,
            warmup=sizes.sizing_warmup,
            window_s=sizes.sizing_window_s,
            cpu_window_s=sizes.sizing_cpu_window_s,
            cycle_processes=sizes.sizing_cycle_processes,
            cycle_seconds=sizes.sizing_cycle_seconds,
            sessions=sizes.sizing_sessions,
            session_processes=sizes.sizing_session_processes,
            repeats=sizes.repeats,
            progress=progress,
        ),
    }
    for name in names:
        progress(f"=== section {name}")
        started = time.monotonic()
        try:
            # gate and sizing start stacks of their own: no idle standalone server beside them.
            with nullcontext() if name in OWN_STACK else zookeeper(name) as zk:
                sections[name] = runners[name](zk)
        except Exception:
            text = traceback.format_exc()
            progress(f"section {name} FAILED:\n{text}")
            sections[name] = {"error": text}
        sections[name]["wall_s"] = time.monotonic() - started
        progress(f"=== section {name} took {sections[name]['wall_s']:.0f} s")


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    sizes = _sizes(args)
    started = time.monotonic()
    started_at = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    command = "python -m benchmarks" + (" " + shlex.join(sys.argv[1:]) if sys.argv[1:] else "")
    sections: dict[str, Any] = {}
    with redis_server() as red:
        client = redis.Redis.from_url(red.url)
        redis_version = str(client.info("server").get("redis_version"))
        client.close()
        with zookeeper() as zk:
            machine = machine_info(zk.port, redis_version)
        _run_sections(args.sections, sizes, red.url, sections, args.contenders)
    report: dict[str, Any] = {
        "benchmark": "celery-zklock",
        "command": command,
        "mode": "quick" if args.quick else "full",
        "started_at": started_at,
        "wall_s": time.monotonic() - started,
        "machine": machine,
        "zookeeper_settings": ZK_SETTINGS,
        "zookeeper_settings_of_section": ZK_SETTINGS_OF_SECTION,
        "sizes": asdict(sizes),
        **({"contenders": list(args.contenders)} if args.contenders else {}),
        "sections": sections,
        "targets": targets(sections, quick=args.quick),
    }
    markdown = render_markdown(report)
    for path in (args.json, args.md):
        path.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    args.md.write_text(markdown, encoding="utf-8")
    print(markdown)
    print(f"written: {args.json}, {args.md} (wall {report['wall_s'] / 60:.1f} min)")
    failed = [name for name, section in sections.items() if "error" in section]
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
