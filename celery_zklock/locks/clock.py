"""The lease clock: until when a held lock is safely ours, from answers the leader gave.

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

from dataclasses import dataclass

from celery_zklock.errors import ConfigurationError

#: The shortest time left to interrupt a body before the leader may expire the session.
MIN_MARGIN = 0.25
#: The shortest negotiated session timeout under which a fresh lease outlives one renewal.
MIN_SESSION_TIMEOUT = 1.0


@dataclass(frozen=True)
class LeaseTiming:
    """The lease clock's numbers for one negotiated session timeout ``session_timeout`` (s)."""

    session_timeout: float

    @property
    def renew_interval(self) -> float:
        """``R``: seconds between renewals (``sync``) while leases are held."""
        return self.session_timeout / 8.0

    @property
    def idle_gap(self) -> float:
        """Longest time kazoo stays silent on a connection: it pings after ``T/3``."""
        return self.session_timeout / 3.0

    @property
    def leader_lag(self) -> float:
        """Upper bound of ``tickTime/2``, the delay of a follower's report to the leader."""
        return self.session_timeout / 4.0

    @property
    def margin(self) -> float:
        """Time left to interrupt the body between loss on our side and expiry on the leader."""
        return max(MIN_MARGIN, self.session_timeout / 10.0)

    @property
    def steady_after(self) -> float:
        """How long renewals must have run before an answer may use the renewal gap."""
        return self.leader_lag + self.renew_interval

    def valid_until(self, sent_at: float, *, renewing_since: float | None) -> float:
        """Until when (monotonic s) leases are safe, from an answer to a request sent at
        ``sent_at`` that reached the leader; ``renewing_since`` is when renewals started."""
        steady = renewing_since is not None and renewing_since <= sent_at - self.steady_after
        gap = self.renew_interval if steady else self.idle_gap
        return sent_at + self.session_timeout - gap - self.leader_lag - self.margin

    def check(self) -> None:
        """Raise ConfigurationError if leases cannot be kept safely under this timeout."""
        if self.session_timeout < MIN_SESSION_TIMEOUT:
            raise ConfigurationError(
                f"the negotiated ZooKeeper session timeout is {self.session_timeout:g}s; a lease "
                f"needs at least {MIN_SESSION_TIMEOUT:g}s to be renewed before it must count as "
                "lost: ask for a longer one (zklock_session_timeout, or the kazoo client's "
                "timeout) or raise the server's minSessionTimeout"
            )

    @property
    def dead_node_lifetime(self) -> float:
        """Upper bound on how long the node of a dead holder can live (seconds): ``T`` rounded
        up to the server's tick (``tick <= T/2``) plus a second for the expiry to be applied."""
        return 1.5 * self.session_timeout + 1.0
