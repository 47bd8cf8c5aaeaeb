"""The contender queue of one lock path: create our node, wait for our turn, delete. All of the
lock recipes' ZooKeeper I/O lives here; the decision itself is :func:`contenders.decide`.

One acquire, step by step:

1. Under a parent this client has seen recently: send, back to back on the one connection, the
   create of our protected ephemeral sequential node ``_c_<uuid>-<marker><seq>`` and a
   ``getChildren`` of the parent. ZooKeeper executes a session's requests in order, so the
   listing already contains our node. Under a parent it has not seen: one ``multi`` that makes
   the parent (a container) and our node, its first child (sequence 0, which holds); if the
   parent was there after all, nothing was made and the first way follows. Either way a
   fresh-key acquire costs one round trip plus the release's delete, like a bare create+delete
   pair. The create's answer reached the leader, so it moves the client's lease clock forward.
2. Decide with the listing. Held: done. Not held: watch the one node that blocks us (``exists``
   with a watch; if it is already gone, list again), wait for its deletion or a connection state
   change, list again, decide again. When that node is the last one in our way, the same round
   trip also watches ours, and the deletion alone grants the lock: ZooKeeper reports a
   session's watch events in the order of the changes, so a deletion of ours before it would
   have come first (see :meth:`ContenderQueue._wait_for_deletion`). The usual handoff to the
   next in line then costs no round trip after the holder's delete. A decision taken while the
   client is between connections waits for the reconnect and is kept only if the session is
   still the one that created our node.
3. If the outcome of a create is unknown (the connection dropped before its answer), the node is
   looked for by the uuid in its name, after a ``sync`` (a lagging follower may not show it yet),
   before anything is created again; every child with our uuid is ours, and twins are deleted.
4. A semaphore (a kind with a limit) also reads the parent's data in the same round trip as its
   create, and before deciding makes sure the parent stores its limit: it writes it if the data is
   empty (a versioned write: of two first contenders one limit wins), and raises
   :class:`~celery_zklock.locks.contenders.LimitMismatch` if another is stored. The parent cannot
   be reaped and remade in between: our node is its child.

Two deadlines bound an acquire: ``wait`` bounds the wait for other holders (``LockTimeout``), and
``io`` (never earlier) bounds each request's answer (``ZooKeeperUnavailable``), so that even
``timeout=0`` can be granted a free lock.

Why containers: a persistent parent per key would pile up for every key ever used. A container is
deleted by the server once its last child is gone. The server may reap it between our look and our
create; the create then fails with NoNode and we make the parents and create again. It may also
reap an empty ancestor while the parents are being made (:func:`make_containers`), which then
makes them again.
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager, nullcontext, suppress
from typing import Any, Final, NamedTuple

from kazoo.client import KazooClient
from kazoo.exceptions import (
    BadVersionError,
    ConnectionClosedError,
    ConnectionLoss,
    KazooException,
    NoAuthError,
    NodeExistsError,
    NoNodeError,
    SessionExpiredError,
)
from kazoo.protocol.states import EventType, KazooState, WatchedEvent

from celery_zklock.errors import (
    ConfigurationError,
    LockTimeout,
    ZkLockError,
    ZooKeeperUnavailable,
)
from celery_zklock.locks.contenders import (
    HOLDS,
    Contender,
    LockKind,
    decide,
    limit_agreement,
    limit_data,
    parse_child,
    queue_of,
    read_contender,
)
from celery_zklock.locks.context import ClientContext, context_for
from celery_zklock.zk import adapter
from celery_zklock.zk.calls import Deadline, synced_children, wait_result, wait_slice

logger = logging.getLogger("celery_zklock.locks")

#: Default seconds :meth:`ContenderQueue.participant_nodes` waits for ZooKeeper's answer.
PARTICIPANTS_TIMEOUT: Final = 5.0
CONTAINER_ROUNDS: Final = 10
"""Rounds :func:`make_containers` sends before it gives up on parents that keep being reaped
(the server reaps at its container checks, seconds apart by default: a second round stands)."""


class Created(NamedTuple):
    """Our contender node, just created: its record (name, fencing token, session), the
    client's connection epoch then, and the queue as listed after it."""

    ours: Contender
    epoch: int
    queue: list[Contender]


class SessionGone(Exception):
    """Our node disappeared (its session ended): start a new attempt with a new node."""


def validate_lock_path(path: str) -> str:
    """Return ``path`` if it is an absolute znode path usable as a lock, else raise ValueError."""
    if not isinstance(path, str) or not path.startswith("/") or path == "/":
        raise ValueError(
            f"lock path must be an absolute znode path like '/app/locks/x', got {path!r}"
        )
    if path.endswith("/") or "//" in path:
        raise ValueError(f"lock path {path!r} has an empty segment: remove the extra '/'")
    segments = f"{path}/"  # a '.' or '..' segment is then always between two slashes
    if "/./" in segments or "/../" in segments:
        raise ValueError(
            f"lock path {path!r} contains '.' or '..' segments, which ZooKeeper refuses"
        )
    return path


class ContenderQueue:
    """The queue of contender nodes under one lock path of ``client``, for one lock kind."""

    def __init__(self, client: KazooClient, path: str, kind: LockKind) -> None:
        self.context: ClientContext = context_for(client)
        self.client = client
        self.path = validate_lock_path(path)
        self.lock_kind = kind

    # -- create ----------------------------------------------------------------------------
    def enqueue(self, prefix: str, io: Deadline, data: bytes) -> Created:
        """Create our contender node; return it with a listing taken after it was created."""
        context, client = self.context, self.client
        with context.lock:
            parent_known = self.path in context.known_parents
        while True:
            session_id = context.session_id()
            if session_id is None:
                context.await_connected(io, f"creating a contender under {self.path}")
                continue
            epoch = context.clock.epoch
            sent_at = time.monotonic()
            node_path = f"{self.path}/{prefix}{self.lock_kind.marker}"
            if parent_known:
                created = adapter.create_node_async(client, node_path, data)
            else:  # one request: a new parent and our node, its first child ever
                created = adapter.create_node_and_parent_async(client, self.path, node_path, data)
            # Under a parent we may be creating right now our node is most likely its first
            # child ever (sequence 0), which holds whatever else comes: list the children in
            # the same round trip only under a parent we have seen before.
            listing = client.get_children_async(self.path) if parent_known else None
            limit_read = client.get_async(self.path) if self.lock_kind.limit else None
            what = f"creating a contender under {self.path}"
            try:
                answer = wait_result(created, io, what)
                if parent_known:
                    full_path, stat = answer
                    token = stat.czxid
                else:
                    full_path, token = adapter.created_with_parent(answer)
                path = client.unchroot(full_path)
                parsed = parse_child(path.rsplit("/", 1)[1])
                assert parsed is not None  # a name we made
                if token is None:
                    token = self._czxid(path, io)
                if limit_read is not None:
                    self._agree_on_limit(prefix, wait_result(limit_read, io, what), io)
                children: list[str] | None = None  # None: ours is the only contender
                if listing is not None:
                    children = wait_result(listing, io, what)
                elif parsed.seq != 0:
                    # Not sequence 0, the first child ever made under the parent (ZooKeeper
                    # numbers children by the parent's count of child changes): others may be
                    # ahead of ours.
                    children = wait_result(client.get_children_async(self.path), io, what)
            except NoNodeError:
                self._make_parents(io)
                parent_known = True
                continue
            except NodeExistsError:  # the parent was there, so nothing was created
                parent_known = True
                continue
            except ConnectionLoss:
                found = self._find_ours(prefix, io)
                if found is None:
                    continue
                if self.lock_kind.limit:
                    self._agree_on_limit(prefix, None, io)
                return found
            except ConnectionClosedError:
                raise
            except SessionExpiredError:
                context.await_connected(io, what)
                continue
            context.clock.confirm(sent_at, epoch)
            if not self._same_session(session_id, epoch, io):
                # The session ended around the create: the node went with it. Start a new
                # attempt under a new uuid, so that this one's purge cannot touch it.
                self.abandon_later(prefix)
                raise SessionGone()
            context.remember_parent(self.path)
            ours = Contender(parsed.seq, parsed.name, parsed.kind, token=token, session=session_id)
            return Created(ours, epoch, [ours] if children is None else queue_of(children))

    def _czxid(self, path: str, io: Deadline) -> int:
        """The czxid of our node at ``path`` (read; SessionGone if it is not there)."""
        stat = wait_result(self.client.exists_async(path), io, f"reading {path}")
        if stat is None:
            raise SessionGone()
        return int(stat.czxid)

    def _agree_on_limit(self, prefix: str, read: tuple[bytes, Any] | None, io: Deadline) -> None:
        """Make sure the parent stores our limit (see step 4); ``read`` is a (data, stat) of the
        parent taken after our create (whose name starts with ``prefix``), or None to read it.

        Raises LimitMismatch (another limit is stored), SessionGone (our node is gone),
        ZooKeeperUnavailable past ``io``.
        """
        limit = self.lock_kind.limit
        assert limit is not None
        what = f"agreeing on the limit of {self.path}"
        while True:
            try:
                if read is None:
                    read = wait_result(self.client.get_async(self.path), io, what)
                data, stat = read
                if limit_agreement(self.path, data, limit) == "agreed":
                    return
                wait_result(
                    self.client.set_async(self.path, limit_data(limit), version=stat.version),
                    io,
                    what,
                )
                return
            except BadVersionError:
                pass  # another contender wrote first: read what it stored
            except ConnectionLoss:
                # Our write may have gone through: read again, it then shows our own limit.
                self.context.await_connected(io, what)
            except NoAuthError:
                raise ConfigurationError(
                    f"semaphore {self.path}: the lock's node has no data yet and this client may "
                    "not write it (NoAuth): semaphore contenders store their max_leases there, "
                    "so their ACL must give them WRITE on the lock's node"
                ) from None
            except ConnectionClosedError:
                raise
            except (NoNodeError, SessionExpiredError):
                # The parent went, so our node went before it (or the session did): start over.
                self.abandon_later(prefix)
                raise SessionGone() from None
            read = None

    def _same_session(self, session_id: int, epoch: int, io: Deadline) -> bool:
        """True if the client's session is still ``session_id`` (waiting out a reconnect)."""
        current = self.context.session_id()
        if current is None:
            self.context.await_connected(io, f"confirming our contender under {self.path}")
            current = self.context.session_id()
        return current == session_id and epoch == self.context.clock.epoch

    def _find_ours(self, prefix: str, io: Deadline) -> Created | None:
        """After a connection loss during our create: find our node by its uuid, if it exists.

        Read after a ``sync`` (:func:`read_queues`), so that a follower we reconnected to has
        applied our create if the leader did; every child with our prefix is ours (a twin from
        an earlier look is deleted), and one owned by an older session of ours is gone with it.
        """
        context = self.context
        what = f"looking for our contender under {self.path}"

        def named_ours(queue: list[Contender]) -> list[Contender]:
            return [c for c in queue if c.name.startswith(prefix)]

        while True:
            context.await_connected(io, what)
            session_id, epoch = context.session_id(), context.clock.epoch
            if session_id is None:
                continue
            try:
                [(_, queue)] = read_queues(self.client, [self.path], io, named_ours)
                ours = [c for c in named_ours(queue) if c.session == session_id]
                for twin in ours[1:]:
                    with suppress(NoNodeError):
                        wait_result(self.client.delete_async(f"{self.path}/{twin.name}"), io, what)
                return Created(ours[0], epoch, queue) if ours else None
            except ConnectionClosedError:
                raise
            except (ConnectionLoss, SessionExpiredError):
                continue

    def _make_parents(self, io: Deadline) -> None:
        make_containers(self.client, self.path, io)

    # -- wait ------------------------------------------------------------------------------
    def await_grant(self, created: Created, blocking: bool, wait: Deadline, io: Deadline) -> bool:
        """True once our node holds the lock; False for a try-lock that found it busy.

        Raises LockTimeout when ``wait`` passes first (ZooKeeperUnavailable if the client is
        not connected then), SessionGone when our node or its session is gone.
        """
        kind, name = self.lock_kind, created.ours.name
        queue = created.queue
        while True:
            if queue and queue[0].name == name:
                decision = HOLDS  # the head of the queue holds, whatever the lock kind
            else:
                try:
                    decision = decide(queue, name, kind.kind, kind.limit)
                except LookupError:
                    raise SessionGone() from None
            if decision.holds:
                if not self._same_session(created.ours.session, created.epoch, io):
                    raise SessionGone()
                return True
            if not blocking:
                return False
            assert decision.watch is not None
            rest = [contender for contender in queue if contender.name != decision.watch]
            # The watched node the last one in our way: also watch ours, so that the deletion
            # alone can tell that we hold (see _wait_for_deletion), without a new listing.
            last = decide(rest, name, kind.kind, kind.limit).holds
            own = f"{self.path}/{name}" if last else None
            if self._wait_for_deletion(f"{self.path}/{decision.watch}", wait, io, own):
                queue = rest
            else:
                queue = self.listing(io)

    def listing(self, io: Deadline) -> list[Contender]:
        """The queue as listed (waiting out connection losses until ``io``), without a ``sync``:
        after a watch of this session fired, or a state change, the server we talk to shows at
        least what it told (ZooKeeper's order of a session's requests and events)."""
        what = f"listing the contenders of {self.path}"
        while True:
            try:
                [(_, queue)] = read_queues(self.client, [self.path], io, _none, sync=False)
                return queue
            except ConnectionLoss:
                self.context.await_connected(io, what)
            except ConnectionClosedError:
                raise
            except SessionExpiredError:
                raise SessionGone() from None

    def _wait_for_deletion(
        self, path: str, wait: Deadline, io: Deadline, own: str | None = None
    ) -> bool:
        """Return when ``path`` is deleted or the connection state changes.

        With ``own`` (our node), also watched, just after ``path``: True if ZooKeeper showed
        ``path`` gone while ``own`` still existed, so the caller need not list the queue again.
        Either the look at ``own`` came after ``path`` was gone, or the deletion was reported
        while our watch on ``own`` was set and had not fired: ZooKeeper sends a session its
        watch events in the order of the changes, and kazoo runs them in that order on one
        thread, so a deletion of ours before it would have come first. Never after a
        connection state change (kazoo does not set watches again on a new connection) or
        another kind of event. False otherwise: then the caller lists the queue again.

        Raises SessionGone when the session ended before the watch was set (as :meth:`listing`
        does), ZooKeeperUnavailable when an answer does not come by ``io``, and LockTimeout (or
        ZooKeeperUnavailable, if the client is not connected then) when ``wait`` passes.
        """
        context, client = self.context, self.client
        event = client.handler.event_object()
        fired, own_fired = threading.Event(), threading.Event()
        deleted = False

        def on_watch(watched: WatchedEvent) -> None:
            nonlocal deleted
            deleted = watched.type == EventType.DELETED
            fired.set()
            event.set()

        def on_own_watch(_watched: WatchedEvent) -> None:
            own_fired.set()

        state_changes = context.state_changes
        with (
            context.wakeup_on_state_change(event),
            self._watching(path, on_watch, fired),
            # Removed when we stop waiting, as the other: left, it would fire at our release,
            # one more event per handoff.
            self._watching(own, on_own_watch, own_fired) if own is not None else nullcontext(),
        ):
            try:
                sent = client.exists_async(path, watch=on_watch)
                own_sent = None if own is None else client.exists_async(own, watch=on_own_watch)
                stat = wait_result(sent, io, f"watching {path}")
                if own_sent is not None and wait_result(own_sent, io, f"watching {own}") is None:
                    return False  # ours is gone: the listing tells
            except ConnectionLoss:
                return False
            except ConnectionClosedError:
                raise
            except SessionExpiredError:
                raise SessionGone() from None  # as in listing: our node went with the session
            while stat is not None and not event.wait(wait_slice(wait)):
                if wait.expired():
                    if client.state != KazooState.CONNECTED:
                        raise ZooKeeperUnavailable(
                            wait.why(f"waiting for lock {self.path}", "ZooKeeper unreachable")
                        )
                    raise LockTimeout(f"timed out waiting for lock {self.path}")
                if io.gave_up():  # nothing answers: see ClientContext.outage
                    raise ZooKeeperUnavailable(io.why(f"waiting for lock {self.path}"))
        return (
            own is not None
            and (stat is None or deleted)
            and not own_fired.is_set()
            and context.state_changes == state_changes
        )

    @contextmanager
    def _watching(
        self, path: str, callback: Callable[[WatchedEvent], None], fired: threading.Event
    ) -> Iterator[None]:
        """Count our watch on ``path``; on exit remove it if it did not fire (client and server)."""
        context = self.context
        with context.lock:
            context.watch_refs[path] = context.watch_refs.get(path, 0) + 1
        try:
            yield
        finally:
            with context.lock:
                left = context.watch_refs[path] - 1
                if left:
                    context.watch_refs[path] = left
                else:
                    del context.watch_refs[path]
                if not fired.is_set():
                    adapter.discard_data_watcher(self.client, path, callback)
                    # Only when no other waiter of this client watches the same node: the server
                    # keeps one watch per session and path, shared by all of them.
                    if not left:
                        adapter.remove_data_watches_async(self.client, path)

    # -- delete ----------------------------------------------------------------------------
    def delete(self, node: str, io: Deadline) -> None:
        """Delete our node, retrying across reconnects until ``io`` (ZooKeeperUnavailable).

        NoNodeError only if the node was already gone at the first attempt: after a
        ConnectionLoss a NoNode answer means our earlier delete went through, which is success.
        """
        context = self.context
        ambiguous = False
        while True:
            epoch = context.clock.epoch
            sent_at = time.monotonic()
            try:
                wait_result(self.client.delete_async(node), io, f"deleting {node}")
            except NoNodeError:
                if ambiguous:
                    return
                raise
            except ConnectionLoss:
                ambiguous = True
                context.await_connected(io, f"deleting {node}")
                continue
            context.clock.confirm(sent_at, epoch)
            return

    def abandon(self, prefix: str) -> None:
        """Remove the node(s) of an abandoned attempt, found by its uuid prefix
        (:func:`remove_attempt`). When the client is not connected, or ZooKeeper fails on the
        way, the removal goes on in the background (:meth:`abandon_later`); anything else that
        lands here (the caller's time limit, say) schedules that too and is raised."""
        if self.context.session_id() is None:
            # Not connected: a removal now would only wait (the caller may be leaving its wait
            # because nothing answers); the purge does it after the reconnect.
            self.abandon_later(prefix)
            return
        io = Deadline(self.context.timing.idle_gap)
        try:
            remove_attempt(self.client, self.path, prefix, io)
        except NoNodeError:
            pass
        except (KazooException, ZooKeeperUnavailable):
            self.abandon_later(prefix)
        except BaseException:
            self.abandon_later(prefix)
            raise

    def abandon_later(self, prefix: str) -> None:
        """Remove the node(s) of an abandoned attempt (or the one node named ``prefix``) in the
        background: see :class:`OrphanPurge`."""
        OrphanPurge.of(self.context).later(self.path, prefix)

    def discard(self, node: str) -> None:
        """Remove our node after a busy try-lock; in the background if ZooKeeper cannot do it
        now. Anything else that lands here (the caller's time limit) schedules that and is
        raised."""
        try:
            self.delete(node, Deadline(self.context.timing.idle_gap))
        except (NoNodeError, SessionExpiredError):
            pass
        except (KazooException, ZooKeeperUnavailable):
            self.abandon_later(node.rsplit("/", 1)[1])
        except BaseException:
            self.abandon_later(node.rsplit("/", 1)[1])
            raise

    # -- reporting -------------------------------------------------------------------------
    def participant_nodes(self, timeout: float = PARTICIPANTS_TIMEOUT) -> list[str]:
        """Names of the current contenders on this lock path, in grant order. Raises
        ZooKeeperUnavailable when ZooKeeper does not answer within ``timeout`` seconds."""
        [(_, queue)] = read_queues(self.client, [self.path], Deadline(timeout), _none, sync=False)
        return [c.name for c in queue]


#: Requests sent back to back before their answers are awaited, when reading many nodes.
PIPELINE: Final = 500
_SEND: Final = {"sync": "sync_async", "children": "get_children_async", "get": "get_async"}


def pipelined(client: Any, requests: Sequence[tuple[str, str]], io: Deadline) -> list[Any]:
    """Answers to ``(operation, path)`` requests (``sync``, ``children`` or ``get``), sent back
    to back in batches of :data:`PIPELINE`; None for a path that does not exist (any more).
    Raises ZooKeeperUnavailable past ``io``."""
    answers: list[Any] = []
    for start in range(0, len(requests), PIPELINE):
        batch = requests[start : start + PIPELINE]
        pending = [getattr(client, _SEND[op])(path) for op, path in batch]
        for (_, path), result in zip(batch, pending, strict=True):
            try:
                answers.append(wait_result(result, io, f"reading {path}"))
            except NoNodeError:
                answers.append(None)
    return answers


def read_queues(
    client: Any,
    paths: Sequence[str],
    io: Deadline,
    pick: Callable[[list[Contender]], Iterable[Contender]] | None = None,
    *,
    parent_data: bool = False,
    sync: bool = True,
) -> list[tuple[bytes | None, list[Contender]]]:
    """The contender queues of the locks at ``paths``: for each path, its own data (with
    ``parent_data``, else None; None too when the lock node does not exist) and its contenders
    in queue order. Those that ``pick`` chooses from each queue (default: every one) are read
    (:func:`~celery_zklock.locks.contenders.read_contender`), and left out if they went
    meanwhile; the others are as listed.

    The one reader of lock queues (an acquire's listings while it waits, our node after a lost
    create, the blocker a busy run names, duplicate delivery, preempt, ``lock_holder`` and
    the ``celery zklock`` commands): a ``sync`` (unless not ``sync``: then the server we talk to
    may lag behind the leader) and the listings are sent back to back, then the reads, all
    pipelined, so the whole read costs two round trips. Raises ZooKeeperUnavailable past
    ``io``, and what a request failed with but NoNode.
    """
    per_path = ("children", "get") if parent_data else ("children",)
    synced = [("sync", paths[0])] if paths and sync else []
    requests = synced + [(op, path) for path in paths for op in per_path]
    answers = pipelined(client, requests, io)[len(synced) :]
    queues = [queue_of(children or ()) for children in answers[0 :: len(per_path)]]
    owns = answers[1::2] if parent_data else [None] * len(paths)
    wanted = [(i, c) for i, queue in enumerate(queues) for c in (pick or list)(queue)]
    read = pipelined(client, [("get", f"{paths[i]}/{c.name}") for i, c in wanted], io)
    found = {(i, c.name): answer for (i, c), answer in zip(wanted, read, strict=True)}
    result = []
    for i, (own, queue) in enumerate(zip(owns, queues, strict=True)):
        nodes = []
        for contender in queue:
            answer = found.get((i, contender.name), ())
            if answer is None:
                continue  # gone between the listing and its read
            nodes.append(read_contender(contender, *answer) if answer else contender)
        result.append((own[0] if own is not None else None, nodes))
    return result


def _none(queue: list[Contender]) -> list[Contender]:
    """A ``pick`` for :func:`read_queues` that reads no node."""
    return []


def remove_attempt(client: Any, parent: str, prefix: str, io: Deadline) -> list[str]:
    """Delete the children of ``parent`` whose name starts with ``prefix`` and return their
    paths: the one way an abandoned attempt's nodes are removed, now or in the background.

    With Curator's protected names the prefix (``_c_<uuid>-``) names one attempt's nodes. They
    are found in a listing after a ``sync`` (:func:`synced_children`, as
    :meth:`ContenderQueue._find_ours` looks): a lagging follower must not hide a node whose
    create went through on the leader. A node already gone is skipped; NoNodeError means the
    parent (and so every node of the attempt) is gone; other failures propagate
    (ZooKeeperUnavailable past ``io``).
    """
    what = f"removing an abandoned contender under {parent}"
    removed = []
    for child in synced_children(client, parent, io, what):
        if child.startswith(prefix):
            node = f"{parent}/{child}"
            with suppress(NoNodeError):
                wait_result(client.delete_async(node), io, what)
                removed.append(node)
    return removed


class OrphanPurge:
    """The removals of abandoned attempts left to the background, for one client.

    :meth:`later` is used when an acquire gave up while ZooKeeper could not remove its node
    then (or the outcome of its create was unknown): the attempt's nodes are removed with
    :func:`remove_attempt` on a thread of their own (a greenlet under gevent), now if
    connected, retrying with backoff, else after the reconnect (:meth:`resume`, called by the
    client's context at every CONNECTED). One per client (:meth:`of`); a purge is never left to
    no one, whatever the order of the thread's exit and a reconnect.
    """

    def __init__(self, context: ClientContext) -> None:
        self._context = context
        self._client_ref = weakref.ref(context.client)
        self._lock = threading.Lock()
        self._pending: set[tuple[str, str]] = set()
        self._purging = False

    @classmethod
    def of(cls, context: ClientContext) -> OrphanPurge:
        """The purge of ``context``'s client (made on first need)."""
        with context.lock:
            purge = context.orphans
            if not isinstance(purge, cls):
                purge = context.orphans = cls(context)
        return purge

    def later(self, parent: str, prefix: str) -> None:
        """Remove the children of ``parent`` whose name starts with ``prefix``, in the
        background."""
        with self._lock:
            self._pending.add((parent, prefix))
        self._start()

    def pending(self) -> set[tuple[str, str]]:
        """The (parent, prefix) removals not done yet."""
        with self._lock:
            return set(self._pending)

    def resume(self) -> None:
        """Go on with the pending removals (the client is connected again)."""
        with self._lock:
            pending = bool(self._pending)
        if pending:
            self._start()

    def _start(self) -> None:
        with self._lock:
            if self._purging:
                return
            self._purging = True
        self._context.handler.spawn(self._run)

    def _run(self) -> None:
        """The purge thread: purge until nothing is pending or the client is not connected,
        and never leave a purge behind that a caller counted on us for."""
        while True:
            try:
                self._purge_pending()
            finally:
                with self._lock:
                    self._purging = False
            # A later(), or the CONNECTED listener, that came while we were on our way out saw
            # _purging still set and left its work to us: look again now that it is clear.
            client = self._client_ref()
            with self._lock:
                if (
                    self._purging
                    or not self._pending
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
            with self._lock:
                pending = list(self._pending)
            if client is None or not pending or adapter.is_closed(client):
                return
            if client.state != KazooState.CONNECTED:
                return  # the CONNECTED listener starts us again
            failed = False
            timeout = self._context.timing.idle_gap
            for parent, prefix in pending:
                try:
                    for node in remove_attempt(client, parent, prefix, Deadline(timeout)):
                        logger.info("removed orphaned contender %s", node)
                except NoNodeError:
                    pass  # the parent (and so our node) is gone already
                except Exception as exc:  # a timeout or connection loss: retry below
                    logger.debug("purge of %s/%s* failed: %r", parent, prefix, exc)
                    failed = True
                    continue
                with self._lock:
                    self._pending.discard((parent, prefix))
            del client
            if failed:
                self._context.handler.sleep_func(backoff)
                backoff = min(backoff * 2, self._context.timing.idle_gap)


def make_containers(client: Any, path: str, io: Deadline) -> None:
    """Create ``path`` and every ancestor as container nodes where missing, pipelined: one
    round trip, and another each time ZooKeeper removed one of them on the way.

    The server reaps an empty container that once had a child at any moment, so also between
    its create (answered NodeExists) and its child's create, which then fails NoNode: the
    chain is sent again. A container made by us is not reaped before its first child, so a
    round that made what had gone stands.

    Raises ZooKeeperUnavailable past ``io``; ZkLockError if they went in each of
    :data:`CONTAINER_ROUNDS` rounds; whatever else ZooKeeper failed a create with.
    """
    parts = path.strip("/").split("/")
    what = f"creating the parents of {path}"
    for _ in range(CONTAINER_ROUNDS):
        pending = [
            adapter.create_container_async(client, "/" + "/".join(parts[: i + 1]))
            for i in range(len(parts))
        ]
        try:
            for result in pending:
                with suppress(NodeExistsError):
                    wait_result(result, io, what)
            return
        except NoNodeError:
            continue  # an ancestor was reaped between its create and its child's
    raise ZkLockError(f"could not create the parents of {path}: they kept being reaped")
