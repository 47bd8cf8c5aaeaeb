"""Who holds a lock: one lock queue read as holders and waiters, and the break request an
operator writes into a holder's node. No Celery here: what a task's lock is
(:mod:`celery_zklock.task.lookup`) and every lock under the root (:mod:`celery_zklock.ops.holders`)
are read above this layer with these.

A lock's children are the contender nodes, in Apache Curator's layout
(:mod:`celery_zklock.locks.contenders` parses their names and decides who holds). Every node a
``ZkLockTask`` run creates stores the run's identity as JSON (:mod:`celery_zklock.locks.
identity`: task id, task name, retries, worker, pid); the node's ``czxid`` is the run's fencing
token and its ``ctime`` when it entered the queue.

- :func:`read_lock`: one lock as a :class:`LockState` (holders and waiters in queue order). Pure
  from the contenders read (:func:`lock_state`): who holds is the lock recipes' own answer
  (:func:`~celery_zklock.locks.contenders.holding`).
- :func:`request_break`: write a break request into a holder's node (``celery zklock break``);
  the format and what the holder does with it: :mod:`celery_zklock.locks.identity`.

Times: ``created`` is the server's clock, ages are measured with this host's clock (a skew
between the two shows in ``held_for``). A holder's ``held_for`` counts from its node's creation,
so it includes the time the run waited in the queue before it was granted.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from typing import Final, Literal

from kazoo.client import KazooClient
from kazoo.exceptions import BadVersionError, NoNodeError

from celery_zklock.locks.contenders import (
    PROTECTED_PREFIX,
    Contender,
    LockMode,
    holding,
    parse_limit,
)
from celery_zklock.locks.identity import Identity, break_request, parse_identity, with_break_request
from celery_zklock.locks.queue import read_queues
from celery_zklock.zk.calls import Deadline, wait_result

__all__ = [
    "READ_TIMEOUT",
    "BreakOutcome",
    "Holder",
    "LockState",
    "lock_state",
    "read_lock",
    "read_states",
    "request_break",
]

READ_TIMEOUT: Final = 10.0
"""Seconds ZooKeeper may take to answer one reading of the locks (else ZooKeeperUnavailable)."""


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


def breakable(name: str, identity: Identity) -> bool:
    """True if the holder of the node ``name`` whose data holds ``identity`` can hear a break
    request: a celery-zklock contender (Curator's protected name, JSON or no data); not a
    Curator one (its IP as data) nor a kazoo recipe's."""
    return identity.ours and name.startswith(PROTECTED_PREFIX)


@dataclass(frozen=True)
class LockState:
    """One lock: its path, its contender nodes in queue order, each read with its identity,
    token and creation time, and ``limit``, the ``N`` of a semaphore (None for other locks;
    its nodes then ask for ``lease`` access: named like a mutex's, they are told apart by the
    limit stored in the lock's node)."""

    path: str
    entries: tuple[Contender, ...]
    limit: int | None = None
    admissions: tuple[float, ...] = ()
    """With ``lock_rate``: when the key's recorded admissions were made (ZooKeeper's clock,
    oldest first): those of the last period, as of the key's last admission decision."""

    @property
    def holders(self) -> tuple[Contender, ...]:
        """The nodes that hold the lock now (:func:`~celery_zklock.locks.contenders.holding`):
        one writer, every reader ahead of the first writer, or a semaphore's first ``limit``
        nodes."""
        return tuple(holding(self.entries, self.limit))

    @property
    def waiters(self) -> tuple[Contender, ...]:
        """The nodes waiting, in the order they will be granted."""
        return self.entries[len(self.holders) :]

    @property
    def mode(self) -> LockMode | None:
        """The mode the lock is held in (None if nobody holds it)."""
        return self.entries[0].mode if self.entries else None

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


def lock_state(path: str, queue: Iterable[Contender], lock_data: bytes | None = None) -> LockState:
    """The :class:`LockState` of the lock at ``path`` from its contenders as read (in any
    order) and the lock node's own data (a semaphore's limit, ``max_leases=N``)."""
    limit = parse_limit(lock_data)
    entries = (replace(c, kind="lease") for c in queue) if limit is not None else queue
    return LockState(path, tuple(sorted(entries)), limit)


# -- reading ZooKeeper -------------------------------------------------------------------------


def read_states(client: KazooClient, paths: Sequence[str], deadline: Deadline) -> list[LockState]:
    """The locks at ``paths``, in order, read within ``deadline``."""
    read = read_queues(client, paths, deadline, parent_data=True)
    return [lock_state(path, queue, own) for path, (own, queue) in zip(paths, read, strict=True)]


def read_lock(client: KazooClient, path: str, timeout: float = READ_TIMEOUT) -> LockState:
    """The lock at ``path`` now (no entries if nobody holds or waits).

    Raises ZooKeeperUnavailable when ZooKeeper does not answer within ``timeout`` seconds.
    """
    return read_states(client, [path], Deadline(timeout))[0]


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
