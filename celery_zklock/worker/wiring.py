"""One function wires the workers: :func:`install` connects every worker signal receiver of the
library and registers the gate's inspect command, once per process, the first time a
``ZkLockTask`` is bound to an app (the package hands it to
:func:`celery_zklock.task.task.when_bound`). A ``celery worker`` finalizes its app, which binds
its tasks, before ``worker_init``: so a worker of an app with locked tasks gets the gate, the
metrics and the checks below, and a process that never binds a locked task gets nothing.

The receivers act only on workers whose app has a ``ZkLockTask`` (the metrics endpoint: on
``zklock_metrics_port``), whatever app bound one first. Their order per signal is the order of
:data:`RECEIVERS`.
"""

from __future__ import annotations

import threading
from typing import Any, Final

from celery.signals import task_prerun, worker_init, worker_process_shutdown, worker_shutdown
from celery.worker.control import inspect_command

from celery_zklock.errors import ConfigurationError
from celery_zklock.task import canvas, interrupt
from celery_zklock.task.task import has_locked_tasks
from celery_zklock.worker import metrics
from celery_zklock.worker.gate import step
from celery_zklock.zk.client import close_clients
from celery_zklock.zk.settings import settings_of

__all__ = ["RECEIVERS", "install"]


def refuse_bad_interrupt_signal(**_: Any) -> None:
    """``worker_init``: a worker refuses to start on an unusable ``ZKLOCK_INTERRUPT_SIGNAL``
    (:func:`celery_zklock.task.interrupt.interrupt_signal`)."""
    try:
        interrupt.interrupt_signal()
    except ConfigurationError as exc:
        # Celery logs and ignores exceptions of signal receivers: end the worker instead.
        raise SystemExit(f"celery-zklock: {exc}") from None


def check_settings(sender: Any = None, **_: Any) -> None:
    """``worker_init``: a worker whose app has locked tasks refuses to start on invalid settings
    (an ACL that needs credentials it lacks, a CA file that is not there...), rather than fail
    each task. ``celery worker -E`` also turns on the lock's task events
    (celery_zklock.task.visibility)."""
    app = getattr(sender, "app", None)
    if app is None or not has_locked_tasks(app):
        return
    if getattr(sender, "task_events", False):
        app.conf.worker_send_task_events = True  # -E reaches the pool processes this way
    try:
        settings_of(app)
    except ConfigurationError as exc:
        # Celery logs and ignores exceptions of signal receivers: end the worker instead.
        raise SystemExit(f"celery-zklock: {exc}") from None


def close_clients_on_shutdown(**_: Any) -> None:
    """``worker_process_shutdown``, ``worker_shutdown``: close the process's ZooKeeper clients."""
    close_clients()


RECEIVERS: Final = (
    (worker_init, refuse_bad_interrupt_signal),
    *metrics.RECEIVERS,
    (worker_init, check_settings),
    (worker_process_shutdown, close_clients_on_shutdown),
    (worker_shutdown, close_clients_on_shutdown),
    *step.RECEIVERS,
    (task_prerun, canvas.hide_markers),
)
"""Every worker signal receiver of the library, ``(signal, receiver)``, in connection order."""

_installed = False
_lock = threading.Lock()


def install(app: Any = None) -> None:
    """Connect :data:`RECEIVERS` and register the gate's ``zklock_held`` inspect command, once
    per process (later calls do nothing). ``app``: the app a ``ZkLockTask`` was bound to (the
    receivers read each worker's own app)."""
    global _installed
    with _lock:
        if _installed:
            return
        for signal, receiver in RECEIVERS:
            signal.connect(receiver, weak=False)
        inspect_command()(step.zklock_held)
        _installed = True
