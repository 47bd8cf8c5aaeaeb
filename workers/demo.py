"""The local end-to-end demo: real ZooKeeper, Redis and workers, locked tasks, a checked report.

``python -m workers.demo`` (and ``celery-zklock demo`` once registered, see :data:`COMMAND`):

1. starts a standalone ZooKeeper and a Redis of our own on free ports (``celery_zklock.testing``);
2. starts two workers with ``python -m workers`` (the compose entry point): prefork with 2
   processes and threads with 4, and waits (with a deadline) until both answer a ping;
3. sends a burst of tasks over a few keys, a seeded mix of exclusive sections that skip when busy,
   exclusive sections that wait, and shared sections that wait;
4. waits (with a deadline) for every result, reads the section records and the fence back from
   Redis, checks them (:func:`workers.record.check_sections`), counts the znodes left under the
   lock root (waiting for the server to reap empty lock parents), and prints a report ending with
   one line (wrapped here)::

       zklock-report: tasks=N ran=R skipped=S failed=F lost=L violations=V
           stale_writes_accepted=W leftover_nodes=K

Exit status 0 only if ``lost``, ``violations``, ``stale_writes_accepted`` and ``leftover_nodes``
are all 0; 1 otherwise, and also when the stack or a worker could not start. Every process it
started (servers, workers and their pool children) is stopped before it returns, whatever
happened: SIGTERM, then SIGKILL after a grace period.

Counting: ``ran`` = SUCCESS with a body that ran; ``skipped`` = SUCCESS with a skip result;
``failed`` = FAILURE or REVOKED (reasons listed); ``lost`` = no final state before the deadline,
or reported as ran without a complete section record. ``violations`` = sections entered while a
conflicting section was inside, plus records that contradict the protocol.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import random
import signal
import socket
import statistics
import sys
import tempfile
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Final, TextIO

import redis
from celery import Celery
from celery.states import READY_STATES
from kazoo.client import KazooClient
from kazoo.exceptions import NoNodeError

from celery_zklock import is_skipped
from celery_zklock.cli import Subcommand
from celery_zklock.testing import RedisServer, StackError, ZooKeeperServer
from celery_zklock.testing.processes import ChildProcess, make_temp_dir, remove_temp_dir, tail
from workers.__main__ import worker_command
from workers.app import create_app
from workers.record import (
    FencedResource,
    FenceStats,
    Mode,
    SectionRecorder,
    SectionReport,
    check_sections,
)
from workers.settings import Settings
from workers.tasks import RECORD_URL_SETTING, TASK_FOR_MODE, fence_namespace

__all__ = [
    "COMMAND",
    "DemoConfig",
    "DemoReport",
    "TaskTally",
    "WorkItem",
    "Worker",
    "main",
    "plan_workload",
    "run_demo",
    "stop_workers",
    "tally_results",
    "wait_for_workers",
]

REPO_ROOT: Final = Path(__file__).resolve().parent.parent
LOCK_ROOT: Final = "/zklock"
WORKER_STOP_GRACE: Final = 10.0
POLL_INTERVAL: Final = 0.05
# (mode, on_busy) of each kind of work item, and its share of the workload.
WORK_MIX: Final[tuple[tuple[Mode, str, float], ...]] = (
    ("exclusive", "wait", 0.4),
    ("exclusive", "skip", 0.3),
    ("shared", "wait", 0.3),
)


@dataclass(frozen=True)
class DemoConfig:
    """The demo's knobs (the command-line options)."""

    tasks: int = 40
    keys: int = 4
    hold_ms: int = 150
    seed: int = 0
    result_timeout: float = 120.0
    wait_timeout: float = 30.0
    start_timeout: float = 60.0
    reap_timeout: float = 15.0
    prefork_concurrency: int = 2
    threads_concurrency: int = 4
    session_timeout: float = 10.0
    keep_logs: bool = False


@dataclass(frozen=True)
class WorkItem:
    """One task to send: which side of the lock, what to do when busy, which key, how long."""

    mode: Mode
    on_busy: str
    key: str
    hold_ms: int


def plan_workload(config: DemoConfig) -> list[WorkItem]:
    """``config.tasks`` items over ``config.keys`` keys, in the proportions of :data:`WORK_MIX`.

    Deterministic for a seed: the kinds are dealt by proportion (rounded, every kind at least
    once when there are enough tasks), then shuffled; hold times vary by +-50%.
    """
    rng = random.Random(config.seed)
    counts = [max(1, round(config.tasks * share)) for _, _, share in WORK_MIX]
    while sum(counts) > config.tasks:
        counts[counts.index(max(counts))] -= 1
    counts[0] += config.tasks - sum(counts)
    kinds = [
        (mode, on_busy)
        for (mode, on_busy, _), n in zip(WORK_MIX, counts, strict=True)
        for _ in range(n)
    ]
    rng.shuffle(kinds)
    return [
        WorkItem(
            mode=mode,
            on_busy=on_busy,
            key=f"key-{rng.randrange(config.keys)}",
            hold_ms=max(1, round(config.hold_ms * rng.uniform(0.5, 1.5))),
        )
        for mode, on_busy in kinds
    ]


# ------------------------------------------------------------------------------------ results


@dataclass
class TaskTally:
    """Final states of the sent tasks."""

    sent: int = 0
    ran: set[str] = field(default_factory=set)
    skipped: set[str] = field(default_factory=set)
    failed: Counter[str] = field(default_factory=Counter)
    unfinished: set[str] = field(default_factory=set)


def tally_results(states: dict[str, tuple[str, Any]]) -> TaskTally:
    """Classify ``{task_id: (state, result)}``; results of unfinished tasks are ignored."""
    tally = TaskTally(sent=len(states))
    for task_id, (state, result) in states.items():
        if state == "SUCCESS":
            (tally.skipped if is_skipped(result) else tally.ran).add(task_id)
        elif state in ("FAILURE", "REVOKED"):
            reason = type(result).__name__ if isinstance(result, BaseException) else state
            tally.failed[reason] += 1
        else:
            tally.unfinished.add(task_id)
    return tally


@dataclass(frozen=True)
class DemoReport:
    """Everything the demo measured, and how to read it."""

    tally: TaskTally
    sections: SectionReport
    fence: FenceStats
    leftover_nodes: int
    timings: dict[str, float] = field(default_factory=dict)

    @property
    def lost(self) -> int:
        """Unfinished tasks, plus tasks reported as ran without a complete section record."""
        return len(self.tally.unfinished) + len(self.tally.ran - self.sections.closed_task_ids)

    @property
    def violations(self) -> int:
        return self.sections.violations + len(self.sections.malformed)

    @property
    def stale_writes_accepted(self) -> int:
        return len(self.sections.stale_writes_accepted)

    @property
    def ok(self) -> bool:
        return not (self.lost or self.violations or self.stale_writes_accepted) and (
            self.leftover_nodes == 0
        )

    def report_line(self) -> str:
        t = self.tally
        return (
            f"zklock-report: tasks={t.sent} ran={len(t.ran)} skipped={len(t.skipped)} "
            f"failed={sum(t.failed.values())} lost={self.lost} violations={self.violations} "
            f"stale_writes_accepted={self.stale_writes_accepted} "
            f"leftover_nodes={self.leftover_nodes}"
        )

    def summary(self) -> list[str]:
        """The human part of the report (without the final report line)."""
        t, s = self.tally, self.sections
        failed = ", ".join(f"{reason} {n}" for reason, n in t.failed.most_common()) or "none"
        lines = [
            f"tasks: sent {t.sent}, ran {len(t.ran)}, skipped (busy) {len(t.skipped)}, "
            f"failed {sum(t.failed.values())} ({failed}), lost {self.lost}",
            "per key (from the enter/exit records, in Redis' order):",
        ]
        for key in sorted(s.keys):
            k = s.keys[key]
            overlaps = sum(1 for o in s.overlaps if o.key == key)
            lines.append(
                f"  {key}: {k.sections} sections ({k.exclusive_sections} exclusive, "
                f"{k.shared_sections} shared); max simultaneous exclusive holders "
                f"{k.max_exclusive}, shared holders {k.max_shared}; overlaps {overlaps}"
            )
        for overlap in s.overlaps[:10]:
            inside = ", ".join(f"{holder} ({mode})" for holder, mode in overlap.inside)
            lines.append(
                f"  VIOLATION at record #{overlap.position}: {overlap.entering} "
                f"({overlap.entering_mode}) entered {overlap.key} while inside: {inside}"
            )
        lines += [f"  MALFORMED: {problem}" for problem in s.malformed[:10]]
        refused = s.writes_refused
        lines.append(
            f"fenced writes: accepted {s.writes_accepted}, refused {sum(refused.values())} "
            f"(exclusive {refused['exclusive']}, shared {refused['shared']}); the fence itself "
            f"counted {self.fence.accepted} accepted, {self.fence.refused} refused; "
            f"stale writes accepted {self.stale_writes_accepted}"
        )
        if refused["shared"]:
            lines.append(
                "  (shared holders overlap by design: a reader whose token is lower than a "
                "concurrent reader's is refused once that reader wrote)"
            )
        if s.hold_seconds:
            holds = sorted(s.hold_seconds)
            lines.append(
                f"hold time: median {statistics.median(holds) * 1000:.0f} ms, "
                f"max {holds[-1] * 1000:.0f} ms over {len(holds)} sections"
            )
        lines.append(f"znodes left under {LOCK_ROOT}: {self.leftover_nodes}")
        if self.timings:
            lines.append(
                "timing: " + ", ".join(f"{name} {sec:.2f} s" for name, sec in self.timings.items())
            )
        if self.timings.get("tasks"):
            lines.append(f"throughput: {t.sent / self.timings['tasks']:.1f} tasks/s")
        return lines


# ------------------------------------------------------------------------------------ workers


class Worker:
    """A ``python -m workers`` subprocess with its own log; stops its whole process group.

    Its node name is ``<label>-<run_id>@<host>``; ``extra`` goes to ``celery worker``.
    """

    def __init__(
        self,
        label: str,
        settings: Settings,
        run_id: str,
        log_dir: Path,
        extra: Sequence[str] = (),
    ) -> None:
        self.label = label
        self.node_prefix = f"{label}-{run_id}@"
        env = {**os.environ, **settings.to_env()}
        self.child = ChildProcess(
            f"worker {label}",
            worker_command(["-n", f"{self.node_prefix}%h", *extra]),
            log_path=log_dir / f"worker-{label}.log",
            cwd=REPO_ROOT,
            env=env,
        )
        self.pool = settings.pool
        self.concurrency = settings.concurrency

    def start(self) -> None:
        self.child.start()

    def log_tail(self) -> str:
        """The last lines of the worker's log."""
        return tail(self.child.log_path, 30)

    def request_stop(self) -> None:
        """Ask for a warm shutdown (SIGTERM) without waiting."""
        self.child.send_signal(signal.SIGTERM)

    def stop(self, grace: float = WORKER_STOP_GRACE) -> None:
        """SIGTERM (warm shutdown), SIGKILL after ``grace`` s; then kill the rest of its group.

        Returns once the worker is gone; a prefork worker's pool children go with its group.
        """
        pgid = self.child.pid  # the worker leads its own session and process group
        try:
            self.child.stop(grace=grace)
        finally:
            if pgid is not None:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(pgid, signal.SIGKILL)


def stop_workers(workers: Sequence[Worker], grace: float = WORKER_STOP_GRACE) -> None:
    """Stop every worker, all within one ``grace`` period (warm shutdowns run in parallel)."""
    for worker in workers:
        worker.request_stop()
    deadline = time.monotonic() + grace
    errors: list[Exception] = []
    for worker in workers:
        try:
            worker.stop(grace=max(0.0, deadline - time.monotonic()))
        except Exception as exc:  # stop the others anyway, then report
            errors.append(exc)
    if errors:
        raise errors[0]


def wait_for_workers(app: Celery, workers: Sequence[Worker], timeout: float) -> None:
    """Return once every worker answered a ping; raise StackError if one exits or time runs out."""
    deadline = time.monotonic() + timeout
    missing = list(workers)
    while missing:
        for worker in missing:
            if not worker.child.is_running():
                raise StackError(
                    f"worker {worker.label} exited with status {worker.child.returncode} while "
                    f"starting:\n{worker.log_tail()}"
                )
        replies = app.control.ping(timeout=0.5)
        answered = {name for reply in replies for name in reply}
        missing = [w for w in missing if not any(n.startswith(w.node_prefix) for n in answered)]
        if missing and time.monotonic() >= deadline:
            tails = "\n".join(f"--- {w.label} ---\n{w.log_tail()}" for w in missing)
            raise StackError(f"workers did not answer a ping within {timeout:.0f} s:\n{tails}")


# --------------------------------------------------------------------------------------- stack


@contextlib.contextmanager
def _local_stack(timeout: float) -> Iterator[tuple[ZooKeeperServer, RedisServer]]:
    zookeeper, redis_server = ZooKeeperServer(), RedisServer()
    try:
        zookeeper.start(timeout=timeout)
        redis_server.start(timeout=timeout)
        yield zookeeper, redis_server
    finally:
        try:
            redis_server.stop()
        finally:
            zookeeper.stop()


def _count_nodes(client: KazooClient, path: str) -> int:
    """Znodes strictly below ``path`` (0 if it does not exist)."""
    try:
        children = client.get_children(path)
    except NoNodeError:
        return 0
    return sum(1 + _count_nodes(client, f"{path.rstrip('/')}/{child}") for child in children)


def _leftover_nodes(hosts: str, root: str, timeout: float) -> int:
    """Znodes under ``root``, once the server reaped empty lock parents, or at the deadline."""
    client = KazooClient(hosts=hosts)
    client.start(timeout=15)
    try:
        deadline = time.monotonic() + timeout
        while True:
            count = _count_nodes(client, root)
            if count == 0 or time.monotonic() >= deadline:
                return count
            time.sleep(POLL_INTERVAL)
    finally:
        client.stop()
        client.close()


def _collect(
    app: Celery, task_ids: Sequence[str], timeout: float, workers: Sequence[Worker]
) -> dict[str, tuple[str, Any]]:
    """Poll until every result is final or ``timeout`` passes; ``{task_id: (state, result)}``.

    Stops early if every worker has exited (nothing can finish any more). Unfinished tasks
    map to their last state and None.
    """
    final: dict[str, tuple[str, Any]] = {}
    pending = {task_id: "PENDING" for task_id in task_ids}
    deadline = time.monotonic() + timeout
    while pending:
        for task_id in list(pending):
            result = app.AsyncResult(task_id)
            state = result.state
            if state in READY_STATES:
                final[task_id] = (state, result.result)
                del pending[task_id]
            else:
                pending[task_id] = state
        if not pending or time.monotonic() >= deadline:
            break
        if not any(w.child.is_running() for w in workers):
            break
        time.sleep(POLL_INTERVAL)
    final.update({task_id: (state, None) for task_id, state in pending.items()})
    return final


def _send(app: Celery, run_id: str, item: WorkItem, wait_timeout: float) -> str:
    """Send one work item; return its task id.

    Only the id leaves this function: the AsyncResult is dropped here, while the broker still
    runs (its destructor unsubscribes from the result channel).
    """
    result = app.tasks[TASK_FOR_MODE[item.mode]].apply_async(
        (run_id, item.key, item.hold_ms),
        zklock={"on_busy": item.on_busy, "timeout": wait_timeout},
    )
    return str(result.id)


# ----------------------------------------------------------------------------------------- run


def run_demo(config: DemoConfig, out: TextIO | None = None) -> int:
    """Run the demo with ``config``, printing to ``out`` (default: the current ``sys.stdout``);
    return the exit status."""

    def say(line: str = "") -> None:
        print(line, file=out or sys.stdout, flush=True)

    run_id = uuid.uuid4().hex[:12]
    began = time.monotonic()
    timings: dict[str, float] = {}
    say(f"celery-zklock demo, run {run_id}")
    try:
        with contextlib.ExitStack() as cleanup:  # undone in reverse: workers, stack, logs
            log_dir = _log_dir(config.keep_logs, cleanup, say)
            zookeeper, redis_server = cleanup.enter_context(_local_stack(config.start_timeout))
            timings["stack start"] = time.monotonic() - began
            say(f"stack: ZooKeeper {zookeeper.hosts} (standalone), Redis {redis_server.url}")
            base = Settings(
                zk_hosts=zookeeper.hosts,
                broker_url=redis_server.url,
                result_backend=redis_server.url,
                record_url=redis_server.url,
                session_timeout=config.session_timeout,
                zk_root=LOCK_ROOT,
            )
            app = create_app(base, main="workers-demo")
            cleanup.callback(app.close)
            started = time.monotonic()
            workers = [
                Worker(pool, replace(base, pool=pool, concurrency=concurrency), run_id, log_dir)
                for pool, concurrency in (
                    ("prefork", config.prefork_concurrency),
                    ("threads", config.threads_concurrency),
                )
            ]
            cleanup.callback(stop_workers, workers)
            for worker in workers:
                worker.start()
            wait_for_workers(app, workers, config.start_timeout)
            timings["workers ready"] = time.monotonic() - started
            say(
                "workers: "
                + ", ".join(
                    f"{w.node_prefix}{socket.gethostname()} ({w.pool} x{w.concurrency}, "
                    f"pid {w.child.pid})"
                    for w in workers
                )
            )
            report = _run_workload(app, config, run_id, workers, zookeeper.hosts, say)
            timings.update(report.timings)
            timings["total before shutdown"] = time.monotonic() - began
            report = replace(report, timings=timings)
            for line in report.summary():
                say(line)
            say(report.report_line())
            return 0 if report.ok else 1
    except StackError as exc:
        say(f"celery-zklock demo: could not run: {exc}")
        return 1


def _log_dir(keep: bool, cleanup: contextlib.ExitStack, say: Callable[[str], None]) -> Path:
    """A directory for the worker logs, removed at the end unless ``keep``."""
    if keep:
        # Not made with make_temp_dir: that one is removed by the stack's exit-time cleanup.
        kept = Path(tempfile.mkdtemp(prefix="zklock-demo-"))
        say(f"worker logs (kept): {kept}")
        return kept
    directory = make_temp_dir("zklock-demo-")
    cleanup.callback(remove_temp_dir, directory)
    return directory


def _run_workload(
    app: Celery,
    config: DemoConfig,
    run_id: str,
    workers: Sequence[Worker],
    zk_hosts: str,
    say: Callable[[str], None],
) -> DemoReport:
    """Send the planned tasks, wait for them, and check what they left behind."""
    plan = plan_workload(config)
    mix = Counter(f"{item.mode}/{item.on_busy}" for item in plan)
    say(
        f"workload: {len(plan)} tasks over {config.keys} keys ("
        + ", ".join(f"{kind} {n}" for kind, n in sorted(mix.items()))
        + f"), hold {config.hold_ms} ms +-50%"
    )
    started = time.monotonic()
    task_ids = [_send(app, run_id, item, config.wait_timeout) for item in plan]
    states = _collect(app, task_ids, config.result_timeout, workers)
    elapsed = time.monotonic() - started
    client = redis.Redis.from_url(app.conf[RECORD_URL_SETTING])
    try:
        sections = check_sections(SectionRecorder(client, run_id).events())
        fence = FencedResource(client, fence_namespace(run_id)).stats()
    finally:
        client.close()
    reaping = time.monotonic()
    leftovers = _leftover_nodes(zk_hosts, LOCK_ROOT, config.reap_timeout)
    timings = {"tasks": elapsed, "lock parents reaped": time.monotonic() - reaping}
    return DemoReport(tally_results(states), sections, fence, leftovers, timings)


# ------------------------------------------------------------------------------ command line


def configure_parser(parser: argparse.ArgumentParser) -> None:
    """Add the demo's options to ``parser``."""
    defaults = DemoConfig()
    add = parser.add_argument
    add("--tasks", type=_positive_int, default=defaults.tasks, help="tasks to send (40)")
    add("--keys", type=_positive_int, default=defaults.keys, help="distinct lock keys (4)")
    add("--hold-ms", type=_positive_int, default=defaults.hold_ms, help="hold time, ms (150)")
    add("--seed", type=int, default=defaults.seed, help="workload seed (0)")
    add(
        "--timeout",
        type=float,
        default=defaults.result_timeout,
        help="seconds to wait for all results (120)",
    )
    add(
        "--prefork-concurrency",
        type=_positive_int,
        default=defaults.prefork_concurrency,
        help="processes of the prefork worker (2)",
    )
    add(
        "--threads-concurrency",
        type=_positive_int,
        default=defaults.threads_concurrency,
        help="threads of the threads worker (4)",
    )
    add("--keep-logs", action="store_true", help="keep the worker logs and print where they are")


def config_from_args(args: argparse.Namespace) -> DemoConfig:
    return DemoConfig(
        tasks=args.tasks,
        keys=args.keys,
        hold_ms=args.hold_ms,
        seed=args.seed,
        result_timeout=args.timeout,
        prefork_concurrency=args.prefork_concurrency,
        threads_concurrency=args.threads_concurrency,
        keep_logs=args.keep_logs,
    )


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def main(argv: list[str] | None = None) -> int:
    """``python -m workers.demo [options]``; returns the exit status."""
    parser = argparse.ArgumentParser(prog="python -m workers.demo", description=_HELP)
    configure_parser(parser)
    config = config_from_args(parser.parse_args(argv))
    try:
        return run_demo(config)
    except KeyboardInterrupt:
        print("celery-zklock demo: interrupted; every process it started is stopped")
        return 130


_HELP: Final = (
    "Run locked tasks on two real workers over a local ZooKeeper and Redis, check mutual "
    "exclusion and fencing from the records, and print a report."
)

COMMAND: Final = Subcommand(
    name="demo",
    help=_HELP,
    configure=configure_parser,
    run=lambda args: run_demo(config_from_args(args)),
)
"""``celery-zklock demo``: add ``"workers.demo"`` to ``celery_zklock.cli.SUBCOMMAND_MODULES``."""


if __name__ == "__main__":
    sys.exit(main())
