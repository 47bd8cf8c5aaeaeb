"""Enqueue-time deduplication: one message per lock key while an earlier one is queued (or
running), crash-safely.

A call with ``lock_dedupe`` set first claims a *marker*, a znode next to the run lock
(``<lock path>~dedupe``) whose data names the task id that owns it: one read, and one create
when there is none (a deduplicated call writes nothing). Creating it is atomic: among
any number of concurrent callers, in any number of processes, one create succeeds and only that
caller sends its message; the others get the owner's task id (``AsyncResult`` of it, or
``AlreadyQueued``). The owner's run removes the marker when it starts (``"queued"``) or when it
ends (``"running"``: success, failure, ``Ignore``, a skip; a retry keeps it, and so do the
retry's own ``apply_async`` and the message's redeliveries, which carry the owner's id).

Nothing may leave a key deduplicated forever (a caller killed between marker and send, a
message the broker lost, a purged queue, a revoked task, a worker killed mid-run). A marker
stops counting when:

- it is a TTL node (where the server enables them, ``zookeeper.extendedTypesEnabled=true``)
  and ``ttl`` seconds passed since it was written: the server deletes it; or
- (everywhere) its owner's state in the result backend is final (``SUCCESS``, ``FAILURE``,
  ``REVOKED``...): the run is over, whatever became of the marker; or
- it is older than ``ttl`` by the claiming caller's clock (the data holds the writer's time).

A caller that finds a marker that no longer counts replaces it with a *versioned* ``set``: of
two callers that both judged it stale, one ``set`` fails on the version and that caller reads
again, so two callers never both send because of a stale check.

**Worst case**: a key whose owner will never run (killed caller, lost or purged message) is
deduplicated for ``ttl`` seconds after the marker was written (plus the clock skew between
machines when the server has no TTL nodes and the result backend cannot tell). A worker killed
mid-run leaves the state ``STARTED`` (or ``PENDING``): the same bound.
"""

from __future__ import annotations

import json
import logging
import posixpath
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Final, Literal

from celery import states
from kazoo.client import KazooClient
from kazoo.exceptions import (
    BadVersionError,
    NodeExistsError,
    NoNodeError,
    UnimplementedError,
)

from celery_zklock.errors import ZkLockError
from celery_zklock.locks.queue import make_containers
from celery_zklock.task.interrupt import STOPPING
from celery_zklock.zk import adapter
from celery_zklock.zk.calls import Deadline, wait_result
from celery_zklock.zk.client import get_client
from celery_zklock.zk.settings import settings_of

__all__ = ["AlreadyQueued", "Dedupe", "claim", "enqueue_once", "marker_path", "release"]

Dedupe = Literal["queued", "running"]
MARKER_SUFFIX: Final = "~dedupe"
CALL_TIMEOUT: Final = 10.0
CLAIM_ROUNDS: Final = 5

logger = logging.getLogger("celery_zklock")


class AlreadyQueued(ZkLockError):
    """A call with ``lock_dedupe_raise=True`` found its key's earlier message still queued (or
    running): ``task_id`` is that message's task id."""

    def __init__(self, message: str, task_id: str) -> None:
        super().__init__(message)
        self.task_id = task_id


@dataclass(frozen=True)
class Marker:
    """What a marker holds: the owning task id, its mode, and when (writer's clock) it was
    written."""

    task_id: str
    mode: str
    written: float

    def encode(self) -> bytes:
        return json.dumps(
            {"task_id": self.task_id, "mode": self.mode, "written": self.written},
            separators=(",", ":"),
        ).encode()

    @classmethod
    def decode(cls, raw: bytes) -> Marker | None:
        try:
            data = json.loads(raw)
            return cls(str(data["task_id"]), str(data["mode"]), float(data["written"]))
        except (ValueError, KeyError, TypeError):
            return None


def enqueue_once(
    task: Any,
    options: Any,
    lock_path: str,
    task_id: str,
    send: Callable[[], Any],
    resend: bool = False,
) -> Any:
    """Send ``task``'s call (``send()``, which sends it as ``task_id``) unless an earlier
    message of ``lock_path``'s key still counts; then that message's ``AsyncResult``, or
    ``AlreadyQueued`` with ``options.dedupe_raise``. The marker is removed again if the send
    fails, so a failed call leaves nothing behind.

    ``resend``: the message is ``task_id``'s own sent again (its ``retry``, or Celery's re-send
    after a lost worker): it is always sent, as dropping it would leave the task waiting for
    a run that never comes; it claims the marker when that is free or its own, and leaves
    another call's marker alone (a ``queued`` run gave its marker up when it started)."""
    client = get_client(settings_of(task.app).client)
    try:
        owner = claim(
            client, lock_path, task_id, options.dedupe, options.dedupe_ttl, _state_of(task)
        )
    except STOPPING:
        raise
    except Exception:
        if not resend:
            raise
        # ZooKeeper failed: the marker is only an optimisation, the re-send is not
        logger.warning("zklock: could not claim %s for the re-send of task %s",
                       marker_path(lock_path), task_id, exc_info=True)  # fmt: skip
        return send()
    if owner is not None and resend:
        return send()  # another call's marker: left alone
    if owner is not None:
        if options.dedupe_raise:
            raise AlreadyQueued(
                f"task {task.name!r}: a call for lock {lock_path} is already "
                f"{'queued' if options.dedupe == 'queued' else 'queued or running'} as task "
                f"{owner}",
                owner,
            )
        return task.AsyncResult(owner)
    try:
        return send()
    except BaseException:
        release(client, lock_path, task_id)
        raise


def _state_of(task: Any) -> Callable[[str], str]:
    def state(task_id: str) -> str:
        try:
            return str(task.AsyncResult(task_id).state)
        except STOPPING:  # an enqueue from inside a task body: its own limit, or its lock lost
            raise
        except Exception:  # no result backend, or it failed: it cannot tell
            return str(states.PENDING)

    return state


def marker_path(lock_path: str) -> str:
    """The marker of the lock at ``lock_path``: a sibling of the lock's parent, so the lock's
    contender queue never sees it."""
    return lock_path + MARKER_SUFFIX


_ttl_unsupported: weakref.WeakSet[KazooClient] = weakref.WeakSet()
"""Clients whose server answered createTTL with Unimplemented (TTL nodes not enabled)."""


def claim(
    client: KazooClient,
    lock_path: str,
    task_id: str,
    mode: Dedupe,
    ttl: float,
    owner_state: Any,
) -> str | None:
    """Claim ``lock_path``'s marker for ``task_id``; None if it is ours now (send the message),
    else the task id that owns it (send nothing).

    ``owner_state(task_id)`` returns a task's state in the result backend (``PENDING`` when the
    backend knows nothing). A marker already naming ``task_id`` is ours (a retry re-sends with
    the same id).
    """
    path = marker_path(lock_path)
    ours = Marker(task_id, mode, time.time()).encode()
    for _ in range(CLAIM_ROUNDS):
        # Read first: a create that fails on an existing node is still a logged, fsynced
        # transaction on the server; a read is not (the deduplicated call is the common one).
        try:
            raw, stat = client.get(path)
        except NoNodeError:
            if _create(client, path, ours, ttl):
                return None
            continue  # another caller created it between our read and our create: read it
        found = Marker.decode(raw)
        if found is not None and found.task_id == task_id:
            return None
        if found is not None and not _stale(found, ttl, owner_state):
            return found.task_id
        try:
            client.set(path, ours, version=stat.version)
            return None
        except (BadVersionError, NoNodeError):
            continue  # another caller replaced or removed it first: look again
    raise ZkLockError(
        f"could not claim the dedupe marker {path} in {CLAIM_ROUNDS} rounds (it kept changing)"
    )


def release(client: KazooClient, lock_path: str, task_id: str) -> bool:
    """Remove ``lock_path``'s marker if it still names ``task_id``; True if removed."""
    path = marker_path(lock_path)
    try:
        raw, stat = client.get(path)
        found = Marker.decode(raw)
        if found is None or found.task_id != task_id:
            return False
        client.delete(path, version=stat.version)
    except (NoNodeError, BadVersionError):
        return False
    return True


def _stale(marker: Marker, ttl: float, owner_state: Any) -> bool:
    if time.time() - marker.written > ttl:
        return True
    return owner_state(marker.task_id) in states.READY_STATES


def _create(client: KazooClient, path: str, data: bytes, ttl: float) -> bool:
    """Create the marker (a TTL node where the server has them); False if it exists."""
    for _ in range(CLAIM_ROUNDS):
        try:
            _create_once(client, path, data, ttl)
            return True
        except NodeExistsError:
            return False
        except NoNodeError:
            # The parent is a container: it may have been reaped.
            make_containers(client, posixpath.dirname(path), Deadline(CALL_TIMEOUT))
    raise ZkLockError(f"could not create the dedupe marker {path}: its parent kept vanishing")


def _create_once(client: KazooClient, path: str, data: bytes, ttl: float) -> None:
    if client not in _ttl_unsupported:
        try:
            wait_result(
                adapter.create_ttl_async(client, path, data, max(1, round(ttl * 1000))),
                Deadline(CALL_TIMEOUT),
                f"create {path}",
            )
            return
        except UnimplementedError:
            _ttl_unsupported.add(client)
    client.create(path, data)
