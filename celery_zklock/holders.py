"""Who holds which lock: the lock queues under ``zklock_root``, read for operators and tasks.

A task's lock is the znode ``<root>/<lock_name>/<key>`` (:func:`lock_path`, the same
computation a run makes); its children are the contender nodes, in Apache Curator's layout
(:mod:`celery_zklock.locks.contenders` parses their names and decides who holds). Every node a
``ZkLockTask`` run creates stores the run's identity as JSON (:mod:`celery_zklock.locks.
identity`: task id, task name, retries, worker, pid); the node's ``czxid`` is the run's fencing
token and its ``ctime`` when it entered the queue.

- :func:`read_lock` / :func:`read_locks`: one lock, or every lock under the root, as
  :class:`LockState` (holders and waiters in queue order). Pure from the nodes read
  (:func:`lock_state`), so the decision is the very one the lock recipes make.
- :func:`lock_path`, :func:`lock_holders`, :func:`lock_holder`: what ``task.lock_path(...)``
  and ``task.lock_holder(...)`` answer.
- :func:`request_break`: write a break request into a holder's node (``celery zklock break``);
  the format and what the holder does with it: :mod:`celery_zklock.locks.identity`.

Times: ``created`` is the server's clock, ages are measured with this host's clock (a skew
between the two shows in ``held_for``). A holder's ``held_for`` counts from its node's creation,
so it includes the time the run waited in the queue before it was granted.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final, Literal

from kazoo.client import KazooClient
from kazoo.exceptions import BadVersionError, NoNodeError
from kazoo.protocol.states import ZnodeStat

from celery_zklock.config import settings_of
from celery_zklock.locks.calls import Deadline, wait_result
from celery_zklock.locks.contenders import (
    PROTECTED_PREFIX,
    Contender,
    Kind,
    decide,
    parse_limit,
    queue_of,
)
from celery_zklock.locks.identity import (
    Identity,
    break_request,
    parse_identity,
    with_break_request,
)
from celery_zklock.locks.queue import pipelined, read_queues
from celery_zklock.locks.rate import ADMISSION_PREFIX, RATE_NODE
from celery_zklock.options import TaskLockSpec
from celery_zklock.session import get_client

__all__ = [
    "READ_TIMEOUT",
    "BreakOutcome",
    "Entry",
    "Holder",
    "LockState",
    "Mode",
    "lock_holder",
    "lock_holders",
    "lock_path",
    "lock_state",
    "read_lock",
    "read_locks",
    "request_break",
]

READ_TIMEOUT: Final = 10.0
"""Seconds ZooKeeper may take to answer one reading of the locks (else ZooKeeperUnavailable)."""

Mode = Literal["exclusive", "shared", "semaphore"]
_MODE_OF_KIND: Final[dict[Kind, Mode]] = {
    "write": "exclusive",
    "read": "shared",
    "lease": "semaphore",
}


@dataclass(frozen=True)
class Holder:
    """The identity of a run that holds a lock (what ``task.lock_holder(...)`` returns).

    ``token`` is the holder's fencing token (its node's ``czxid``); ``held_for`` the seconds
    since its node was created (including any wait in the queue before the grant); ``node`` the
    full path of its contender node (what ``celery zklock break`` takes). The other fields are
    None for a holder that is not a celery-zklock task run (a Curator or plain recipe holder).
    """

    task_id: str | None
    task: str | None
    worker: str | None
    pid: int | None
    token: int
    held_for: float
    node: str


@dataclass(frozen=True, kw_only=True)
class Entry(Contender):
    """One contender node of a lock, as read: the contender record (place, kind, identity) with
    its grant, token and age.

    ``kind`` is the access it asks for: ``write`` (``_c_<uuid>-lock-`` and ``__WRIT__`` nodes),
    ``read`` (``__READ__``), or ``lease`` (a node of a semaphore: named like a mutex's, told
    apart by the limit stored in the lock's node).
    """

    identity: Identity = field(compare=False)
    holds: bool
    token: int
    created: float
    """Unix time (seconds) the node was created, by the server's clock."""
    session: int

    @property
    def mode(self) -> Mode:
        """``exclusive`` (write), ``shared`` (read) or ``semaphore`` (lease)."""
        return _MODE_OF_KIND[self.kind]

    def age(self, now: float) -> float:
        """Seconds since the node was created, at Unix time ``now`` (never negative)."""
        return max(0.0, now - self.created)

    @property
    def breakable(self) -> bool:
        """True if the holder can hear a break request: a celery-zklock contender (Curator's
        protected name, JSON or no data); not a Curator one (its IP as data) nor a kazoo
        recipe's."""
        return breakable(self.name, self.identity)


def breakable(name: str, identity: Identity) -> bool:
    """See :attr:`Entry.breakable`."""
    return identity.ours and name.startswith(PROTECTED_PREFIX)


@dataclass(frozen=True)
class LockState:
    """One lock: its path, its contender nodes in queue order, and ``limit``, the ``N`` of a
    semaphore (None for other locks)."""

    path: str
    entries: tuple[Entry, ...]
    limit: int | None = None
    admissions: tuple[float, ...] = ()
    """With ``lock_rate``: when the key's recorded admissions were made (ZooKeeper's clock,
    oldest first): those of the last period, as of the key's last admission decision."""

    @property
    def holders(self) -> tuple[Entry, ...]:
        """The nodes that hold the lock now: one writer, every reader ahead of the first
        writer, or a semaphore's first ``limit`` nodes."""
        return tuple(e for e in self.entries if e.holds)

    @property
    def waiters(self) -> tuple[Entry, ...]:
        """The nodes waiting, in the order they will be granted."""
        return tuple(e for e in self.entries if not e.holds)

    @property
    def mode(self) -> Mode | None:
        """The mode the lock is held in (None if nobody holds it)."""
        holders = self.holders
        return holders[0].mode if holders else None

    def holder_records(self, now: float) -> tuple[Holder, ...]:
        """The holders as :class:`Holder` records, ages at Unix time ``now``."""
        return tuple(
            Holder(
                task_id=e.identity.task_id,
                task=e.identity.task,
                worker=e.identity.worker,
                pid=e.identity.pid,
                token=e.token,
                held_for=e.age(now),
                node=f"{self.path}/{e.name}",
            )
            for e in self.holders
        )


def lock_state(
    path: str,
    nodes: Iterable[tuple[str, bytes | None, ZnodeStat]],
    lock_data: bytes | None = None,
) -> LockState:
    """The :class:`LockState` of the lock at ``path`` from its nodes ``(name, data, stat)`` and
    the lock node's own data (a semaphore's limit, ``max_leases=N``).

    Children that are not contenders are left out; who holds is decided by
    :func:`celery_zklock.locks.contenders.decide`, as each contender decides for itself.
    """
    limit = parse_limit(lock_data)
    read = {name: (data, stat) for name, data, stat in nodes}
    queue = queue_of(read)
    entries = []
    for contender in queue:
        data, stat = read[contender.name]
        kind: Kind = "lease" if limit is not None else contender.kind
        entries.append(
            Entry(
                name=contender.name,
                seq=contender.seq,
                kind=kind,
                holds=decide(queue, contender.name, kind, limit).holds,
                token=int(stat.czxid),
                created=stat.ctime / 1000.0,
                session=int(stat.ephemeralOwner),
                identity=parse_identity(data),
            )
        )
    return LockState(path, tuple(entries), limit)


# -- reading ZooKeeper -------------------------------------------------------------------------


def _read_states(client: KazooClient, paths: Sequence[str], deadline: Deadline) -> list[LockState]:
    read = read_queues(client, paths, deadline, parent_data=True)
    return [
        lock_state(path, [(c.name, data, stat) for c, data, stat in nodes], own)
        for path, (own, nodes) in zip(paths, read, strict=True)
    ]


def read_lock(client: KazooClient, path: str, timeout: float = READ_TIMEOUT) -> LockState:
    """The lock at ``path`` now (no entries if nobody holds or waits).

    Raises ZooKeeperUnavailable when ZooKeeper does not answer within ``timeout`` seconds.
    """
    return _read_states(client, [path], Deadline(timeout))[0]


def read_locks(
    client: KazooClient,
    root: str,
    *,
    names: Sequence[str] | None = None,
    timeout: float = READ_TIMEOUT,
) -> list[LockState]:
    """Every lock under ``root`` that has a contender (``<root>/<lock name>/<key>``), sorted by
    path; with ``names``, only those lock names. Raises ZooKeeperUnavailable when ZooKeeper
    does not answer within ``timeout`` seconds."""
    deadline = Deadline(timeout)
    if names is None:
        listed = pipelined(client, [("children", root)], deadline)[0] or []
        names = sorted(listed)
    parents = [f"{root}/{name}" for name in names]
    keys = pipelined(client, [("children", p) for p in parents], deadline)
    paths = [
        f"{parent}/{key}"
        for parent, found in zip(parents, keys, strict=True)
        for key in sorted(found or ())
    ]
    states = _with_admissions(client, _read_states(client, paths, deadline), deadline)
    return [state for state in states if state.entries or state.admissions]


def _with_admissions(
    client: KazooClient, states: list[LockState], deadline: Deadline
) -> list[LockState]:
    """``states`` with the admissions their keys' rate limits recorded (two round trips)."""
    rates = [f"{state.path}/{RATE_NODE}" for state in states]
    listings = pipelined(client, [("children", rate) for rate in rates], deadline)
    nodes = [
        (index, f"{rates[index]}/{name}")
        for index, names in enumerate(listings)
        for name in names or ()
        if name.startswith(ADMISSION_PREFIX)
    ]
    read = pipelined(client, [("get", node) for _, node in nodes], deadline)
    made: dict[int, list[float]] = {}
    for (index, _), answer in zip(nodes, read, strict=True):
        if answer is not None:
            made.setdefault(index, []).append(answer[1].ctime / 1000.0)
    return [
        dataclasses.replace(state, admissions=tuple(sorted(made[i]))) if i in made else state
        for i, state in enumerate(states)
    ]


# -- a task's lock -----------------------------------------------------------------------------


def lock_path(
    task: Any, args: Sequence[Any], kwargs: Mapping[str, Any], *, whole_call: bool = False
) -> str:
    """The lock path a call of ``task`` (a ZkLockTask) with these arguments takes: the app's
    ``zklock_root``, the task's lock name and the key its own key builder computes. When
    ``lock_key`` names parameters, the arguments of those are enough (``task.lock_path("x")``
    for ``hold(k, seconds)`` with ``lock_key=["k"]``), unless ``whole_call`` (a call being sent
    must fit the task's signature whole).

    Raises TypeError naming a missing key argument or one that fits no parameter, LockKeyError
    (or what a callable ``lock_key`` raises) for arguments that make no key.
    """
    spec: TaskLockSpec = task._zklock_compile(task.name)
    root = settings_of(task.app).root
    return spec.path(root, args, kwargs) if whole_call else spec.key_path(root, args, kwargs)


def lock_holders(task: Any, args: Sequence[Any], kwargs: Mapping[str, Any]) -> tuple[Holder, ...]:
    """Who holds the lock a call of ``task`` with these arguments takes, in queue order (several
    readers of a shared lock), read with the process's ZooKeeper client for the app's settings.

    Raises ZooKeeperUnavailable when ZooKeeper does not answer in time.
    """
    path = lock_path(task, args, kwargs)
    client = get_client(settings_of(task.app).client)
    return read_lock(client, path).holder_records(time.time())


def lock_holder(task: Any, args: Sequence[Any], kwargs: Mapping[str, Any]) -> Holder | None:
    """The first of :func:`lock_holders` (the one a writer would wait for first), or None."""
    holders = lock_holders(task, args, kwargs)
    return holders[0] if holders else None


# -- breaking ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class BreakOutcome:
    """What :func:`request_break` did to one node.

    ``status``: ``requested`` (the request is written), ``already`` (a break request was there:
    ``by`` names who wrote it), ``gone`` (the node no longer exists), ``foreign`` (its data is
    not a JSON object: the holder cannot hear a request).
    """

    node: str
    status: Literal["requested", "already", "gone", "foreign"]
    by: str | None = None


def request_break(
    client: KazooClient, node: str, by: str, reason: str | None, *, attempts: int = 5
) -> BreakOutcome:
    """Write a break request into the holder's node ``node``, conditional on the version read,
    so the holder's identity is kept and a concurrent change is never overwritten.

    Raises kazoo's NoAuthError when the ACL does not let this client write the node, and
    ZooKeeperUnavailable when ZooKeeper does not answer in time.
    """
    for _ in range(attempts):
        deadline = Deadline(READ_TIMEOUT)
        try:
            data, stat = wait_result(client.get_async(node), deadline, f"reading {node}")
        except NoNodeError:
            return BreakOutcome(node, "gone")
        if not breakable(node.rsplit("/", 1)[-1], parse_identity(data)):
            return BreakOutcome(node, "foreign")
        existing = break_request(data)
        if existing is not None:
            return BreakOutcome(node, "already", str(existing.get("by")))
        marked = with_break_request(data, by, time.time(), reason)
        try:
            wait_result(
                client.set_async(node, marked, version=stat.version), deadline, f"writing {node}"
            )
        except NoNodeError:
            return BreakOutcome(node, "gone")
        except BadVersionError:
            continue  # changed between our read and write: read again
        return BreakOutcome(node, "requested", by)
    raise RuntimeError(f"{node} kept changing: could not write the break request")
