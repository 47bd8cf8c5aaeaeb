"""``python -m workers loadtest``: locked tasks on a worker fleet, with faults, checked.

:func:`run_loadtest` starts a local stack and fleet (or uses an existing one), sends the
workload (:func:`plan_workload`) from one thread and collects final states in another while the
main thread injects faults (:mod:`workers.faults`), then counts leftover znodes, checks the
records (:func:`workers.checker.check_run`), writes the reports and prints the summary; exit
status 0 only if the report is ok. The phases and options in detail: ``docs/fleet.md``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import random
import sys
import tempfile
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Final, TextIO

import redis
from celery import Celery
from celery.backends.base import KeyValueStoreBackend
from kazoo.client import KazooClient
from kazoo.exceptions import NoNodeError

from celery_zklock.locks.rate import RATE_NODE
from celery_zklock.testing import (
    RedisServer,
    StackError,
    ZooKeeperEnsemble,
    ZooKeeperOptions,
    ZooKeeperServer,
)
from celery_zklock.testing.cli import Subcommand
from celery_zklock.testing.processes import make_temp_dir, remove_temp_dir
from celery_zklock.testing.rabbitmq import RabbitMQServer
from celery_zklock.testing.zookeeper import partition_unavailable_reason
from celery_zklock.zk.validate import argument, positive_int, seconds
from workers.app import create_app
from workers.chatter import IN_PROCESS_POOLS
from workers.checker import RunReport, TaskOutcome, check_run
from workers.compose import ComposeProject
from workers.docker_faults import DOCKER_FAULT_KINDS, DockerFaultInjector
from workers.faults import (
    FaultEnvironment,
    FaultInjector,
    describe_plan,
    gate_holdings,
    parse_faults,
    quiet_kazoo_logger,
)
from workers.fleet import Fleet, WorkerSpec
from workers.netns import Namespace, NetnsError, blackhole_unavailable_reason, unavailable_reason
from workers.record import FAULT_KINDS, FaultLog, FaultRecord, Mode, SectionRecorder
from workers.report import write_reports
from workers.settings import POOLS, Settings, is_amqp
from workers.tasks import DEBOUNCED_TASK, PAIR_TASK, TASK_FOR_MODE, UNRELATED_TASK
from workers.whereabouts import whereabouts

__all__ = [
    "COMMAND",
    "HOT_KEY",
    "SCENARIOS",
    "External",
    "LoadConfig",
    "WorkItem",
    "config_from_args",
    "configure_parser",
    "count_nodes",
    "main",
    "plan_workload",
    "run_loadtest",
]

POLL: Final = 0.25
SCENARIOS: Final = ("mixed", "hot-key")
"""``mixed``: the locked tasks spread over ``--keys``; ``hot-key``: a share of them
(``--hot-share``) are exclusive ``wait`` sections on the one key :data:`HOT_KEY`."""
HOT_KEY: Final = "hot"
HELD_LOOK_EVERY: Final = 1.0
"""Seconds between two looks at what the fleet's gates hold (the report's most held at once)."""
RESULT_KEY_PREFIX: Final = str(KeyValueStoreBackend.task_keyprefix)
SEND_ATTEMPTS: Final = 5
"""Times the sender tries to publish one task before it gives up (and stops sending)."""
SEND_RETRY_INTERVAL: Final = 0.5
"""Seconds between two of those tries."""
RESERVE_SHARE: Final = 0.25
"""The last quarter of the plan is a reserve: while faults are still due it keeps sections open
for them to aim at, instead of running out on the schedule."""
RESERVE_IN_FLIGHT: Final = 2
"""Reserve tasks in flight at once while faults are due (not every slot: it must last)."""
RESERVE_HOLD_MS: Final = 2000
"""Least hold of a reserve task sent while faults are due: with the usual few hundred ms the
reserve was spent in a couple of seconds, and the last faults of a slow run found no holder."""
RESERVE_HOLD_SHARE: Final = 0.5
"""Longest hold of a reserve task, as a share of the wait timeout: a reserve task holds as long
as the faults still due need (their seconds left spread over the reserve), but a waiter behind
one must not time out for it."""
DEFAULT_SYNC_LIMIT: Final = 5
# Rough seconds one fault takes (plus the session timeout for the ones that outlast one),
# to size the default duration of a run with faults.
FAULT_SECONDS: Final[Mapping[str, float]] = {
    "kill": 3.0,
    "pause": 2.0,
    "expire": 1.0,
    "leader": 4.0,
    "partition": 2.5,
    "broker_restart": 2.0,
    "blackhole": 4.0,
    "follower_partition": 5.0,
    "stall_before_write": 3.0,
    "kill_held": 6.0,
    "quorum_loss": 6.0,
}
WAITS_FOR_EXPIRY: Final = frozenset(
    {"pause", "partition", "blackhole", "follower_partition", "stall_before_write", "quorum_loss"}
)
NETNS_FAULTS: Final = frozenset({"partition", "blackhole"})
BROKER_KINDS: Final = ("redis", "amqp")
"""``--broker-kind``: the broker of a fleet the run starts itself."""


@dataclass(frozen=True)
class External:
    """An existing fleet to run against (``--zk-hosts``, ``--broker``, ...). ``workers``: how
    many must answer a ping before the run starts; ``slots``: the tasks they run at once.
    ``visibility_timeout``: the workers' (when known). ``compose``: the compose project the
    fleet is, whose faults then go through Docker."""

    zk_hosts: str
    broker: str
    record_url: str
    result_backend: str
    workers: int = 1
    slots: int = 4
    visibility_timeout: float | None = None
    compose: ComposeProject | None = None


@dataclass(frozen=True)
class LoadConfig:
    """A run's knobs; see the module docstring and ``--help``."""

    tasks: int = 200
    keys: int = 8
    shared_ratio: float = 0.3
    skip_ratio: float = 0.3
    rate_ratio: float = 0.0
    rate: str = "5/s"
    preempt_ratio: float = 0.0
    pair_ratio: float = 0.0
    eta_ratio: float = 0.0
    eta_countdown: float = 4.0
    debounce_ratio: float = 0.0
    replace_ratio: float = 0.0
    burst: int = 3
    hold_ms: int = 200
    hold_spread: float = 0.5
    scenario: str = "mixed"
    hot_share: float = 0.5
    hot_hold_ms: int | None = None
    unrelated: int | None = None
    gate: bool = True
    duration: float | None = None
    workers: int = 4
    pools: tuple[str, ...] = ("prefork", "threads")
    concurrency: int = 2
    session_timeout: float = 10.0
    zk_nodes: int = 1
    broker_kind: str = "redis"
    faults: Mapping[str, int] = field(default_factory=dict)
    seed: int = 0
    out_dir: Path | None = None
    wait_timeout: float = 20.0
    visibility_timeout: float | None = None
    result_timeout: float | None = None
    start_timeout: float = 90.0
    netns_workers: int | None = None
    zk_sync_limit: int | None = None
    fault_gap: float = 1.0
    zk_root: str = "/zklock"
    external: External | None = None
    keep_logs: bool = False
    progress: bool | None = None
    name: str = "loadtest"

    def effective_unrelated(self) -> int:
        """Unrelated tasks (no lock) to send: as set, else as many as locked tasks in the
        ``hot-key`` scenario and none in ``mixed``."""
        if self.unrelated is not None:
            return self.unrelated
        return self.tasks if self.scenario == "hot-key" else 0

    def effective_visibility_timeout(self) -> float:
        """The broker's visibility timeout: longer than a task may take (wait, then hold)."""
        if self.visibility_timeout is not None:
            return self.visibility_timeout
        return self.wait_timeout + 3 * max(self.hold_ms, self.hot_hold_ms or 0) / 1000.0 + 10.0

    def effective_result_timeout(self) -> float:
        """Seconds to wait for final states after the last send: enough for a message to be
        redelivered twice (a worker died holding it), unless set."""
        if self.result_timeout is not None:
            return self.result_timeout
        return 2 * self.effective_visibility_timeout() + 20.0

    def effective_duration(self) -> float:
        """Seconds over which the tasks are sent."""
        if self.duration is not None:
            return self.duration
        faults = sum(
            n * (FAULT_SECONDS[kind] + self.fault_gap)
            + n * (self.session_timeout if kind in WAITS_FOR_EXPIRY else 0.0)
            for kind, n in self.faults.items()
        )
        return 1.15 * faults

    def effective_netns_workers(self) -> int:
        if self.netns_workers is not None:
            return self.netns_workers
        return 1 if any(self.faults.get(kind) for kind in NETNS_FAULTS) else 0

    def effective_sync_limit(self) -> int:
        """An ensemble's ``syncLimit`` in ticks: as set, else ZooKeeper's usual 5, or with
        follower partitions planned, enough ticks that a follower cut off from its leader keeps
        serving its clients for twice the session timeout plus 2 s: the leader expires their
        sessions first, as with a production ``syncLimit x tickTime`` longer than the timeout."""
        if self.zk_sync_limit is not None:
            return self.zk_sync_limit
        if not self.faults.get("follower_partition"):
            return DEFAULT_SYNC_LIMIT
        tick = ZooKeeperOptions().tick_time_ms / 1000.0
        return max(DEFAULT_SYNC_LIMIT, math.ceil((2 * self.session_timeout + 2.0) / tick))


@dataclass(frozen=True)
class WorkItem:
    """One task to send: a section (``mode``, ``on_busy``, ``key``, ``hold_ms``), or with
    ``unrelated`` the task of no lock (the other fields then mean nothing)."""

    mode: Mode
    on_busy: str
    key: str
    hold_ms: int
    unrelated: bool = False
    rate: str | None = None
    key_b: str | None = None
    """A pair section's second key (``workers.pair_section`` locks ``key`` and this one)."""
    countdown: float | None = None
    """Seconds the call is delayed by (``apply_async(countdown=...)``: an ETA call), or None."""
    debounced: bool = False
    """A call of the debounced section (``workers.debounced_section``, exclusive)."""
    follows: bool = False
    """Sent right after the section before it, off the schedule: the later calls of a burst
    (debounced or ``replace`` calls of one key, back to back)."""


UNRELATED_ITEM: Final = WorkItem("exclusive", "", "", 0, unrelated=True)


def plan_workload(config: LoadConfig) -> list[WorkItem]:
    """``config.tasks`` sections and ``config.effective_unrelated()`` unrelated tasks;
    deterministic for ``config.seed``.

    A section is shared with ``shared_ratio``, skips when busy with ``skip_ratio`` (else waits)
    and takes one of ``keys`` keys; in the ``hot-key`` scenario it is first, with
    ``hot_share``, an exclusive ``wait`` section on :data:`HOT_KEY`. It holds ``hold_ms``
    (on the hot key ``hot_hold_ms``, if set) +-``hold_spread``. Unrelated tasks are spread
    evenly among the sections: the one numbered j of m follows the section numbered
    ``floor(j * tasks / m)``.

    Off the hot key, with ``pair_ratio`` a section is a pair section (exclusive, over its key
    and another of the ``keys``: ``workers.pair_section``); else (on the hot key too) with
    ``preempt_ratio`` it is sent with ``on_busy="preempt"``. Neither has a ``lock_rate``. A
    preempt lands only on a holder that holds longer than its lease's renewal interval (its
    node is read for break requests from then on; a shorter hold ends as usual): the hot key's
    long holds are where most preempts end a holder. These draws come from their own
    generator: with both ratios at 0 the plan is the same as without them.

    With ``eta_ratio`` a section (any kind, on any key) is an ETA call: sent with a countdown
    drawn between half of ``eta_countdown`` and all of it, from a generator of its own (the
    plan is otherwise the same as without it). The worker receives such a message at once and
    keeps it, unacknowledged, until its ETA and then at its gate while its key is busy: the
    broker's visibility timeout runs over both.

    With ``debounce_ratio`` (``replace_ratio``) a section off the hot key begins a *burst*: it
    and the ``burst - 1`` sections after it become calls of its key sent back to back
    (:attr:`WorkItem.follows`), exclusive, with no rate, second key or countdown, each of the
    debounced section (``workers.debounced_section``: the burst coalesces into one run, the
    others skipped as ``debounced``), or sent with ``on_busy="replace"`` (while one holds the
    key, each newer call replaces the waiting one, skipped as ``replaced``). Drawn last, from
    a generator of its own: with both ratios at 0 the plan is the same as without them; the
    unrelated tasks due among a burst's sections follow its last one."""
    rng = random.Random(config.seed)
    rated = random.Random(config.seed + 1)  # its own draws: the rest of the plan is unchanged
    mixed = random.Random(config.seed + 2)  # pair and preempt sections: their own draws too
    delayed = random.Random(config.seed + 3)  # ETA calls: their own draws too
    low, high = 1 - config.hold_spread, 1 + config.hold_spread
    sections = []
    mode: Mode
    for _ in range(config.tasks):
        hold = config.hold_ms
        if config.scenario == "hot-key" and rng.random() < config.hot_share:
            mode, on_busy, key = "exclusive", "wait", HOT_KEY
            hold = config.hot_hold_ms or hold
        else:
            mode = "shared" if rng.random() < config.shared_ratio else "exclusive"
            on_busy = "skip" if rng.random() < config.skip_ratio else "wait"
            key = f"key-{rng.randrange(config.keys)}"
        hold_ms = max(1, round(hold * rng.uniform(low, high)))
        rate = config.rate if key != HOT_KEY and rated.random() < config.rate_ratio else None
        key_b = None
        if key != HOT_KEY and config.keys > 1 and mixed.random() < config.pair_ratio:
            mode, rate = "exclusive", None
            other = mixed.randrange(config.keys - 1)
            key_b = f"key-{other + (other >= int(key.removeprefix('key-')))}"
        elif mixed.random() < config.preempt_ratio:
            on_busy, rate = "preempt", None
        countdown = None
        if delayed.random() < config.eta_ratio:
            countdown = round(delayed.uniform(0.5, 1.0) * config.eta_countdown, 3)
        sections.append(
            WorkItem(mode, on_busy, key, hold_ms, rate=rate, key_b=key_b, countdown=countdown)
        )
    sections = _bursts(sections, config)
    unrelated = config.effective_unrelated()
    if not sections:
        return [UNRELATED_ITEM] * unrelated
    after = Counter(j * len(sections) // unrelated for j in range(unrelated))
    plan: list[WorkItem] = []
    due = 0
    for index, item in enumerate(sections):
        plan.append(item)
        due += after[index]
        if index + 1 == len(sections) or not sections[index + 1].follows:
            plan.extend([UNRELATED_ITEM] * due)
            due = 0
    return plan


def _bursts(sections: list[WorkItem], config: LoadConfig) -> list[WorkItem]:
    """``sections`` with the bursts of debounced and ``replace`` calls drawn in (see
    :func:`plan_workload`)."""
    if not (config.debounce_ratio or config.replace_ratio):
        return sections
    draws = random.Random(config.seed + 4)
    out: list[WorkItem] = []
    index = 0
    while index < len(sections):
        head = sections[index]
        draw = draws.random()
        debounced = draw < config.debounce_ratio
        replacing = not debounced and draw < config.debounce_ratio + config.replace_ratio
        if head.key == HOT_KEY or not (debounced or replacing):
            out.append(head)
            index += 1
            continue
        on_busy = "wait" if debounced else "replace"
        for offset, item in enumerate(sections[index : index + config.burst]):
            out.append(WorkItem("exclusive", on_busy, head.key, item.hold_ms,
                                debounced=debounced, follows=offset > 0))  # fmt: skip
        index += config.burst
    return out


# ---------------------------------------------------------------------------- the run's parts


@dataclass
class _Run:
    """What a run has started (and must stop) and talks to."""

    run_id: str
    settings: Settings
    app: Celery
    records: Any
    fleet: Fleet | None = None
    zookeeper: ZooKeeperServer | ZooKeeperEnsemble | None = None
    broker: RedisServer | RabbitMQServer | None = None
    namespaces: list[Namespace] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    external: External | None = None


class _Progress:
    """Counts shared by the sender, the collector and the progress line."""

    def __init__(self, total: int) -> None:
        self.total = total
        self.lock = threading.Lock()
        self.submitted: dict[str, float] = {}
        self.outcomes: dict[str, TaskOutcome] = {}
        self.unrelated: set[str] = set()
        """The submitted tasks of no lock."""
        self.done_at: dict[str, float] = {}
        """Task id -> when its final state was stored (the result's ``date_done``)."""
        self.held_max: int | None = None
        """The most messages the fleet's gates held at one look (None: no look answered)."""
        self.sending_done = threading.Event()
        self.collecting_done = threading.Event()
        self.send_error: BaseException | None = None
        self.resent: list[str] = []
        """Sends repeated after an error (task id: the error)."""
        self.collect_error: BaseException | None = None

    def in_flight(self) -> int:
        with self.lock:
            return len(self.submitted) - len(self.outcomes)

    def counts(self) -> tuple[int, int, int, int, int]:
        """submitted, final, ran, skipped, failed"""
        with self.lock:
            outcomes = list(self.outcomes.values())
            submitted = len(self.submitted)
        skipped = sum(o.skipped for o in outcomes)
        failed = sum(o.state != "SUCCESS" for o in outcomes)
        return submitted, len(outcomes), len(outcomes) - skipped - failed, skipped, failed


def _send_all(
    app: Celery,
    run_id: str,
    plan: Sequence[WorkItem],
    config: LoadConfig,
    progress: _Progress,
    faults_pending: Callable[[], bool],
    min_in_flight: int,
    stop: threading.Event,
    faults_seconds_left: Callable[[], float] = lambda: 0.0,
) -> None:
    """Send ``plan`` on its schedule (see the module docstring); runs in its own thread.
    ``faults_seconds_left`` says how long the faults still due take, which the reserve's holds
    stretch to cover."""
    try:
        duration = config.effective_duration()
        reserve_from = math.floor(len(plan) * (1 - RESERVE_SHARE)) if faults_pending() else None
        started = time.monotonic()
        for index, item in enumerate(plan):
            due = started + duration * index / len(plan)
            if stop.wait(0.0 if item.follows else max(0.0, due - time.monotonic())):
                return
            hold_ms = item.hold_ms
            if (
                reserve_from is not None
                and index >= reserve_from
                and not (item.unrelated or item.follows)
            ):
                while faults_pending() and progress.in_flight() >= min(
                    min_in_flight, RESERVE_IN_FLIGHT
                ):
                    if stop.wait(POLL):
                        return
                if faults_pending():
                    # Spread over the reserve left, RESERVE_IN_FLIGHT at a time: Docker's
                    # faults take several times FAULT_SECONDS, and the last ones of a run
                    # were recorded "the run ended first" once the reserve ran dry.
                    spread_ms = (
                        1000 * faults_seconds_left() * RESERVE_IN_FLIGHT / (len(plan) - index)
                    )
                    longest_ms = 1000 * RESERVE_HOLD_SHARE * config.wait_timeout
                    hold_ms = max(hold_ms, RESERVE_HOLD_MS, int(min(spread_ms, longest_ms)))
            task_id = str(uuid.uuid4())
            for attempt in range(1, SEND_ATTEMPTS + 1):
                try:
                    if item.unrelated:
                        app.tasks[UNRELATED_TASK].apply_async((run_id,), task_id=task_id)
                    else:
                        options = {"on_busy": item.on_busy, "timeout": config.wait_timeout}
                        if item.rate is not None:
                            options["rate"] = item.rate  # lock_rate, per call
                        eta = {} if item.countdown is None else {"countdown": item.countdown}
                        if item.debounced:
                            app.tasks[DEBOUNCED_TASK].apply_async(
                                (run_id, item.key, hold_ms), task_id=task_id, zklock=options
                            )
                        elif item.key_b is not None:
                            app.tasks[PAIR_TASK].apply_async(
                                (run_id, item.key, item.key_b, hold_ms),
                                task_id=task_id,
                                zklock=options,
                                **eta,
                            )
                        else:
                            app.tasks[TASK_FOR_MODE[item.mode]].apply_async(
                                (run_id, item.key, hold_ms), task_id=task_id, zklock=options, **eta
                            )
                    break
                except Exception as exc:
                    # kombu 5.7's publish retry can itself fail across a broker restart
                    # (AttributeError on a released connection): send the same task again.
                    if attempt == SEND_ATTEMPTS:
                        raise
                    progress.resent.append(f"{task_id}: {exc!r}")
                    if stop.wait(SEND_RETRY_INTERVAL):
                        return
            with progress.lock:
                progress.submitted[task_id] = time.time()
                if item.unrelated:
                    progress.unrelated.add(task_id)
    except BaseException as exc:
        progress.send_error = exc
    finally:
        progress.sending_done.set()


def _collect(
    client: Any,
    progress: _Progress,
    timeout: float,
    stop: threading.Event,
    on_done: Callable[[], None],
) -> None:
    """Poll the result backend until every sent task is final, or ``timeout`` s after the last
    send; runs in its own thread. Results are read straight from Redis (one MGET a round)."""
    deadline: float | None = None
    try:
        while not stop.is_set():
            with progress.lock:
                pending = [t for t in progress.submitted if t not in progress.outcomes]
            if pending:
                keys = [f"{RESULT_KEY_PREFIX}{t}" for t in pending]
                for task_id, raw in zip(pending, client.mget(keys), strict=True):
                    meta = None if raw is None else json.loads(raw)
                    outcome = _outcome(task_id, meta)
                    if meta is not None and outcome is not None:
                        with progress.lock:
                            progress.outcomes[task_id] = outcome
                            done = _done_at(meta)
                            if done is not None:
                                progress.done_at[task_id] = done
            if progress.sending_done.is_set():
                if deadline is None:
                    deadline = time.monotonic() + timeout
                if progress.in_flight() == 0 or time.monotonic() >= deadline:
                    return
            stop.wait(POLL)
    except BaseException as exc:
        progress.collect_error = exc
    finally:
        progress.collecting_done.set()
        on_done()


def _outcome(task_id: str, meta: Mapping[str, Any] | None) -> TaskOutcome | None:
    """The final outcome in a stored result, or None if there is none (yet)."""
    if meta is None:
        return None
    state = str(meta.get("status"))
    if state == "SUCCESS":
        return TaskOutcome.from_result(task_id, state, meta.get("result"))
    if state in ("FAILURE", "REVOKED"):
        result = meta.get("result")
        if isinstance(result, dict) and "exc_type" in result:
            message = result.get("exc_message")
            if isinstance(message, list):
                message = " ".join(str(m) for m in message)
            return TaskOutcome(task_id, state, reason=f"{result['exc_type']}: {message}")
        return TaskOutcome(task_id, state, reason=state)
    return None


def _done_at(meta: Mapping[str, Any]) -> float | None:
    """When a stored result was stored (its ``date_done``, ISO 8601 in UTC), as ``time.time()``."""
    try:
        done = datetime.fromisoformat(str(meta["date_done"]))
    except (KeyError, ValueError):
        return None
    return (done if done.tzinfo else done.replace(tzinfo=timezone.utc)).timestamp()


def _watch_gates(app: Celery, progress: _Progress, stop: threading.Event) -> None:
    """Every :data:`HELD_LOOK_EVERY` s until ``stop``: ask the workers' gates what they hold
    (``zklock_held``) and keep the most held at one look in ``progress.held_max``; runs in its
    own thread. A look that fails (a broker restart) is skipped."""
    while not stop.wait(HELD_LOOK_EVERY):
        try:
            held = sum(gate_holdings(app, timeout=HELD_LOOK_EVERY / 2).values())
        except Exception:
            continue
        with progress.lock:
            progress.held_max = max(progress.held_max or 0, held)


@contextlib.contextmanager
def _progress_line(
    progress: _Progress, injector: FaultInjector | None, stream: TextIO, enabled: bool | None
) -> Iterator[None]:
    """Keep a progress line on ``stream`` while the block runs (see the module docstring)."""
    if enabled is False:
        yield
        return
    tty = stream.isatty()
    stop = threading.Event()
    started = time.monotonic()

    def line() -> str:
        submitted, final, ran, skipped, failed = progress.counts()
        width = 24
        filled = round(width * final / progress.total) if progress.total else width
        faults = f" | faults {injector.done}/{injector.total}" if injector is not None else ""
        return (
            f"[{'#' * filled}{'.' * (width - filled)}] {final}/{progress.total} done "
            f"(ran {ran}, skipped {skipped}, failed {failed}) | sent {submitted}{faults} | "
            f"{time.monotonic() - started:.0f} s"
        )

    def loop() -> None:
        while not stop.wait(0.2 if tty else 5.0):
            stream.write(f"\r\x1b[K{line()}" if tty else f"progress: {line()}\n")
            stream.flush()

    thread = threading.Thread(target=loop, name="zklock-progress", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join(timeout=5)
        stream.write(f"\r\x1b[K{line()}\n" if tty else f"progress: {line()}\n")
        stream.flush()


# ------------------------------------------------------------------------------------ stack


def _start_local(
    config: LoadConfig, run_id: str, log_dir: Path, cleanup: contextlib.ExitStack
) -> _Run:
    """Start namespaces, ZooKeeper, the broker (Redis, or RabbitMQ with ``--broker-kind amqp``),
    the records Redis and the fleet; register their stops."""
    notes: list[str] = []
    namespaces: list[Namespace] = []
    wanted = min(config.effective_netns_workers(), config.workers)
    if wanted and config.broker_kind == "amqp":
        kinds = " and ".join(k for k in FAULT_KINDS if k in NETNS_FAULTS)
        notes.append(
            f"{kinds} faults will not run: no worker runs in a network namespace with "
            "--broker-kind amqp (the RabbitMQ node listens on the loopback address only)"
        )
        wanted = 0
    if wanted:
        reason = unavailable_reason()
        if reason is not None:
            kinds = " and ".join(k for k in FAULT_KINDS if k in NETNS_FAULTS)
            notes.append(f"{kinds} faults will not run: {reason}")
        else:
            for index in range(wanted):
                namespace = Namespace.create(f"{run_id[:3]}{index}")
                cleanup.callback(namespace.delete)
                namespaces.append(namespace)
            if config.faults.get("blackhole"):
                reason = blackhole_unavailable_reason()
                if reason is not None:
                    notes.append(f"blackhole faults will not run: {reason}")
    # Workers in a namespace reach ZooKeeper through their link's host address, not loopback.
    address = "0.0.0.0" if namespaces else "127.0.0.1"
    zookeeper: ZooKeeperServer | ZooKeeperEnsemble
    if config.zk_nodes > 1:
        isolatable = False
        if config.faults.get("follower_partition"):
            reason = partition_unavailable_reason()
            if reason is not None:
                notes.append(f"follower_partition faults will not run: {reason}")
            isolatable = reason is None
        zookeeper = ZooKeeperEnsemble(
            config.zk_nodes,
            client_address=address,
            sync_limit_ticks=config.effective_sync_limit(),
            isolatable=isolatable,
        )
    else:
        zookeeper = ZooKeeperServer(client_address=address)
    bind = [namespace.redis_address for namespace in namespaces]
    broker: RedisServer | RabbitMQServer
    if config.broker_kind == "amqp":
        broker = RabbitMQServer()
    else:
        broker = RedisServer(appendonly=True, appendfsync="always", bind=bind)
    records = RedisServer(bind=bind)
    for server in (zookeeper, broker, records):
        cleanup.callback(server.stop)
        server.start(timeout=config.start_timeout)
    settings = Settings(
        zk_hosts=zookeeper.hosts,
        broker_url=broker.url,
        result_backend=records.url,
        record_url=records.url,
        session_timeout=config.session_timeout,
        zk_root=config.zk_root,
        visibility_timeout=config.effective_visibility_timeout(),
        gate=config.gate,
    )
    run = _client_side(config, run_id, settings, cleanup)
    pools = [config.pools[index % len(config.pools)] for index in range(config.workers)]
    blackholes = bool(config.faults.get("blackhole"))
    places = _netns_places(pools, len(namespaces), in_process=blackholes)
    if blackholes and namespaces and all(pools[i] not in IN_PROCESS_POOLS for i in places):
        notes.append(
            "blackhole faults will not run: no worker in a network namespace has an "
            f"in-process pool ({', '.join(sorted(IN_PROCESS_POOLS))}); see --pools"
        )
    specs = []
    for index, pool in enumerate(pools):
        netns = namespaces[places.index(index)] if index in places else None
        specs.append(WorkerSpec(f"{pool}{index + 1}", pool, config.concurrency, netns))
    fleet = Fleet(run.app, settings, specs, run_id, log_dir)
    cleanup.callback(fleet.stop)
    fleet.start(timeout=config.start_timeout)
    return replace(
        run, fleet=fleet, zookeeper=zookeeper, broker=broker, namespaces=namespaces, notes=notes
    )


def _netns_places(pools: Sequence[str], count: int, *, in_process: bool) -> list[int]:
    """Which ``count`` of the workers (indexes into ``pools``) run in a namespace: the last
    ones; with ``in_process``, the last ones with an in-process pool first."""
    order = list(range(len(pools) - 1, -1, -1))
    if in_process:
        order.sort(key=lambda index: pools[index] not in IN_PROCESS_POOLS)
    return sorted(order[:count])


def _client_side(
    config: LoadConfig, run_id: str, settings: Settings, cleanup: contextlib.ExitStack
) -> _Run:
    """The sending app and the records client (closed at the end)."""
    app = create_app(settings, main=f"zklock-{config.name}")
    # Results are read straight from Redis (_collect): no result subscription per sent task.
    app.conf.result_backend = "disabled://"
    cleanup.callback(app.close)
    records = redis.Redis.from_url(settings.record_url)
    cleanup.callback(records.close)
    return _Run(run_id=run_id, settings=settings, app=app, records=records)


def _start_external(
    config: LoadConfig, external: External, run_id: str, cleanup: contextlib.ExitStack
) -> _Run:
    settings = Settings(
        zk_hosts=external.zk_hosts,
        broker_url=external.broker,
        result_backend=external.result_backend,
        record_url=external.record_url,
        session_timeout=config.session_timeout,
        zk_root=config.zk_root,
    )
    if external.visibility_timeout is not None:
        settings = replace(settings, visibility_timeout=external.visibility_timeout)
    run = _client_side(config, run_id, settings, cleanup)
    run.external = external
    deadline = time.monotonic() + config.start_timeout
    while len(run.app.control.ping(timeout=1.0)) < external.workers:
        if time.monotonic() >= deadline:
            raise StackError(
                f"fewer than {external.workers} workers answered a ping on {external.broker} "
                f"within {config.start_timeout:.0f} s"
            )
    if external.compose is not None:
        local = ", ".join(kind for kind in FAULT_KINDS if kind not in DOCKER_FAULT_KINDS)
        run.notes.append(
            f"compose project {external.compose.name}: faults go through Docker; {local} "
            "faults need local processes and are recorded as not run"
        )
    else:
        local = ", ".join(kind for kind in FAULT_KINDS if kind != "expire")
        run.notes.append(
            f"external run: {local} faults need local processes and are recorded as not run"
        )
    return run


def count_nodes(client: KazooClient, path: str) -> int:
    """Znodes strictly below ``path`` (0 if it does not exist) that locks left behind. A
    rate-limited key's admissions are not among them: :mod:`celery_zklock.locks.rate` keeps
    them for a period by design (at most N per key), under ``<lock path>/rate``, and a lock
    node kept only by them is not counted either."""
    return _left_and_rated(client, path)[0]


def _leaves(client: KazooClient, path: str) -> list[str]:
    """The znodes below ``path`` without children, rate-limit state apart."""
    try:
        children = [c for c in client.get_children(path) if c != RATE_NODE]
    except NoNodeError:
        return []
    found = []
    for child in children:
        below = f"{path.rstrip('/')}/{child}"
        found.extend(_leaves(client, below) or [below])
    return found


def _left_and_rated(client: KazooClient, path: str) -> tuple[int, bool]:
    """(left-behind nodes below ``path``, whether any rate-limit state is there)."""
    try:
        children = client.get_children(path)
    except NoNodeError:
        return 0, False
    left, rated = 0, False
    for child in children:
        if child == RATE_NODE:
            rated = True
            continue
        below, child_rated = _left_and_rated(client, f"{path.rstrip('/')}/{child}")
        rated = rated or child_rated
        if below or not child_rated:
            left += 1 + below
    return left, rated


def _leftover_nodes(
    hosts: str, root: str, timeout: float, say: Callable[[str], None] = lambda _: None
) -> int:
    """Znodes under ``root`` once the server reaped what it will (or at the deadline); says the
    deepest of those left (at most 10), with their data."""
    client = KazooClient(hosts=hosts, logger=quiet_kazoo_logger())
    client.start(timeout=15)
    try:
        deadline = time.monotonic() + timeout
        while True:
            count = count_nodes(client, root)
            if count == 0 or time.monotonic() >= deadline:
                for path in _leaves(client, root)[:10]:
                    with contextlib.suppress(NoNodeError):
                        data = client.get(path)[0][:200]
                        say(f"  left behind: {path} {data!r}")
                return count
            time.sleep(POLL)
    finally:
        client.stop()
        client.close()


# ----------------------------------------------------------------------------------- the run


def run_loadtest(config: LoadConfig, out: TextIO | None = None, err: TextIO | None = None) -> int:
    """Run a load test with ``config``; print to ``out`` (default ``sys.stdout``) and the
    progress line to ``err`` (default ``sys.stderr``); return the exit status."""

    def say(line: str = "") -> None:
        print(line, file=out or sys.stdout, flush=True)

    run_id = uuid.uuid4().hex[:12]
    began = time.monotonic()
    out_dir = config.out_dir or Path(tempfile.gettempdir()) / f"zklock-{config.name}-{run_id}"
    say(f"celery-zklock {config.name}, run {run_id}")
    with contextlib.ExitStack() as cleanup:
        try:
            log_dir = _log_dir(config, out_dir, cleanup)
            if config.external is not None:
                run = _start_external(config, config.external, run_id, cleanup)
            else:
                run = _start_local(config, run_id, log_dir, cleanup)
        except (StackError, NetnsError) as exc:
            say(f"celery-zklock {config.name}: could not start: {exc}")
            return 1
        _describe_start(config, run, log_dir, time.monotonic() - began, say)
        report, records = _drive(config, run, err or sys.stderr, say)
        paths = write_reports(report, out_dir, **records)
        say(f"reports: {paths['html']} (also report.json, summary.txt)")
        lines = report.summary_lines()
        for line in lines:
            say(line)
        if not lines or lines[-1] != report.report_line():
            say(report.report_line())
        return 0 if report.ok else 1
    raise AssertionError("unreachable")  # the with block returns


def _log_dir(config: LoadConfig, out_dir: Path, cleanup: contextlib.ExitStack) -> Path:
    if config.keep_logs:
        directory = out_dir / "logs"
        directory.mkdir(parents=True, exist_ok=True)
        return directory
    directory = make_temp_dir("zklock-fleet-")
    cleanup.callback(remove_temp_dir, directory)
    return directory


def _describe_start(
    config: LoadConfig, run: _Run, log_dir: Path, took: float, say: Callable[[str], None]
) -> None:
    if run.zookeeper is not None:
        kind = f"{config.zk_nodes}-node ensemble" if config.zk_nodes > 1 else "standalone"
        say(f"stack: ZooKeeper {run.settings.zk_hosts} ({kind}), up in {took:.1f} s")
        if is_amqp(run.settings.broker_url):
            say(f"  broker RabbitMQ {run.settings.broker_url} (a private node, publisher confirms)")
        else:
            say(f"  broker Redis {run.settings.broker_url} (append-only, fsync always)")
        say(f"  records, fence and results Redis {run.settings.record_url}")
    else:
        say(f"external fleet: ZooKeeper {run.settings.zk_hosts}, broker {run.settings.broker_url}")
    for worker in run.fleet or ():
        say(f"worker {worker.describe()}")
    if run.fleet is not None and config.keep_logs:
        say(f"worker logs: {log_dir}")
    unrelated = config.effective_unrelated()
    if config.scenario == "hot-key":
        say(
            f"scenario hot-key: {config.hot_share:.0%} of the locked tasks are exclusive and "
            f"wait on key {HOT_KEY!r}, holding {config.hot_hold_ms or config.hold_ms} ms; "
            "the rest as below"
        )
    if unrelated:
        say(f"unrelated traffic: {unrelated} tasks of no lock spread among the locked ones")
    if run.fleet is not None:
        say(f"gate: {'on' if config.gate else 'off'} (ZKLOCK_GATE)")
    say(
        f"workload: {config.tasks} tasks over {config.keys} keys, "
        f"shared {config.shared_ratio:.0%}, "
        f"skip when busy {config.skip_ratio:.0%} (else wait up to {config.wait_timeout:.0f} s), "
        f"rate-limited {config.rate_ratio:.0%} (zklock['rate']={config.rate!r}), "
        + (
            f"two keys at once {config.pair_ratio:.0%}, preempt {config.preempt_ratio:.0%}, "
            if config.pair_ratio or config.preempt_ratio
            else ""
        )
        + (
            f"ETA calls {config.eta_ratio:.0%} (countdown {config.eta_countdown / 2:g} to "
            f"{config.eta_countdown:g} s), "
            if config.eta_ratio
            else ""
        )
        + (
            f"bursts of {config.burst} calls of a key back to back: debounced "
            f"{config.debounce_ratio:.0%}, replace {config.replace_ratio:.0%}, "
            if config.debounce_ratio or config.replace_ratio
            else ""
        )
        + f"hold {config.hold_ms} ms +-{config.hold_spread:.0%}, "
        f"sent over {config.effective_duration():.0f} s; "
        f"session timeout {run.settings.session_timeout:g} s, visibility timeout "
        f"{run.settings.visibility_timeout:g} s"
    )
    say(f"faults: {describe_plan(config.faults)}")
    for note in run.notes:
        say(f"note: {note}")


def _drive(
    config: LoadConfig, run: _Run, err: TextIO, say: Callable[[str], None]
) -> tuple[RunReport, dict[str, Any]]:
    """Send, inject, collect; then count leftovers and check everything. Returns the report
    and what the HTML report's timeline draws (``write_reports``' ``events``, ``faults`` and
    ``start``)."""
    plan = plan_workload(config)
    progress = _Progress(len(plan))
    injector = _injector(config, run) if config.faults else None
    stop = threading.Event()
    if run.fleet is not None:
        slots = sum(w.spec.concurrency for w in run.fleet)
    else:
        slots = run.external.slots if run.external is not None else 4
    sender = threading.Thread(
        target=_send_all,
        args=(run.app, run.run_id, plan, config, progress),
        kwargs={
            "faults_pending": injector.pending if injector is not None else lambda: False,
            "faults_seconds_left": (injector.seconds_left if injector is not None else lambda: 0.0),
            "min_in_flight": slots,
            "stop": stop,
        },
        name="zklock-sender",
        daemon=True,
    )
    gates = threading.Thread(
        target=_watch_gates, args=(run.app, progress, stop), name="zklock-gates", daemon=True
    )
    collector = threading.Thread(
        target=_collect,
        args=(run.records, progress, config.effective_result_timeout(), stop),
        kwargs={"on_done": injector.stop if injector is not None else lambda: None},
        name="zklock-collector",
        daemon=True,
    )
    started = time.monotonic()
    try:
        with _progress_line(progress, injector, err, config.progress):
            sender.start()
            collector.start()
            gates.start()
            if injector is not None:
                injector.run()  # here, in the main thread: it restarts processes
            while not progress.collecting_done.wait(POLL):
                if injector is not None:
                    injector.revive()
                elif run.fleet is not None:
                    run.fleet.revive()
    finally:
        stop.set()
        if injector is not None:
            injector.close()
        sender.join(timeout=30)
        collector.join(timeout=30)
        gates.join(timeout=30)
    elapsed = time.monotonic() - started
    if progress.send_error is not None:
        say(f"sending stopped early: {progress.send_error!r}")
    for line in progress.resent:
        say(f"sent again after a failed publish: {line}")
    if progress.collect_error is not None:
        say(f"collecting results stopped early: {progress.collect_error!r}")
    for record in injector.records if injector is not None else ():
        say(_fault_line(record))
    for label, status, at in run.fleet.unexpected_exits if run.fleet is not None else ():
        say(
            f"worker {label} exited on its own (status {status}) at "
            f"{time.strftime('%H:%M:%S', time.localtime(at))} and was restarted (see its log)"
        )
    reap_timeout = 2 * run.settings.session_timeout + 15.0
    leftovers = _leftover_nodes(run.settings.zk_hosts, run.settings.zk_root, reap_timeout, say)
    events = SectionRecorder(run.records, run.run_id).events()
    faults = FaultLog(run.records, run.run_id).records()
    with progress.lock:
        submitted, outcomes = dict(progress.submitted), dict(progress.outcomes)
        unrelated, done_at = set(progress.unrelated), dict(progress.done_at)
    say(f"tasks sent and settled in {elapsed:.1f} s")
    unsettled = [t for t in submitted if t not in outcomes]
    returns = _broker_returns(run, unsettled)
    resent = {t: back.since for t, back in returns.items() if back.since}
    report = check_run(
        submitted=submitted,
        outcomes=outcomes,
        events=events,
        faults=faults,
        leftover_nodes=leftovers,
        never_delivered=_never_delivered(run, unsettled, say),
        never_received=_never_received(run, unsettled, say, returns),
        resent=resent,
        unrelated=unrelated,
        done_at=done_at,
        gate=config.gate if run.fleet is not None else None,
        gate_held_max=progress.held_max,
    )
    start = min(submitted.values(), default=None)
    return report, {"events": events, "faults": faults, "start": start}


def _never_delivered(run: _Run, unsettled: Sequence[str], say: Callable[[str], None]) -> set[str]:
    """Of the tasks without a final state, those that never started (no state at all in the
    result backend: ``task_track_started`` stores STARTED before the body runs) and whose message
    is nowhere in the broker. Says, for each, how far it got and where its message is."""
    if not unsettled:
        return set()
    if is_amqp(run.settings.broker_url):
        # RabbitMQ takes a message off its queue only when it is acknowledged: there is no
        # window in which a message leaves the queue unrecorded (the Redis transport's), so
        # every unsettled task counts as lost.
        say("  broker RabbitMQ: a message leaves its queue only when acknowledged; not looked up")
        return set()
    states = run.records.mget([f"{RESULT_KEY_PREFIX}{t}" for t in unsettled])
    view = whereabouts(run.settings.broker_url, unsettled)
    if view.error is not None:
        say(f"  broker not readable for the unsettled tasks' messages: {view.error}")
        return set()
    for task_id, state in zip(unsettled, states, strict=True):
        began = "never started" if state is None else f"last state {json.loads(state)['status']}"
        place = view.places.get(task_id, "not in the broker")
        say(f"  unsettled task {task_id}: {began}; its message: {place}")
    if view.mutex_ttl is not None:
        say(f"  kombu's restore mutex is held ({view.mutex_ttl} s left): no redelivery until then")
    # A retry's message is a new one that never started (the attempt before it stored RETRY).
    never_started = {
        t
        for t, state in zip(unsettled, states, strict=True)
        if state is None or json.loads(state)["status"] == "RETRY"
    }
    return never_started - set(view.places)


def _never_received(
    run: _Run,
    unsettled: Sequence[str],
    say: Callable[[str], None],
    returns: Mapping[str, BrokerReturn] | None = None,
) -> set[str] | None:
    """Of the tasks without a final state, those that no worker of a local fleet logged as
    received since their message last went back to the broker (``returns``, see
    :func:`broker_returns`); None for an external fleet, whose logs are not here. Says, for
    each received one, which worker logged it."""
    if run.fleet is None:
        return None
    received = set()
    for task_id in unsettled:
        back = (returns or {}).get(task_id, BrokerReturn())
        if back.received_by:
            received.add(task_id)
            say(f"  unsettled task {task_id}: received by {', '.join(back.received_by)} (its log)")
        elif back.since:
            say(f"  unsettled task {task_id}: not received since its message went back to the "
                f"broker ({back.how})")  # fmt: skip
    return set(unsettled) - received


_RESENT_MARKS: Final = ("] retry: ", "event=sent-back task_id=", "go back to the broker: ")
"""Worker log lines that send a task's message to the broker again: Celery's retry, a run's
send-back in a ZooKeeper outage, the gate's give-back at the broker's bound (which names the
task ids it gives back)."""
RECEIVED_MARK: Final = "] received"
"""Celery's ``Task NAME[ID] received``: a worker took the message and recorded it delivered."""
BANNER_MARK: Final = " -------------- "
"""The first line of Celery's start banner: a worker (re)started in the log it appends to."""
RESEND_LOG_LAG: Final = 0.5
"""Seconds by which a worker may take a re-sent message before the sender logs the send (the
line is written once the publish returned): such a receipt is of the new message."""


@dataclass(frozen=True)
class BrokerReturn:
    """When a task's message last went back to the broker (``since``, 0.0 if never: then it
    counts from its submission) and how (``how``), and which workers logged it received since
    (``received_by``). A message goes back when a worker sends it again (a retry, a send-back,
    a give-back: :data:`_RESENT_MARKS`) and when the worker that received it last restarts
    before the task ended: it died with the message unacknowledged, which the broker hands out
    again (Redis after its visibility timeout). The restart's first logged line stands for the
    death (it comes later: the stricter count)."""

    since: float = 0.0
    how: str = ""
    received_by: tuple[str, ...] = ()


def _broker_returns(run: _Run, unsettled: Sequence[str]) -> dict[str, BrokerReturn]:
    if run.fleet is None or not unsettled:
        return {}
    logs = {w.label: w.log_text() if w.log_path.exists() else "" for w in run.fleet}
    return broker_returns(logs, unsettled)


def broker_returns(logs: Mapping[str, str], task_ids: Iterable[str]) -> dict[str, BrokerReturn]:
    """:class:`BrokerReturn` of each of ``task_ids`` from the fleet's worker logs (label ->
    text; a restarted worker appends to its log, under a new banner)."""
    wanted = set(task_ids)
    marks: dict[str, float] = {}
    receipts: dict[str, list[tuple[float, str]]] = {}
    restarts: dict[str, list[float]] = {}
    for label, text in logs.items():
        banners, restarted = 0, False
        for line in text.splitlines():
            if line.startswith(BANNER_MARK):
                banners += 1
                restarted = banners > 1
                continue
            at = _logged_at(line)
            if restarted and at:
                restarts.setdefault(label, []).append(at)
                restarted = False
            resends = any(mark in line for mark in _RESENT_MARKS)
            if not resends and RECEIVED_MARK not in line:
                continue
            for task_id in wanted:
                if resends and task_id in line:
                    marks[task_id] = max(marks.get(task_id, 0.0), at)
                elif f"[{task_id}{RECEIVED_MARK}" in line:
                    receipts.setdefault(task_id, []).append((at, label))
    found = {}
    for task_id in wanted:
        since = marks.get(task_id, 0.0)
        how, lag = ("sent again by a worker", RESEND_LOG_LAG) if since else ("", 0.0)
        taken = sorted(r for r in receipts.get(task_id, []) if r[0] >= since - lag)
        if taken:  # the last receipt's worker restarted after it: back in the broker since
            at, label = taken[-1]
            death = next((s for s in restarts.get(label, []) if s > at), None)
            if death is not None:
                since, how = death, f"the worker that received it last, {label}, restarted"
                taken = []
        found[task_id] = BrokerReturn(since, how, tuple(dict.fromkeys(lbl for _, lbl in taken)))
    return found


def _logged_at(line: str) -> float:
    """The instant a worker's log line was written (``[YYYY-MM-DD HH:MM:SS,mmm: ...``, the
    host's local time), or 0.0 for a line without one."""
    try:
        stamp = datetime.strptime(line[1:24], "%Y-%m-%d %H:%M:%S,%f")
    except ValueError:
        return 0.0
    return stamp.timestamp()


def _injector(config: LoadConfig, run: _Run) -> FaultInjector:
    env = FaultEnvironment(
        run_id=run.run_id,
        records=run.records,
        zk_hosts=run.settings.zk_hosts,
        session_timeout=run.settings.session_timeout,
        fleet=run.fleet,
        zookeeper=run.zookeeper,
        broker=run.broker,
    )
    compose = run.external.compose if run.external is not None else None
    if compose is not None:
        return DockerFaultInjector(
            env, config.faults, compose, seed=config.seed, gap=config.fault_gap
        )
    return FaultInjector(env, config.faults, seed=config.seed, gap=config.fault_gap)


def _fault_line(record: FaultRecord) -> str:
    at = time.strftime("%H:%M:%S", time.localtime(record.time))
    if not record.ran:
        return f"fault {record.kind} at {at}: NOT RUN: {record.detail}"
    return f"fault {record.kind} at {at}: {record.target}: {record.detail}"


# ------------------------------------------------------------------------------ command line


def configure_parser(parser: argparse.ArgumentParser, defaults: LoadConfig | None = None) -> None:
    """Add the load test's options to ``parser``, with ``defaults`` (LoadConfig()'s if None)."""
    d = defaults or LoadConfig()
    add = parser.add_argument
    add("--tasks", type=_positive_int, default=d.tasks, help=f"tasks to send ({d.tasks})")
    add("--keys", type=_positive_int, default=d.keys, help=f"distinct lock keys ({d.keys})")
    add("--shared-ratio", type=_ratio, default=d.shared_ratio,
        help=f"share of shared (read) sections, 0..1 ({d.shared_ratio})")  # fmt: skip
    add("--skip-ratio", type=_ratio, default=d.skip_ratio,
        help=f"share of tasks that skip when busy; the rest wait ({d.skip_ratio})")  # fmt: skip
    add("--rate-ratio", type=_ratio, default=d.rate_ratio,
        help=f"share of sections sent with a per-key lock_rate ({d.rate_ratio})")  # fmt: skip
    add("--rate", default=d.rate,
        help=f"that lock_rate, in Celery's syntax ({d.rate})")  # fmt: skip
    add("--preempt-ratio", type=_ratio, default=d.preempt_ratio,
        help=f"share of sections sent with on_busy='preempt' ({d.preempt_ratio})")  # fmt: skip
    add("--pair-ratio", type=_ratio, default=d.pair_ratio,
        help=f"share of sections that lock two keys at once ({d.pair_ratio})")  # fmt: skip
    add("--eta-ratio", type=_ratio, default=d.eta_ratio,
        help=f"share of sections sent as ETA calls, with a countdown ({d.eta_ratio})")  # fmt: skip
    add("--eta-countdown", type=_seconds, default=d.eta_countdown,
        help="their countdown: drawn between half of it and all of it, s "
        f"({d.eta_countdown:g})")  # fmt: skip
    add("--debounce-ratio", type=_ratio, default=d.debounce_ratio,
        help="share of sections (off the hot key) that begin a burst of --burst debounced "
        f"calls of their key ({d.debounce_ratio})")  # fmt: skip
    add("--replace-ratio", type=_ratio, default=d.replace_ratio,
        help="share of sections (off the hot key) that begin a burst of --burst calls of "
        f"their key sent with on_busy='replace' ({d.replace_ratio})")  # fmt: skip
    add("--burst", type=_positive_int, default=d.burst,
        help=f"calls in one such burst ({d.burst})")  # fmt: skip
    add("--hold-ms", type=_positive_int, default=d.hold_ms,
        help=f"time a section holds its lock, +-HOLD_SPREAD ({d.hold_ms})")  # fmt: skip
    add("--hold-spread", type=_ratio, default=d.hold_spread,
        help=f"how far a hold may be off --hold-ms, a share 0..1 ({d.hold_spread:g})")  # fmt: skip
    add("--scenario", choices=SCENARIOS, default=d.scenario,
        help=f"mixed: sections over --keys; hot-key: a share of them (--hot-share) wait on "
        f"one key (default {d.scenario})")  # fmt: skip
    add("--hot-share", type=_ratio, default=d.hot_share,
        help=f"hot-key: share of the locked tasks on the hot key ({d.hot_share:g})")  # fmt: skip
    add("--hot-hold-ms", type=_positive_int, default=d.hot_hold_ms,
        help="hot-key: how long a hot-key section holds, +-HOLD_SPREAD (--hold-ms)")  # fmt: skip
    add("--unrelated", type=_count, default=d.unrelated,
        help="tasks of no lock spread among the locked ones, their latency reported (default: "
        "as many as --tasks with --scenario hot-key, else 0)")  # fmt: skip
    add("--gate", type=_on_off, default=d.gate, metavar="on|off",
        help="the workers' gate, which holds a busy wait task's message outside the pool "
        f"(default {'on' if d.gate else 'off'})")  # fmt: skip
    add("--duration", type=_seconds, default=d.duration,
        help="seconds over which to send the tasks (default: at once without faults, as "
        "long as the faults need with them)")  # fmt: skip
    add("--wait-timeout", type=_seconds, default=d.wait_timeout,
        help=f"seconds a waiting task waits for its lock ({d.wait_timeout:g})")  # fmt: skip
    add("--workers", type=_positive_int, default=d.workers,
        help=f"worker processes to start ({d.workers})")  # fmt: skip
    add("--pools", type=_pools, default=d.pools,
        help=f"their pools, cycled through ({','.join(d.pools)})")  # fmt: skip
    add("--concurrency", type=_positive_int, default=d.concurrency,
        help=f"processes/threads per worker ({d.concurrency})")  # fmt: skip
    add("--session-timeout", type=_seconds, default=d.session_timeout,
        help=f"ZooKeeper session timeout of the workers, s ({d.session_timeout:g})")  # fmt: skip
    add("--zk-nodes", type=_positive_int, default=d.zk_nodes,
        help=f"1 = standalone ZooKeeper, N = an N-node ensemble ({d.zk_nodes})")  # fmt: skip
    add("--broker-kind", choices=BROKER_KINDS, default=d.broker_kind,
        help="the broker of the fleet this run starts: redis (append-only Redis) or amqp (a "
        "private node of Debian's rabbitmq-server, publisher confirms); broker_restart "
        f"faults SIGKILL and restart it ({d.broker_kind}; --broker names an external "
        "fleet's broker instead)")  # fmt: skip
    add("--faults", type=parse_faults, default=dict(d.faults), metavar="KIND:N,...",
        help=f"faults to inject: {', '.join(FAULT_KINDS)}, or all "
        f"(e.g. kill:3,pause:3 or all:3; default: {describe_plan(d.faults)})")  # fmt: skip
    add("--fault-gap", type=_seconds, default=d.fault_gap,
        help=f"seconds between two faults ({d.fault_gap:g})")  # fmt: skip
    add("--netns-workers", type=int, default=d.netns_workers,
        help="workers run in a network namespace for partitions and black holes (default 1 "
        "with such faults, else 0)")  # fmt: skip
    add("--visibility-timeout", type=_seconds, default=d.visibility_timeout,
        help="broker redelivery timeout, s (default: wait timeout + 3 holds + 10)")  # fmt: skip
    add("--timeout", type=_seconds, default=d.result_timeout,
        help="seconds to wait for final states after the last send (default: twice the "
        "visibility timeout + 20)")  # fmt: skip
    add("--seed", type=int, default=d.seed, help=f"workload and fault order seed ({d.seed})")
    add("--out", type=Path, default=d.out_dir,
        help="directory for report.json, summary.txt and report.html (default: a new one "
        "in the temp directory)")  # fmt: skip
    add("--keep-logs", action="store_true", default=d.keep_logs,
        help="keep the worker logs in OUT/logs")  # fmt: skip
    add("--no-progress", action="store_true", help="no progress line on stderr")
    external = parser.add_argument_group(
        "external fleet (e.g. compose): nothing is started; process faults do not run"
    )
    external.add_argument("--zk-hosts", help="ZooKeeper connection string of the fleet")
    external.add_argument("--broker", help="the fleet's broker URL (redis://...)")
    external.add_argument("--record-url", help="Redis URL of the section records (--broker)")
    external.add_argument("--result-backend", help="result backend URL (--record-url)")
    external.add_argument("--zk-root", default=d.zk_root, help=f"lock root ({d.zk_root})")
    external.add_argument(
        "--compose-project", metavar="NAME",
        help="the external fleet is this docker-compose project of compose/docker-compose.yml: "
        "its faults go through Docker (docs/compose.md)")  # fmt: skip


def config_from_args(
    args: argparse.Namespace, name: str = "loadtest", parser: argparse.ArgumentParser | None = None
) -> LoadConfig:
    """The :class:`LoadConfig` of parsed arguments; an incomplete external target is an error."""
    external = None
    if args.zk_hosts or args.broker:
        if not (args.zk_hosts and args.broker):
            message = "--zk-hosts and --broker go together (an external fleet)"
            if parser is not None:
                parser.error(message)
            raise ValueError(message)
        if args.broker_kind != LoadConfig.broker_kind:
            message = (
                "--broker-kind is for a fleet the run starts; --broker names an external one's"
            )
            if parser is not None:
                parser.error(message)
            raise ValueError(message)
        record_url = args.record_url or args.broker
        compose = ComposeProject(args.compose_project) if args.compose_project else None
        external = External(
            zk_hosts=args.zk_hosts,
            broker=args.broker,
            record_url=record_url,
            result_backend=args.result_backend or record_url,
            compose=compose,
        )
    elif args.compose_project:
        message = "--compose-project needs --zk-hosts and --broker (`workers fleet` sets them)"
        if parser is not None:
            parser.error(message)
        raise ValueError(message)
    return LoadConfig(
        tasks=args.tasks,
        keys=args.keys,
        shared_ratio=args.shared_ratio,
        skip_ratio=args.skip_ratio,
        rate_ratio=args.rate_ratio,
        rate=args.rate,
        preempt_ratio=args.preempt_ratio,
        pair_ratio=args.pair_ratio,
        eta_ratio=args.eta_ratio,
        eta_countdown=args.eta_countdown,
        debounce_ratio=args.debounce_ratio,
        replace_ratio=args.replace_ratio,
        burst=args.burst,
        hold_ms=args.hold_ms,
        hold_spread=args.hold_spread,
        scenario=args.scenario,
        hot_share=args.hot_share,
        hot_hold_ms=args.hot_hold_ms,
        unrelated=args.unrelated,
        gate=args.gate,
        duration=args.duration,
        workers=args.workers,
        pools=args.pools,
        concurrency=args.concurrency,
        session_timeout=args.session_timeout,
        zk_nodes=args.zk_nodes,
        broker_kind=args.broker_kind,
        faults=args.faults,
        seed=args.seed,
        out_dir=args.out,
        wait_timeout=args.wait_timeout,
        visibility_timeout=args.visibility_timeout,
        result_timeout=args.timeout,
        netns_workers=args.netns_workers,
        fault_gap=args.fault_gap,
        zk_root=args.zk_root,
        external=external,
        keep_logs=args.keep_logs,
        progress=False if args.no_progress else None,
        name=name,
    )


_positive_int = argument(positive_int)
_seconds = argument(seconds, zero=True)


def _ratio(text: str) -> float:
    value = float(text)
    if not 0 <= value <= 1:
        raise argparse.ArgumentTypeError(f"must be between 0 and 1, got {text}")
    return value


def _count(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be a whole number >= 0, got {text}")
    return value


def _on_off(text: str) -> bool:
    word = text.strip().lower()
    if word not in ("on", "off"):
        raise argparse.ArgumentTypeError(f"must be on or off, got {text}")
    return word == "on"


def _pools(text: str) -> tuple[str, ...]:
    pools = tuple(p.strip() for p in text.split(",") if p.strip())
    bad = [p for p in pools if p not in POOLS]
    if not pools or bad:
        raise argparse.ArgumentTypeError(f"pools are a comma list of {', '.join(POOLS)}")
    return pools


def run_command(args: argparse.Namespace, name: str = "loadtest") -> int:
    """Run from parsed arguments; Ctrl-C stops everything and exits 130."""
    try:
        return run_loadtest(config_from_args(args, name))
    except KeyboardInterrupt:
        print(f"celery-zklock {name}: interrupted; every process it started is stopped")
        return 130


def main(argv: list[str] | None = None) -> int:
    """``python -m workers.loadtest [options]``; returns the exit status."""
    parser = argparse.ArgumentParser(prog="python -m workers.loadtest", description=_HELP)
    configure_parser(parser)
    args = parser.parse_args(argv)
    config_from_args(args, parser=parser)  # usage errors exit here, before anything starts
    return run_command(args)


_HELP: Final = (
    "Run a workload of locked tasks on a worker fleet (local, or an external one), inject "
    "faults, check mutual exclusion, fencing and task accounting, and write a report."
)

COMMAND: Final = Subcommand(
    name="loadtest", help=_HELP, configure=configure_parser, run=run_command
)
"""``python -m workers loadtest``."""


if __name__ == "__main__":
    sys.exit(main())
