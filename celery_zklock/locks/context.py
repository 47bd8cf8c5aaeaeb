"""Per-client context: what every lock of one kazoo client shares.

One :class:`ClientContext` per kazoo client (:func:`context_for`), held weakly: it goes with its
client. It keeps

- the **session**: the current session id, whether the client can send at all
  (:meth:`~ClientContext.check_usable`), waiting for a connection
  (:meth:`~ClientContext.await_connected`), since when it has been without one and so when a
  wait gives up on ZooKeeper (:meth:`~ClientContext.outage`), and the **negotiated session
  timeout**, always known before a lease is handed out (a client that connected before
  celery-zklock saw its handshake is made to reconnect once);
- the client's **lease clock** (:class:`~celery_zklock.locks.clock.LeaseClock`, with its break
  watches), told of kazoo's states: LOST (the session expired) ends every lease at once, a new
  session on CONNECTED ends the leases of the old one;
- the bookkeeping the locks share: who holds which path in which thread (reentrancy), which lock
  parents exist, how many waiters watch a node, and the client's orphan purge
  (:class:`~celery_zklock.locks.queue.OrphanPurge`, made by the queue on first need and resumed
  here at every reconnect).

Listeners run on kazoo's connection thread and must not block: they only flip state, set events
and spawn work.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import weakref
from collections import OrderedDict
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Protocol

from kazoo.client import KazooClient
from kazoo.protocol.states import KazooState

from celery_zklock.errors import LossCode, ZooKeeperUnavailable
from celery_zklock.locks.clock import MIN_SESSION_TIMEOUT, LeaseClock, LeaseTiming, timing_for
from celery_zklock.zk import adapter
from celery_zklock.zk.calls import Deadline, wait_slice

logger = logging.getLogger("celery_zklock.locks")

#: How many lock parents per client are remembered as existing (skips the createContainer).
KNOWN_PARENTS = 1024


class Resumable(Protocol):
    """Background work of the client that waits for a connection (the orphan purge)."""

    def resume(self) -> None:
        """Go on with the work left pending, now that the client is connected."""


class ClientContext:
    """Everything the locks of one kazoo client share; see the module docstring."""

    def __init__(self, client: KazooClient) -> None:
        self._client_ref = weakref.ref(client)
        self.handler = client.handler
        self.lock = threading.Lock()
        #: (lock path, thread id) -> the record held there (reentrancy).
        self.owned: dict[tuple[str, int], Any] = {}
        #: Node -> how many of this client's waiters and break watches watch it.
        self.watch_refs: dict[str, int] = {}
        #: Lock parents known to exist, least recently used first (at most
        #: :data:`KNOWN_PARENTS`): the queue looks them up under ``lock``.
        self.known_parents: OrderedDict[str, None] = OrderedDict()
        self._wakeups: set[Any] = set()
        #: Incremented at every state kazoo reports, before waiters are woken: watches set
        #: while it stays the same were set on one connection, which is still up.
        self.state_changes = 0
        #: Since when (monotonic s) the client has been without a connection; None while
        #: connected. Set at the first state other than CONNECTED, cleared at CONNECTED.
        self.disconnected_since: float | None = (
            None if client.state == KazooState.CONNECTED else time.monotonic()
        )
        self._forced_reconnect = False
        #: The waits' liveness probe (see :meth:`outage`): when the latest answered probe was
        #: sent, and when the one in flight was (None: none in flight).
        self._answered_probe = time.monotonic()
        self._probe_in_flight: float | None = None
        self.timing: LeaseTiming
        self.lease_ready: bool
        self._read_timing(client)
        self.clock = LeaseClock(client, self, self.lock, self.watch_refs)
        #: The client's orphan purge, once one was needed (set by the queue under ``lock``).
        self.orphans: Resumable | None = None
        client.add_listener(self._on_state)

    @property
    def client(self) -> KazooClient:
        client = self._client_ref()
        if client is None:  # pragma: no cover - a lock keeps its client alive
            raise ZooKeeperUnavailable("the kazoo client of this lock was garbage-collected")
        return client

    # -- the session ----------------------------------------------------------------------
    def session_id(self) -> int | None:
        """The current session id, or None while not connected."""
        client = self._client_ref()
        if client is None or client.state != KazooState.CONNECTED:
            return None
        client_id = client.client_id
        return int(client_id[0]) if client_id else None

    @property
    def session_timeout(self) -> float:
        """The negotiated session timeout in seconds (the requested one until it is known)."""
        return self.timing.session_timeout

    def _read_timing(self, client: KazooClient) -> None:
        """Set :attr:`timing` (the numbers of the session timeout: the negotiated one, the
        requested one until it is known) and :attr:`lease_ready` (the negotiated one is known
        and long enough: see :meth:`ensure_timeout_known`). Read at every state kazoo reports:
        the negotiated timeout changes only with a handshake, which is recorded before kazoo
        reports CONNECTED, and before any answer on the new connection."""
        negotiated = adapter.negotiated_timeout(client)
        timeout = negotiated if negotiated is not None else adapter.requested_timeout(client)
        self.timing = timing_for(timeout)
        self.lease_ready = negotiated is not None and timeout >= MIN_SESSION_TIMEOUT

    def check_usable(self) -> None:
        """Raise :class:`ZooKeeperUnavailable` at once for a client that cannot send at all:
        not started, stopped or closed (or garbage-collected), or whose connection loop gave up
        for good."""
        client = self._client_ref()
        if client is None or adapter.is_closed(client):
            raise ZooKeeperUnavailable(
                "the kazoo client is not started, or was stopped or closed: call "
                "client.start() before using a lock (and do not use it after client.stop())"
            )
        if adapter.connection_gave_up(client):
            raise ZooKeeperUnavailable(
                "the kazoo client gave up connecting to ZooKeeper (its connection_retry policy "
                "ran out, or authentication failed on a reconnect) and will not reconnect by "
                "itself: call client.start() to connect again (not client.restart(): the "
                "close its stop() queues would end the new session), or give the client "
                "connection_retry={'max_tries': -1} to keep retrying"
            )

    def ensure_timeout_known(self, deadline: Deadline) -> None:
        """Return once the negotiated session timeout of the current connection is known.

        A client that connected before celery-zklock was imported is made to reconnect once
        (same session), so that its next handshake is seen. Raises ZooKeeperUnavailable when
        that does not happen before ``deadline``.
        """
        client = self.client
        if adapter.negotiated_timeout(client) is not None:
            self._read_timing(client)
            self.timing.check()
            return
        event = self.handler.event_object()
        with self.wakeup_on_state_change(event):
            while adapter.negotiated_timeout(client) is None:
                self.check_usable()
                if client.state == KazooState.CONNECTED and not self._forced_reconnect:
                    self._forced_reconnect = True
                    logger.info(
                        "reconnecting the ZooKeeper client once to learn its negotiated "
                        "session timeout (it connected before celery_zklock was imported)"
                    )
                    adapter.force_reconnect(client)
                if deadline.expired():
                    raise ZooKeeperUnavailable(
                        "the negotiated ZooKeeper session timeout is not known yet and the "
                        "client did not reconnect in time: no lease is handed out under an "
                        "unknown timeout"
                    )
                event.wait(wait_slice(deadline))
                event.clear()
        self._read_timing(client)
        self.timing.check()

    def outage(self, start: float) -> str | None:
        """The outage check of a wait that began at ``start`` (monotonic s), for its
        :class:`~celery_zklock.zk.calls.Deadline` (``functools.partial(context.outage,
        start)``): a reason once the client has been without a connection, or without an
        answer, for a session timeout counted from when that began or from ``start``,
        whichever came later; else None.

        Why a session timeout: the server expires a session that long after it last heard of
        it, and with it the waiter's node, its place in the queue; and while nothing answers,
        nothing can grant the lock. A connection back before then (the same session) leaves
        the wait as it was. kazoo reports a lost connection at once when the server's process
        is gone or refuses connections, and at most ``2T/3`` after the last answer on a silent
        link - unless the process keeps sending on the client (other threads holding leases
        renew every ``T/8``): kazoo pings only after ``T/3`` without sending, so it then stays
        CONNECTED. So a wait that has lasted ``T/3`` also keeps one request of its own in
        flight (an ``exists`` of ``/``, one per client however many wait, sent ``T/3`` after
        the previous answered one), and an answer missing for ``T`` ends the wait too.
        """
        now = time.monotonic()
        timeout = self.timing.session_timeout
        since = self.disconnected_since
        if since is not None:
            if now - max(since, start) < timeout:
                return None
            what = "no connection to"
        else:
            silent_since = self._probe(now) if now - start >= timeout / 3.0 else None
            if silent_since is None or now - max(silent_since, start) < timeout:
                return None
            what = "no answer from"
        hosts = ",".join(f"{host}:{port}" for host, port in self.client.hosts)
        return f"{what} ZooKeeper ({hosts}) for a session timeout ({timeout:g}s)"

    def _probe(self, now: float) -> float | None:
        """Keep a liveness probe in flight (one per ``T/3``); while one is unanswered, return
        when the latest answered probe was sent, else None."""
        with self.lock:
            in_flight, answered = self._probe_in_flight, self._answered_probe
            send = in_flight is None and now - answered >= self.timing.idle_gap
            if send:
                self._probe_in_flight = now
        if send:
            try:
                self.client.exists_async("/").rawlink(
                    lambda result: self._probe_answered(now, result)
                )
            except Exception:  # the client is closing: its waits end on check_usable
                with self.lock:
                    self._probe_in_flight = None
        return answered if in_flight is not None else None

    def _probe_answered(self, sent: float, result: Any) -> None:
        with self.lock:
            if self._probe_in_flight == sent:
                self._probe_in_flight = None
            if result.successful() and sent > self._answered_probe:
                self._answered_probe = sent

    def await_connected(self, deadline: Deadline, what: str) -> None:
        """Wait until the client is connected; ZooKeeperUnavailable at ``deadline``, or within
        a :data:`~celery_zklock.zk.calls.WAIT_SLICE` of the client becoming unusable (see
        :meth:`check_usable`), which no state change need announce.

        Retrying a request at once after ConnectionLoss or SessionExpired would spin: while the
        session is expired kazoo fails requests without waiting, and under gevent a greenlet
        that never blocks starves kazoo's reconnecting greenlet for good.
        """
        client = self.client
        event = self.handler.event_object()
        with self.wakeup_on_state_change(event):
            while client.state != KazooState.CONNECTED:
                self.check_usable()
                if deadline.expired():
                    raise ZooKeeperUnavailable(deadline.why(what, "ZooKeeper unreachable"))
                event.wait(wait_slice(deadline))
                event.clear()

    @contextmanager
    def wakeup_on_state_change(self, event: Any) -> Iterator[None]:
        """Set ``event`` whenever the connection state changes, while the block runs."""
        with self.lock:
            self._wakeups.add(event)
        try:
            yield
        finally:
            with self.lock:
                self._wakeups.discard(event)

    # -- kazoo's states -------------------------------------------------------------------
    def _on_state(self, state: str) -> bool:
        client = self._client_ref()
        if client is not None:
            self._read_timing(client)
        with self.lock:
            self.state_changes += 1
            if state == KazooState.CONNECTED:
                self.disconnected_since = None
                # The handshake was answered: the silence the probe measures starts again.
                self._answered_probe = max(self._answered_probe, time.monotonic())
            elif self.disconnected_since is None:
                self.disconnected_since = time.monotonic()
            wakeups = list(self._wakeups)
        for event in wakeups:
            event.set()
        if state == KazooState.LOST:
            self.clock.session_lost()
        elif state == KazooState.CONNECTED:
            current = self.session_id()
            if current is not None:
                self.clock.declare_lost(
                    LossCode.SESSION_EXPIRED,
                    "the ZooKeeper session changed",
                    except_session=current,
                )
            orphans = self.orphans
            if orphans is not None:
                orphans.resume()
        self.clock.wake()
        return False

    # -- lock parents ---------------------------------------------------------------------
    def remember_parent(self, path: str) -> None:
        """Note that the lock parent ``path`` exists (a create under it went through): the most
        recently used of :attr:`known_parents`, the least recently used one forgotten past
        :data:`KNOWN_PARENTS`."""
        with self.lock:
            self.known_parents[path] = None
            self.known_parents.move_to_end(path)
            if len(self.known_parents) > KNOWN_PARENTS:
                self.known_parents.popitem(last=False)


_contexts: weakref.WeakKeyDictionary[KazooClient, ClientContext] = weakref.WeakKeyDictionary()
_contexts_lock = threading.Lock()


def _new_contexts_lock_after_fork() -> None:
    # A thread of the parent may have held it at the fork: the child's first context_for
    # would then wait for ever.
    global _contexts_lock
    _contexts_lock = threading.Lock()


os.register_at_fork(after_in_child=_new_contexts_lock_after_fork)


def context_for(client: KazooClient) -> ClientContext:
    """The :class:`ClientContext` of ``client`` (created and attached on first use)."""
    with _contexts_lock:
        context = _contexts.get(client)
        if context is None:
            context = _contexts[client] = ClientContext(client)
        return context
