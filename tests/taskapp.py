"""The Celery app that `celery worker` subprocesses run in the task tests.

Configured from the environment the test sets: TASKAPP_BROKER (broker URL), TASKAPP_BACKEND
(result backend, default the broker URL), ZKLOCK_HOSTS, ZKLOCK_SESSION_TIMEOUT, TASKAPP_DIR (a
directory for witness files and records), TASKAPP_VISIBILITY_TIMEOUT (seconds: a short Redis
visibility timeout, for redelivery tests), TASKAPP_BEAT_EVERY (seconds: schedule
:func:`singleton` that often, for ``celery beat``).
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from pathlib import Path
from typing import Any

from celery import Celery
from celery.exceptions import SoftTimeLimitExceeded
from kazoo.client import KazooClient

from celery_zklock import ZkLockTask, signals
from celery_zklock.locks.rate import Rate
from celery_zklock.task.options import request_overrides
from celery_zklock.testing import introspect  # noqa: F401  (the zklock_live command)
from celery_zklock.testing.witness import Witness
from tests.lockutil import task_client
from workers.settings import broker_transport_options

BROKER = os.environ.get("TASKAPP_BROKER", "redis://127.0.0.1:1/0")
app = Celery("taskapp")
app.conf.update(
    broker_url=BROKER,
    result_backend=os.environ.get("TASKAPP_BACKEND", BROKER),
    task_serializer="json",
    result_serializer="json",
    accept_content=["json"],
    worker_prefetch_multiplier=1,
    result_extended=True,  # results name their task: tests find a beat job's runs by name
    zklock_root="/taskapp",
    broker_connection_retry_on_startup=True,
)
DIR = Path(os.environ.get("TASKAPP_DIR", "/tmp"))
if "TASKAPP_VISIBILITY_TIMEOUT" in os.environ:
    # The fleet's options: restore unacknowledged messages after this long (checked every
    # second for the short timeouts the tests use), a dead sweeper's mutex lapsing in 5 s.
    app.conf.broker_transport_options = broker_transport_options(
        float(os.environ["TASKAPP_VISIBILITY_TIMEOUT"]), BROKER
    )
if "TASKAPP_BEAT_EVERY" in os.environ:
    app.conf.beat_schedule = {
        "singleton": {
            "task": "tests.taskapp.singleton",
            "schedule": float(os.environ["TASKAPP_BEAT_EVERY"]),
            "args": (1.0,),
            "options": {"queue": os.environ.get("TASKAPP_BEAT_QUEUE", "celery")},
        }
    }


def _section(task: Any, key: str, mode: str, hold_s: float) -> dict[str, Any]:
    lease = task.lock
    witness = Witness(DIR / f"witness-{key}")
    holder = f"{task.request.id}-t{lease.token}"
    with witness.section(holder, "write" if mode == "exclusive" else "read"):
        time.sleep(hold_s)
    return {"token": lease.token, "pid": os.getpid()}


@app.task(bind=True, base=ZkLockTask, lock_name="section", lock_key=["key"], lock_on_busy="skip")
def exclusive_section(self: Any, key: str, hold_s: float) -> dict[str, Any]:
    return _section(self, key, "exclusive", hold_s)


@app.task(
    bind=True,
    base=ZkLockTask,
    lock_name="section",
    lock_key=["key"],
    lock_mode="shared",
    lock_on_busy="wait",
)
def shared_section(self: Any, key: str, hold_s: float) -> dict[str, Any]:
    return _section(self, key, "shared", hold_s)


def _write_atomically(path: Path, text: str) -> None:
    """Readers poll for ``path``: it must appear complete, never half written."""
    partial = path.with_name(path.name + ".partial")
    partial.write_text(text)
    partial.rename(path)


@app.task(bind=True, base=ZkLockTask, lock_name="long", lock_key=["key"], lock_on_busy="wait")
def long_hold(self: Any, key: str, seconds: float) -> str:
    """Records its session (id, password, pid) and then runs until interrupted."""
    client = task_client(self)  # the client that holds the lock
    session_id, password = client.client_id
    record = {"session_id": session_id, "password": password.hex(), "pid": os.getpid(),
              "token": self.lock.token, "node": self.lock.node,
              "factory": getattr(client, "built_by_factory", False)}  # fmt: skip
    _write_atomically(DIR / f"session-{self.request.id}", json.dumps(record))
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        time.sleep(0.02)
    return "finished"


def zk_factory() -> KazooClient:
    """``zklock_client_factory`` of the factory tests: a client of its own (marked), each call
    recorded with the pid that made it."""
    _append(DIR / "factory-calls", {"pid": os.getpid()})
    client = KazooClient(
        hosts=os.environ["ZKLOCK_HOSTS"], timeout=float(os.environ["ZKLOCK_SESSION_TIMEOUT"])
    )
    client.built_by_factory = True
    return client


def _append(path: Path, record: dict[str, Any]) -> None:
    """Append one JSON line (a single O_APPEND write, so concurrent writers don't interleave)."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, (json.dumps(record) + "\n").encode())
    finally:
        os.close(fd)


def hold_until_released(key: str, seconds: float) -> None:
    """Return after ``seconds``, or once the test creates the file ``release-<key>``."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and not (DIR / f"release-{key}").exists():
        time.sleep(0.02)


def read_records(path: Path) -> list[dict[str, Any]]:
    """The JSON lines :func:`_append` wrote, in order (none if the file does not exist)."""
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line]


@app.task(bind=True, base=ZkLockTask, lock_name="retry", lock_key=["key"], lock_on_busy="skip")
def retry_once(self: Any, key: str) -> dict[str, Any]:
    """Retries itself once while holding its lock; records each attempt's effective options."""
    _append(
        DIR / f"attempts-{key}",
        {"retries": self.request.retries, "token": self.lock.token,
         "on_busy": self._zklock_compile().for_call(request_overrides(self.request)).on_busy},
    )  # fmt: skip
    if self.request.retries == 0:
        raise self.retry(countdown=0)
    return {"token": self.lock.token, "retries": self.request.retries}


def _held_until_released(
    task: Any, key: str, seconds: float, outlive_soft_limit: bool = False
) -> dict[str, Any]:
    """Records each start of the body (task id, pid, token, session), then holds the lock for
    ``seconds`` or until the file ``release-<key>`` exists (and, with ``outlive_soft_limit``,
    past its soft time limit)."""
    session_id, password = task_client(task).client_id
    _append(DIR / f"starts-{key}", {"task_id": task.request.id, "pid": os.getpid(),
                                    "token": task.lock.token, "session_id": session_id,
                                    "password": password.hex()})  # fmt: skip
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and not (DIR / f"release-{key}").exists():
        try:
            time.sleep(0.02)
        except SoftTimeLimitExceeded:
            if not outlive_soft_limit:
                raise
    return {"token": task.lock.token}


@app.task(
    bind=True, base=ZkLockTask, lock_name="late", lock_key=["key"], lock_on_busy="skip",
    acks_late=True, reject_on_worker_lost=True,
)  # fmt: skip
def acked_late(self: Any, key: str, seconds: float) -> dict[str, Any]:
    """See :func:`_held_until_released`."""
    return _held_until_released(self, key, seconds)


@app.task(
    bind=True, base=ZkLockTask, lock_name="late", lock_key=["key"], lock_on_busy="skip",
    acks_late=True, reject_on_worker_lost=True,
)  # fmt: skip
def acked_late_stubborn(self: Any, key: str, seconds: float) -> dict[str, Any]:
    """:func:`acked_late` whose body holds on past its soft time limit (until killed)."""
    return _held_until_released(self, key, seconds, outlive_soft_limit=True)


@app.task(
    bind=True, base=ZkLockTask, lock_name="late", lock_key=["key"], lock_mode="shared",
    lock_on_busy="wait", acks_late=True, reject_on_worker_lost=True,
)  # fmt: skip
def acked_late_shared(self: Any, key: str, seconds: float) -> dict[str, Any]:
    """:func:`acked_late` on the shared (read) side of the same locks."""
    return _held_until_released(self, key, seconds)


@app.task(bind=True, base=ZkLockTask, lock_name="singleton", lock_key=[], lock_on_busy="skip")
def singleton(self: Any, hold_s: float) -> dict[str, Any]:
    """The periodic job: one run at a time, whatever the schedule."""
    witness = Witness(DIR / "witness-singleton")
    with witness.section(f"{self.request.id}-t{self.lock.token}", "write"):
        time.sleep(hold_s)
    return {"token": self.lock.token}


@app.task(
    bind=True, base=ZkLockTask, lock_name="needs_zk", lock_key=["key"], lock_retry_countdown=0.2,
    max_retries=2,
)  # fmt: skip
def needs_zk(self: Any, key: str) -> str:
    return "ran"


def _record_lost(task_id: Any = None, path: str = "", token: int = 0, **_: Any) -> None:
    _append(DIR / "lost-events", {"task_id": task_id, "path": path, "token": token,
                                  "time": time.time()})  # fmt: skip


signals.lock_lost.connect(_record_lost, weak=False)


@app.task(
    bind=True, base=ZkLockTask, lock_name="dedupe", lock_key=["key"], lock_on_busy="skip",
    lock_dedupe="queued", lock_dedupe_ttl=float(os.environ.get("TASKAPP_DEDUPE_TTL", "3600")),
)  # fmt: skip
def deduped(self: Any, key: str, seconds: float) -> dict[str, Any]:
    """Deduplicated at send time (``queued``; per call ``zklock={"dedupe": "running"}``); see
    :func:`_held_until_released`."""
    return _held_until_released(self, key, seconds)


@app.task(
    bind=True, base=ZkLockTask, lock_name="limited", lock_key=["key"], lock_mode="semaphore",
    lock_limit=2, lock_on_busy="wait",
)  # fmt: skip
def limited_section(self: Any, key: str, hold_s: float) -> dict[str, Any]:
    """At most 2 at once per key: each run is a ``read`` section of ``witness-limited-<key>``
    (the witness counts holders at once as readers) and of ``witness-all``."""
    lease = self.lock
    holder = f"{self.request.id}-t{lease.token}"
    per_key, every_key = Witness(DIR / f"witness-limited-{key}"), Witness(DIR / "witness-all")
    with per_key.section(holder, "read"), every_key.section(holder, "read"):
        time.sleep(hold_s)
    return {"token": lease.token, "pid": os.getpid()}


@app.task(
    bind=True, base=ZkLockTask, lock_name="limited_held", lock_key=["key"], lock_mode="semaphore",
    lock_limit=2, lock_on_busy="skip",
)  # fmt: skip
def limited_held(self: Any, key: str, seconds: float) -> dict[str, Any]:
    """:func:`_held_until_released` under a semaphore of 2 that skips when full."""
    return _held_until_released(self, key, seconds)


# -- celery_zklock.beat.LeaderScheduler (tests/task/test_beat_leader.py) -------------------------
# TASKAPP_BEAT_LEADER="fast=1,slow=10": schedule beat_mark(<entry name>) at those periods (s) on
# TASKAPP_BEAT_QUEUE, which no worker consumes; TASKAPP_BEAT_NAME names the beat group.
from celery.signals import after_task_publish  # noqa: E402 (additions stay at the end)

if "TASKAPP_BEAT_LEADER" in os.environ:
    _periods = (part.split("=") for part in os.environ["TASKAPP_BEAT_LEADER"].split(","))
    app.conf.beat_schedule = {
        name: {
            "task": "tests.taskapp.beat_mark",
            "schedule": float(every),
            "args": (name,),
            "options": {"queue": os.environ["TASKAPP_BEAT_QUEUE"]},
        }
        for name, every in _periods
    }
    app.conf.zklock_beat_name = os.environ["TASKAPP_BEAT_NAME"]


@app.task
def beat_mark(name: str) -> str:
    return name


def _record_beat_send(sender: Any = None, body: Any = None, headers: Any = None, **_: Any) -> None:
    """Every beat_mark message a beat published (after the broker took it): which beat (pid),
    which entry, when, and the message id."""
    if sender == "tests.taskapp.beat_mark" and headers and headers.get("celery_beat_task"):
        _append(DIR / "beat-sends", {"pid": os.getpid(), "entry": body[0][0],
                                     "time": time.time(), "id": headers["id"]})  # fmt: skip


after_task_publish.connect(_record_beat_send, weak=False)


@app.task(
    bind=True, base=ZkLockTask, lock_name="breakable", lock_key=["key"], lock_on_busy="wait",
    lock_timeout=60,
)  # fmt: skip
def breakable(self: Any, key: str, role: str, seconds: float) -> dict[str, Any]:
    """Appends ``enter`` and ``exit`` records (``exit`` also when the body is interrupted, with
    the exception's name) to ``breaks-<key>``, in between holding the lock for ``seconds`` or
    until the file ``release-<key>`` exists. One file for every run of a key: its line order is
    the order the runs wrote in."""
    lease = self.lock
    session_id, _ = task_client(self).client_id
    record = {"task_id": self.request.id, "role": role, "pid": os.getpid(),
              "token": lease.token, "node": lease.node, "session_id": session_id}  # fmt: skip
    records = DIR / f"breaks-{key}"
    _append(records, {"event": "enter", **record, "time": time.time()})
    try:
        hold_until_released(key, seconds)
    except BaseException as exc:
        _append(records, {"event": "exit", **record, "error": type(exc).__name__,
                          "time": time.time()})  # fmt: skip
        raise
    _append(records, {"event": "exit", **record, "error": None, "time": time.time()})
    return {"token": lease.token}


@app.task(
    bind=True, base=ZkLockTask, lock_name="late_limited", lock_key=["key"],
    lock_mode="semaphore", lock_limit=2, lock_on_busy="wait", acks_late=True,
    reject_on_worker_lost=True,
)  # fmt: skip
def acked_late_limited(self: Any, key: str, seconds: float) -> dict[str, Any]:
    """:func:`acked_late` under a semaphore of 2: a copy of its message would fit beside it."""
    return _held_until_released(self, key, seconds)


@app.task(
    bind=True, base=ZkLockTask, lock_name="gated", lock_key=["key"], lock_on_busy="wait",
    lock_timeout=120, acks_late=True, reject_on_worker_lost=True,
)  # fmt: skip
def gated_section(self: Any, key: str, hold_s: float) -> dict[str, Any]:
    """A ``wait`` task of the gate tests: one witnessed section, its end recorded (task id)."""
    return _gated_body(self, key, hold_s)


def _gated_body(task: Any, key: str, hold_s: float) -> dict[str, Any]:
    """The body of :func:`gated_section`, for any task on its lock."""
    result = _section(task, key, "exclusive", hold_s)
    _append(DIR / f"gated-done-{key}", {"task_id": task.request.id, "end": time.time()})
    return result


@app.task(
    bind=True, base=ZkLockTask, lock_name="gated", lock_key=["key"], lock_on_busy="wait",
    lock_timeout=120,
)  # fmt: skip
def gated_section_early(self: Any, key: str, hold_s: float) -> dict[str, Any]:
    """:func:`gated_section` without ``acks_late`` (Celery's default: acknowledged when its run
    starts)."""
    return _gated_body(self, key, hold_s)


@app.task(
    bind=True, base=ZkLockTask, lock_name="gated", lock_key={"key": ["src", "dst"]},
    lock_on_busy="wait", lock_timeout=120,
)  # fmt: skip
def transfer(self: Any, src: str, dst: str, hold_s: float) -> dict[str, Any]:
    """Locks the keys ``src`` and ``dst`` of :func:`gated_section`'s locks at once: one
    witnessed section on each (one on both when they are equal); returns each path's token."""
    tokens = self.lock.tokens
    holder = f"{self.request.id}-t{'-'.join(map(str, tokens.values()))}"
    with contextlib.ExitStack() as sections:
        for key in sorted({src, dst}):
            sections.enter_context(Witness(DIR / f"witness-{key}").section(holder, "write"))
        time.sleep(hold_s)
    return {"tokens": tokens}


@app.task(
    bind=True, base=ZkLockTask, lock_name="gated", lock_key=["key"], lock_mode="shared",
    lock_on_busy="wait", lock_timeout=120, acks_late=True, reject_on_worker_lost=True,
)  # fmt: skip
def gated_reader(self: Any, key: str, hold_s: float) -> dict[str, Any]:
    """The read side of :func:`gated_section`'s locks."""
    return _section(self, key, "shared", hold_s)


@app.task(
    bind=True, base=ZkLockTask, lock_name="gated", lock_key=["key"], lock_on_busy="wait",
    acks_late=True, reject_on_worker_lost=True,
)  # fmt: skip
def gated_stamp(self: Any, key: str) -> float:
    """A ``wait`` no-op on :func:`gated_section`'s locks: when its body started."""
    return time.time()


@app.task
def unlocked_hold(key: str) -> None:
    """A plain task holding a pool slot until the file ``release-<key>`` exists (2 min at
    most); records its start in ``plain-<key>``."""
    _append(DIR / f"plain-{key}", {"start": time.time()})
    hold_until_released(key, 120.0)


@app.task(acks_late=True)
def unlocked_noop() -> float:
    """Unrelated traffic: returns when it ran (this host's clock)."""
    return time.time()


@app.task(
    bind=True, base=ZkLockTask, lock_name="rated", lock_key=["key"], lock_mode="shared",
    lock_rate="2/s", lock_on_busy="skip",
)  # fmt: skip
def rated(self: Any, key: str) -> dict[str, Any]:
    """At most 2 runs a second per key (readers, so that only the rate refuses): records when
    its body started (this host's clock)."""
    _append(DIR / f"rated-{key}", {"task_id": self.request.id, "start": time.time()})
    return {"token": self.lock.token}


@app.task(bind=True)
def received(self: Any, value: Any, tag: str = "") -> dict[str, Any]:
    """A step after a locked one (chain, chord body): records and returns what it got."""
    _append(DIR / "received", {"task_id": self.request.id, "tag": tag, "value": value})
    return {"received": value}


@app.task(bind=True, zklock_accepts_skipped=True)
def received_skips(self: Any, value: Any, tag: str = "") -> dict[str, Any]:
    """:func:`received`, opted in to get skip markers (celery_zklock.task.canvas)."""
    _append(DIR / "received", {"task_id": self.request.id, "tag": tag, "value": value})
    return {"received": value}


@app.task(
    bind=True, base=ZkLockTask, lock_name="gated", lock_key=["key"], lock_on_busy="wait",
    lock_timeout=120, acks_late=True, reject_on_worker_lost=True,
)  # fmt: skip
def gated_failing(self: Any, key: str, hold_s: float) -> None:
    """A ``wait`` task whose body records its start, holds ``hold_s`` and raises: a FAILURE
    that a copy handed out again must not run a second time."""
    _fail_after(self, key, hold_s)


def _fail_after(task: Any, key: str, hold_s: float) -> None:
    _append(DIR / f"starts-{key}", {"task_id": task.request.id, "token": task.lock.token})
    time.sleep(hold_s)
    raise ValueError(f"{task.name} {key} fails on purpose")


@app.task(
    bind=True, base=ZkLockTask, lock_name="gated", lock_key=["key"], lock_on_busy="wait",
    lock_timeout=120, acks_late=True, reject_on_worker_lost=True, track_started=True,
)  # fmt: skip
def gated_failing_tracked(self: Any, key: str, hold_s: float) -> None:
    """:func:`gated_failing` with ``track_started``: Celery writes STARTED for a copy's run
    before the run looks for its original's final state."""
    _fail_after(self, key, hold_s)


@app.task(
    bind=True, base=ZkLockTask, lock_name="gated", lock_key=["key"], lock_on_busy="wait",
    lock_timeout=300, acks_late=True, reject_on_worker_lost=True,
)  # fmt: skip
def gated_step(self: Any, key: str, seq: int, hold_s: float) -> int:
    """A ``wait`` task of the order tests: records ``seq`` when its body starts and when it
    ends (with its worker), holds ``hold_s`` or until the file ``release-<key>`` exists."""
    return _step(self, key, seq, hold_s)


def _step(self: Any, key: str, seq: int, hold_s: float) -> int:
    """The body of :func:`gated_step`, for any task on its lock."""
    request = self.request
    start = {"seq": seq, "at": "start", "task_id": request.id, "worker": request.hostname}
    _append(DIR / f"steps-{key}", {**start, "token": self.lock.token})
    hold_until_released(key, hold_s)
    _append(DIR / f"steps-{key}", {"seq": seq, "at": "end", "task_id": self.request.id})
    return seq


class _EndsLate(ZkLockTask):
    """A locked task whose run, after its lock is released, is held up in ``after_return`` (as a
    slow result store would) until the file ``release-end-<key>`` exists."""

    def after_return(self, *args: Any, **kwargs: Any) -> None:
        hold_until_released(f"end-{self.request.args[0]}", 60.0)


@app.task(
    bind=True, base=_EndsLate, lock_name="gated", lock_key=["key"], lock_on_busy="wait",
    lock_timeout=300,
)  # fmt: skip
def gated_ends_late(self: Any, key: str, seq: int, hold_s: float) -> int:
    """:func:`gated_step` (same lock), whose run ends only once ``release-end-<key>`` exists,
    well after its lock was released."""
    return _step(self, key, seq, hold_s)


@app.task(
    bind=True, base=ZkLockTask, lock_name="gated", lock_key=["key"], lock_on_busy="wait",
    lock_timeout=3, lock_on_timeout="skip",
)  # fmt: skip
def gated_retrying(self: Any, key: str, countdown: float, retry_queue: str) -> dict[str, Any]:
    """Its first attempt retries after ``countdown`` s (longer than its 3 s ``lock_timeout``)
    on ``retry_queue``; the retry's wait must count from the retry's own receipt, not the
    first attempt's."""
    _append(DIR / f"attempts-{key}", {"retries": self.request.retries})
    if self.request.retries == 0:
        raise self.retry(countdown=countdown, queue=retry_queue)
    return {"token": self.lock.token, "retries": self.request.retries}


@app.task(
    bind=True, base=ZkLockTask, lock_name="preempting", lock_key=["key"], lock_on_busy="preempt",
    lock_on_lost="retry", lock_retry_countdown=2.0, lock_timeout=120, max_retries=None,
)  # fmt: skip
def preempting_section(self: Any, key: str, hold_s: float) -> dict[str, Any]:
    """A ``preempt`` task whose preempted runs retry without limit: records each attempt whose
    body starts (task id, retries, token), then holds one witnessed section of ``hold_s``. The
    retry's countdown leaves the preempting call time to enter the lock's queue (it breaks the
    holder first, then queues), also on a loaded machine."""
    request = self.request
    record = {"task_id": request.id, "retries": request.retries, "token": self.lock.token}
    _append(DIR / f"preempt-starts-{key}", record)
    return _section(self, key, "exclusive", hold_s)


@app.task(
    bind=True, base=ZkLockTask, lock_name="throttled", lock_key=["key"], lock_on_busy="wait",
    lock_rate=Rate(1, 3.0), lock_timeout=60,
)  # fmt: skip
def throttled(self: Any, key: str, seq: int) -> int:
    """One run per 3 s per key, waiting for its window (the throttle): records its start."""
    _record_throttled(self, key, seq)
    return seq


def _record_throttled(task: Any, key: str, seq: int) -> None:
    request = task.request
    record = {"seq": seq, "start": time.time(), "retries": request.retries, "task_id": request.id}
    _append(DIR / f"throttled-{key}", record)


@app.task(
    bind=True, base=ZkLockTask, lock_name="throttled_retrying", lock_key=["key"],
    lock_on_busy="wait", lock_rate=Rate(1, 3.0), lock_timeout=4, lock_on_timeout="skip",
)  # fmt: skip
def throttled_retrying(self: Any, key: str, seq: int) -> int:
    """As :func:`throttled` (records in ``throttled-<key>``), with a 4 s ``lock_timeout``
    (skip); the first attempt of ``seq`` 1 retries at once, to wait for a window again."""
    _record_throttled(self, key, seq)
    if seq == 1 and not self.request.retries:
        raise self.retry(countdown=0)
    return seq


@app.task(
    bind=True, base=ZkLockTask, lock_name="debounced", lock_key=["key"], lock_debounce=1.0,
    lock_debounce_max=3.0, acks_late=True, reject_on_worker_lost=True,
)  # fmt: skip
def debounced(self: Any, key: str, value: int) -> dict[str, Any]:
    """A debounced task (1 s of quiet, at most 3 s a window): records each body that starts
    (task id, value, when, worker) in ``debounced-<key>``."""
    return _debounced_body(self, f"debounced-{key}", value)


def _debounced_body(task: Any, records: str, value: int) -> dict[str, Any]:
    """A debounced task's body: appends (task id, value, when, worker) to ``records``."""
    record = {"task_id": task.request.id, "value": value, "start": time.time(),
              "worker": task.request.hostname}  # fmt: skip
    _append(DIR / records, record)
    return {"value": value}


@app.task(
    bind=True, base=ZkLockTask, lock_name="replacing", lock_key=["key"], lock_on_busy="replace",
    lock_timeout=60, acks_late=True, reject_on_worker_lost=True,
)  # fmt: skip
def replacing(self: Any, key: str, seq: int, hold_s: float) -> int:
    """A ``replace`` task: records each body that starts (task id, seq) in ``replacing-<key>``,
    then holds one witnessed section of ``hold_s`` or until the file ``release-<key>`` exists."""
    _append(DIR / f"replacing-{key}", {"task_id": self.request.id, "seq": seq})
    holder = f"{self.request.id}-t{self.lock.token}"
    with Witness(DIR / f"witness-{key}").section(holder, "write"):
        hold_until_released(key, hold_s)
    return seq


@app.task(
    bind=True, base=ZkLockTask, lock_name="debounced_half", lock_key=["key"], lock_debounce=0.5,
    acks_late=True, reject_on_worker_lost=True,
)  # fmt: skip
def debounced_half(self: Any, key: str, value: int) -> dict[str, Any]:
    """:func:`debounced` with half a second of quiet (and the default cap): records each body
    that starts in ``debounced-half-<key>``."""
    return _debounced_body(self, f"debounced-half-{key}", value)


@app.task(
    bind=True, base=ZkLockTask, lock_name="throttled_fast", lock_key=["key"], lock_on_busy="wait",
    lock_rate="5/s", lock_timeout=60,
)  # fmt: skip
def throttled_fast(self: Any, key: str, seq: int) -> int:
    """Five runs a second per key, waiting for their window (the throttle): records each body
    (seq, retries, when it started on this host's clock) with its admission's ``ctime`` (ms,
    ZooKeeper's clock) read back from the rate limit's nodes, in ``throttled-fast-<key>``."""
    from workers.admissions import find_admission

    request = self.request
    retries = int(request.retries or 0)
    lock_path = self.lock.node.rsplit("/", 1)[0]  # the path the client sees the rate under
    admitted = find_admission(task_client(self), lock_path, str(request.id), os.getpid(), retries)
    record = {"seq": seq, "start": time.time(), "retries": retries, "admitted": admitted,
              "task_id": request.id}  # fmt: skip
    _append(DIR / f"throttled-fast-{key}", record)
    return seq


@app.task(
    bind=True, base=ZkLockTask, lock_name="debounced_hold", lock_key=["key"], lock_debounce=3.0,
    lock_debounce_max=10.0, acks_late=True, reject_on_worker_lost=True,
)  # fmt: skip
def debounced_hold(self: Any, key: str, value: int) -> dict[str, Any]:
    """A debounced task (3 s of quiet) whose body records itself in ``debounced-hold-<key>``
    and then holds its lock until the file ``release-<key>`` exists (at most 30 s)."""
    _append(DIR / f"debounced-hold-{key}", {"task_id": self.request.id, "value": value})
    hold_until_released(key, 30.0)
    return {"value": value}
