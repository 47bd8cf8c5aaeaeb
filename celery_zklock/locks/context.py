"""Per-client context: what every lock of one kazoo client shares, and the lease clock that runs it.

One :class:`ClientContext` per kazoo client (:func:`context_for`), held weakly: it goes with its
client. It keeps

- the **lease clock** (:mod:`celery_zklock.locks.clock`): the latest moment until which the
  client's leases are safe, moved forward by answers to requests that reached the leader; while
  any lease is held a renewer (a thread, or a greenlet under kazoo's gevent handler) sends a
  ``sync`` every ``R`` and declares every lease lost when the moment passes unrenewed;
- the **negotiated session timeout**, always known before a lease is handed out (a client that
  connected before celery-zklock saw its handshake is made to reconnect once);
- reaction to kazoo's states: LOST (the session expired) ends every lease at once, a new session
  on CONNECTED ends the leases of the old one;
- **break requests** (:mod:`celery_zklock.locks.lease`): a lease held for a renewal interval
  ``R`` gets its node read once, with a data watch, at the renewer's next tick; a break request
  in the data (written before or after the watch) ends that lease, and so does the node's
  deletion by anyone else (``celery zklock break --force``). A lease released within ``R``
  costs no request for this;
- the bookkeeping the locks share: who holds which path in which thread (reentrancy), which lock
  parents exist, how many waiters watch a node, and orphaned contender nodes to delete.

Listeners run on kazoo's connection thread and must not block: they only flip state, set events
and spawn work.
"""

from __future__ import annotations

import functools
import logging
import math
import os
import threading
import time
import weakref
from collections import OrderedDict
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Protocol

from kazoo.client import KazooClient
from kazoo.exceptions import ConnectionClosedError, NoNodeError
from kazoo.protocol.states import EventType, KazooState, WatchedEvent

from celery_zklock.errors import ZooKeeperUnavailable
from celery_zklock.locks import adapter
from celery_zklock.locks.clock import LeaseTiming
from celery_zklock.locks.lease import break_reason

logger = logging.getLogger("celery_zklock.locks")

#: How many lock parents per client are remembered as existing (skips the createContainer).
KNOWN_PARENTS = 1024
#: Longest single blocking wait, in seconds: see :func:`wait_slice`.
WAIT_SLICE = 0.1
#: A renewal counts as on time when sent within this factor of ``R`` after the previous one.
_ON_TIME = 1.25
_DELETED = "the lock node was deleted by someone else while it was held"


class Deadline:
    """A point in monotonic time, or none (wait without limit)."""

    def __init__(self, seconds: float | None) -> None:
        self.at = None if seconds is None else time.monotonic() + seconds

    def remaining(self) -> float | None:
        return None if self.at is None else max(0.0, self.at - time.monotonic())

    def expired(self) -> bool:
        return self.at is not None and time.monotonic() >= self.at


def wait_slice(deadline: Deadline) -> float:
    """Wait in short slices: an exception thrown into this thread (PyThreadState_SetAsyncExc,
    as Celery's threads pool revocation does) is only delivered between blocking calls."""
    remaining = deadline.remaining()
    return WAIT_SLICE if remaining is None else min(WAIT_SLICE, remaining)


class Timed(Protocol):
    """A held lease as the clock sees it: its node and session, and how to tell it that it is
    lost."""

    node: str
    session_id: int

    def mark_lost(self, reason: str) -> None: ...

    def record_lost(self, reason: str) -> list[Any] | None: ...

    def tell_lost(self, reason: str, callbacks: list[Any] | None) -> None: ...


class ClientContext:
    """Everything the locks of one kazoo client share; see the module docstring."""

    def __init__(self, client: KazooClient) -> None:
        self._client_ref = weakref.ref(client)
        self.handler = client.handler
        self.lock = threading.Lock()
        #: (lock path, thread id) -> the record held there (reentrancy).
        self.owned: dict[tuple[str, int], Any] = {}
        self.watch_refs: dict[str, int] = {}
        self._known_parents: OrderedDict[str, None] = OrderedDict()
        self._timed: set[Timed] = set()
        #: Timed leases whose node is not read for break requests yet -> when timing began.
        self._unwatched: dict[Timed, float] = {}
        #: Leases whose node has our break watch (counted in watch_refs until untracked).
        self._break_watched: set[Timed] = set()
        #: Breaks (requests read, nodes deleted) for the renewer to act on: lease -> reason.
        self._breaks: dict[Timed, str] = {}
        self._wakeups: set[Any] = set()
        self._pending_purges: set[tuple[str, str]] = set()
        self._purging = False
        #: Incremented each time the session is lost; lets a caller see "the session changed".
        self.epoch = 0
        #: Incremented at every state kazoo reports, before waiters are woken: watches set
        #: while it stays the same were set on one connection, which is still up.
        self.state_changes = 0
        self._valid_until = -math.inf
        self._renewing_since: float | None = None
        self._last_renewal_sent: float | None = None
        self._next_renewal = math.inf
        self._renewal_outstanding = False
        self._renewer_running = False
        #: When the renewer will next wake by itself; inf while it is working out when.
        self._renewer_wakes_at = math.inf
        self._renew_event = client.handler.event_object()
        self._forced_reconnect = False
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
        client = self.client
        if client.state != KazooState.CONNECTED:
            return None
        client_id = client.client_id
        return int(client_id[0]) if client_id else None

    @property
    def session_timeout(self) -> float:
        """The negotiated session timeout in seconds (the requested one until it is known)."""
        negotiated = adapter.negotiated_timeout(self.client)
        return negotiated if negotiated is not None else adapter.requested_timeout(self.client)

    @property
    def timing(self) -> LeaseTiming:
        return _timing(self.session_timeout)

    def check_usable(self) -> None:
        """Raise :class:`ZooKeeperUnavailable` at once for a client that cannot send at all:
        not started, stopped or closed, or whose connection loop gave up for good."""
        client = self.client
        if adapter.is_closed(client):
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
        self.timing.check()

    def await_connected(self, deadline: Deadline, what: str) -> None:
        """Wait until the client is connected; ZooKeeperUnavailable at ``deadline``, or within
        a :data:`WAIT_SLICE` of the client becoming unusable (see :meth:`check_usable`), which
        no state change need announce.

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
                    raise ZooKeeperUnavailable(f"ZooKeeper unreachable while {what}")
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

    # -- the lease clock ------------------------------------------------------------------
    def confirm(self, sent_at: float, epoch: int) -> None:
        """An answer came to a request sent at ``sent_at`` (during ``epoch``) that reached the
        leader: move the clock forward."""
        timing = self.timing
        with self.lock:
            if epoch != self.epoch:
                return
            valid = timing.valid_until(sent_at, renewing_since=self._renewing_since)
            if valid > self._valid_until:
                self._valid_until = valid

    def valid_until(self) -> float:
        """Until when (monotonic seconds) this client's leases are safe."""
        return self._valid_until

    def renew(self, deadline: Deadline) -> None:
        """Send one ``sync`` and wait for its answer (it moves the clock forward)."""
        epoch = self.epoch
        sent_at = time.monotonic()
        result = self.client.sync_async("/")
        wait_result(result, deadline, f"confirming the session with a sync ({self.client.hosts})")
        self.confirm(sent_at, epoch)

    def track(self, held: Timed) -> None:
        """Time ``held``: it is declared lost when the clock runs out or its session ends."""
        renew_interval = self.timing.renew_interval
        now = time.monotonic()
        with self.lock:
            if not self._timed:
                # A new stretch of holding: the first renewal is due one interval from now
                # (the grant's own create just confirmed the session).
                self._renewing_since = None
                self._last_renewal_sent = None
                self._next_renewal = now + renew_interval
            self._timed.add(held)
            self._unwatched[held] = now
            start = not self._renewer_running
            self._renewer_running = True
            # Waking the renewer is a thread hand-off per grant; it is needed only when it
            # would otherwise sleep past the first renewal (an idle renewer wakes every R).
            wake = self._renewer_wakes_at > self._next_renewal
        current = self.session_id()
        if current is not None and current != held.session_id:
            self.declare_lost("the ZooKeeper session changed", only_session=held.session_id)
        if start:
            self.handler.spawn(self._renew_loop)
        elif wake:
            self._renew_event.set()

    def untrack(self, held: Timed) -> None:
        with self.lock:
            self._timed.discard(held)
            self._unwatched.pop(held, None)
            self._breaks.pop(held, None)
            if held in self._break_watched:
                # The server's watch stays: our release deletes the node, which fires it.
                self._break_watched.discard(held)
                self._unref_watch(held.node)

    def expire_if_due(self) -> None:
        """Declare the leases lost now if the clock ran out (for readers that do not wait for
        the renewer: a process paused past its timeout runs no timer)."""
        if time.monotonic() >= self._valid_until:
            self.declare_lost(self._expired_reason())

    def _expired_reason(self) -> str:
        timing = self.timing
        return (
            f"no answer from the ZooKeeper leader in time (session timeout "
            f"{timing.session_timeout:g}s): the session may expire and another client be "
            "granted the lock"
        )

    def _renew_loop(self) -> None:
        """Renew while leases are held; declare them lost when the clock runs out. Lingers
        a session timeout after the last lease goes, so short tasks do not start a thread each."""
        client_ref, event = self._client_ref, self._renew_event
        idle_since: float | None = None
        while True:
            client = client_ref()
            self._apply_breaks()
            now = time.monotonic()
            timing = self.timing if client is not None else None
            with self.lock:
                self._renewer_wakes_at = math.inf
                if client is None or timing is None:
                    self._renewer_running = False
                    return
                holding = bool(self._timed)
                if holding:
                    idle_since = None
                else:
                    idle_since = now if idle_since is None else idle_since
                    if now - idle_since >= timing.session_timeout:
                        self._renewer_running = False
                        return
                valid_until = self._valid_until
                outstanding = self._renewal_outstanding
                next_renewal = self._next_renewal
            if not holding:
                assert idle_since is not None
                # Lingering, it looks every R, so a new grant need not wake it (see track).
                wake_at = min(idle_since + timing.session_timeout, now + timing.renew_interval)
            elif now >= valid_until:
                self.declare_lost(self._expired_reason())
                continue
            else:
                if not outstanding and now >= next_renewal:
                    self._send_renewal(client, now, timing)
                    self._watch_for_breaks(client, now, timing)
                    outstanding = True
                wake_at = valid_until if outstanding else min(valid_until, self._next_renewal)
            del client
            with self.lock:
                self._renewer_wakes_at = wake_at
            event.wait(max(0.0, wake_at - time.monotonic()))
            event.clear()

    def _send_renewal(self, client: KazooClient, now: float, timing: LeaseTiming) -> None:
        with self.lock:
            last_sent = self._last_renewal_sent
            on_time = last_sent is not None and now - last_sent <= timing.renew_interval * _ON_TIME
            if not on_time or self._renewing_since is None:
                self._renewing_since = now
            self._last_renewal_sent = now
            self._next_renewal = now + timing.renew_interval
            self._renewal_outstanding = True
            epoch = self.epoch

        def answered(result: Any) -> None:
            with self.lock:
                self._renewal_outstanding = False
                if not result.successful():
                    # It may never have reached the server: the gap between our touches is
                    # no longer known to be one interval.
                    self._renewing_since = None
            if result.successful():
                self.confirm(now, epoch)
            self._renew_event.set()

        try:
            client.sync_async("/").rawlink(answered)
        except Exception:  # the client is closing: the clock runs out on its own
            logger.debug("lease renewal could not be sent", exc_info=True)
            with self.lock:
                self._renewal_outstanding = False

    def declare_lost(
        self, reason: str, *, only_session: int | None = None, except_session: int | None = None
    ) -> None:
        """Tell every timed lease (of ``only_session``, or not of ``except_session``) it is lost."""
        with self.lock:
            victims = [
                held
                for held in self._timed
                if (only_session is None or held.session_id == only_session)
                and (except_session is None or held.session_id != except_session)
            ]
            told = []
            for held in victims:
                self._timed.discard(held)
                self._unwatched.pop(held, None)
                # Recorded before the lock is let go: a reader that then finds the lease gone
                # from _timed (Lease.lost's own look at the clock) sees it lost, not still held.
                told.append((held, held.record_lost(reason)))
        for held, callbacks in told:
            held.tell_lost(reason, callbacks)

    # -- break requests -------------------------------------------------------------------
    def _watch_for_breaks(self, client: KazooClient, now: float, timing: LeaseTiming) -> None:
        """Read, with a data watch, the node of every lease held for ``R`` or longer that has no
        watch yet: one request per lease that lives that long, none for shorter ones."""
        with self.lock:
            due = [
                held
                for held, since in self._unwatched.items()
                if since + timing.renew_interval <= now  # as the renewal due time is computed
            ]
            for held in due:
                del self._unwatched[held]
                self._break_watched.add(held)
                # A waiter of this client watching the same node must not remove the server's
                # watch (one per session and path) when it stops waiting: count ours.
                self.watch_refs[held.node] = self.watch_refs.get(held.node, 0) + 1
        for held in due:
            self._read_for_break(client, held)

    def _read_for_break(self, client: KazooClient, held: Timed) -> None:
        """Read ``held``'s node and watch it; a break request found (now or at a later change)
        is handed to the renewer."""
        node = held.node

        def changed(event: WatchedEvent) -> None:
            # kazoo's event thread: only send and note. Our own release untracks the lease
            # before it deletes the node; NONE is kazoo dropping its watchers at a session's end.
            if not self._is_break_watched(held):
                return
            if event.type == EventType.CHANGED:
                self._read_for_break(client, held)
            elif event.type == EventType.DELETED:
                self._note_loss(held, _DELETED)

        def answered(result: Any) -> None:
            try:
                data, _ = result.get_nowait()
            except NoNodeError:
                # kazoo registered the watcher all the same: drop it.
                adapter.discard_data_watcher(client, node, changed)
                self._note_loss(held, _DELETED)
                return
            except ConnectionClosedError:
                return
            except Exception:  # not answered (connection loss): read again at the next tick
                logger.debug("break watch on %s not set", node, exc_info=True)
                with self.lock:
                    if held in self._break_watched and held in self._timed:
                        self._break_watched.discard(held)
                        self._unref_watch(node)
                        self._unwatched[held] = -math.inf
                return
            reason = break_reason(data)
            if reason is not None:
                self._note_loss(held, reason)

        try:
            client.get_async(node, watch=changed).rawlink(answered)
        except Exception:  # the client is closing: the lease goes with it
            logger.debug("break watch on %s could not be sent", node, exc_info=True)

    def _note_loss(self, held: Timed, reason: str) -> None:
        """Hand ``held``'s loss to the renewer, if it is still timed."""
        with self.lock:
            if held not in self._timed:
                return
            self._breaks[held] = reason
        self._renew_event.set()

    def _is_break_watched(self, held: Timed) -> bool:
        with self.lock:
            return held in self._break_watched

    def _unref_watch(self, node: str) -> None:
        """Drop our count on ``node``'s watch (the caller holds ``self.lock``)."""
        left = self.watch_refs.get(node, 0) - 1
        if left > 0:
            self.watch_refs[node] = left
        else:
            self.watch_refs.pop(node, None)

    def _apply_breaks(self) -> None:
        """End the leases whose node carries a break request (on the renewer's thread, like
        every other loss the clock declares)."""
        with self.lock:
            breaks, self._breaks = self._breaks, {}
            told = []
            for held, reason in breaks.items():
                self._timed.discard(held)
                told.append((held, reason, held.record_lost(reason)))
        for held, reason, callbacks in told:
            held.tell_lost(reason, callbacks)

    # -- kazoo's states -------------------------------------------------------------------
    def _on_state(self, state: str) -> bool:
        with self.lock:
            self.state_changes += 1
            wakeups = list(self._wakeups)
        for event in wakeups:
            event.set()
        if state == KazooState.LOST:
            with self.lock:
                self.epoch += 1
                self._valid_until = -math.inf
            self.declare_lost("the ZooKeeper session expired")
        elif state == KazooState.CONNECTED:
            current = self.session_id()
            if current is not None:
                self.declare_lost("the ZooKeeper session changed", except_session=current)
            if self._pending_purges:
                self._start_purges()
        self._renew_event.set()
        return False

    # -- lock parents and watches ----------------------------------------------------------
    def parent_known(self, path: str) -> bool:
        with self.lock:
            if path in self._known_parents:
                self._known_parents.move_to_end(path)
                return True
            return False

    def remember_parent(self, path: str, exists: bool) -> None:
        with self.lock:
            if exists:
                self._known_parents[path] = None
                if len(self._known_parents) > KNOWN_PARENTS:
                    self._known_parents.popitem(last=False)
            else:
                self._known_parents.pop(path, None)

    # -- orphans --------------------------------------------------------------------------
    def purge_later(self, parent: str, prefix: str) -> None:
        """Delete the children of ``parent`` whose name starts with ``prefix`` (listed after a
        ``sync``, see :func:`synced_children`), in the background: now if connected (retrying
        with backoff), else after the reconnect.

        Used when an acquire gave up while the outcome of its create was unknown: with
        Curator's protected names the prefix (``_c_<uuid>-``) names that one attempt's nodes.
        """
        with self.lock:
            self._pending_purges.add((parent, prefix))
        self._start_purges()

    def pending_purges(self) -> set[tuple[str, str]]:
        with self.lock:
            return set(self._pending_purges)

    def _start_purges(self) -> None:
        with self.lock:
            if self._purging:
                return
            self._purging = True
        self.handler.spawn(self._run_purges)

    def _run_purges(self) -> None:
        """The purge thread: purge until nothing is pending or the client is not connected,
        and never leave a purge behind that a caller counted on us for."""
        while True:
            try:
                self._purge_pending()
            finally:
                with self.lock:
                    self._purging = False
            # A purge_later, or the CONNECTED listener, that came while we were on our way out
            # saw _purging still set and left its work to us: look again now that it is clear.
            client = self._client_ref()
            with self.lock:
                if (
                    self._purging
                    or not self._pending_purges
                    or client is None
                    or adapter.is_closed(client)
                    or client.state != KazooState.CONNECTED
                ):
                    return
                self._purging = True
            del client

    def _purge_pending(self) -> None:
        backoff = 0.05
        while True:
            client = self._client_ref()
            with self.lock:
                pending = list(self._pending_purges)
            if client is None or not pending or adapter.is_closed(client):
                return
            if client.state != KazooState.CONNECTED:
                return  # the CONNECTED listener starts us again
            failed = False
            timeout = self.timing.idle_gap
            for parent, prefix in pending:
                what = f"removing orphans under {parent}"
                try:
                    for child in synced_children(client, parent, Deadline(timeout), what):
                        if child.startswith(prefix):
                            node = f"{parent}/{child}"
                            try:
                                wait_result(client.delete_async(node), Deadline(timeout), what)
                                logger.info("removed orphaned contender %s", node)
                            except NoNodeError:
                                pass
                except NoNodeError:
                    pass  # the parent (and so our node) is gone already
                except Exception as exc:  # a timeout or connection loss: retry below
                    logger.debug("purge of %s/%s* failed: %r", parent, prefix, exc)
                    failed = True
                    continue
                with self.lock:
                    self._pending_purges.discard((parent, prefix))
            del client
            if failed:
                self.handler.sleep_func(backoff)
                backoff = min(backoff * 2, self.timing.idle_gap)


_contexts: weakref.WeakKeyDictionary[KazooClient, ClientContext] = weakref.WeakKeyDictionary()
_contexts_lock = threading.Lock()


def _new_contexts_lock_after_fork() -> None:
    # A thread of the parent may have held it at the fork: the child's first context_for
    # would then wait for ever.
    global _contexts_lock
    _contexts_lock = threading.Lock()


os.register_at_fork(after_in_child=_new_contexts_lock_after_fork)


@functools.lru_cache(maxsize=64)
def _timing(session_timeout: float) -> LeaseTiming:
    return LeaseTiming(session_timeout)


def context_for(client: KazooClient) -> ClientContext:
    """The :class:`ClientContext` of ``client`` (created and attached on first use)."""
    with _contexts_lock:
        context = _contexts.get(client)
        if context is None:
            context = _contexts[client] = ClientContext(client)
        return context


def wait_result(result: Any, deadline: Deadline, what: str) -> Any:
    """Wait for a kazoo async result until ``deadline``; ZooKeeperUnavailable when it passes.

    Waits with ``wait`` and never with ``get(timeout=...)``: the gevent handler's ``get``
    raises ``gevent.Timeout`` on its own timeout, which cannot be told apart from a timeout
    the gevent pool throws into the task (its time limit) and must not be swallowed.
    Exceptions the request failed with propagate unchanged.
    """
    while not result.ready():
        if deadline.expired():
            raise ZooKeeperUnavailable(f"ZooKeeper did not answer in time while {what}")
        result.wait(wait_slice(deadline))
    return result.get()


def synced_children(client: Any, path: str, io: Deadline, what: str) -> list[str]:
    """The children of ``path`` as the leader had them when we asked: a ``sync`` and the listing
    back to back (the server answers a session's requests in order, so it costs no round trip).
    Raises what either request failed with (ZooKeeperUnavailable past ``io``)."""
    synced = client.sync_async(path)
    listing = client.get_children_async(path)
    wait_result(synced, io, what)
    children: list[str] = wait_result(listing, io, what)
    return children
