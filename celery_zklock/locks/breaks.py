"""Break watches: how a holder learns that an operator broke its lease, or deleted its node.

A lease held for a renewal interval ``R`` gets its node read once, with a data watch, at the
lease clock's next tick (:meth:`BreakWatches.watch_due`); a lease released within ``R`` costs no
request for this. A caller about to rely on leases it has held for a while (a
:class:`~celery_zklock.MultiLock` that took its paths one after the other) has their nodes read
at once instead (:meth:`BreakWatches.look_now`, :meth:`BreakWatches.judge_now`), which sets the
watches of those not watched yet. A break request in the node's data (written before or
after the watch was set; see :func:`~celery_zklock.locks.identity.break_reason`) ends the lease
with :attr:`~celery_zklock.errors.LossCode.BROKEN`, and the node's deletion by anyone else
(``celery zklock break --force``) with :attr:`~celery_zklock.errors.LossCode.NODE_DELETED`.

What the watches find (on kazoo's event thread, which must not block) is only noted and the
clock woken: the clock's thread ends the lease (:meth:`BreakWatches.apply`), like every other
loss it declares. Everything here is guarded by the client's one lock, which the clock passes
in with its set of timed leases.
"""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import Callable, Iterable
from contextlib import suppress
from typing import Any

from kazoo.client import KazooClient
from kazoo.exceptions import ConnectionClosedError, NoNodeError
from kazoo.protocol.states import EventType, WatchedEvent

from celery_zklock.errors import LossCode, ZooKeeperUnavailable
from celery_zklock.locks.identity import break_reason
from celery_zklock.locks.lease import Hold
from celery_zklock.zk import adapter
from celery_zklock.zk.calls import Deadline, wait_result

logger = logging.getLogger("celery_zklock.locks")

#: The reason of a lease whose node someone else deleted (found by its watch or at release).
DELETED = "the lock node was deleted by someone else while it was held"

Read = tuple[Any, Callable[[Any], "BaseException | None"]]
"""A read of a lease's node in flight, and its judge (see :meth:`BreakWatches._send_read`)."""


class BreakWatches:
    """The break watches of one client's leases.

    ``lock`` guards this object's state, ``timed`` (the clock's set of the leases it times) and
    ``watch_refs`` (the client's count of its watches per node, shared with waiters: one server
    watch per session and path). ``wake()`` wakes the clock's thread to act on a break.
    """

    def __init__(
        self,
        lock: threading.Lock,
        timed: set[Hold],
        watch_refs: dict[str, int],
        wake: Callable[[], None],
    ) -> None:
        self._lock = lock
        self._timed = timed
        self._watch_refs = watch_refs
        self._wake = wake
        #: Timed leases whose node is not read for break requests yet -> when timing began.
        self._unwatched: dict[Hold, float] = {}
        #: Leases whose node has our break watch (counted in watch_refs until forgotten).
        self._watched: set[Hold] = set()
        #: Breaks (requests read, nodes deleted) for the clock to act on.
        self._found: dict[Hold, tuple[LossCode, str]] = {}

    # -- called by the clock, under the lock ----------------------------------------------
    def begin_locked(self, held: Hold, now: float) -> None:
        """``held`` is timed from ``now``: its node is read once it has been held for ``R``."""
        self._unwatched[held] = now

    def stop_reading_locked(self, held: Hold) -> None:
        """``held`` is lost: its node need not be read (a watch already set stays counted)."""
        self._unwatched.pop(held, None)

    def forget_locked(self, held: Hold) -> None:
        """``held`` is released: drop everything about it."""
        self._unwatched.pop(held, None)
        self._found.pop(held, None)
        if held in self._watched:
            # The server's watch stays: our release deletes the node, which fires it.
            self._watched.discard(held)
            self._unref_watch_locked(held.node)

    def apply(self) -> None:
        """End the leases whose node was broken (on the clock's thread, like every other loss
        the clock declares): recorded under the lock as the lease leaves the timed set, told
        after it."""
        with self._lock:
            found, self._found = self._found, {}
            told = []
            for held, (code, reason) in found.items():
                self._timed.discard(held)
                told.append((held, reason, held.record_lost(code, reason)))
        for held, reason, callbacks in told:
            held.tell_lost(reason, callbacks)

    # -- the watches ----------------------------------------------------------------------
    def watch_due(self, client: KazooClient, now: float, renew_interval: float) -> None:
        """Read, with a data watch, the node of every lease held for ``renew_interval`` (``R``)
        or longer that has no watch yet: one request per lease that lives that long, none for
        shorter ones."""
        with self._lock:
            due = [
                held
                for held, since in self._unwatched.items()
                if since + renew_interval <= now  # as the renewal due time is computed
            ]
            for held in due:
                self._watching_locked(held)
        for held in due:
            self._read(client, held)

    def _read(self, client: KazooClient, held: Hold) -> None:
        """Read ``held``'s node and watch it; a break request found (now or at a later change)
        is handed to the clock."""
        sent = self._send_read(client, held, watch=True)
        if sent is not None:
            result, judge = sent
            result.rawlink(judge)

    def _send_read(self, client: KazooClient, held: Hold, *, watch: bool) -> Read | None:
        """Send a read of ``held``'s node (with our break watch if ``watch``); return it with
        its judge, which hands a deletion or a break request it finds to the clock and returns
        the failure of a read that was not answered (None once answered). None if the client
        cannot send."""
        node = held.node

        def changed(event: WatchedEvent) -> None:
            # kazoo's event thread: only send and note. Our own release forgets the lease
            # before it deletes the node; NONE is kazoo dropping its watchers at a session's end.
            if not self._is_watched(held):
                return
            if event.type == EventType.CHANGED:
                self._read(client, held)
            elif event.type == EventType.DELETED:
                self._note(held, LossCode.NODE_DELETED, DELETED)

        def judge(result: Any) -> BaseException | None:
            failure: BaseException
            try:
                data, _ = result.get_nowait()
            except NoNodeError:
                if watch:  # kazoo registered the watcher all the same: drop it.
                    adapter.discard_data_watcher(client, node, changed)
                self._note(held, LossCode.NODE_DELETED, DELETED)
                return None
            except Exception as exc:  # not answered (connection loss)
                failure = exc
                if isinstance(exc, ConnectionClosedError):
                    return failure  # the client is closing: the lease goes with it
                logger.debug("break watch on %s not set", node, exc_info=True)
                if watch:  # read again at the clock's next tick
                    with self._lock:
                        if held in self._watched and held in self._timed:
                            self._watched.discard(held)
                            self._unref_watch_locked(node)
                            self._unwatched[held] = -math.inf
                return failure
            reason = break_reason(data)
            if reason is not None:
                self._note(held, LossCode.BROKEN, reason)
            return None

        try:
            return client.get_async(node, watch=changed if watch else None), judge
        except Exception:  # the client is closing: the lease goes with it
            logger.debug("break watch on %s could not be sent", node, exc_info=True)
            return None

    # -- a look now, for a caller about to rely on its leases -------------------------------
    def look_now(self, client: KazooClient, holds: Iterable[Hold]) -> list[Read]:
        """Send at once, back to back, a read of the node of each of ``holds`` still timed, for
        :meth:`judge_now`: with our break watch where it is not set yet (what
        :meth:`watch_due` would do at a later tick), without where it is (its event may be on
        its way still; the read's answer says the same)."""
        with self._lock:
            timed = [held for held in holds if held in self._timed]
            fresh = {held for held in timed if held in self._unwatched}
            for held in fresh:
                self._watching_locked(held)
        reads = (self._send_read(client, held, watch=held in fresh) for held in timed)
        return [read for read in reads if read is not None]

    def judge_now(self, reads: list[Read], deadline: Deadline) -> None:
        """Wait for the answers to :meth:`look_now`'s ``reads`` and judge them on this thread: a
        node found deleted or carrying a break request ends its lease (:meth:`apply`) before
        this returns. Raises the failure of a read that was not answered (a lost connection),
        ZooKeeperUnavailable past ``deadline``; answers still to come are judged when they
        come, as the clock's reads are."""
        failure: BaseException | None = None
        judged = 0
        try:
            for result, judge in reads:
                with suppress(Exception):  # the request's own failure: judged below
                    wait_result(result, deadline, "reading a held lock's node")
                if not result.ready():
                    raise ZooKeeperUnavailable(deadline.why("reading a held lock's node"))
                judged += 1
                failure = judge(result) or failure
        finally:
            for result, judge in reads[judged:]:
                result.rawlink(judge)
        self.apply()
        if failure is not None:
            raise failure

    def _note(self, held: Hold, code: LossCode, reason: str) -> None:
        """Hand ``held``'s loss to the clock, if it still times the lease."""
        with self._lock:
            if held not in self._timed:
                return
            self._found[held] = (code, reason)
        self._wake()

    def _is_watched(self, held: Hold) -> bool:
        with self._lock:
            return held in self._watched

    def _watching_locked(self, held: Hold) -> None:
        """``held``'s node gets our break watch now: it leaves the unwatched leases."""
        del self._unwatched[held]
        self._watched.add(held)
        # A waiter of this client watching the same node must not remove the server's watch
        # (one per session and path) when it stops waiting: count ours.
        self._watch_refs[held.node] = self._watch_refs.get(held.node, 0) + 1

    def _unref_watch_locked(self, node: str) -> None:
        """Drop our count on ``node``'s watch."""
        left = self._watch_refs.get(node, 0) - 1
        if left > 0:
            self._watch_refs[node] = left
        else:
            self._watch_refs.pop(node, None)
