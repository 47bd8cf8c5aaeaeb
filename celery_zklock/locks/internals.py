"""The contender queue: the one mechanism behind every lock kind, and all of its ZooKeeper I/O.

A lock kind is a node-name *marker* plus a *kind* ("write" excludes everyone, "read" excludes
writers only); the decision itself is the pure function :func:`contenders.decide`.

One acquire, step by step:

1. Send, back to back on the one connection, a ``createContainer`` for the lock's parent (unless
   this client recently saw the parent), the create of our protected ephemeral sequential node
   ``_c_<uuid>-<marker><seq>`` and a ``getChildren`` of the parent. ZooKeeper executes a session's
   requests in order, so the listing already contains our node: a fresh-key acquire costs one round
   trip plus the release's delete, like a bare create+delete pair.
2. Decide with the listing. Held: done. Not held: watch the one node that blocks us (``exists``
   with a watch; if it is already gone, list again), wait for its deletion or a connection state
   change, list again, decide again.
3. Leave nothing behind. A try-lock that finds the lock busy deletes its node before returning.
   A timeout or any exception (``BaseException`` included: an exception thrown into the waiting
   thread) deletes the node; if the connection is down, the delete is queued to run on reconnect.
   If the outcome of a create is unknown (the connection dropped before its answer), the node is
   found again by the uuid in its name before anything is created again: one acquire never owns two
   nodes. A watch that did not fire is removed from the server (``removeWatches``).

Why containers: a persistent parent per key would pile up for every key ever used. A container is
deleted by the server once its last child is gone. The server may reap it between our look and our
create; the create then fails with NoNode and we make the parents and create again.
"""

from __future__ import annotations

import sys
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from typing import Any
from uuid import uuid4

from kazoo.client import KazooClient, KazooState
from kazoo.exceptions import (
    ConnectionLoss,
    NodeExistsError,
    NoNodeError,
    SessionExpiredError,
)
from kazoo.handlers.threading import KazooTimeoutError

from celery_zklock.errors import LockTimeout, ZkLockError
from celery_zklock.locks.contenders import Kind, decide, parse_child, protected_prefix, queue_of
from celery_zklock.locks.lease import Hold, Lease
from celery_zklock.locks.requests import create_container_async, remove_data_watches_async
from celery_zklock.session import SessionWatch, watch_for

#: How many lock parents per client are remembered as existing (skips the createContainer).
KNOWN_PARENTS = 1024
#: Longest single blocking wait, in seconds (see :func:`_slice`).
WAIT_SLICE = 0.1


class Deadline:
    """A point in monotonic time, or none (wait without limit)."""

    def __init__(self, seconds: float | None) -> None:
        self.at = None if seconds is None else time.monotonic() + seconds

    def remaining(self) -> float | None:
        return None if self.at is None else max(0.0, self.at - time.monotonic())

    def expired(self) -> bool:
        return self.at is not None and time.monotonic() >= self.at


@dataclass
class _Created:
    name: str
    token: int
    session_id: int
    children: list[str]


class _SessionGone(Exception):
    """Our node disappeared (its session expired): start a new attempt with a new node."""


class ClientLockState:
    """Per-client bookkeeping shared by all locks of one kazoo client."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.owned: dict[tuple[str, int], Hold] = {}
        self.known_parents: OrderedDict[str, None] = OrderedDict()
        self.watch_refs: dict[str, int] = {}

    def parent_known(self, path: str) -> bool:
        with self.lock:
            if path in self.known_parents:
                self.known_parents.move_to_end(path)
                return True
            return False

    def remember_parent(self, path: str, exists: bool) -> None:
        with self.lock:
            if exists:
                self.known_parents[path] = None
                if len(self.known_parents) > KNOWN_PARENTS:
                    self.known_parents.popitem(last=False)
            else:
                self.known_parents.pop(path, None)


_states: dict[int, tuple[KazooClient, ClientLockState]] = {}
_states_lock = threading.Lock()


def _state_for(client: KazooClient) -> ClientLockState:
    with _states_lock:
        entry = _states.get(id(client))
        if entry is None or entry[0] is not client:
            entry = _states[id(client)] = (client, ClientLockState())
        return entry[1]


def validate_lock_path(path: str) -> str:
    """Return ``path`` if it is an absolute znode path usable as a lock, else raise ValueError."""
    if not isinstance(path, str) or not path.startswith("/") or path == "/":
        raise ValueError(
            f"lock path must be an absolute znode path like '/app/locks/x', got {path!r}"
        )
    if path.endswith("/") or "//" in path:
        raise ValueError(f"lock path {path!r} has an empty segment: remove the extra '/'")
    if any(part in (".", "..") for part in path.split("/")):
        raise ValueError(
            f"lock path {path!r} contains '.' or '..' segments, which ZooKeeper refuses"
        )
    return path


class LockInternals:
    """The contender queue of one lock path for one lock kind.

    ``marker`` is the node-name part before the sequence (``lock-``, ``__READ__``, ``__WRIT__``);
    ``kind`` selects the predicate.
    """

    def __init__(self, client: KazooClient, path: str, marker: str, kind: Kind) -> None:
        self.client = client
        self.path = validate_lock_path(path)
        self.marker = marker
        self.kind: Kind = kind
        self.watch: SessionWatch = watch_for(client)
        self._state = _state_for(client)

    # -- public entry points ---------------------------------------------------------------
    def acquire(self, *, blocking: bool, timeout: float | None, data: bytes = b"") -> Lease | None:
        """Acquire; see :meth:`celery_zklock.Mutex.acquire` for the contract."""
        if timeout is not None and timeout < 0:
            raise ValueError(f"timeout must be >= 0 seconds or None, got {timeout!r}")
        thread_id = threading.get_ident()
        reentered = self._reenter(thread_id)
        if reentered is not None:
            return Lease(reentered)
        if timeout is None and not blocking:
            # A try-lock still talks to the server: never let it block forever while cut off.
            timeout = self.watch.session_timeout
        deadline = Deadline(timeout)
        hold = self._acquire_node(blocking, deadline, thread_id, data)
        if hold is None:
            return None
        with self._state.lock:
            self._state.owned[(self.path, thread_id)] = hold
        self.watch.track(hold)
        return Lease(hold)

    def release(self, hold: Hold) -> None:
        """Drop one reentrant count of ``hold``; at zero delete its node (see ``Lease.release``)."""
        with self._state.lock:
            hold.count -= 1
            if hold.count > 0:
                return
            key = (self.path, hold.thread_id)
            if self._state.owned.get(key) is hold:
                del self._state.owned[key]
        self.watch.untrack(hold)
        node_session = hold.session_id
        if self.watch.session_id() not in (node_session, None):
            hold.mark_lost("the ZooKeeper session that created the lock node ended before release")
            return
        try:
            self._delete(hold.node, Deadline(self.watch.lost_after))
        except NoNodeError:
            hold.mark_lost("the lock node was already gone at release (its session expired)")
        except SessionExpiredError:
            hold.mark_lost("the ZooKeeper session expired before release")
        except LockTimeout:
            name = hold.node.rsplit("/", 1)[1]
            self.watch.purge_later(self.path, name)
            hold.mark_lost("ZooKeeper was unreachable at release; the node is removed on reconnect")

    def blocker_data(self, timeout: float) -> bytes | None:
        """Data of the contender a new acquire of this kind would wait for first, if any.

        One listing and one read; for reporting who holds a busy lock. ``None`` when no
        contender blocks (or it went away meanwhile).
        """
        deadline = Deadline(timeout)
        try:
            queue = queue_of(_wait(self.client.get_children_async(self.path), deadline))
            blockers = [c for c in queue if self.kind == "write" or c.kind == "write"]
            if not blockers:
                return None
            data, _ = _wait(self.client.get_async(f"{self.path}/{blockers[0].name}"), deadline)
            return bytes(data)
        except NoNodeError:
            return None

    def participant_nodes(self) -> list[str]:
        """Names of the current contenders on this lock path, in grant order."""
        try:
            children = self.client.get_children(self.path)
        except NoNodeError:
            return []
        return [c.name for c in queue_of(children)]

    # -- reentrancy ------------------------------------------------------------------------
    def _reenter(self, thread_id: int) -> Hold | None:
        with self._state.lock:
            hold = self._state.owned.get((self.path, thread_id))
            if hold is None or hold.lost_reason is not None:
                return None
            if hold.kind == "read" and self.kind == "write":
                raise ZkLockError(
                    f"this thread holds a read lock on {self.path} and asked for the write lock: "
                    "upgrading would deadlock; release the read lock first"
                )
            hold.count += 1
            return hold

    # -- one acquire -----------------------------------------------------------------------
    def _acquire_node(
        self, blocking: bool, deadline: Deadline, thread_id: int, data: bytes
    ) -> Hold | None:
        while True:
            prefix = protected_prefix(str(uuid4()))
            try:
                created = self._create(prefix, deadline, data)
                granted = self._wait_for_grant(created, blocking, deadline)
            except _SessionGone:
                continue
            except BaseException:
                # Whether or not the create ran (or is still queued), our node is the one child
                # with this attempt's uuid: remove it before the exception goes on.
                self._abandon(prefix)
                raise
            node = f"{self.path}/{created.name}"
            if not granted:
                self._discard(node)
                return None
            return Hold(self, node, created.token, created.session_id, thread_id)

    def _create(self, prefix: str, deadline: Deadline, data: bytes) -> _Created:
        """Create our contender node; return it with a listing taken after it was created."""
        client = self.client
        parent_known = self._state.parent_known(self.path)
        while True:
            epoch = self.watch.epoch
            parent = None if parent_known else create_container_async(client, self.path)
            created = client.create_async(
                f"{self.path}/{prefix}{self.marker}",
                data,
                ephemeral=True,
                sequence=True,
                include_data=True,
            )
            # Under a parent we may be creating right now our node is most likely its first
            # child ever (sequence 0), which holds whatever else comes: list the children in
            # the same round trip only under a parent we have seen before.
            listing = client.get_children_async(self.path) if parent_known else None
            try:
                path, stat = _wait(created, deadline)
                if listing is not None:
                    children = _wait(listing, deadline)
                elif _first_child_ever(path):
                    children = [path.rsplit("/", 1)[1]]
                else:
                    children = _wait(client.get_children_async(self.path), deadline)
            except NoNodeError:
                self._make_parents(deadline)
                parent_known = True
                continue
            except ConnectionLoss:
                found = self._find_ours(prefix, deadline)
                if found is None:
                    self._await_connected(deadline)
                    continue
                return found
            except SessionExpiredError:
                self._await_connected(deadline)
                continue
            finally:
                if parent is not None:
                    self._note_parent_result(parent)
            session_id = self.watch.session_id()
            if session_id is None or epoch != self.watch.epoch:
                # The session changed around the create: the node may be gone with it. Start a
                # new attempt under a new uuid, so the purge of this one cannot touch it.
                self.watch.purge_later(self.path, prefix)
                raise _SessionGone()
            self._state.remember_parent(self.path, True)
            return _Created(path.rsplit("/", 1)[1], stat.czxid, session_id, children)

    def _note_parent_result(self, parent: Any) -> None:
        if parent.ready() and not parent.successful():
            exc = parent.exception
            if not isinstance(exc, NodeExistsError):
                self._state.remember_parent(self.path, False)

    def _find_ours(self, prefix: str, deadline: Deadline) -> _Created | None:
        """After a connection loss during our create: find our node by its uuid, if it exists."""
        while True:
            try:
                children = _wait(self.client.get_children_async(self.path), deadline)
                ours = [c for c in children if c.startswith(prefix)]
                if not ours:
                    return None
                stat = _wait(self.client.exists_async(f"{self.path}/{ours[0]}"), deadline)
                session_id = self.watch.session_id()
                if stat is None or session_id is None:
                    return None
                return _Created(ours[0], stat.czxid, session_id, children)
            except (NoNodeError, SessionExpiredError):
                return None  # a node of an expired session is gone with it
            except ConnectionLoss:
                self._await_connected(deadline)
                continue

    def _await_connected(self, deadline: Deadline) -> None:
        """Before retrying a request that failed for want of a connection: wait until the
        client is connected again (LockTimeout at the deadline).

        Retrying at once would spin: while the session is expired kazoo fails requests without
        waiting, and under gevent a greenlet that never blocks starves kazoo's reconnecting
        greenlet for good.
        """
        event = self.client.handler.event_object()
        with self.watch.wakeup_on_state_change(event):
            while self.client.state != KazooState.CONNECTED:
                if deadline.expired():
                    raise LockTimeout(f"ZooKeeper unreachable while acquiring {self.path}")
                event.wait(_slice(deadline))
                event.clear()

    def _make_parents(self, deadline: Deadline) -> None:
        """Create every ancestor of the lock path as a container, pipelined, in one round trip."""
        parts = self.path.strip("/").split("/")
        pending = [
            create_container_async(self.client, "/" + "/".join(parts[: i + 1]))
            for i in range(len(parts))
        ]
        for result in pending:
            with suppress(NodeExistsError):
                _wait(result, deadline)

    def _wait_for_grant(self, created: _Created, blocking: bool, deadline: Deadline) -> bool:
        children = created.children
        while True:
            try:
                decision = decide(queue_of(children), created.name, self.kind)
            except LookupError:
                raise _SessionGone() from None
            if decision.holds:
                if self.watch.session_id() != created.session_id:
                    raise _SessionGone()
                return True
            if not blocking:
                return False
            assert decision.watch is not None
            self._wait_for_deletion(f"{self.path}/{decision.watch}", deadline)
            children = self._list(deadline)

    def _list(self, deadline: Deadline) -> list[str]:
        while True:
            try:
                children: list[str] = _wait(self.client.get_children_async(self.path), deadline)
                return children
            except ConnectionLoss:
                self._await_connected(deadline)
                continue
            except (NoNodeError, SessionExpiredError):
                raise _SessionGone() from None

    def _wait_for_deletion(self, path: str, deadline: Deadline) -> None:
        """Return when ``path`` is deleted or the connection state changes.

        Raises LockTimeout when the deadline passes first.
        """
        event = self.client.handler.event_object()
        fired = threading.Event()

        def on_watch(_event: object) -> None:
            fired.set()
            event.set()

        with self.watch.wakeup_on_state_change(event), self._watching(path, on_watch, fired):
            try:
                stat = _wait(self.client.exists_async(path, watch=on_watch), deadline)
            except ConnectionLoss:
                return
            if stat is None:
                return
            while not event.wait(_slice(deadline)):
                if deadline.expired():
                    raise LockTimeout(f"timed out waiting for lock {self.path}")

    @contextmanager
    def _watching(
        self, path: str, callback: Callable[[object], None], fired: threading.Event
    ) -> Iterator[None]:
        """Count our watch on ``path``; on exit remove it if it did not fire (client and server)."""
        state = self._state
        with state.lock:
            state.watch_refs[path] = state.watch_refs.get(path, 0) + 1
        try:
            yield
        finally:
            with state.lock:
                left = state.watch_refs[path] - 1
                if left:
                    state.watch_refs[path] = left
                else:
                    del state.watch_refs[path]
                if not fired.is_set():
                    chroot = self.client.chroot
                    watchers = self.client._data_watchers.get(chroot + path if chroot else path)
                    if watchers is not None:
                        watchers.discard(callback)
                    # Only when no other waiter of this client watches the same node: the server
                    # keeps one watch per session and path, shared by all of them.
                    if not left:
                        remove_data_watches_async(self.client, path)

    # -- deletes ---------------------------------------------------------------------------
    def _delete(self, node: str, deadline: Deadline) -> None:
        """Delete our node, retrying across reconnects until ``deadline`` (then LockTimeout)."""
        while True:
            try:
                _wait(self.client.delete_async(node), deadline)
                return
            except ConnectionLoss:
                if deadline.expired():
                    raise LockTimeout(f"could not delete {node}: ZooKeeper unreachable") from None

    def _abandon(self, prefix: str) -> None:
        """Remove the node of an abandoned attempt, found by its uuid prefix; never raises
        an Exception (on failure the removal is deferred to the next reconnect)."""
        deadline = Deadline(self.watch.lost_after)
        try:
            for child in _wait(self.client.get_children_async(self.path), deadline):
                if child.startswith(prefix):
                    with suppress(NoNodeError):
                        _wait(self.client.delete_async(f"{self.path}/{child}"), deadline)
        except NoNodeError:
            pass
        except Exception:
            self.watch.purge_later(self.path, prefix)
        except BaseException:
            self.watch.purge_later(self.path, prefix)
            raise

    def _discard(self, node: str) -> None:
        """Remove our node after a failed or abandoned acquire; defer to reconnect if need be."""
        try:
            self._delete(node, Deadline(self.watch.lost_after))
        except (NoNodeError, SessionExpiredError):
            pass
        except Exception:
            self.watch.purge_later(self.path, node.rsplit("/", 1)[1])
        except BaseException:
            self.watch.purge_later(self.path, node.rsplit("/", 1)[1])
            raise


def _first_child_ever(path: str) -> bool:
    """True if the node at ``path`` got sequence 0: no child was created under its parent
    before it (ZooKeeper numbers children by the parent's count of child changes), so no
    contender can come before it."""
    contender = parse_child(path.rsplit("/", 1)[1])
    return contender is not None and contender.seq == 0


def _wait(result: Any, deadline: Deadline) -> Any:
    """Wait for a kazoo async result until ``deadline``; LockTimeout when it passes.

    ``result.get`` raises the handler's own timeout error: kazoo's for threading,
    ``gevent.Timeout`` (a BaseException) for gevent. Anything else propagates unchanged.
    """
    while True:
        try:
            return result.get(timeout=_slice(deadline))
        except _timeout_types():
            if result.ready():
                raise
            if deadline.expired():
                raise LockTimeout("timed out waiting for ZooKeeper") from None


def _slice(deadline: Deadline) -> float:
    """Wait in short slices: an exception thrown into this thread (PyThreadState_SetAsyncExc,
    as Celery's threads pool revocation does) is only delivered between blocking calls."""
    remaining = deadline.remaining()
    return WAIT_SLICE if remaining is None else min(WAIT_SLICE, remaining)


def _timeout_types() -> tuple[type[BaseException], ...]:
    gevent = sys.modules.get("gevent")
    if gevent is None:
        return (KazooTimeoutError,)
    return (KazooTimeoutError, gevent.Timeout)
