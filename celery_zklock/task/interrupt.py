"""Interrupting the body of a running task when its lease is lost, per worker pool.

When a lease is lost another worker may take the lock at any moment, so the body must stop. How
depends on where the body runs:

- **prefork and solo** (the process's main thread): a signal (``SIGUSR2`` by default; see
  :func:`interrupt_signal`) is sent to our own process's main thread (which ends a blocking
  call such as a sleep); its handler raises :class:`LockLost` there, as billiard does for soft
  time limits. The handler is installed when the outermost locked run starts (billiard resets
  handlers after ``worker_process_init``) and the previous one is restored when it ends.
- **threads** (a worker thread): ``PyThreadState_SetAsyncExc`` raises :class:`LockLost` in the
  task's thread at its next Python bytecode. It cannot interrupt a blocking C call; the body
  should call ``self.lock.check()`` at safe points, and the release reports the loss regardless.
- **gevent** (a greenlet): :class:`LockLost` is thrown into the task's greenlet from the hub
  (not ``GreenletExit``, which Celery would not record as a failure), only if still armed then.

Every locked run arms its own :class:`Interruption`. Runs nest (a task body that calls another
locked task directly, with ``apply()`` or eagerly): each thread keeps the stack of its armed
runs, and an interruption fired for any run on the stack lands in the innermost body, which is
part of that run's body too. Disarming a run never disarms or withdraws an interruption of a run
outside it; a late interruption never hits the next task (each run has its own token).

An interruption fired from the run's own thread or greenlet (a lease found lost while its run
registers for the loss) interrupts nothing: the run checks its lease itself right after. Once
``Lease.check`` has raised in the body's own context the run's interruption stands down, so
a body is told of one loss once, not again in its ``except`` or ``finally``.

Whatever happened to the interruption, the task's release sees that the lease was lost and the
task ends with ``LockLost``, never SUCCESS.
"""

from __future__ import annotations

import ctypes
import itertools
import os
import re
import signal
import sys
import threading
from dataclasses import dataclass, field
from types import FrameType
from typing import Any, Final

from celery.exceptions import SoftTimeLimitExceeded

from celery_zklock.errors import ConfigurationError, LockLost

SIGNAL_ENV = "ZKLOCK_INTERRUPT_SIGNAL"
"""Environment variable naming the signal of the prefork/solo interruption (default SIGUSR2)."""
LEGACY_SIGNAL_ENV = "ZKLOCK_REVOKE_SIGNAL"
"""Its earlier name, still read when :data:`SIGNAL_ENV` is not set."""
DEFAULT_SIGNAL = "SIGUSR2"

STOPPING: Final = (SoftTimeLimitExceeded, LockLost)
"""What is raised into the task's own thread to stop it: its soft time limit (billiard's signal
handler) and a lost lease's interruption. Every ``except Exception`` that stands for "the result
backend, the broker or ZooKeeper failed" lets these through first (``except STOPPING: raise``):
taken for such a failure, they would let the run go on past its limit or without its lock."""

_tokens = itertools.count(1)

try:
    # The C function that signal.signal wraps: the wrapper turns the handler it returns into an
    # enum member by trying Handlers(handler), which raises and catches for a function (ours,
    # on every disarm) and costs several times the system call.
    from _signal import signal as _set_handler  # type: ignore[import-not-found, unused-ignore]
except ImportError:  # pragma: no cover - not CPython
    _set_handler = signal.signal
_REALTIME = re.compile(r"^SIGRT(MIN|MAX)(?:([+-])(\d+))?$")


def interrupt_signal() -> signal.Signals | int:
    """The signal that interrupts a body on a main thread, from the environment.

    ``ZKLOCK_INTERRUPT_SIGNAL`` (or its earlier name ``ZKLOCK_REVOKE_SIGNAL``) may be
    ``SIGUSR2`` (the default) or a real-time signal: ``SIGRTMIN``, ``SIGRTMAX``, ``SIGRTMIN+n``,
    ``SIGRTMAX-n``. Every other signal is refused, because something else owns it: billiard
    sends ``SIGUSR1`` for soft time limits (and Celery's main process dumps its threads on it),
    Celery and billiard use ``SIGTERM``, ``SIGINT``, ``SIGQUIT``, ``SIGHUP``, ``SIGCHLD`` and
    ``SIGALRM``, ``SIGKILL`` and ``SIGSTOP`` cannot be caught, and the rest are faults, job
    control or timers that the system sends on its own.

    Raises :class:`~celery_zklock.errors.ConfigurationError` naming the variable, the value and
    the allowed choices.
    """
    environ = getattr(os.environ, "_data", None)  # os.environ's own dict, encoded names
    if type(environ) is dict:
        # Every locked run on a main thread asks: os.environ.get raises and catches a KeyError
        # for a variable not set (the usual case), several times the cost of this lookup.
        setting: tuple[object, object] = (environ.get(_SIGNAL_KEY), environ.get(_LEGACY_KEY))
    else:  # pragma: no cover - an os.environ without its dict (not CPython on POSIX)
        setting = (os.environ.get(SIGNAL_ENV), os.environ.get(LEGACY_SIGNAL_ENV))
    known = _signal_of_setting.get(setting)
    if known is None:  # parsed once per value: every locked run on a main thread asks
        known = _signal_of_setting[setting] = _parse_signal()
    return known


_signal_of_setting: dict[tuple[object, object], signal.Signals | int] = {}
_SIGNAL_KEY, _LEGACY_KEY = os.fsencode(SIGNAL_ENV), os.fsencode(LEGACY_SIGNAL_ENV)


def _parse_signal() -> signal.Signals | int:
    env = SIGNAL_ENV if SIGNAL_ENV in os.environ else LEGACY_SIGNAL_ENV
    name = os.environ.get(env, DEFAULT_SIGNAL).strip().upper()
    if name == DEFAULT_SIGNAL:
        return signal.SIGUSR2
    match = _REALTIME.match(name)
    if match is not None and hasattr(signal, "SIGRTMIN"):
        low, high = int(signal.SIGRTMIN), int(signal.SIGRTMAX)
        end, sign, offset = match.groups()
        number = low if end == "MIN" else high
        if offset is not None:
            number += int(offset) if sign == "+" else -int(offset)
        if low <= number <= high:
            return number
    why = "is not an allowed signal"
    if name == "SIGUSR1":
        why = "is the signal billiard uses for soft time limits (they would stop working)"
    elif name in signal.Signals.__members__:
        why = "is a signal Celery, billiard or the system use for something else"
    raise ConfigurationError(
        f"{env}={os.environ.get(env)!r} {why}; allowed: {DEFAULT_SIGNAL} (the default) or a "
        "real-time signal SIGRTMIN, SIGRTMIN+n, SIGRTMAX-n, SIGRTMAX"
    )


class Interruption:
    """Arms an interruption of one run's body; :meth:`fire` triggers it from any thread. Its
    ``token`` is the run's own, which an interruption of another run never carries."""

    strategy = "none"

    def __init__(self) -> None:
        self.token = next(_tokens)

    def fire(self, reason: str) -> None:
        """Interrupt the run's body (unless disarmed, or called from the run's own context)."""
        if not self._in_own_context():
            self._interrupt(reason)

    def disarm(self) -> None:
        """Stop any further interruption of this run (and of runs nested in it); idempotent.

        After this returns no LockLost is raised by this run's interruption.
        """

    def stand_down(self) -> None:
        """The body was told of the loss in its own context: no interruption of this run after.

        Called when ``Lease.check`` is about to raise :class:`LockLost`, so that a body gets one
        LockLost per loss, not a second one in its ``except`` or ``finally``. Called from any
        other thread or greenlet (one the body handed its lease to) it does nothing: the body
        itself was not told. Runs nested in this one keep their own interruptions.
        """
        if self._in_own_context():
            self._stand_down()

    def _stand_down(self) -> None:
        raise NotImplementedError

    def _in_own_context(self) -> bool:
        raise NotImplementedError

    def _interrupt(self, reason: str) -> None:
        raise NotImplementedError


class _MainThreadSignal(Interruption):
    strategy = "signal"
    # Only the main thread runs these, and a signal handler runs there between bytecodes: the
    # state is module-wide, and the handler reads it without a lock (it could be the holder).
    _armed: list[int] = []
    _pending: dict[int, str] = {}
    _stood_down: set[int] = set()
    _previous: Any = None
    _signum: int | None = None
    _sent = False  # a signal went to the main thread since the handler was installed
    # Held by the lease clock's thread from its look at _armed through its kill, and by the
    # main thread to put the previous handler back: a signal taken after that would meet the
    # previous handler (in a pool process the default one, which ends the process).
    _kill_lock = threading.Lock()

    def __init__(self) -> None:
        signum = int(interrupt_signal())
        super().__init__()
        cls = _MainThreadSignal
        if not cls._armed:
            cls._pending.clear()
            cls._stood_down.clear()
            cls._previous = _set_handler(signum, cls._handler)
            cls._signum = signum
        cls._armed.append(self.token)

    @staticmethod
    def _handler(signum: int, frame: FrameType | None) -> None:
        cls = _MainThreadSignal
        for token in list(cls._armed):
            reason = cls._pending.pop(token, None)
            # Stood down: the body was told already (the signal may have been on its way).
            if reason is not None and token not in cls._stood_down:
                raise LockLost(reason)

    def _in_own_context(self) -> bool:
        return threading.current_thread() is threading.main_thread()

    def _interrupt(self, reason: str) -> None:
        cls = _MainThreadSignal
        with cls._kill_lock:
            if self.token in cls._armed and self.token not in cls._stood_down and cls._signum:
                cls._pending[self.token] = reason
                # To the main thread itself: a signal to the process goes to whichever thread
                # the kernel picks, this one when the main thread has a signal of its own
                # pending (a SIGCONT after a pause), and a main thread blocked in a call
                # (time.sleep, a socket read) then runs on until that call returns.
                cls._sent = True
                signal.pthread_kill(threading.main_thread().ident or 0, cls._signum)

    def _stand_down(self) -> None:
        cls = _MainThreadSignal
        if self.token in cls._armed:
            cls._stood_down.add(self.token)
            cls._pending.pop(self.token, None)

    def disarm(self) -> None:
        cls = _MainThreadSignal
        armed, token = cls._armed, self.token
        if armed and armed[-1] == token:  # the innermost run: the usual case, made cheap
            armed.pop()
            if cls._pending:
                cls._pending.pop(token, None)
            if cls._stood_down:
                cls._stood_down.discard(token)
        elif token in armed:
            # Runs nested in this one ended before it (one thread: last in, first out).
            gone = armed[armed.index(token) :]
            del armed[armed.index(token) :]
            for ended in gone:
                cls._pending.pop(ended, None)
                cls._stood_down.discard(ended)
        else:
            return
        if not armed and cls._signum is not None:
            with cls._kill_lock:
                if cls._sent:
                    # A signal sent to this thread may still be pending: any system call takes
                    # it on its return, with our handler (which raises nothing now).
                    signal.pthread_sigmask(signal.SIG_BLOCK, ())
                    cls._sent = False
                _set_handler(cls._signum, cls._previous)
                cls._previous = cls._signum = None


@dataclass
class _ThreadRuns:
    """The armed runs of one thread, and which of them set an exception not yet withdrawn."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    armed: list[int] = field(default_factory=list)
    pending: set[int] = field(default_factory=set)
    stood_down: set[int] = field(default_factory=set)


_thread_runs: dict[int, _ThreadRuns] = {}
_thread_runs_lock = threading.Lock()


def _set_async_exc(thread_id: int, exc: type[BaseException] | None) -> None:
    """Raise ``exc`` in the thread at its next bytecode; ``None`` withdraws one not yet raised."""
    ctypes.pythonapi.PyThreadState_SetAsyncExc(
        ctypes.c_ulong(thread_id), None if exc is None else ctypes.py_object(exc)
    )


class _ThreadAsyncException(Interruption):
    strategy = "async-exception"

    def __init__(self) -> None:
        super().__init__()
        self.thread_id = threading.get_ident()
        with _thread_runs_lock:
            self._runs = _thread_runs.setdefault(self.thread_id, _ThreadRuns())
        with self._runs.lock:
            self._runs.armed.append(self.token)

    def _in_own_context(self) -> bool:
        return threading.get_ident() == self.thread_id

    def _interrupt(self, reason: str) -> None:
        runs = self._runs
        with runs.lock:
            if self.token not in runs.armed or self.token in runs.stood_down:
                return
            runs.pending.add(self.token)
            _set_async_exc(self.thread_id, LockLost)

    def _stand_down(self) -> None:
        runs = self._runs
        with runs.lock:
            if self.token not in runs.armed:
                return
            runs.stood_down.add(self.token)
            if self.token in runs.pending:
                runs.pending.discard(self.token)
                if not runs.pending:  # one set for an outer run stays, as in disarm
                    _set_async_exc(self.thread_id, None)

    def disarm(self) -> None:
        runs = self._runs
        with runs.lock:
            if self.token not in runs.armed:
                return
            position = runs.armed.index(self.token)
            runs.pending.difference_update(runs.armed[position:])
            runs.stood_down.difference_update(runs.armed[position:])
            del runs.armed[position:]
            if not runs.pending:
                # Withdraw an exception set for this run (or one nested in it) but not yet
                # raised; one set for an outer run stays: that run's body is still running.
                _set_async_exc(self.thread_id, None)
            empty = not runs.armed
        if empty:
            with _thread_runs_lock:
                if _thread_runs.get(self.thread_id) is runs and not runs.armed:
                    del _thread_runs[self.thread_id]


class _GreenletKill(Interruption):
    strategy = "greenlet"

    def __init__(self, greenlet: Any) -> None:
        super().__init__()
        self.greenlet = greenlet
        self._armed = True

    def _in_own_context(self) -> bool:
        from gevent import getcurrent

        return getcurrent() is self.greenlet

    def _interrupt(self, reason: str) -> None:
        from gevent import get_hub

        # Throw from the hub, checking "armed" at that moment: a kill scheduled before the
        # task disarmed must not land in its release (which switches greenlets on I/O).
        get_hub().loop.run_callback(self._throw_if_armed, reason)

    def _throw_if_armed(self, reason: str) -> None:
        if self._armed and not self.greenlet.dead:
            self.greenlet.throw(LockLost(reason))

    def _stand_down(self) -> None:
        # Greenlets take turns: the hub's callback runs after this or not at all for this run.
        self._armed = False

    def disarm(self) -> None:
        self._armed = False


def arm() -> Interruption:
    """Prepare to interrupt the body that is about to run on this thread or greenlet.

    Raises :class:`~celery_zklock.errors.ConfigurationError` when the interruption needs a
    signal and the configured one is refused (see :func:`interrupt_signal`).
    """
    if "gevent" in sys.modules:
        from gevent import getcurrent, monkey

        current = getcurrent()  # gevent's threads, in a greenlet not its thread's main one:
        if monkey.is_module_patched("threading") and getattr(current, "parent", None) is not None:
            return _GreenletKill(current)
    if threading.current_thread() is threading.main_thread():
        return _MainThreadSignal()
    return _ThreadAsyncException()
