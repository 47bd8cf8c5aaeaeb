"""Stopping the body of a running task when its lock is lost, per worker pool.

When the session policy declares a lease lost, another worker may take the lock at any moment,
so the body must stop. How depends on where the body runs:

- **prefork and solo** (the process's main thread): a signal (``SIGUSR2`` by default; set
  ``ZKLOCK_REVOKE_SIGNAL`` to another name) is sent to our own process; its handler raises
  :class:`LockLost` in the main thread, as billiard does for soft time limits. The handler is
  installed when the task starts (billiard resets handlers after ``worker_process_init``) and
  the previous one is restored after. Each execution has a token; the handler raises only if the
  signalled token is the one currently running, so a late signal never hits the next task.
- **threads** (a worker thread): ``PyThreadState_SetAsyncExc`` raises :class:`LockLost` in the
  task's thread at its next Python bytecode. It cannot interrupt a blocking C call; the body
  should call ``self.lock.check()`` at safe points, and the release reports the loss regardless.
- **gevent** (a greenlet): :class:`LockLost` is thrown into the task's greenlet from the hub
  (not ``GreenletExit``, which Celery would not record as a failure), only if still armed then.

Whatever happened to the interruption, the task's release sees that the lease was lost and the
task ends with ``LockLost``, never SUCCESS.
"""

from __future__ import annotations

import ctypes
import itertools
import logging
import os
import signal
import sys
import threading
from types import FrameType
from typing import Any

from celery_zklock.errors import LockLost

logger = logging.getLogger("celery_zklock.revoke")

_tokens = itertools.count(1)


def _revoke_signal() -> signal.Signals:
    name = os.environ.get("ZKLOCK_REVOKE_SIGNAL", "SIGUSR2")
    try:
        return signal.Signals[name]
    except KeyError:
        raise ValueError(f"ZKLOCK_REVOKE_SIGNAL={name!r} is not a signal name") from None


class Revocation:
    """Arms an interruption of the current task body; :meth:`fire` triggers it from any thread."""

    strategy = "none"

    def __init__(self) -> None:
        self.token = next(_tokens)
        self.fired_reason: str | None = None

    def fire(self, reason: str) -> None:
        self.fired_reason = reason
        self._interrupt(reason)

    def disarm(self) -> None:
        """Stop any further interruption; after this returns no LockLost is raised by us."""

    def _interrupt(self, reason: str) -> None:
        raise NotImplementedError


class _MainThreadSignal(Revocation):
    strategy = "signal"
    # One execution at a time runs on a main thread: module-level state is enough.
    _running: int | None = None
    _pending: tuple[int, str] | None = None

    def __init__(self) -> None:
        super().__init__()
        self.signum = _revoke_signal()
        self._previous: Any = signal.signal(self.signum, self._handler)
        _MainThreadSignal._pending = None
        _MainThreadSignal._running = self.token

    @staticmethod
    def _handler(signum: int, frame: FrameType | None) -> None:
        pending = _MainThreadSignal._pending
        if pending is not None and pending[0] == _MainThreadSignal._running:
            _MainThreadSignal._pending = None
            raise LockLost(pending[1])

    def _interrupt(self, reason: str) -> None:
        _MainThreadSignal._pending = (self.token, reason)
        os.kill(os.getpid(), self.signum)

    def disarm(self) -> None:
        _MainThreadSignal._running = None
        _MainThreadSignal._pending = None
        signal.signal(self.signum, self._previous)


class _ThreadAsyncException(Revocation):
    strategy = "async-exception"

    def __init__(self) -> None:
        super().__init__()
        self.thread_id = threading.get_ident()
        self._lock = threading.Lock()
        self._armed = True

    def _interrupt(self, reason: str) -> None:
        with self._lock:
            if not self._armed:
                return
            ctypes.pythonapi.PyThreadState_SetAsyncExc(
                ctypes.c_ulong(self.thread_id), ctypes.py_object(LockLost)
            )

    def disarm(self) -> None:
        with self._lock:
            self._armed = False
            # Withdraw an exception that was set but not yet raised in our thread.
            ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(self.thread_id), None)


class _GreenletKill(Revocation):
    strategy = "greenlet"

    def __init__(self, greenlet: Any) -> None:
        super().__init__()
        self.greenlet = greenlet
        self._armed = True

    def _interrupt(self, reason: str) -> None:
        from gevent import get_hub

        # Throw from the hub, checking "armed" at that moment: a kill scheduled before the
        # task disarmed must not land in its release (which switches greenlets on I/O).
        get_hub().loop.run_callback(self._throw_if_armed, reason)

    def _throw_if_armed(self, reason: str) -> None:
        if self._armed and not self.greenlet.dead:
            self.greenlet.throw(LockLost(reason))

    def disarm(self) -> None:
        self._armed = False


def _current_gevent_greenlet() -> Any | None:
    if "gevent" not in sys.modules:
        return None
    from gevent import getcurrent, monkey

    if not monkey.is_module_patched("threading"):
        return None
    current = getcurrent()
    if getattr(current, "parent", None) is None:  # the main greenlet of the thread
        return None
    return current


def arm() -> Revocation:
    """Prepare to interrupt the body that is about to run on this thread or greenlet."""
    greenlet = _current_gevent_greenlet()
    if greenlet is not None:
        return _GreenletKill(greenlet)
    if threading.current_thread() is threading.main_thread():
        return _MainThreadSignal()
    return _ThreadAsyncException()
