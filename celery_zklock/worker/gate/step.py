"""The gate's place in a worker: a consumer bootstep, added to every worker whose app has a
``ZkLockTask`` (unless ``zklock_gate = False``), and the ``zklock_held`` inspect command that
``celery zklock locks`` asks for the messages held per key. Nothing here is connected at import:
:func:`celery_zklock.worker.wiring.install` connects :data:`RECEIVERS` and registers the command."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

from celery import bootsteps
from celery.signals import task_received, worker_init, worker_ready

from celery_zklock.errors import ConfigurationError
from celery_zklock.task.options import RECEIPT_FIELD, check_redelivery
from celery_zklock.task.task import ZkLockTask, has_locked_tasks
from celery_zklock.worker.gate.gate import Gate
from celery_zklock.zk import outages
from celery_zklock.zk.client import new_client
from celery_zklock.zk.settings import settings_of

logger = logging.getLogger("celery_zklock.gate")

CONSUMER_ATTRIBUTE = "zklock_gate"
"""The consumer's attribute that holds its :class:`Gate`."""


class GateStep(bootsteps.StartStopStep):  # type: ignore[misc]
    """Puts a :class:`Gate` in front of the consumer's ``on_task_request`` when the consumer is
    made, so that every way a request reaches the pool (at once, after its ETA, after a rate
    limit) passes it; starts it once the consumer's QoS exists."""

    label = "zklock gate"
    requires = ("celery.worker.consumer.tasks:Tasks",)

    def __init__(self, consumer: Any, **kwargs: Any) -> None:
        super().__init__(consumer, **kwargs)
        self.gate: Gate | None = None
        if consumer.hub is None:
            # gevent and eventlet workers (no event loop): a waiting run is a greenlet there,
            # and the gate's answers could not reach the consumer promptly.
            return
        self.gate = Gate(consumer, settings_of(consumer.app, connection=False).gate)
        setattr(consumer, CONSUMER_ATTRIBUTE, self.gate)
        consumer.on_task_request = self.gate.wrap(consumer.on_task_request)

    def start(self, consumer: Any) -> None:
        if self.gate is not None:
            self.gate.start()

    def stop(self, consumer: Any) -> None:
        if self.gate is not None:
            self.gate.stop()

    def shutdown(self, consumer: Any) -> None:
        self.stop(consumer)


def install(sender: Any = None, **_: Any) -> None:
    """``worker_init``: add the gate to a worker whose app has a ``ZkLockTask``, unless the
    app sets ``zklock_gate = False``; warn of a locked task that acknowledges late without
    ``reject_on_worker_lost`` through the app's settings (:func:`~celery_zklock.task.options.
    check_redelivery`; set on the task, it was said when the task was defined)."""
    app = getattr(sender, "app", None)
    if app is None or not has_locked_tasks(app):
        return
    for task in app.tasks.values():
        if isinstance(task, ZkLockTask):  # bound now: acks_late from the app's settings too
            check_redelivery(task.name, task)
    try:
        config = settings_of(app, connection=False).gate
    except ConfigurationError as exc:
        raise SystemExit(f"celery-zklock: {exc}") from None
    if config.enabled and config.asked_outage_budget > config.outage_budget:
        logger.warning(
            "celery-zklock: zklock_outage_budget=%gs is longer than the gate may hold a message "
            "(%gs, before the broker would hand it out again): calls ride an outage out for "
            "%gs, then lock_on_unavailable applies",
            config.asked_outage_budget,
            config.max_hold,
            config.outage_budget,
        )
    if config.enabled:
        app.steps["consumer"].add(GateStep)
        task_received.connect(note_receipt, weak=False, dispatch_uid="celery-zklock-receipt")


def note_receipt(sender: Any = None, request: Any = None, **_: Any) -> None:
    """``task_received`` (the worker's main process, as the message arrives, before any ETA
    wait): note when, for the gate's broker bound
    (:data:`~celery_zklock.task.options.RECEIPT_FIELD`)."""
    if request is not None and isinstance(request.task, ZkLockTask):
        request.request_dict[RECEIPT_FIELD] = time.time()


def probe_when_ungated(sender: Any = None, **_: Any) -> None:
    """``worker_ready``: without the gate (which connects at start and says so when it cannot),
    try ZooKeeper once from a thread with a client of its own, closed again, and say once if it
    cannot be reached (:func:`celery_zklock.zk.outages.warn_unreachable`). The worker runs on:
    ZooKeeper may come up after it."""
    app = getattr(sender, "app", None)
    if app is None or not has_locked_tasks(app):
        return
    if settings_of(app, connection=False).gate.enabled:
        return
    threading.Thread(target=_probe, args=(app,), name="zklock-probe", daemon=True).start()


def _probe(app: Any) -> None:
    config = settings_of(app).client
    client = None
    try:
        client = new_client(config)  # a client factory's may fail too: said the same way
        client.start(timeout=config.connect_timeout)
    except Exception as exc:
        meanwhile = "locked tasks end ZooKeeperUnavailable (retried) until it answers"
        outages.warn_unreachable(config, exc, meanwhile)
    finally:
        if client is not None:
            client.stop()
            client.close()


def zklock_held(state: Any) -> dict[str, Any]:
    """This worker's gate, per lock path: ``{"held": count, "oldest": seconds, "messages":
    [{"task_id", "task", "held_for", "position"}, ...]}``, the messages in line order
    (``position`` 1 goes to the pool first). ``held`` and ``oldest`` are the whole reply of a
    worker of a version before ``messages``: readers take both shapes (:func:`merge_held`)."""
    gate = getattr(state.consumer, CONSUMER_ATTRIBUTE, None)
    if gate is None:
        return {}
    return {
        path: {
            "held": len(line),
            "oldest": round(max(held_for for _, _, held_for in line), 3),
            "messages": [
                {
                    "task_id": task_id,
                    "task": task,
                    "held_for": round(held_for, 3),
                    "position": position,
                }
                for position, (task_id, task, held_for) in enumerate(line, start=1)
            ],
        }
        for path, line in gate.held_by_key().items()
    }


#: This module's worker signal receivers, in order, for :func:`celery_zklock.worker.wiring.install`.
RECEIVERS: Final = ((worker_init, install), (worker_ready, probe_when_ungated))


HELD_REPLY_TIMEOUT: Final = 1.0
"""Seconds ``celery zklock locks`` waits for the workers' gates to say what they hold."""


@dataclass(frozen=True)
class HeldMessage:
    """One message held at a worker's gate: its call (``task_id``, ``task``), the ``worker``
    whose gate holds it, for ``held_for`` seconds (since it reached the gate), ``position`` in
    that gate's line for its key (1 goes to the pool first, once the lock can be granted)."""

    task_id: str
    task: str
    worker: str
    held_for: float
    position: int


@dataclass(frozen=True)
class HeldMessages:
    """What the workers' gates hold for one lock path: ``count`` messages, the ``oldest`` held
    for that many seconds, in ``workers``; ``messages`` names them, ordered by position in
    their gate's line, then worker (each gate's line goes in its own order; between gates the
    order is the race for the lock). A worker of a version before named messages counts its
    messages in ``count`` and names none."""

    path: str
    count: int
    oldest: float
    workers: tuple[str, ...]
    messages: tuple[HeldMessage, ...] = ()

    @property
    def unnamed(self) -> int:
        """Messages counted by workers that name none (an older version)."""
        return self.count - len(self.messages)


def held_messages(app: Any, timeout: float = HELD_REPLY_TIMEOUT) -> list[HeldMessages]:
    """The messages held at the gates of the app's workers that answer within ``timeout``
    seconds, by lock path (:func:`merge_held`); empty when the broker cannot be reached
    (logged)."""
    try:
        with app.connection_for_write() as connection:
            connection.ensure_connection(max_retries=1)
            replies = app.control.broadcast(
                "zklock_held", reply=True, timeout=timeout, connection=connection
            )
    except Exception as exc:
        logger.warning("could not ask the workers' gates what they hold: %r", exc)
        return []
    return merge_held(replies or [])


def merge_held(replies: Sequence[Mapping[str, Any]]) -> list[HeldMessages]:
    """The ``zklock_held`` replies (``[{worker: {path: held}}]``) merged by lock path, sorted by
    path. A worker's ``held`` may be this version's (with ``messages``) or an older one's
    (``held`` and ``oldest`` only: a rolling deploy): both count; only the first names."""
    merged: dict[str, list[tuple[str, int, float]]] = {}
    named: dict[str, list[HeldMessage]] = {}
    for reply in replies:
        for worker, paths in reply.items():
            for path, held in (paths or {}).items():
                merged.setdefault(path, []).append((worker, held["held"], held["oldest"]))
                named.setdefault(path, []).extend(
                    HeldMessage(m["task_id"], m["task"], worker, m["held_for"], m["position"])
                    for m in held.get("messages") or ()
                )
    return [
        HeldMessages(
            path,
            sum(count for _, count, _ in rows),
            max(oldest for _, _, oldest in rows),
            tuple(sorted(worker for worker, _, _ in rows)),
            tuple(sorted(named[path], key=lambda m: (m.position, m.worker))),
        )
        for path, rows in sorted(merged.items())
    ]
