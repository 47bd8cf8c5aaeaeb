"""Enqueue-time deduplication: one message per lock key while an earlier one is queued (or
running), crash-safely, and never waiting on ZooKeeper past a deadline.

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
- it is older than ``ttl`` by the claiming caller's clock (the data holds the writer's time); or
- it reached ZooKeeper after its caller gave up (see below).

A caller that finds a marker that no longer counts replaces it with a *versioned* ``set``: of
two callers that both judged it stale, one ``set`` fails on the version and that caller reads
again, so two callers never both send because of a stale check.

**Deadline.** A claim waits for ZooKeeper at most ``timeout`` seconds (the app's
``zklock_dedupe_timeout``), then raises ``ZooKeeperUnavailable``: the caller sends nothing, or
sends without the marker (``lock_dedupe_unavailable="send"``). It sends no write while its
client has no connection (kazoo would queue it and send it after the reconnect), but a write
already sent may still be waiting in a server that stalls, and land later, naming a task id
whose caller gave up. Such a *late marker* never blocks the key:

- the marker's data holds the caller's deadline (its clock: when the claim started plus
  ``timeout``), and a later caller treats a marker that the server last wrote (its ``mtime``)
  after that deadline as absent (replaces it, as a stale one); and
- the caller that gave up removes it when the late write's answer comes (a versioned delete,
  so a marker another caller wrote since stays).

The first compares the server's clock with the writer's: a server clock ahead by more than
``timeout`` would make every marker look late (no deduplication, never a lost call); a late
marker whose writer died before the answer came, on a server clock behind, counts until its
owner's state or ``ttl`` ends it, as any marker of a call that was never sent.

**Worst case**: a key whose owner will never run (killed caller, lost or purged message) is
deduplicated for ``ttl`` seconds after the marker was written (plus the clock skew between
machines when the server has no TTL nodes and the result backend cannot tell). A worker killed
mid-run leaves the state ``STARTED`` (or ``PENDING``): the same bound.
"""

from __future__ import annotations

import functools
import json
import logging
import posixpath
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any, Final, Literal

from celery import states
from kazoo.client import KazooClient
from kazoo.exceptions import (
    BadVersionError,
    ConnectionClosedError,
    ConnectionLoss,
    NodeExistsError,
    NoNodeError,
    SessionExpiredError,
    UnimplementedError,
)
from kazoo.handlers.threading import KazooTimeoutError
from kazoo.protocol.states import ZnodeStat

from celery_zklock.errors import ZkLockError, ZooKeeperUnavailable
from celery_zklock.locks.context import context_for
from celery_zklock.locks.queue import make_containers
from celery_zklock.task.interrupt import STOPPING
from celery_zklock.zk import adapter
from celery_zklock.zk.calls import Deadline, wait_result
from celery_zklock.zk.client import get_client
from celery_zklock.zk.settings import DEFAULT_DEDUPE_TIMEOUT, settings_of

__all__ = ["AlreadyQueued", "Dedupe", "claim", "enqueue_once", "marker_path", "release"]

Dedupe = Literal["queued", "running"]
MARKER_SUFFIX: Final = "~dedupe"
CLAIM_ROUNDS: Final = 5

_UNREACHABLE: Final = (
    ConnectionLoss,
    SessionExpiredError,
    ConnectionClosedError,
    KazooTimeoutError,
)
"""What kazoo raises when ZooKeeper cannot be reached (besides our ``ZooKeeperUnavailable``):
a dropped connection, an expired session, a closed client, a first connect that timed out."""

logger = logging.getLogger("celery_zklock")


class AlreadyQueued(ZkLockError):
    """A call with ``lock_dedupe_raise=True`` found its key's earlier message still queued (or
    running): ``task_id`` is that message's task id."""

    def __init__(self, message: str, task_id: str) -> None:
        super().__init__(message)
        self.task_id = task_id


@dataclass(frozen=True)
class Marker:
    """What a marker holds: the owning task id, its mode, when (writer's clock) it was
    written, and when (writer's clock) its writer stopped waiting for the write: a marker the
    server wrote after that is a late one (see the module docstring). Markers written before
    the deadline existed have none."""

    task_id: str
    mode: str
    written: float
    deadline: float | None = None

    def encode(self) -> bytes:
        data = {name: value for name, value in asdict(self).items() if value is not None}
        return json.dumps(data, separators=(",", ":")).encode()

    @classmethod
    def decode(cls, raw: bytes) -> Marker | None:
        try:
            data = json.loads(raw)
            deadline = None if data.get("deadline") is None else float(data["deadline"])
            return cls(str(data["task_id"]), str(data["mode"]), float(data["written"]), deadline)
        except (ValueError, KeyError, TypeError, AttributeError):
            return None

    def late(self, stat: ZnodeStat) -> bool:
        """True if the server wrote this marker (``stat.mtime``, its clock) after its writer
        gave up waiting for it (:attr:`deadline`, the writer's clock)."""
        return self.deadline is not None and stat.mtime / 1000.0 > self.deadline


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

    ZooKeeper unreachable (no answer within the app's ``zklock_dedupe_timeout``, or no first
    connection within ``zklock_connect_timeout``): ``ZooKeeperUnavailable`` and nothing sent,
    or with ``options.dedupe_unavailable == "send"`` the message sent without deduplication.

    ``resend``: the message is ``task_id``'s own sent again (its ``retry``, or Celery's re-send
    after a lost worker): it is always sent, as dropping it would leave the task waiting for
    a run that never comes; it claims the marker when that is free or its own, and leaves
    another call's marker alone (a ``queued`` run gave its marker up when it started)."""
    settings = settings_of(task.app)
    timeout = settings.dedupe_timeout
    try:
        client = get_client(settings.client)
        owner = claim(
            client, lock_path, task_id, options.dedupe, options.dedupe_ttl, _state_of(task), timeout
        )
    except STOPPING:
        raise
    except Exception as exc:
        if resend:
            # ZooKeeper failed: the marker is only an optimisation, the re-send is not
            logger.warning("zklock: could not claim %s for the re-send of task %s",
                           marker_path(lock_path), task_id, exc_info=True)  # fmt: skip
            return send()
        if not isinstance(exc, (ZooKeeperUnavailable, *_UNREACHABLE)):
            raise
        why = _unreachable(exc, timeout)
        if options.dedupe_unavailable == "send":
            logger.warning("zklock: task %s (%s) sent without deduplication: %s "
                           "(lock_dedupe_unavailable='send')", task.name, task_id, why)  # fmt: skip
            return send()
        raise ZooKeeperUnavailable(
            f"task {task.name!r}: nothing sent: {why} while claiming the dedupe marker of lock "
            f"{lock_path}; lock_dedupe_unavailable='send' sends without deduplication instead"
        ) from exc
    if owner is not None and resend:
        return send()  # another call's marker: left alone
    if owner is not None:
        if options.dedupe_raise:
            what = "queued" if options.dedupe == "queued" else "queued or running"
            message = f"a call for lock {lock_path} is already {what} as task {owner}"
            raise AlreadyQueued(f"task {task.name!r}: {message}", owner)
        return task.AsyncResult(owner)
    try:
        return send()
    except BaseException:
        try:
            release(client, lock_path, task_id, timeout)
        except Exception:  # the send's error is the one to raise; the ttl bounds the marker
            logger.warning("zklock: could not remove the dedupe marker of task %s after its "
                           "send failed", task_id, exc_info=True)  # fmt: skip
        raise


def _unreachable(exc: Exception, timeout: float) -> str:
    if isinstance(exc, ZooKeeperUnavailable):
        return f"{exc} (zklock_dedupe_timeout {timeout:g}s)"
    return f"ZooKeeper unreachable ({type(exc).__name__}: {exc})"


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


def claim(
    client: KazooClient,
    lock_path: str,
    task_id: str,
    mode: Dedupe,
    ttl: float,
    owner_state: Any,
    timeout: float = DEFAULT_DEDUPE_TIMEOUT,
) -> str | None:
    """Claim ``lock_path``'s marker for ``task_id``; None if it is ours now (send the message),
    else the task id that owns it (send nothing).

    ``owner_state(task_id)`` returns a task's state in the result backend (``PENDING`` when the
    backend knows nothing). A marker already naming ``task_id`` is ours (a retry re-sends with
    the same id). Raises ``ZooKeeperUnavailable`` once ``timeout`` seconds passed without the
    answers it needs; a write of ours still unanswered then is undone when it lands (see the
    module docstring). A connection lost on the way is waited for, and the marker read again:
    a create whose answer the lost connection took may have landed, and then names us.
    """
    path = marker_path(lock_path)
    deadline = Deadline(timeout)
    now = time.time()
    mine = Marker(task_id, mode, now, now + timeout)
    context = context_for(client)
    what = f"claiming the dedupe marker {path}"
    contended = 0
    while contended < CLAIM_ROUNDS:
        # No request while the client has no connection: kazoo would send it after the
        # reconnect, however long after we gave up.
        context.await_connected(deadline, what)
        try:
            return _claim_once(client, path, mine, ttl, owner_state, deadline)
        except (ConnectionLoss, SessionExpiredError):
            if deadline.expired():  # kazoo may fail requests at once, without a wait
                raise ZooKeeperUnavailable(deadline.why(what)) from None
        except (BadVersionError, NoNodeError, NodeExistsError):
            contended += 1  # another caller wrote or removed it first: read again
    raise ZkLockError(
        f"could not claim the dedupe marker {path} in {CLAIM_ROUNDS} rounds (it kept changing)"
    )


def _claim_once(
    client: KazooClient, path: str, mine: Marker, ttl: float, owner_state: Any, deadline: Deadline
) -> str | None:
    """One read and at most one write (of ``mine``): None (ours) or the owner's task id. Raises
    ``NodeExistsError``, ``BadVersionError`` or ``NoNodeError`` when another caller wrote or
    removed the marker first."""
    # Read first: a create that fails on an existing node is still a logged, fsynced
    # transaction on the server; a read is not (the deduplicated call is the common one).
    try:
        raw, stat = wait_result(client.get_async(path), deadline, f"reading {path}")
    except NoNodeError:
        _create(client, path, mine.encode(), ttl, deadline)
        return None
    found = Marker.decode(raw)
    if found is not None and found.task_id == mine.task_id:
        return None
    if found is not None and not _stale(found, stat, ttl, owner_state):
        return found.task_id
    _write(client, path, client.set_async(path, mine.encode(), version=stat.version), deadline)
    return None


def release(
    client: KazooClient, lock_path: str, task_id: str, timeout: float = DEFAULT_DEDUPE_TIMEOUT
) -> bool:
    """Remove ``lock_path``'s marker if it still names ``task_id``; True if removed.
    Raises ``ZooKeeperUnavailable`` when ZooKeeper does not answer within ``timeout`` seconds."""
    path = marker_path(lock_path)
    deadline = Deadline(timeout)
    what = f"removing the dedupe marker {path}"
    try:
        raw, stat = wait_result(client.get_async(path), deadline, what)
        found = Marker.decode(raw)
        if found is None or found.task_id != task_id:
            return False
        wait_result(client.delete_async(path, version=stat.version), deadline, what)
    except (NoNodeError, BadVersionError):
        return False
    return True


def _stale(marker: Marker, stat: ZnodeStat, ttl: float, owner_state: Any) -> bool:
    if marker.late(stat):
        return True  # its caller gave up before it was written: nothing was sent for it
    if time.time() - marker.written > ttl:
        return True
    return owner_state(marker.task_id) in states.READY_STATES


def _create(client: KazooClient, path: str, data: bytes, ttl: float, deadline: Deadline) -> None:
    """Create the marker (a TTL node where the server has them). Raises ``NodeExistsError``
    if it exists."""
    for _ in range(CLAIM_ROUNDS):
        try:
            _create_once(client, path, data, ttl, deadline)
            return
        except NoNodeError:
            # The parent is a container: it may have been reaped.
            make_containers(client, posixpath.dirname(path), deadline)
    raise ZkLockError(f"could not create the dedupe marker {path}: its parent kept vanishing")


def _create_once(
    client: KazooClient, path: str, data: bytes, ttl: float, deadline: Deadline
) -> None:
    if adapter.has_ttl_nodes(client):
        ttl_ms = max(1, round(ttl * 1000))
        try:
            _write(client, path, adapter.create_ttl_async(client, path, data, ttl_ms), deadline)
            return
        except UnimplementedError:
            adapter.note_no_ttl_nodes(client)
    _write(client, path, client.create_async(path, data), deadline)


def _write(client: KazooClient, path: str, request: Any, deadline: Deadline) -> Any:
    """Wait for a write of the marker at ``path`` (a create or a versioned set) until
    ``deadline``. If the wait ends without its answer (the deadline, or an exception thrown
    into the caller), the write may still land: it is then undone as its answer comes."""
    try:
        return wait_result(request, deadline, f"writing {path}")
    except BaseException:
        request.rawlink(functools.partial(_undo_late, client, path))
        raise


def _undo_late(client: KazooClient, path: str, result: Any) -> None:
    """On kazoo's callback thread (must not block): the answer of a marker write whose caller
    gave up. Written: delete it, at the version written (a create's is 0), so that a marker
    another caller wrote since stays. Not written, or no answer (the connection dropped): the
    marker's deadline tells later callers (:meth:`Marker.late`)."""
    if not result.successful():
        return
    version = getattr(result.get(), "version", 0)  # a set's stat; a create's path
    logger.info("zklock: the dedupe marker %s was written after its caller gave up: removed", path)
    try:
        client.delete_async(path, version=version)
    except Exception:  # the client is closing: the marker's deadline still tells
        logger.debug("could not remove the late dedupe marker %s", path, exc_info=True)
