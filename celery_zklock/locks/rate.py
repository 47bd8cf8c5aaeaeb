"""A fleet-wide rate limit on ZooKeeper's clock: at most ``N`` admissions per period, per path.

:class:`RateLimit` keeps one sequential node per admission under its path
(``<path>/adm-<seq>``, or ``<path>/adm-t-<seq>`` for a TTL node; the caller's data in it) and
decides each new one under a short :class:`~celery_zklock.Mutex` (``<path>/lock``), so
decisions are made one at a time:

1. create the candidate node: its ``ctime`` is *now*, stamped by the ZooKeeper leader;
2. read the other admissions' ``ctime``;
3. check that the decision lock is still held (its :class:`~celery_zklock.Lease` is not lost)
   and that the listing came within :data:`LISTING_BOUND` of sending the create. Else the
   decision is void: the candidate is deleted and the decision is made again under a new lock.
   The races this closes: a decider stalled between 1 and 2 whose session expired meanwhile
   lists long after its candidate's ``ctime``, after another decider, granted the lock since,
   deleted admissions of its window as old by *its* later clock; and a decider that kept its
   lock but listed late could miss a TTL admission of its window that the server removed
   meanwhile (TTL nodes go without the lock);
4. admissions of ``ctime <= now - period`` are deleted; fewer than ``N`` left: admitted (the node
   stays, and counts for a period); else the node is deleted and the answer is no, with the
   time the window next admits one (from the admissions' ``ctime``).

**The guarantee**: at most ``N`` admission ``ctime`` values in any half-open window
``[t, t + period)``, whatever the clients' clocks say, as every time compared is a ``ctime``
written by the leader. Why: a decision counts only if it listed under its lock, so after every
earlier decision's listing; it counts every admission of ``ctime > now - period``, and none of
those can be gone yet: a deletion under the lock removes only nodes old for a ``now`` no later
than any later decision's (the decider's own candidate, or for a sweep its lock node, was
created before any later decider's), and a TTL node outlives its period by
:data:`LISTING_BOUND`, longer than any counted decision takes from create to listing.

**Where admissions go** (a key that stops being used leaves no node):

- *TTL nodes*: where the server enables them (``zookeeper.extendedTypesEnabled=true``) each
  admission is a TTL node of ``period + LISTING_BOUND``: the server deletes it at its first
  container check (``znode.container.checkIntervalMs``, ZooKeeper's default 60 s) after that,
  whether or not any client is left.
- *Elsewhere* (ZooKeeper's default): admissions are persistent, and removed by the next decision
  on the key, or by a *sweep*: after every decision that leaves persistent admissions, the
  deciding process removes them once old, :data:`SWEEP_MARGIN` after the newest one's period
  (a thread per client while it has sweeps to do; under the decision lock, like a decision;
  tried again every :data:`SWEEP_RETRY` while ZooKeeper is unreachable or the lock busy). A
  process that stops its client (or dies) first leaves them to the next decision on the key.
- The decision lock (``<path>/lock``) and ``<path>`` are containers, as every lock's parents:
  once the admissions are gone the server reaps them, and then the parents above that became
  empty, one level per container check.

So an idle key's nodes are all gone within ``period + E + (levels + 1) x checkIntervalMs`` of
its last admission's ``ctime``, where ``E`` is :data:`LISTING_BOUND` with TTL nodes and
:data:`SWEEP_MARGIN` (plus the sweep's own time) without, and ``levels`` counts the containers
that become empty (the decision lock, ``<path>``, and the parents above it that nothing else
keeps). Without TTL nodes that bound needs the last decider's client to stay open.

Edges, stated plainly:

- *What counts*: an admission is counted when ``acquire`` returns True (``admit`` returns None),
  whatever the caller then does with it; it is never given back.
- *A crash*, or a candidate whose create or delete ZooKeeper did not answer, leaves a node that
  counts as an admission (the limit holds; one slot is lost for one period), removed as above
  (a decision that failed so schedules a sweep).
- *ZooKeeper unreachable*: ``acquire`` raises :class:`~celery_zklock.ZooKeeperUnavailable`;
  nothing is admitted without ZooKeeper's answer.
- *A jump of the leader's clock* (``ctime`` is the leader's wall clock; a leader change between
  servers whose clocks disagree is one too: keep the ensemble in NTP sync, as ZooKeeper asks).
  *Forward* by ``J``: every admission ages ``J`` at once, so up to ``2N`` are admitted within
  one real period around the jump (``N`` before it, ``N`` after); TTL expiries and sweeps come
  ``J`` early; the statement on ``ctime`` values holds, except that with TTL nodes a decision
  whose create came before the jump and its listing after may miss a TTL admission removed
  early, and admit one more. *Backward* by ``J``: never more within a real period (admissions
  stamped "in the future" count as recent until the clock passes them, so the key admits
  fewer for up to ``J``), but new ``ctime`` values then fall among older ones, so up to ``2N``
  ``ctime`` values can share one window of clock readings.
- *Older versions* (before issue 42: persistent admissions, no step 3, no sweeps) decide on the
  same nodes under the same lock, and count every ``adm-`` child, TTL ones included; their
  persistent admissions are counted, deleted when old and swept by this version's processes.
  During a deploy the limit holds except for the void decisions of step 3 that an old process
  may still count.
"""

from __future__ import annotations

import logging
import re
import threading
import time
import weakref
from contextlib import suppress
from dataclasses import dataclass
from typing import Final

from kazoo.client import KazooClient
from kazoo.exceptions import KazooException, NoNodeError, SessionExpiredError, UnimplementedError

from celery_zklock.errors import ConfigurationError, LockTimeout, ZooKeeperUnavailable
from celery_zklock.locks.lease import Lease
from celery_zklock.locks.mutex import Mutex
from celery_zklock.locks.queue import make_containers, pipelined, validate_lock_path
from celery_zklock.zk import adapter
from celery_zklock.zk.calls import Deadline, wait_result, wait_slice

__all__ = ["Rate", "RateLimit", "parse_rate"]

logger = logging.getLogger("celery_zklock.locks")

RATE_NODE: Final = "rate"
"""The child of a task lock's path that holds its key's rate admissions (``lock_rate``)."""
ADMISSION_PREFIX: Final = "adm-"
"""Name prefix of an admission node (ZooKeeper appends the sequence number)."""
TTL_ADMISSION_PREFIX: Final = ADMISSION_PREFIX + "t-"
"""Name prefix of an admission that is a TTL node (a client cannot tell from its stat: the
server shows a TTL node's ``ephemeralOwner`` as 0)."""
DECISION_LOCK: Final = "lock"
"""The child of a rate limit's path under which decisions take their turn."""
TRY_WAIT: Final = 2.0
"""Seconds a try (``blocking=False``) waits for its turn to decide: others decide in a few
milliseconds, so this bounds only a slow ZooKeeper."""
IO_TIMEOUT: Final = 10.0
"""Seconds ZooKeeper may take to answer one decision's requests (else ZooKeeperUnavailable)."""
LISTING_BOUND: Final = 10.0
"""Seconds from sending a decision's candidate create to receiving its listing past which the
decision is void (made again): a TTL admission lives this long past its period, so none that
counts for the decision can have expired before its listing."""
SWEEP_MARGIN: Final = 1.0
"""Seconds after the newest persistent admission's period at which its process sweeps the key."""
SWEEP_RETRY: Final = 1.0
"""Seconds before a sweep that failed (ZooKeeper unreachable, the decision lock busy) is tried
again."""
_PERIODS: Final = {"s": 1.0, "m": 60.0, "h": 3600.0}
_RATE = re.compile(r"^\s*(\d+)\s*(?:/\s*([smh]))?\s*$")


@dataclass(frozen=True)
class Rate:
    """``limit`` admissions per ``period`` seconds."""

    limit: int
    period: float

    def __str__(self) -> str:
        unit = {1.0: "s", 60.0: "m", 3600.0: "h"}.get(self.period)
        return f"{self.limit}/{unit}" if unit else f"{self.limit}/{self.period}s"

    @property
    def period_ms(self) -> int:
        """The period in whole milliseconds, ZooKeeper's unit of ``ctime``."""
        return round(self.period * 1000)


def parse_rate(rate: object, label: str = "rate") -> Rate:
    """A rate in Celery's syntax: ``"10/s"``, ``"100/m"``, ``"1/h"`` (a bare number is per
    second), or a :class:`Rate`. Raises ConfigurationError naming ``label`` otherwise."""
    if isinstance(rate, Rate):
        return rate
    match = _RATE.match(rate) if isinstance(rate, str) else None
    if match is None or int(match[1]) < 1:
        raise ConfigurationError(
            f"{label} must be 'N/s', 'N/m' or 'N/h' with N >= 1 (Celery's rate syntax, e.g. "
            f"'10/s', '100/m', '1/h'), got {rate!r}"
        )
    return Rate(int(match[1]), _PERIODS[match[2] or "s"])


@dataclass(frozen=True)
class Admission:
    """An admission node as read: its path, ``ctime`` (ms) and whether the server removes it
    (a TTL node)."""

    node: str
    ctime: int
    ttl: bool


_VOID: Final = object()
"""A decision taken without the decision lock (lost before the listing came): it counts for
nothing."""


class RateLimit:
    """At most ``rate`` admissions per period on ``path``, fleet-wide; see the module
    docstring for the guarantee and its edges. Thread-safe; usable without Celery."""

    def __init__(self, client: KazooClient, path: str, rate: str | Rate) -> None:
        self.client = client
        self.path = validate_lock_path(path)
        self.rate = parse_rate(rate)
        self._decisions = Mutex(client, f"{self.path}/{DECISION_LOCK}")
        self._last = threading.local()

    @property
    def admitted_at(self) -> float | None:
        """When this thread's last admission was decided: its node's ``ctime`` (ZooKeeper's
        clock, seconds since the epoch); None before the first."""
        return getattr(self._last, "ctime", None)

    def acquire(
        self, blocking: bool = True, timeout: float | None = None, data: bytes = b""
    ) -> bool:
        """Be admitted: True once admitted. A try (``blocking=False``) over the limit answers
        False at once; a blocking call over the limit sleeps until the window can admit one
        (the oldest admission's age, from ZooKeeper's clock), then tries again, up to
        ``timeout`` seconds (None: no limit), and answers False when that passes. ``data`` is
        stored in the admission's node (who was admitted, for operators).

        Raises ZooKeeperUnavailable when ZooKeeper does not answer, ValueError for a negative
        timeout."""
        if timeout is not None and timeout < 0:
            raise ValueError(f"timeout must be >= 0 or None, got {timeout!r}")
        deadline = Deadline(timeout)
        while True:
            try:
                wait = self.admit(data, TRY_WAIT if not blocking else deadline.remaining())
            except LockTimeout:
                return False
            if wait is None:
                return True
            remaining = deadline.remaining()
            if not blocking or (remaining is not None and wait > remaining):
                return False
            pause = Deadline(wait)
            while not pause.expired():
                time.sleep(wait_slice(pause))

    def admit(self, data: bytes = b"", turn: float | None = TRY_WAIT) -> float | None:
        """One decision: None when admitted, else the seconds until the window can admit one.
        Waits up to ``turn`` seconds for its turn to decide (LockTimeout past it); a decision
        whose lock was lost before its listing came is made again within that time."""
        deadline = Deadline(turn)
        while True:
            lease = self._decisions.acquire(timeout=deadline.remaining())
            try:
                outcome = self._decide(lease, data)
            except (KazooException, ZooKeeperUnavailable):
                # Our candidate may be there (a create or delete with no answer): sweep it.
                Sweeper.of(self.client).schedule(
                    self.path, self.rate, self.rate.period + SWEEP_MARGIN
                )
                raise
            finally:
                lease.release()
            if outcome is not _VOID:
                assert outcome is None or isinstance(outcome, float)
                return outcome
            logger.info("rate %s: the decision lock was lost mid-decision; deciding again",
                        self.path)  # fmt: skip

    def admissions(self) -> list[float]:
        """The ``ctime`` (ZooKeeper's clock, seconds since the epoch) of the admissions of the
        last period, oldest first, as seen now (for operators)."""
        nodes = self._nodes(Deadline(IO_TIMEOUT))
        newest = max((a.ctime for a in nodes), default=0)
        return sorted(a.ctime / 1000.0 for a in nodes if a.ctime > newest - self.rate.period_ms)

    def sweep(self) -> float | None:
        """Remove the admissions older than a period (by ZooKeeper's clock), under the decision
        lock; the seconds until the newest persistent one left is a period old, or None when
        none is left. A path without admissions is left alone (its containers go by
        themselves). Raises LockTimeout (the lock stayed busy for :data:`TRY_WAIT`),
        ZooKeeperUnavailable."""
        io = Deadline(IO_TIMEOUT)
        (children,) = pipelined(self.client, [("children", self.path)], io)
        if not any(name.startswith(ADMISSION_PREFIX) for name in children or ()):
            return None
        lease = self._decisions.acquire(timeout=TRY_WAIT)
        try:
            # Now, as the leader stamps it: our lock node's ctime, which is no later than any
            # later decider's candidate (see the module docstring).
            (lock_node,) = pipelined(self.client, [("get", lease.node)], io)
            if lock_node is None:
                raise ZooKeeperUnavailable(f"the decision lock of {self.path} was lost")
            now = int(lock_node[1].ctime)
            left, cleared = self._remove_old(self._nodes(io), now, io)
        finally:
            lease.release()
        if not cleared:
            raise ZooKeeperUnavailable(f"old admissions under {self.path} were not removed")
        persistent = [a.ctime for a in left if not a.ttl]
        if not persistent:
            return None
        return max(0.0, (max(persistent) + self.rate.period_ms - now) / 1000.0)

    def _decide(self, lease: Lease, data: bytes) -> object:
        """Under the decision lock: None when admitted, the seconds until the window admits
        one, or :data:`_VOID` when the lock was lost before the listing came."""
        io = Deadline(IO_TIMEOUT)
        sent = time.monotonic()
        ours, now, ttl = self._create_candidate(data, io)
        try:
            nodes = self._nodes(io)
        except SessionExpiredError:  # our lock went with the session
            nodes = None
        if nodes is None or lease.lost or time.monotonic() - sent > LISTING_BOUND:
            if not self._remove([ours], io):
                self._sweep_later([], now, retry=True)
            return _VOID
        others = [a for a in nodes if a.node != ours]
        left, cleared = self._remove_old(others, now, io)
        recent = sorted(a.ctime for a in left)
        admitted = len(recent) < self.rate.limit
        if not admitted:
            cleared = self._remove([ours], io) and cleared
        else:
            left.append(Admission(ours, now, ttl))
        self._sweep_later(left, now, retry=not cleared)
        if admitted:
            self._last.ctime = now / 1000.0
            return None
        opens = recent[len(recent) - self.rate.limit] + self.rate.period_ms
        return max(0.001, (opens - now) / 1000.0 + 0.001)

    def _create_candidate(self, data: bytes, io: Deadline) -> tuple[str, int, bool]:
        """Create our candidate admission (where the server has TTL nodes, one that lives
        :data:`LISTING_BOUND` past its period); its path, ``ctime`` (ms) and whether it is a
        TTL node."""
        client, what = self.client, f"creating an admission under {self.path}"
        while True:
            try:
                if adapter.has_ttl_nodes(client):
                    try:
                        ttl = self.rate.period_ms + round(LISTING_BOUND * 1000)
                        node = f"{self.path}/{TTL_ADMISSION_PREFIX}"
                        created = adapter.create_ttl_async(client, node, data, ttl, sequential=True)
                        full, stat = wait_result(created, io, what)
                        return client.unchroot(full), int(stat.ctime), True
                    except UnimplementedError:
                        adapter.note_no_ttl_nodes(client)
                node = f"{self.path}/{ADMISSION_PREFIX}"
                created = client.create_async(node, data, sequence=True, include_data=True)
                path, stat = wait_result(created, io, what)
                return path, int(stat.ctime), False
            except NoNodeError:
                make_containers(client, self.path, io)

    def _remove_old(
        self, nodes: list[Admission], now: int, io: Deadline
    ) -> tuple[list[Admission], bool]:
        """Delete the admissions a period old at ``now``; return the others, and whether every
        old one is gone (see :meth:`_remove`)."""
        old = [a.node for a in nodes if a.ctime <= now - self.rate.period_ms]
        cleared = self._remove(old, io)
        return [a for a in nodes if a.ctime > now - self.rate.period_ms], cleared

    def _remove(self, nodes: list[str], io: Deadline) -> bool:
        """Delete ``nodes`` (one already gone is skipped); False if ZooKeeper failed or did not
        answer in time: a node left so counts as an admission until it is old."""
        try:
            for result in [self.client.delete_async(node) for node in nodes]:
                with suppress(NoNodeError):
                    wait_result(result, io, f"removing admissions under {self.path}")
        except (KazooException, ZooKeeperUnavailable) as exc:
            logger.info("rate %s: admissions not removed now (%r)", self.path, exc)
            return False
        return True

    def _sweep_later(self, left: list[Admission], now: int, *, retry: bool = False) -> None:
        """Have this client sweep the path once the newest persistent admission in ``left``
        (read at ZooKeeper's ``now``) is a period old, or (``retry``: a removal failed) after
        :data:`SWEEP_RETRY`."""
        persistent = [a.ctime for a in left if not a.ttl]
        sweeper = Sweeper.of(self.client)
        if retry:
            sweeper.schedule(self.path, self.rate, SWEEP_RETRY)
        if persistent:
            delay = (max(persistent) + self.rate.period_ms - now) / 1000.0
            sweeper.schedule(self.path, self.rate, delay + SWEEP_MARGIN)

    def _nodes(self, io: Deadline) -> list[Admission]:
        """Every admission under the path, as listed now."""
        (children,) = pipelined(self.client, [("children", self.path)], io)
        paths = [f"{self.path}/{n}" for n in children or () if n.startswith(ADMISSION_PREFIX)]
        answers = pipelined(self.client, [("get", p) for p in paths], io)
        ttl = f"{self.path}/{TTL_ADMISSION_PREFIX}"
        return [
            Admission(p, int(a[1].ctime), p.startswith(ttl))
            for p, a in zip(paths, answers, strict=True)
            if a is not None
        ]


class Sweeper:
    """The sweeps one client owes (see the module docstring): each path is swept with
    :meth:`RateLimit.sweep` when due, and again while persistent admissions are left, on a
    thread of the client's handler that runs while there is something to sweep. Pending sweeps
    are dropped when the client is stopped. One per client (:meth:`of`)."""

    _by_client: weakref.WeakKeyDictionary[KazooClient, Sweeper] = weakref.WeakKeyDictionary()
    _made = threading.Lock()

    def __init__(self, client: KazooClient) -> None:
        self._client_ref = weakref.ref(client)
        self._handler = client.handler
        self._lock = threading.Lock()
        self._due: dict[str, tuple[float, Rate]] = {}
        self._wake = client.handler.event_object()
        self._running = False

    @classmethod
    def of(cls, client: KazooClient) -> Sweeper:
        with cls._made:
            sweeper = cls._by_client.get(client)
            if sweeper is None:
                sweeper = cls._by_client[client] = cls(client)
        return sweeper

    def schedule(self, path: str, rate: Rate, delay: float) -> None:
        """Sweep ``path`` ``delay`` seconds from now (or later, if it is due later already)."""
        due = time.monotonic() + max(0.0, delay)
        with self._lock:
            current = self._due.get(path)
            self._due[path] = (max(due, current[0]) if current else due, rate)
            start = not self._running
            self._running = True
        if start:
            self._handler.spawn(self._run)
        elif current is None:
            self._wake.set()

    def pending(self) -> dict[str, float]:
        """The paths still to sweep, with when (``time.monotonic()``)."""
        with self._lock:
            return {path: due for path, (due, _) in self._due.items()}

    def _run(self) -> None:
        while True:
            with self._lock:
                client = self._client_ref()
                if client is None or adapter.is_closed(client) or not self._due:
                    self._due.clear()
                    self._running = False
                    return
                now = time.monotonic()
                ready = [(p, r) for p, (due, r) in self._due.items() if due <= now]
                for path, _ in ready:
                    del self._due[path]
                wait = min((due for due, _ in self._due.values()), default=now) - now
                self._wake.clear()
            for path, rate in ready:
                self._sweep(client, path, rate)
            del client
            if not ready:
                self._wake.wait(wait)

    def _sweep(self, client: KazooClient, path: str, rate: Rate) -> None:
        try:
            again = RateLimit(client, path, rate).sweep()
            delay = None if again is None else again + SWEEP_MARGIN
        except Exception as exc:  # ZooKeeper unreachable or the lock busy: try again later
            logger.debug("rate sweep of %s failed: %r", path, exc)
            delay = SWEEP_RETRY
        if delay is not None:
            self.schedule(path, rate, delay)
