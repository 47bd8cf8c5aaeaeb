"""The fleet's locked tasks: a critical section, exclusive or shared, recorded into Redis.

Both tasks share one lock name (:data:`LOCK_NAME`) and ``lock_key=["key"]``, so for one key the
exclusive task takes the write side and the shared task the read side of the same read-write
lock. A section (:func:`run_section`) records ``enter``, holds, records ``writing``, writes
through the run's fence, records the write, and records ``exit``; the write comes last on
purpose (``docs/fleet.md``). Records go to the Redis at the app setting ``fleet_record_url``. A
section planted by a fault injector is given a ``release_key``: the hold ends early once that
Redis key exists; and may be given a ``stall_key``: if that key exists once the hold is over,
the section stops its own process (SIGSTOP) between its ``writing`` event and the write, for the
``stall_before_write`` fault (``workers/faults.py``), and sends the write when it runs again.
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
from typing import Any, Final

import redis
from celery import Celery

from celery_zklock import LockLost, ZkLockTask
from celery_zklock.fence import FenceOutcome, RedisFence
from workers.record import Mode, SectionEvent, SectionRecorder

__all__ = [
    "EXCLUSIVE_TASK",
    "HOLD_SLICE_SECONDS",
    "LOCK_NAME",
    "RECORD_URL_SETTING",
    "RELEASE_POLL_SECONDS",
    "SHARED_TASK",
    "TASK_FOR_MODE",
    "fence_namespace",
    "record_exit",
    "register_tasks",
    "run_section",
]

LOCK_NAME: Final = "workers.section"
EXCLUSIVE_TASK: Final = "workers.exclusive_section"
SHARED_TASK: Final = "workers.shared_section"
TASK_FOR_MODE: Final[dict[Mode, str]] = {"exclusive": EXCLUSIVE_TASK, "shared": SHARED_TASK}
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
    """The body of both tasks; must run inside a locked run (``task.lock`` is the lease).

    With ``release_key``, the hold ends early once that Redis key exists; with ``stall_key``,
    the section stalls before its write if that key exists when the hold is over (see the
    module doc and :func:`_stall`).

    Raises what the section raised (``LockLost`` when the lease was lost during the hold) after
    recording ``exit``; returns the token, whether the fenced write was accepted, and where it ran.
    """
    if hold_ms < 0:
        raise ValueError(f"hold_ms must be >= 0, got {hold_ms}")
    lease = task.lock
    client = _record_client(str(task.app.conf[RECORD_URL_SETTING]))
    recorder = SectionRecorder(client, run_id)
    fence = RedisFence(client, fence_namespace(run_id))
    request = task.request
    enter = SectionEvent(
        kind="enter",
        task_id=str(request.id),
        key=key,
        mode=mode,
        token=lease.token,
        hostname=str(request.hostname or socket.gethostname()),
        pid=os.getpid(),
        node=lease.node,
        time=time.time(),
    )
    recorder.record(enter)
    outcome = "ok"
    try:
        _hold(task, hold_ms / 1000.0, None if release_key is None else _flag(client, release_key))
        value = json.dumps({"task_id": enter.task_id, "token": lease.token, "mode": mode})
        stall = stall_key is not None and bool(client.exists(stall_key))
        # Recorded before the write is sent: every write recorded before this reached the fence
        # before ours, which lets the checker bound our token without trusting the fence.
        recorder.record(replace(enter, kind="writing", time=time.time()))
        loss = _stall(task) if stall else None
        written = fence.write(key, lease.token, value)
        recorder.record(
            replace(
                enter,
                kind="write",
                time=time.time(),
                accepted=written.accepted,
                previous_token=written.previous_token,
            )
        )
        if loss is not None:
            raise loss
    except LockLost:
        outcome = "lost"
        raise
    except BaseException as exc:
        outcome = f"error:{type(exc).__name__}"
        raise
    finally:
        record_exit(recorder, replace(enter, kind="exit", time=time.time(), outcome=outcome))
    return _result(enter, written)


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


def register_tasks(app: Celery) -> None:
    """Register both tasks on ``app`` (under their fixed names, on this app only)."""
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
