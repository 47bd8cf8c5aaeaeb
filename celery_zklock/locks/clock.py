"""The lease clock: until when a held lock is safely ours, from answers the leader gave.

:class:`LeaseTiming` holds the numbers for one session timeout; :class:`LeaseClock` is the clock
of one client (its renewer, and the loss it declares). Why the numbers are what they are:

A lease is only as good as the ZooKeeper session that owns its ephemeral node, and the only
party that decides when that session ends is the ensemble's leader: it expires the session ``T``
(the negotiated session timeout) after the last time it heard of the session, and from then on
another client can be granted the lock. kazoo's connection state is no guide to that moment:
kazoo declares a link dead only when a *ping* goes unanswered and pings only ``T/3`` after its
last *send*, so a process whose other threads keep sending into a silent link stays CONNECTED for
the whole partition; and a follower cut off from its leader goes on answering pings (and reads)
until its own ``syncLimit * tickTime`` runs out, while the leader expires the session at ``T``.

So the clock trusts only answers that prove the *leader* heard of the session: answers to
requests that a follower cannot answer alone (``sync``, ``create``, ``delete``). For such an
answer to a request sent at ``s`` (our monotonic clock, taken before the request was queued, so
no later than the server saw it), the leader's expiry of the session is no earlier than::

    s + T - gap - tick/2

- ``tick/2``: a follower reports the sessions it heard from to the leader in its answer to the
  leader's ping, sent every ``tickTime/2``; the request that reached the leader travelled on the
  same ordered link after the report that covers our previous send. ZooKeeper's default
  ``minSessionTimeout`` is ``2 * tickTime``, so ``tick/2 <= T/4``; we use ``T/4``. (Standalone
  servers hear us directly and this term is slack.)
- ``gap``: the longest time between two of our sends before ``s``. kazoo sends a ping whenever
  it sent nothing for ``T/3``, so ``gap <= T/3`` always; while leases are held the clock
  renews every ``R = T/8`` with a ``sync``, so once renewals have run for ``T/4 + R`` the gap
  is ``R``.
- The server rounds expiry *up* to the next tick and checks expiry once a tick: both only make
  the real expiry later than the bound.

Every lease of the client counts as lost ``margin`` before that bound, with
``margin = max(0.25 s, T/10)``: the time left to interrupt the task body before anyone else can
be granted the lock. With renewals running, a lease stays valid for ``T - R - T/4 - margin``
after the latest answered renewal: ``5T/8 - margin``, 2.1 s for ``T = 4 s`` and 5.25 s for
``T = 10 s``; right after a grant (no renewals yet) the window is ``5T/12 - margin`` from the
create. A link that is silent for longer than that revokes the lease even if the session
survives: safety wins over availability.

On reconnect to another member the session is revalidated by the leader; the clock credits
nothing for the handshake and waits for the next answered renewal. A session that expired ends
every lease at once (kazoo reports LOST), and a lease once lost stays lost.

What no client-side clock can cover: a process paused (SIGSTOP, a stall) runs no timer, so it
may resume after the leader expired its session. Its lease is then past its validity, which
:attr:`Lease.lost <celery_zklock.Lease.lost>` and the release see; fencing tokens protect the
writes it may still attempt. The bound assumes the client's and the leader's clocks run at the
same rate (drift of parts per million is far below the margin).
"""

from __future__ import annotations

import functools
import logging
import math
import threading
import time
import weakref
from collections.abc import Iterable
from typing import Any, Protocol

from kazoo.client import KazooClient

from celery_zklock.errors import ConfigurationError, LossCode, ZooKeeperUnavailable
from celery_zklock.locks.breaks import BreakWatches
from celery_zklock.locks.lease import Hold
from celery_zklock.zk.calls import Deadline, wait_result

logger = logging.getLogger("celery_zklock.locks")

#: The shortest time left to interrupt a body before the leader may expire the session.
MIN_MARGIN = 0.25
#: The shortest negotiated session timeout under which a fresh lease outlives one renewal.
MIN_SESSION_TIMEOUT = 1.0
#: A renewal counts as on time when sent within this factor of ``R`` after the previous one.
_ON_TIME = 1.25


class LeaseTiming:
    """The lease clock's numbers for one negotiated session timeout ``session_timeout`` (s),
    worked out once, when it is made (they depend on nothing else).

    Attributes:
        renew_interval: ``R``, seconds between renewals (``sync``) while leases are held.
        idle_gap: the longest time kazoo stays silent on a connection: it pings after ``T/3``.
        leader_lag: upper bound of ``tickTime/2``, the delay of a follower's report to the
            leader.
        margin: time left to interrupt the body between loss on our side and expiry on the
            leader.
        steady_after: how long renewals must have run before an answer may use the renewal
            gap.
        dead_node_lifetime: upper bound on how long the node of a dead holder can live
            (seconds): ``T`` rounded up to the server's tick (``tick <= T/2``) plus a second
            for the expiry to be applied.
    """

    def __init__(self, session_timeout: float) -> None:
        self.session_timeout = session_timeout
        self.renew_interval = session_timeout / 8.0
        self.idle_gap = session_timeout / 3.0
        self.leader_lag = session_timeout / 4.0
        self.margin = max(MIN_MARGIN, session_timeout / 10.0)
        self.steady_after = self.leader_lag + self.renew_interval
        self.dead_node_lifetime = 1.5 * session_timeout + 1.0
        # What valid_until adds to the send time, before and once renewals run steadily.
        common = session_timeout - self.leader_lag - self.margin
        self._fresh_validity = common - self.idle_gap
        self._steady_validity = common - self.renew_interval

    def valid_until(self, sent_at: float, *, renewing_since: float | None) -> float:
        """Until when (monotonic s) leases are safe, from an answer to a request sent at
        ``sent_at`` that reached the leader; ``renewing_since`` is when renewals started:
        ``sent_at + T - gap - leader_lag - margin``, the gap ``R`` once renewals have run for
        ``steady_after``, else ``idle_gap``."""
        if renewing_since is not None and renewing_since <= sent_at - self.steady_after:
            return sent_at + self._steady_validity
        return sent_at + self._fresh_validity

    def check(self) -> None:
        """Raise ConfigurationError if leases cannot be kept safely under this timeout."""
        if self.session_timeout < MIN_SESSION_TIMEOUT:
            raise ConfigurationError(
                f"the negotiated ZooKeeper session timeout is {self.session_timeout:g}s; a lease "
                f"needs at least {MIN_SESSION_TIMEOUT:g}s to be renewed before it must count as "
                "lost: ask for a longer one (zklock_session_timeout, or the kazoo client's "
                "timeout) or raise the server's minSessionTimeout"
            )


@functools.lru_cache(maxsize=64)
def timing_for(session_timeout: float) -> LeaseTiming:
    """The (shared) :class:`LeaseTiming` of ``session_timeout``."""
    return LeaseTiming(session_timeout)


class Session(Protocol):
    """What the clock reads of its client's session (the client's
    :class:`~celery_zklock.locks.context.ClientContext`)."""

    @property
    def timing(self) -> LeaseTiming:
        """The numbers of the negotiated session timeout."""

    def session_id(self) -> int | None:
        """The current session id, or None while not connected."""


class LeaseClock:
    """The lease clock of one kazoo client: times its held leases and declares them lost.

    While any lease is held a renewer (a thread, or a greenlet under kazoo's gevent handler)
    sends a ``sync`` every ``R``, whether or not the previous one was answered yet; every answer
    to a request that reached the leader (:meth:`confirm`) moves :attr:`valid_until` forward,
    and when that moment passes unrenewed every lease is lost
    (:attr:`~celery_zklock.errors.LossCode.LEASE_CLOCK`). So is every lease
    of a session that ended (:meth:`session_lost`, :meth:`declare_lost`), and one whose node was
    broken (:class:`~celery_zklock.locks.breaks.BreakWatches`, read on the renewer's ticks, or
    at once by :meth:`confirm_held`). A
    loss is recorded on the lease under ``lock`` before the lease leaves the clock, then told
    (log, callbacks) after ``lock`` is let go. The renewer lingers a session timeout after the
    last lease goes, so short tasks do not start a thread each.

    ``lock`` is the client's one lock (the context's), ``watch_refs`` its count of watches per
    node; ``session`` gives the negotiated timing and the current session id.
    """

    def __init__(
        self,
        client: KazooClient,
        session: Session,
        lock: threading.Lock,
        watch_refs: dict[str, int],
    ) -> None:
        self._client_ref = weakref.ref(client)
        self._session = session
        self._handler = client.handler
        self._lock = lock
        #: Incremented each time the session is lost; lets a caller see "the session changed",
        #: and keeps an answer from an earlier session from moving the clock.
        self.epoch = 0
        self._timed: set[Hold] = set()
        #: Until when (monotonic seconds) this client's leases are safe; written under ``lock``.
        self.valid_until = -math.inf
        self._renewing_since: float | None = None
        self._last_renewal_sent: float | None = None
        self._next_renewal = math.inf
        self._renewer_running = False
        #: When the renewer will next wake by itself; inf while it is working out when.
        self._renewer_wakes_at = math.inf
        self._renew_event = client.handler.event_object()
        self.breaks = BreakWatches(lock, self._timed, watch_refs, self.wake)

    def wake(self) -> None:
        """Wake the renewer to look again (a state change, a break found)."""
        self._renew_event.set()

    def confirm(self, sent_at: float, epoch: int) -> None:
        """An answer came to a request sent at ``sent_at`` (during ``epoch``) that reached the
        leader: move the clock forward."""
        timing = self._session.timing
        with self._lock:
            if epoch != self.epoch:
                return
            valid = timing.valid_until(sent_at, renewing_since=self._renewing_since)
            if valid > self.valid_until:
                self.valid_until = valid

    def ensure_fresh(self, deadline: Deadline, what: str) -> None:
        """Before a lease is handed out: make sure the clock has a renewal's worth left (one
        ``sync`` if not); ZooKeeperUnavailable if the leader did not confirm the session in
        time to grant ``what`` (a lock path)."""
        if self.valid_until - time.monotonic() < self._session.timing.renew_interval:
            self.renew(deadline)
        if self.valid_until <= time.monotonic():
            raise ZooKeeperUnavailable(
                f"the ZooKeeper leader did not confirm the session in time to grant {what}"
            )

    def renew(self, deadline: Deadline) -> None:
        """Send one ``sync`` and wait for its answer (it moves the clock forward)."""
        client = self._client()
        epoch = self.epoch
        sent_at = time.monotonic()
        result = client.sync_async("/")
        wait_result(result, deadline, f"confirming the session with a sync ({client.hosts})")
        self.confirm(sent_at, epoch)

    def confirm_held(self, holds: Iterable[Hold], deadline: Deadline) -> None:
        """Bring the verdict on ``holds`` up to date, for a caller about to rely on them: a
        ``sync`` (an answer from the leader, which moves the clock forward) and, sent behind it
        on the same connection, a read of each node (:meth:`BreakWatches.look_now`), so the
        reads see at least what the leader had when the sync reached it. One round trip. When
        this returns, a lease whose node is gone or carries a break request, whose session
        ended or whose clock ran out counts as lost. Raises what a request failed with (a lost
        connection, an expired session), ZooKeeperUnavailable past ``deadline``.
        """
        client = self._client()
        epoch, sent_at = self.epoch, time.monotonic()
        synced = client.sync_async("/")
        reads = self.breaks.look_now(client, holds)
        failure: Exception | None = None
        try:
            wait_result(synced, deadline, "confirming the session with a sync")
        except Exception as exc:  # the reads are judged all the same (a failed one re-arms)
            failure = exc
        else:
            self.confirm(sent_at, epoch)
        self.breaks.judge_now(reads, deadline)
        if failure is not None:
            raise failure
        self.expire_if_due()

    def track(self, held: Hold) -> None:
        """Time ``held``: it is declared lost when the clock runs out or its session ends."""
        renew_interval = self._session.timing.renew_interval
        now = time.monotonic()
        with self._lock:
            if not self._timed:
                # A new stretch of holding: the first renewal is due one interval from now
                # (the grant's own create just confirmed the session).
                self._renewing_since = None
                self._last_renewal_sent = None
                self._next_renewal = now + renew_interval
            self._timed.add(held)
            self.breaks.begin_locked(held, now)
            start = not self._renewer_running
            self._renewer_running = True
            # Waking the renewer is a thread hand-off per grant; it is needed only when it
            # would otherwise sleep past the first renewal (an idle renewer wakes every R).
            wake = self._renewer_wakes_at > self._next_renewal
        current = self._session.session_id()
        if current is not None and current != held.ours.session:
            self.declare_lost(
                LossCode.SESSION_EXPIRED,
                "the ZooKeeper session changed",
                only_session=held.ours.session,
            )
        if start:
            self._handler.spawn(self._renew_loop)
        elif wake:
            self._renew_event.set()

    def untrack(self, held: Hold) -> None:
        """Stop timing ``held`` (it is being released)."""
        with self._lock:
            self._timed.discard(held)
            self.breaks.forget_locked(held)

    def expire_if_due(self) -> None:
        """Declare the leases lost now if the clock ran out (for readers that do not wait for
        the renewer: a process paused past its timeout runs no timer)."""
        if time.monotonic() >= self.valid_until:
            self.declare_lost(LossCode.LEASE_CLOCK, self._expired_reason())

    def session_lost(self) -> None:
        """The session expired (kazoo reported LOST): every lease ends, and no answer from it
        moves the clock any more."""
        with self._lock:
            self.epoch += 1
            self.valid_until = -math.inf
        self.declare_lost(LossCode.SESSION_EXPIRED, "the ZooKeeper session expired")

    def declare_lost(
        self,
        code: LossCode,
        reason: str,
        *,
        only_session: int | None = None,
        except_session: int | None = None,
    ) -> None:
        """Tell every timed lease (of ``only_session``, or not of ``except_session``) it is lost."""
        with self._lock:
            victims = [
                held
                for held in self._timed
                if (only_session is None or held.ours.session == only_session)
                and (except_session is None or held.ours.session != except_session)
            ]
            told = []
            for held in victims:
                self._timed.discard(held)
                self.breaks.stop_reading_locked(held)
                # Recorded before the lock is let go: a reader that then finds the lease gone
                # from _timed (Lease.lost's own look at the clock) sees it lost, not still held.
                told.append((held, held.record_lost(code, reason)))
        for held, callbacks in told:
            held.tell_lost(reason, callbacks)

    def _client(self) -> KazooClient:
        client = self._client_ref()
        if client is None:  # pragma: no cover - a lock keeps its client alive
            raise ZooKeeperUnavailable("the kazoo client of this lock was garbage-collected")
        return client

    def _expired_reason(self) -> str:
        timing = self._session.timing
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
            self.breaks.apply()
            now = time.monotonic()
            timing = self._session.timing if client is not None else None
            with self._lock:
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
                valid_until = self.valid_until
                next_renewal = self._next_renewal
            if not holding:
                assert idle_since is not None
                # Lingering, it looks every R, so a new grant need not wake it (see track).
                wake_at = min(idle_since + timing.session_timeout, now + timing.renew_interval)
            elif now >= valid_until:
                self.declare_lost(LossCode.LEASE_CLOCK, self._expired_reason())
                continue
            else:
                # Not held back by a renewal still unanswered: a slow answer (the server's log
                # fsync, a stalled member) would make the next one late, and a late one restarts
                # the steady count, so the next renewals would earn only the fresh validity.
                if now >= next_renewal:
                    self._send_renewal(client, now, timing)
                    self.breaks.watch_due(client, now, timing.renew_interval)
                wake_at = min(valid_until, self._next_renewal)
            del client
            with self._lock:
                self._renewer_wakes_at = wake_at
            event.wait(max(0.0, wake_at - time.monotonic()))
            event.clear()

    def _send_renewal(self, client: KazooClient, now: float, timing: LeaseTiming) -> None:
        with self._lock:
            last_sent = self._last_renewal_sent
            on_time = last_sent is not None and now - last_sent <= timing.renew_interval * _ON_TIME
            if not on_time or self._renewing_since is None:
                self._renewing_since = now
            self._last_renewal_sent = now
            self._next_renewal = now + timing.renew_interval
            epoch = self.epoch

        def answered(result: Any) -> None:
            if not result.successful():
                with self._lock:
                    # It may never have reached the server: the gap between our touches is
                    # no longer known to be one interval.
                    self._renewing_since = None
            else:
                self.confirm(now, epoch)
            self._renew_event.set()

        try:
            client.sync_async("/").rawlink(answered)
        except Exception:  # the client is closing: the clock runs out on its own
            logger.debug("lease renewal could not be sent", exc_info=True)
