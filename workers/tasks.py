"""The fleet's locked tasks: a critical section, exclusive or shared, recorded into Redis.

Both tasks share one lock name (:data:`LOCK_NAME`) and ``lock_key=["key"]``, so for one key the
exclusive task takes the write side and the shared task the read side of the same read-write
lock. :data:`PAIR_TASK` locks two keys at once under the same lock name
(``lock_key={"key": ["key_a", "key_b"]}``): each is the key the others take for that value, so it
excludes them on both; its section records its events once per key, each with that key's token.
A section (:func:`run_section`) records ``enter``, holds, records ``writing``, writes
through the run's fence, records the write, and records ``exit``; the write comes last on
purpose (``docs/fleet.md``). Records go to the Redis at the app setting ``fleet_record_url``. A
section planted by a fault injector is given a ``release_key``: the hold ends early once that
Redis key exists; and may be given a ``stall_key``: if that key exists once the hold is over,
the section stops its own process (SIGSTOP) between its ``writing`` event and the write, for the
``stall_before_write`` fault (``workers/faults.py``), and sends the write when it runs again.
A section run under a ``lock_rate`` (the task's, or the call's ``zklock={"rate": ...}``) first
reads its own admission back from ZooKeeper (:func:`workers.admissions.find_admission`) and
records, on each of its events, the rate and the admission's ``ctime``: the checker's rate
check counts admissions on ZooKeeper's clock, not on a worker's.

:data:`UNRELATED_TASK` is the unrelated traffic of the ``hot-key`` scenario: a plain task (no
lock, no record) that returns at once, whose time from send to result the load test reports.

:data:`DEBOUNCED_TASK` is the exclusive section under ``lock_debounce`` (:data:`DEBOUNCE_SECONDS`
of quiet, at most :data:`DEBOUNCE_MAX_SECONDS` a window), on the same locks: calls of one key
close together run once, with the last call's arguments; the others end as skips (reason
``debounced``) and must never enter their section (the checker's superseded rule, as for
``replace`` calls, which are exclusive sections sent with ``zklock={"on_busy": "replace"}``).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any, Final, cast

import redis
from celery import Celery

from celery_zklock import LockLost, ZkLockTask
from celery_zklock.errors import LossCode
from celery_zklock.fence import FenceOutcome, RedisFence
from celery_zklock.locks import Lease, MultiLease
from celery_zklock.locks.rate import parse_rate
from celery_zklock.task.options import request_overrides
from celery_zklock.task.run import PREEMPTED
from celery_zklock.zk.client import get_client
from celery_zklock.zk.settings import settings_of
from workers.admissions import find_admission
from workers.record import PREEMPTED_OUTCOME, Mode, SectionEvent, SectionRecorder

__all__ = [
    "DEBOUNCED_TASK",
    "DEBOUNCE_MAX_SECONDS",
    "DEBOUNCE_SECONDS",
    "EXCLUSIVE_TASK",
    "HOLD_SLICE_SECONDS",
    "LOCK_NAME",
    "PAIR_TASK",
    "PREEMPTED_OUTCOME",
    "RECORD_URL_SETTING",
    "RELEASE_POLL_SECONDS",
    "SHARED_TASK",
    "TASK_FOR_MODE",
    "UNRELATED_TASK",
    "fence_namespace",
    "loss_outcome",
    "record_exit",
    "register_tasks",
    "run_section",
]

LOCK_NAME: Final = "workers.section"
EXCLUSIVE_TASK: Final = "workers.exclusive_section"
SHARED_TASK: Final = "workers.shared_section"
TASK_FOR_MODE: Final[dict[Mode, str]] = {"exclusive": EXCLUSIVE_TASK, "shared": SHARED_TASK}
PAIR_TASK: Final = "workers.pair_section"
"""The exclusive section over two keys: ``pair_section(run_id, key_a, key_b, hold_ms)``."""
UNRELATED_TASK: Final = "workers.unrelated"
DEBOUNCED_TASK: Final = "workers.debounced_section"
"""The exclusive section under ``lock_debounce``: ``debounced_section(run_id, key, hold_ms)``."""
DEBOUNCE_SECONDS: Final = 1.0
"""The debounced section's quiet period: calls of a key sent back to back coalesce within it
also when a loaded worker takes a few hundred ms to record each."""
DEBOUNCE_MAX_SECONDS: Final = 5.0
"""The debounced section's cap on a window."""
RECORD_URL_SETTING: Final = "fleet_record_url"
DEFAULT_WAIT_SECONDS: Final = 30.0
HOLD_SLICE_SECONDS: Final = 0.02
RELEASE_POLL_SECONDS: Final = 0.1
STALL_LOSS_WAIT_SECONDS: Final = 5.0
"""How long a stalled section, once continued, waits to learn that its lease was lost."""


def fence_namespace(run_id: str) -> str:
    """The :class:`~celery_zklock.fence.RedisFence` namespace of run ``run_id``."""
    return f"run:{run_id}"


def run_section(
    task: ZkLockTask,
    run_id: str,
    key: str,
    hold_ms: int,
    mode: Mode,
    release_key: str | None = None,
    stall_key: str | None = None,
) -> dict[str, Any]:
    """The body of the one-key tasks; must run inside a locked run (``task.lock`` is the lease).

    With ``release_key``, the hold ends early once that Redis key exists; with ``stall_key``,
    the section stalls before its write if that key exists when the hold is over (see the
    module doc and :func:`_stall`).

    Raises what the section raised (``LockLost`` when the lease was lost during the hold) after
    recording ``exit``; returns the token, whether the fenced write was accepted, and where it ran.
    """
    assert not isinstance(task.lock, MultiLease), "a section locks one key"
    lease = cast(Lease, task.lock)  # one key's lease (a test's stand-in has its node and token)
    rate, admitted = _admission(task, lease.node)
    return _run_sections(
        task,
        run_id,
        [(key, lease.token, lease.node)],
        hold_ms,
        mode,
        release_key,
        stall_key,
        rate=rate,
        admitted=admitted,
    )


def _admission(task: ZkLockTask, node: str) -> tuple[str | None, int | None]:
    """The rate this run was admitted under (Celery's syntax; None without a ``lock_rate``) and
    its admission's ``ctime`` in ms (None when the rate limit's nodes could not be read: the
    checker then counts the section as unchecked). ``node`` is the run's lock node, whose
    parent is the lock path the rate limit lives under."""
    overrides = request_overrides(task.request) or {}
    raw = overrides.get("rate", getattr(task, "lock_rate", None))
    if raw is None:
        return None, None
    request = task.request
    client = get_client(settings_of(task.app).client)
    lock_path = node.rsplit("/", 1)[0]
    found = find_admission(
        client, lock_path, str(request.id), os.getpid(), int(request.retries or 0)
    )
    return str(parse_rate(raw)), found


def _run_sections(
    task: ZkLockTask,
    run_id: str,
    held: list[tuple[str, int, str]],
    hold_ms: int,
    mode: Mode,
    release_key: str | None = None,
    stall_key: str | None = None,
    *,
    rate: str | None = None,
    admitted: int | None = None,
) -> dict[str, Any]:
    """One section over the keys of ``held`` (``(key, its token, its node)`` each): every
    event is recorded once per key, in ``held``'s order, each with that key's token (and the
    run's ``rate`` and ``admitted``, see :func:`_admission`); each key gets its own fenced write
    (a key's write fenced with its own token)."""
    if hold_ms < 0:
        raise ValueError(f"hold_ms must be >= 0, got {hold_ms}")
    client = _record_client(str(task.app.conf[RECORD_URL_SETTING]))
    recorder = SectionRecorder(client, run_id)
    fence = RedisFence(client, fence_namespace(run_id))
    request = task.request
    enters = [
        SectionEvent(
            kind="enter",
            task_id=str(request.id),
            key=key,
            mode=mode,
            token=token,
            hostname=str(request.hostname or socket.gethostname()),
            pid=os.getpid(),
            node=node,
            time=time.time(),
            rate=rate,
            admitted=admitted,
        )
        for key, token, node in held
    ]
    entered: list[SectionEvent] = []
    outcome = "ok"
    written: list[FenceOutcome] = []
    try:
        for enter in enters:
            _record_enter(recorder, replace(enter, time=time.time()), entered)
        _hold(task, hold_ms / 1000.0, None if release_key is None else _flag(client, release_key))
        stall = stall_key is not None and bool(client.exists(stall_key))
        # Recorded before the writes are sent: every write recorded before this reached the
        # fence before ours, which lets the checker bound our token without trusting the fence.
        valid_until = time.time() + task.lock.valid_for
        for enter in enters:
            recorder.record(
                replace(enter, kind="writing", time=time.time(), valid_until=valid_until)
            )
        loss = _stall(task) if stall else None
        for enter in enters:
            value = json.dumps({"task_id": enter.task_id, "token": enter.token, "mode": mode})
            outcome_of_write = fence.write(enter.key, enter.token, value)
            written.append(outcome_of_write)
            recorder.record(
                replace(
                    enter,
                    kind="write",
                    time=time.time(),
                    accepted=outcome_of_write.accepted,
                    previous_token=outcome_of_write.previous_token,
                )
            )
        if loss is not None:
            raise loss
    except LockLost as exc:
        outcome = loss_outcome(exc, task.lock)
        raise
    except BaseException as exc:
        outcome = f"error:{type(exc).__name__}"
        raise
    finally:
        _record_exits(recorder, entered, outcome)
    return _result(enters[0], written[0]) if len(enters) == 1 else _results(enters, written)


def loss_outcome(exc: LockLost, lease: Any = None) -> str:
    """The ``exit`` outcome of a section that ended with ``exc``: :data:`PREEMPTED_OUTCOME` when
    a newer ``preempt`` call broke the lock (a break request naming it), else ``"lost"``.

    The interruption's ``LockLost`` carries no code (in a threads pool not even a message), so
    the lease's own ``lost_code``/``lost_reason`` are asked first (a Lease or a MultiLease: the
    first of its leases lost), then the exception's."""
    for code, reason in (
        (getattr(lease, "lost_code", None), getattr(lease, "lost_reason", None)),
        (getattr(exc, "code", None), str(exc)),
    ):
        if code == LossCode.BROKEN and PREEMPTED in (reason or ""):
            return PREEMPTED_OUTCOME
    return "lost"


def _record_enter(
    recorder: SectionRecorder, enter: SectionEvent, entered: list[SectionEvent]
) -> None:
    """Append ``enter`` and add it to ``entered`` (whose exits the section records), also when
    the lease's interruption lands while it is written (a preempt may come right after the
    grant): then it is appended unless the first append got through, as in :func:`record_exit`,
    and the LockLost raised once it is in ``entered``."""
    try:
        recorder.record(enter)
    except LockLost:
        recorder.record_once(enter)
        entered.append(enter)
        raise
    entered.append(enter)


def _record_exits(recorder: SectionRecorder, entered: list[SectionEvent], outcome: str) -> None:
    """Record ``exit`` for every key entered; a LockLost interrupting one of them (see
    :func:`record_exit`) is raised once all are recorded."""
    interrupted: LockLost | None = None
    for enter in entered:
        try:
            record_exit(recorder, replace(enter, kind="exit", time=time.time(), outcome=outcome))
        except LockLost as exc:
            interrupted = exc
    if interrupted is not None:
        raise interrupted


def record_exit(recorder: SectionRecorder, exit_event: SectionEvent) -> None:
    """Append ``exit_event``, also when the lease's interruption lands while it is written.

    A body that sees the loss first (``lock.check()`` raises LockLost) is still armed until its
    run ends, so the signal the lease clock sends a moment later raises LockLost again, possibly
    here; the event is then appended unless the first append got through. The interruption
    fires once per loss, so the second append is not interrupted by it.
    """
    try:
        recorder.record(exit_event)
    except LockLost:
        recorder.record_once(exit_event)
        raise


def _hold(task: ZkLockTask, seconds: float, released: Callable[[], bool] | None = None) -> None:
    """Sleep ``seconds`` in short slices, raising ``LockLost`` as soon as the lease is lost, and
    returning early once ``released()`` is true (asked every :data:`RELEASE_POLL_SECONDS`).

    The slices also keep every sleep short, so an interruption aimed at the body (a signal, or an
    asynchronous exception in the threads pool) is not held up by one long C-level sleep.
    """
    now = time.monotonic()
    deadline = now + seconds
    next_poll = now + RELEASE_POLL_SECONDS
    while True:
        task.lock.check()
        now = time.monotonic()
        remaining = deadline - now
        if remaining <= 0:
            return
        if released is not None and now >= next_poll:
            if released():
                return
            next_poll = now + RELEASE_POLL_SECONDS
        time.sleep(min(remaining, HOLD_SLICE_SECONDS))


def _stall(task: ZkLockTask) -> LockLost | None:
    """Stop this process (SIGSTOP) until someone sends SIGCONT; return the loss of the lease
    learned once running again (None if it is still held after :data:`STALL_LOSS_WAIT_SECONDS`).

    The stop lands between the ``writing`` event and the fenced write: a holder paused after
    its last look at its lease. Once resumed, the lease clock interrupts the body (the lease's
    validity ran out while stopped), racing the write; the write must go out whatever wins, as
    a write already on its way would (the point of the fault: only the fence stands between it
    and the data). So the loss is taken here, from the interruption or from ``check()`` (which
    stands the interruption down), and handed back to be raised once the write is recorded.
    ``check()`` reads the lease clock itself, so the first one after a stop past the lease's
    validity raises; it is asked until it raises all the same, for a stop that ends sooner.
    """
    try:
        os.kill(os.getpid(), signal.SIGSTOP)  # returns once continued
        deadline = time.monotonic() + STALL_LOSS_WAIT_SECONDS
        while time.monotonic() < deadline:
            task.lock.check()
            time.sleep(HOLD_SLICE_SECONDS / 4)
    except LockLost as exc:
        return exc
    return None


def _flag(client: redis.Redis, key: str) -> Callable[[], bool]:
    """A callable that is true once ``key`` exists in Redis."""
    return lambda: bool(client.exists(key))


def _result(enter: SectionEvent, written: FenceOutcome) -> dict[str, Any]:
    return {
        "token": enter.token,
        "accepted": written.accepted,
        "hostname": enter.hostname,
        "pid": enter.pid,
    }


def _results(enters: list[SectionEvent], written: list[FenceOutcome]) -> dict[str, Any]:
    """The result of a section over several keys: per key its token and write's verdict."""
    return {
        "tokens": {e.key: e.token for e in enters},
        "accepted": {e.key: w.accepted for e, w in zip(enters, written, strict=False)},
        "hostname": enters[0].hostname,
        "pid": enters[0].pid,
    }


def exclusive_section(
    self: ZkLockTask,
    run_id: str,
    key: str,
    hold_ms: int,
    release_key: str | None = None,
    stall_key: str | None = None,
) -> dict[str, Any]:
    """Hold the exclusive (write) side of ``key``'s lock for ``hold_ms``; see the module doc."""
    return run_section(self, run_id, key, hold_ms, "exclusive", release_key, stall_key)


def shared_section(
    self: ZkLockTask,
    run_id: str,
    key: str,
    hold_ms: int,
    release_key: str | None = None,
    stall_key: str | None = None,
) -> dict[str, Any]:
    """Hold the shared (read) side of ``key``'s lock for ``hold_ms``; see the module doc."""
    return run_section(self, run_id, key, hold_ms, "shared", release_key, stall_key)


def debounced_section(self: ZkLockTask, run_id: str, key: str, hold_ms: int) -> dict[str, Any]:
    """The exclusive section of ``key`` for the last call of a debounce window; see the module
    doc."""
    return run_section(self, run_id, key, hold_ms, "exclusive")


def pair_section(
    self: ZkLockTask,
    run_id: str,
    key_a: str,
    key_b: str,
    hold_ms: int,
) -> dict[str, Any]:
    """Hold the exclusive side of both ``key_a``'s and ``key_b``'s locks (taken together, all or
    nothing) for ``hold_ms``: the section of :func:`run_section`, recorded for each key with
    that key's token. The same key twice is one key (the library takes one lock)."""
    lease = self.lock
    if isinstance(lease, Lease):
        return _run_sections(self, run_id, [(key_a, lease.token, lease.node)], hold_ms, "exclusive")
    assert isinstance(lease, MultiLease)
    single = self.app.tasks[EXCLUSIVE_TASK]
    by_path = {lease.path: lease for lease in lease.leases}
    held = []
    for key in sorted({key_a, key_b}):
        one = by_path[single.lock_path(key=key)]
        held.append((key, one.token, one.node))
    return _run_sections(self, run_id, held, hold_ms, "exclusive")


def unrelated(run_id: str) -> str:
    """A task of no lock: the unrelated traffic whose latency shows whether waiting runs of a
    hot key hold the worker's pool (``run_id`` only labels it)."""
    return run_id


def register_tasks(app: Celery) -> None:
    """Register the sections (the debounced one too) and the unrelated task on ``app`` (under
    their fixed names, on this app only)."""
    common: dict[str, Any] = {
        "bind": True,
        "base": ZkLockTask,
        "shared": False,
        "lock_name": LOCK_NAME,
        "lock_key": ["key"],
        "lock_on_busy": "wait",
        "lock_timeout": DEFAULT_WAIT_SECONDS,
        "lock_on_timeout": "raise",
    }
    app.task(name=EXCLUSIVE_TASK, lock_mode="exclusive", **common)(exclusive_section)
    app.task(name=SHARED_TASK, lock_mode="shared", **common)(shared_section)
    pair = {**common, "lock_key": {"key": ["key_a", "key_b"]}}
    app.task(name=PAIR_TASK, lock_mode="exclusive", **pair)(pair_section)
    app.task(name=UNRELATED_TASK, shared=False)(unrelated)
    debounced = {**common, "lock_debounce": DEBOUNCE_SECONDS,
                 "lock_debounce_max": DEBOUNCE_MAX_SECONDS}  # fmt: skip
    app.task(name=DEBOUNCED_TASK, lock_mode="exclusive", **debounced)(debounced_section)


# One Redis client per (process, URL): a client must not be shared across a fork.
_clients: dict[tuple[int, str], redis.Redis] = {}
_clients_lock = threading.Lock()


def _record_client(url: str) -> redis.Redis:
    key = (os.getpid(), url)
    with _clients_lock:
        client = _clients.get(key)
        if client is None:
            client = _clients[key] = redis.Redis.from_url(url)
        return client
