"""One function wires the workers: :func:`install` connects every worker signal receiver of the
library and registers the gate's inspect command, once per process, the first time a
``ZkLockTask`` is bound to an app (the package hands it to
:func:`celery_zklock.task.task.when_bound`). A ``celery worker`` finalizes its app, which binds
its tasks, before ``worker_init``: so a worker of an app with locked tasks gets the gate, the
metrics and the checks below, and a process that never binds a locked task gets nothing.

The receivers act only on workers whose app has a ``ZkLockTask`` (the metrics endpoint: on
``zklock_metrics_port``), whatever app bound one first. Their order per signal is the order of
:data:`RECEIVERS`.

A mistake stops a worker with one line ``celery-zklock: <what is wrong>`` and no traceback:
an invalid setting (:func:`check_settings`, which also warns of each misspelt setting name), or
a task option the validator refuses. The latter is found when Celery makes the task's class or
binds it (:func:`check_lock_options`), inside ``app.finalize()``, which a worker calls before it
sends any signal a library could receive: so the one place that can turn that
:class:`~celery_zklock.errors.ConfigurationError` into one line is the process's
``sys.excepthook``, chained to the one before it, and set when this module is imported (it acts
only in a process running Celery's command line, and only on a ``ConfigurationError``).
"""

from __future__ import annotations

import sys
import threading
import weakref
from types import TracebackType
from typing import Any, Final

from celery.signals import task_prerun, worker_init, worker_process_shutdown, worker_shutdown
from celery.worker.control import inspect_command

from celery_zklock.errors import ConfigurationError
from celery_zklock.task import canvas, interrupt
from celery_zklock.task.options import TASK_ATTRIBUTES, options_from_task
from celery_zklock.task.task import ZkLockTask, has_locked_tasks
from celery_zklock.worker import metrics
from celery_zklock.worker.gate import step
from celery_zklock.zk import known
from celery_zklock.zk.client import close_clients
from celery_zklock.zk.settings import forget_settings, settings_of

__all__ = ["RECEIVERS", "check_lock_options", "install"]


def read_settings_afresh(sender: Any = None, **_: Any) -> None:
    """``worker_init``, first: a worker reads its app's settings afresh, as it reads ``app.conf``
    (a setting changed in this process since the app's first locked call counts)."""
    if getattr(sender, "app", None) is not None:
        forget_settings(sender.app)


def refuse_bad_interrupt_signal(**_: Any) -> None:
    """``worker_init``: a worker refuses to start on an unusable ``ZKLOCK_INTERRUPT_SIGNAL``
    (:func:`celery_zklock.task.interrupt.interrupt_signal`)."""
    try:
        interrupt.interrupt_signal()
    except ConfigurationError as exc:
        # Celery logs and ignores exceptions of signal receivers: end the worker instead.
        raise SystemExit(f"celery-zklock: {exc}") from None


def check_settings(sender: Any = None, **_: Any) -> None:
    """``worker_init``: a worker whose app has locked tasks warns once of each name in its
    ``app.conf`` and environment that looks like a celery-zklock setting and is none (with the
    setting it most likely means: :func:`celery_zklock.zk.known.warn_unknown`), and refuses to
    start on invalid settings (an ACL that needs credentials it lacks, a CA file that is not
    there...), rather than fail each task. ``celery worker -E`` also turns on the lock's task
    events (celery_zklock.task.visibility)."""
    app = getattr(sender, "app", None)
    if app is None or not has_locked_tasks(app):
        return
    if getattr(sender, "task_events", False):
        app.conf.worker_send_task_events = True  # -E reaches the pool processes this way
    known.warn_unknown(app.conf)
    try:
        settings_of(app)
    except ConfigurationError as exc:
        # Celery logs and ignores exceptions of signal receivers: end the worker instead.
        raise SystemExit(f"celery-zklock: {exc}") from None


def close_clients_on_shutdown(**_: Any) -> None:
    """``worker_process_shutdown``, ``worker_shutdown``: close the process's ZooKeeper clients."""
    close_clients()


RECEIVERS: Final = (
    (worker_init, read_settings_afresh),
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
    per process (later calls do nothing); then :func:`check_lock_options` of ``app``, the app a
    ``ZkLockTask`` was bound to (the receivers read each worker's own app). Called at every
    bind of a ``ZkLockTask`` (see :func:`celery_zklock.task.task.when_bound`)."""
    global _installed
    with _lock:
        if not _installed:
            for signal, receiver in RECEIVERS:
                signal.connect(receiver, weak=False)
            inspect_command()(step.zklock_held)
            _installed = True
    if app is not None:
        check_lock_options(app)


_checked: weakref.WeakSet[type] = weakref.WeakSet()
"""The task classes :func:`check_lock_options` passed."""


def check_lock_options(app: Any) -> None:
    """Check every ``ZkLockTask`` of ``app`` not checked before, as its tasks are bound (when
    the app is finalized, or a task is registered after): its lock options by the validator of
    :mod:`celery_zklock.task.options`, under the name the task is registered by, and any
    ``lock_*`` attribute of its base classes that is no lock option (``lock_on_bussy`` in a
    shared base class: the validator reads the task's own class, where the decorator's keywords
    land, so such a typo would leave the option at its default). Raises
    :class:`~celery_zklock.errors.ConfigurationError` naming the task and the option, out of
    ``app.finalize()`` (a worker exits with that one line: see the module's docstring)."""
    for task in list(app._tasks.values()):  # app.tasks would finalize the app
        kind = type(task)
        if not isinstance(task, ZkLockTask) or kind in _checked:
            continue
        inherited = {
            attr: value
            for base in reversed(kind.__mro__[1:])
            if issubclass(base, ZkLockTask) and base is not ZkLockTask
            for attr, value in vars(base).items()
            if attr.startswith("lock_") and attr not in TASK_ATTRIBUTES and not _method(value)
        }
        if inherited:
            options_from_task(task.name, inherited)  # raises: names the task and the option
        kind._zklock_compile(task.name)
        _checked.add(kind)


def _method(value: object) -> bool:
    """A function, property or class/static method: a helper of a base class, no option."""
    return callable(value) or isinstance(value, property | classmethod | staticmethod)


def _one_line_exit(
    kind: type[BaseException], exc: BaseException, trace: TracebackType | None
) -> None:
    """``sys.excepthook``: a ``ConfigurationError`` that ends Celery's command line (``celery
    worker``, ``celery beat``...) is printed as one line; anything else as before."""
    if issubclass(kind, ConfigurationError) and "celery.bin.celery" in sys.modules:
        print(f"celery-zklock: {exc}", file=sys.stderr, flush=True)
        return
    _previous_excepthook(kind, exc, trace)


_previous_excepthook = sys.excepthook
sys.excepthook = _one_line_exit
