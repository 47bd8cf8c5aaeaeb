"""``on_leader``: your own code on exactly one worker of the fleet, while that worker leads.

``@on_leader(app, name)`` registers a function ``f(stop)``. Every worker of ``app`` takes part
in a :class:`~celery_zklock.LeaderLatch` election on ``<zklock_root>/leaders/<name>`` from the
moment it is ready; the worker that leads calls ``f`` on a thread of its main process. ``stop``
(a :class:`threading.Event`) is set when that leadership is lost - counted by the lease clock,
before the ZooKeeper leader could expire the session and elect another worker - and when the
worker shuts down; ``stop.is_set()`` also reads the lease clock at each call, so a worker paused
past its session sees it set the moment it runs again.

A warm shutdown sets ``stop``, waits for ``f`` to return and only then lets go of the
leadership, so the next worker starts ``f`` after this one returned. A lost leadership does not
wait: the next worker may start ``f`` while this one is still returning (it was told first).
When ``f`` returns or raises while its worker leads, that worker gives up the leadership and
contends again :data:`RESTART_DELAY` seconds later, so the next worker elected (or this one, if
it is alone) runs ``f`` again. A cold shutdown sets ``stop`` and does not wait.

Wired in by the decorator, per app: a worker bootstep (its stop runs at a warm shutdown, after
the consumer stopped and before the pool drains) and a ``worker_ready`` receiver, which starts
the election. The node of each worker carries ``{"leader", "worker", "pid"}`` as JSON.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import weakref
from collections.abc import Callable
from typing import Any, Final, TypeVar

from celery import bootsteps
from celery.signals import worker_ready

from celery_zklock.errors import ConfigurationError
from celery_zklock.locks.leader import LeaderLatch
from celery_zklock.locks.lease import Lease
from celery_zklock.zk import outages
from celery_zklock.zk.client import get_client
from celery_zklock.zk.settings import settings_of

logger = logging.getLogger("celery_zklock.leader")

LEADERS: Final = "leaders"
"""The znode under ``zklock_root`` that holds one election per ``on_leader`` name."""
RESTART_DELAY: Final = 1.0
"""Seconds a worker whose function returned or raised while it led waits before it contends
again (the next worker elected runs the function meanwhile)."""
RECONNECT_DELAY: Final = 2.0
"""Seconds between two tries to reach ZooKeeper before the first election."""
WORKER_ATTRIBUTE: Final = "zklock_leaders"
"""The worker's attribute that holds its :class:`LeaderStep`."""

LeaderFunction = Callable[["Stop"], object]
"""A leader function: called with its :class:`Stop` (a :class:`threading.Event`)."""
F = TypeVar("F", bound=LeaderFunction)

_functions: weakref.WeakKeyDictionary[Any, dict[str, LeaderFunction]] = weakref.WeakKeyDictionary()
_lock = threading.Lock()


def on_leader(app: Any, name: str) -> Callable[[F], F]:
    """Decorator: run the function in one worker of ``app``'s fleet at a time, while that
    worker leads the election ``name`` (see the module docstring). Returns the function as it
    is. Decorate before the worker starts (in a module the worker imports).

    Raises:
        ValueError: ``name`` is not one znode name (empty, ``.``, ``..``, or with ``/``).
        ConfigurationError: ``app`` has another function registered under ``name``.
    """
    if not isinstance(name, str) or name in ("", ".", "..") or "/" in name or "\0" in name:
        raise ValueError(f"an on_leader name is one znode name like 'sweeper', got {name!r}")

    def register(function: F) -> F:
        with _lock:
            registered = _functions.setdefault(app, {})
            known = registered.get(name)
            if known is not None and _qualname(known) != _qualname(function):
                raise ConfigurationError(
                    f"on_leader: {name!r} is registered for {_qualname(known)} already; give "
                    f"{_qualname(function)} another name"
                )
            registered[name] = function
        install(app)
        return function

    return register


def registered(app: Any) -> dict[str, LeaderFunction]:
    """The functions registered for ``app`` by name (a copy)."""
    with _lock:
        return dict(_functions.get(app, {}))


def install(app: Any) -> None:
    """Add the :class:`LeaderStep` to ``app``'s workers and connect the ``worker_ready``
    receiver that starts it (both once)."""
    app.steps["worker"].add(LeaderStep)
    worker_ready.connect(start_when_ready, weak=False, dispatch_uid="celery-zklock-on-leader")


def start_when_ready(sender: Any = None, **_: Any) -> None:
    """``worker_ready`` (the worker's main process; ``sender`` is its consumer): start the
    elections of the worker's :class:`LeaderStep`."""
    step = getattr(getattr(sender, "controller", None), WORKER_ATTRIBUTE, None)
    if isinstance(step, LeaderStep):
        step.elect()


class LeaderStep(bootsteps.StartStopStep):  # type: ignore[misc]
    """The worker bootstep of the ``on_leader`` functions, one :class:`Candidate` each: made
    with the worker, its elections started by ``worker_ready`` (:meth:`elect`), stopped at a
    warm shutdown before the pool (which waits for running tasks), so the next worker takes
    over without waiting for them."""

    label = "zklock leaders"
    requires = ("celery.worker.components:Pool",)

    def __init__(self, worker: Any, **kwargs: Any) -> None:
        super().__init__(worker, **kwargs)
        functions = registered(worker.app).items()
        self.candidates = [Candidate(worker.app, n, f, worker.hostname) for n, f in functions]
        setattr(worker, WORKER_ATTRIBUTE, self)

    def start(self, worker: Any) -> None:
        """Nothing yet: the elections start when the worker is ready."""

    def elect(self) -> None:
        """Start every function's election (``worker_ready``)."""
        for candidate in self.candidates:
            candidate.start()

    def stop(self, worker: Any) -> None:
        """Stop every function, wait for each to return, then leave each election."""
        self.terminate(worker)
        for candidate in self.candidates:
            candidate.join()

    def terminate(self, worker: Any) -> None:
        """Stop every function without waiting (a cold shutdown)."""
        for candidate in self.candidates:
            candidate.ask_to_stop()


class Stop(threading.Event):
    """The ``stop`` a leader function is given: set when the worker shuts down or the
    leadership's lease is lost; :meth:`is_set` also reads the lease clock at each call.
    :attr:`token` is the leadership's fencing token (it rises from one leadership to the next),
    for the function's writes."""

    def __init__(self, lease: Lease) -> None:
        super().__init__()
        self._lease = lease

    @property
    def token(self) -> int:
        return self._lease.token

    def is_set(self) -> bool:
        if super().is_set():
            return True
        if self._lease.held:
            return False
        self.set()
        return True

    def lost(self, _reason: str) -> None:
        """The lease's ``on_lost`` callback."""
        self.set()


class Candidate:
    """One worker's part in the election of one ``on_leader`` function: a thread that
    contends, runs the function while the worker leads, and leaves the election at stop."""

    def __init__(self, app: Any, name: str, function: LeaderFunction, worker: str) -> None:
        self.app, self.name, self.function, self.worker = app, name, function, worker
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._stop: Stop | None = None
        self._latch: LeaderLatch | None = None
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        with self._lock:
            if self._thread is not None or self._stopping.is_set():
                return  # worker_ready again (the consumer restarted), or stopping
            thread = self._thread = threading.Thread(
                target=self._run, name=f"zklock-on-leader {self.name}", daemon=True
            )
        thread.start()

    def ask_to_stop(self) -> None:
        """Set the running function's ``stop``; a worker not leading leaves the election now."""
        with self._lock:
            self._stopping.set()
            stop, latch = self._stop, self._latch
        if stop is not None:
            logger.info("on_leader %s: shutting down: stop set for %s", self.name, self._what)
            stop.set()
        elif latch is not None:
            latch.close()  # also wakes the thread's await_leader

    def join(self) -> None:
        """Wait until the function returned and the election was left."""
        thread = self._thread
        if thread is not None:
            thread.join()

    @property
    def _what(self) -> str:
        return getattr(self.function, "__qualname__", repr(self.function))

    def _run(self) -> None:
        latch: LeaderLatch | None = None
        try:
            while not self._stopping.is_set():
                if latch is None:
                    latch = self._join_election()
                    if latch is None:
                        return
                if not latch.await_leader():
                    continue  # closed: we are stopping
                if not self._term(latch):
                    self._leave(latch)
                    latch = None
                    self._stopping.wait(RESTART_DELAY)
        finally:
            if latch is not None:
                self._leave(latch)

    def _join_election(self) -> LeaderLatch | None:
        """A started latch on this function's election; None when stopping (or misconfigured)."""
        while not self._stopping.is_set():
            try:
                settings = settings_of(self.app)
                client = get_client(settings.client)
            except ConfigurationError as exc:
                logger.error("on_leader %s: off (%s)", self.name, exc)
                return None
            except Exception as exc:  # ZooKeeper unreachable: say so once, try again
                waits = f"on_leader {self.name} waits for it"
                outages.warn_unreachable(settings.client, exc, waits)
                self._stopping.wait(RECONNECT_DELAY)
                continue
            identity = {"leader": self.name, "worker": self.worker, "pid": os.getpid()}
            latch = LeaderLatch(
                client, f"{settings.root}/{LEADERS}/{self.name}", id=json.dumps(identity)
            )
            with self._lock:
                if self._stopping.is_set():
                    return None
                self._latch = latch
                latch.start()
            return latch
        return None

    def _leave(self, latch: LeaderLatch) -> None:
        latch.close()
        with self._lock:
            if self._latch is latch:
                self._latch = None

    def _term(self, latch: LeaderLatch) -> bool:
        """Run the function while ``latch`` leads; False if it returned (or raised) while the
        worker still led and was not stopping: the worker then gives up the leadership."""
        lease = latch.lease
        if lease is None:
            return True  # lost again already: wait for the next election
        stop = Stop(lease)
        with self._lock:
            if self._stopping.is_set():
                return True
            self._stop = stop
        lease.on_lost(stop.lost)
        logger.info(
            "on_leader %s: %s leads (token %d): running %s",
            self.name,
            self.worker,
            lease.token,
            self._what,
        )
        try:
            self.function(stop)
        except Exception:
            logger.exception("on_leader %s: %s raised", self.name, self._what)
        finally:
            lease.remove_on_lost(stop.lost)
            with self._lock:
                self._stop = None
        if stop.is_set():
            logger.info("on_leader %s: %s returned after stop was set", self.name, self._what)
            return True
        logger.warning(
            "on_leader %s: %s returned while %s led: it gives up the leadership and contends "
            "again in %g s",
            self.name,
            self._what,
            self.worker,
            RESTART_DELAY,
        )
        return False


def _qualname(function: Any) -> str:
    module = getattr(function, "__module__", "?")
    return f"{module}.{getattr(function, '__qualname__', repr(function))}"
