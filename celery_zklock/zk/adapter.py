"""Every use of kazoo's private API, in one place (kazoo 2.x; the dependency is capped ``<3``).

What kazoo 2.11 does not offer publicly, and what we do about it:

- **The negotiated session timeout.** kazoo keeps it in a local variable of its connect routine.
  :func:`install_connect_hook` wraps ``ConnectionHandler._invoke`` (the writer kazoo uses only
  while a connection is being set up) once per process, so every ``ConnectResponse`` leaves its
  ``timeOut`` on the connection object *before* kazoo reports CONNECTED. A client that connected
  before this module was imported has no such record: :func:`force_reconnect` makes it reconnect
  (same session) so the next handshake is seen.
- **How long a handshake waits for its answer.** kazoo waits the session timeout over the number
  of hosts, with no setting. The same wrapper shortens that wait on the connections
  :func:`limit_handshake_wait` marks (the library's clients: why, in
  :data:`celery_zklock.zk.client.HANDSHAKE_WAIT_SHARE`).
- **The create of a contender node without a thread hop** (shape checked, below).
  ``KazooClient.create_async`` hands its answer to kazoo's callback thread, which copies it
  into the result the caller waits on: one more thread wake-up per lock.
  :func:`create_node_async` sends kazoo's own ``Create2`` through ``KazooClient._call``, so the
  connection thread sets the caller's result directly.
- **A node and its new parent in one request**: :func:`create_node_and_parent_async` sends a
  ``multi`` of ``createContainer`` and ``create2``, which kazoo's ``TransactionRequest`` cannot
  hold (it knows neither opcode, nor their answers).
- **Three requests:** ``createContainer`` (opcode 19, a parent the server deletes once empty),
  ``createTTL`` (opcode 21, a node the server deletes once unchanged for its TTL; only where the
  server runs with ``zookeeper.extendedTypesEnabled=true``, else it answers ``Unimplemented``)
  and ``removeWatches`` (opcode 18), sent through ``KazooClient._call`` like kazoo's own.
- **A client-side watcher** that did not fire is dropped from ``KazooClient._data_watchers``.
- **Socket reads and writes that try before they poll**: :func:`use_direct_socket_io` makes a
  client's ``ConnectionHandler`` a :class:`~celery_zklock.zk.handler.DirectSocketConnection`
  (it overrides ``_read`` and ``_write``).
- **Whether a client can send at all** (``KazooClient._stopped``): a stopped, closed or never
  started client fails every request with ``ConnectionClosedError``, which kazoo derives from
  ``SessionExpiredError``; a caller that waits for a reconnect on session expiry would wait forever.
- **Whether kazoo's connection loop gave up** (``ConnectionHandler.connection_stopped`` and
  ``_connection_routine``): when its ``connection_retry`` policy runs out, or authentication fails
  on a reconnect, the loop ends without ``_stopped`` being set; the state stays LOST and the
  client never connects again unless it is restarted.

:data:`PRIVATE_HOOKS` lists every attribute used here; ``tests/unit/test_lease_clock.py`` checks
that the installed kazoo still has them, so an upgrade that removes one fails loudly in the tests.

**Shapes checked before use.** The two speed hooks that have a public way round them are checked
once per process, when the first client is prepared (:func:`hook_that_differs`): the parameters
of ``KazooClient._call`` (the contender create) and of ``ConnectionHandler._read`` and ``_write``
(the socket I/O). If one differs from what this module was written against, the contender create
goes through ``client.create_async`` and clients keep kazoo's own socket I/O, and one warning per
process names the hook and kazoo's version. The other hooks have no public equivalent: their
presence is checked by the tests and their behaviour by the contract tests.

``tests/recipes/test_kazoo_contract.py`` exercises the client's request path with
:func:`use_direct_socket_io`'s socket I/O on a real ZooKeeper (answers paired under concurrency,
reconnects, a stop); ``make test-kazoo`` runs it against every supported kazoo minor version.
"""

from __future__ import annotations

import inspect
import logging
import socket
import threading
import weakref
from importlib.metadata import version
from typing import Any, ClassVar, Final

from kazoo.client import KazooClient
from kazoo.exceptions import EXCEPTIONS, KazooException, RolledBackError, RuntimeInconsistency
from kazoo.protocol.connection import ConnectionHandler
from kazoo.protocol.serialization import (
    Connect,
    Create2,
    MultiHeader,
    ZnodeStat,
    int_struct,
    long_struct,
    multiheader_struct,
    read_string,
    stat_struct,
    write_string,
)
from kazoo.security import ACL, OPEN_ACL_UNSAFE

from celery_zklock.zk.handler import DirectSocketConnection, PollingThreadingHandler

#: (object, attribute) pairs of kazoo's private API this module relies on.
PRIVATE_HOOKS: Final[tuple[tuple[str, str], ...]] = (
    ("ConnectionHandler", "_invoke"),
    ("ConnectionHandler", "_socket"),
    ("KazooClient", "_call"),
    ("KazooClient", "_session_timeout"),
    ("KazooClient", "_data_watchers"),
    ("KazooClient", "_stopped"),
    ("KazooClient", "_connection"),
    ("ConnectionHandler", "_read"),
    ("ConnectionHandler", "_write"),
    ("ConnectionHandler", "connection_stopped"),
    ("ConnectionHandler", "_connection_routine"),
)

#: ZooKeeper's CreateMode.CONTAINER flag.
CONTAINER_FLAGS: Final = 4
#: ZooKeeper's CreateMode.PERSISTENT_WITH_TTL flag.
TTL_FLAGS: Final = 5
#: ZooKeeper's CreateMode.PERSISTENT_SEQUENTIAL_WITH_TTL flag.
TTL_SEQUENTIAL_FLAGS: Final = 6
#: RemoveWatches watcher types (org.apache.zookeeper.Watcher.WatcherType).
DATA_WATCHES: Final = 2
_NEGOTIATED_ATTR: Final = "_zklock_negotiated_timeout"
_HANDSHAKE_WAIT_ATTR: Final = "_zklock_handshake_wait"

#: The parameters each checked hook had when this module was written (kazoo 2.9 to 2.11).
HOOK_SHAPES: Final[tuple[tuple[type, str, tuple[str, ...]], ...]] = (
    (KazooClient, "_call", ("self", "request", "async_object")),
    (ConnectionHandler, "_read", ("self", "length", "timeout")),
    (ConnectionHandler, "_write", ("self", "msg", "timeout")),
)

logger = logging.getLogger("celery_zklock.locks.adapter")  # its name before the move
_hook_lock = threading.Lock()
_hook_installed = False
_shape_checked = False
_differing: str | None = None


def hook_that_differs() -> str | None:
    """The first checked hook (``"KazooClient._call"``, say) whose parameters differ from
    :data:`HOOK_SHAPES` in the installed kazoo, or None. Checked once per process; the first
    difference found is logged once as a warning, and the callers take kazoo's public path."""
    global _shape_checked, _differing
    if _shape_checked:
        return _differing
    with _hook_lock:
        if not _shape_checked:
            for owner, name, expected in HOOK_SHAPES:
                found = tuple(
                    inspect.signature(getattr(owner, name, None) or (lambda: None)).parameters
                )
                if found != expected:
                    _differing = f"{owner.__name__}.{name}"
                    logger.warning(
                        "kazoo %s: %s takes %s, not %s as celery-zklock expects; using kazoo's "
                        "public path instead (correct, a little slower)",
                        version("kazoo"), _differing, found, expected,
                    )  # fmt: skip
                    break
            _shape_checked = True
    return _differing


def install_connect_hook() -> None:
    """Record every negotiated session timeout on its connection object, and wait for a
    handshake's answer no longer than its connection's :func:`limit_handshake_wait` (idempotent).
    """
    global _hook_installed
    with _hook_lock:
        if _hook_installed:
            return
        original = ConnectionHandler._invoke

        def _invoke(self: Any, timeout: float, request: Any, xid: Any = None) -> Any:
            if isinstance(request, Connect):
                timeout = min(timeout, getattr(self, _HANDSHAKE_WAIT_ATTR, timeout))
            result = original(self, timeout, request, xid)
            if isinstance(request, Connect) and isinstance(result, tuple) and result:
                response = result[0]
                time_out = getattr(response, "time_out", 0)
                if time_out and time_out > 0:
                    setattr(self, _NEGOTIATED_ATTR, time_out / 1000.0)
            return result

        _invoke.__wrapped__ = original  # type: ignore[attr-defined]
        ConnectionHandler._invoke = _invoke
        _hook_installed = True


install_connect_hook()


def limit_handshake_wait(client: KazooClient, seconds: float) -> None:
    """Make ``client`` give up a connection whose server has not answered its handshake within
    ``seconds`` (kazoo's wait is the session timeout over the number of hosts, if shorter it
    stays); kazoo then tries again on its reconnect schedule."""
    setattr(client._connection, _HANDSHAKE_WAIT_ATTR, seconds)


def use_direct_socket_io(client: KazooClient) -> bool:
    """Give a not yet started threading ``client`` socket I/O that polls only when the socket
    would block (:class:`~celery_zklock.zk.handler.DirectSocketConnection`). True if it now
    has it; False (unchanged) for a started client or another connection class."""
    connection = client._connection
    if type(connection) is DirectSocketConnection:
        return True
    if hook_that_differs() is not None:
        return False
    if (
        type(connection) is not ConnectionHandler
        or not isinstance(client.handler, PollingThreadingHandler)
        or not client._stopped.is_set()
    ):
        return False
    # Same object, other methods: _read and _write try the socket before they poll.
    connection.__class__ = DirectSocketConnection
    return True


def requested_timeout(client: KazooClient) -> float:
    """The session timeout ``client`` asks the server for, in seconds."""
    return float(client._session_timeout) / 1000.0


def negotiated_timeout(client: KazooClient) -> float | None:
    """The session timeout the server granted on ``client``'s latest connection, in seconds;
    ``None`` if no handshake was seen since :func:`install_connect_hook` ran."""
    value = getattr(client._connection, _NEGOTIATED_ATTR, None)
    return float(value) if value else None


def force_reconnect(client: KazooClient) -> bool:
    """Make ``client`` drop its connection and reconnect (the session survives: kazoo
    reconnects with its session id and password). True if a connection was dropped."""
    sock = getattr(client._connection, "_socket", None)
    if sock is None:
        return False
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        return False
    return True


def is_closed(client: KazooClient) -> bool:
    """True if ``client`` cannot send at all: never started, stopped or closed."""
    return bool(client._stopped.is_set())


def connection_gave_up(client: KazooClient) -> bool:
    """True if the connection loop of a started ``client`` ended by itself (its
    ``connection_retry`` policy ran out, or authentication failed on a reconnect): it will not
    connect again unless it is restarted. False while it runs or is being started."""
    connection = client._connection
    if not connection.connection_stopped.is_set():
        return False
    # The event is also set between start() and the first step of a new loop: the loop's
    # routine (a thread or greenlet) tells a loop that ended from one that has not begun.
    routine = connection._connection_routine
    if routine is None:
        return False
    is_alive = getattr(routine, "is_alive", None)  # threads; gevent's greenlets have ready()
    return not (is_alive() if is_alive is not None else not routine.ready())


def discard_data_watcher(client: KazooClient, path: str, callback: Any) -> None:
    """Forget a client-side data watcher that did not fire (the server's is removed apart)."""
    chroot = client.chroot
    watchers = client._data_watchers.get(chroot + path if chroot else path)
    if watchers is not None:
        watchers.discard(callback)


class CreateContainer(Create2):  # type: ignore[misc]
    """``createContainer`` (opcode 19): a parent the server deletes once its last child is gone.

    ``create2`` under another opcode: the body is a CreateRequest (with the CONTAINER flag) and
    the response a Create2Response (path and stat), which kazoo's ``Create2`` writes and reads.
    """

    type: ClassVar[int] = 19


class CreateTTL:
    """``createTTL`` (opcode 21): a persistent node the server deletes once it has had no child
    and no change for ``ttl`` milliseconds. The body is a CreateRequest plus the TTL (a long);
    the response a Create2Response."""

    type: ClassVar[int] = 21

    def __init__(self, path: str, data: bytes, acl: list[ACL], flags: int, ttl_ms: int) -> None:
        self.path = path
        self.data = data
        self.acl = acl
        self.flags = flags
        self.ttl_ms = ttl_ms

    def serialize(self) -> bytearray:
        body: bytearray = Create2(self.path, self.data, self.acl, self.flags).serialize()
        body.extend(long_struct.pack(self.ttl_ms))
        return body

    @classmethod
    def deserialize(cls, data: bytes, offset: int) -> tuple[str, ZnodeStat]:
        return Create2.deserialize(data, offset)  # type: ignore[no-any-return]


class RemoveWatches:
    """``removeWatches`` (opcode 18): drop this session's watches of one type on one path."""

    type: ClassVar[int] = 18

    def __init__(self, path: str, watcher_type: int) -> None:
        self.path = path
        self.watcher_type = watcher_type

    def serialize(self) -> bytearray:
        body = bytearray()
        body.extend(write_string(self.path))
        body.extend(int_struct.pack(self.watcher_type))
        return body

    @classmethod
    def deserialize(cls, data: bytes, offset: int) -> None:
        return None


#: ZooKeeper's CreateMode.EPHEMERAL_SEQUENTIAL flags.
EPHEMERAL_SEQUENTIAL_FLAGS: Final = 3


def create_node_async(client: Any, path: str, data: bytes) -> Any:
    """Send a ``create2`` of an ephemeral sequential node at ``path`` (the server appends the
    sequence number); kazoo's async result gives ``(full path, stat)``: pass the path through
    ``client.unchroot``. The same request as ``client.create_async(path, data,
    ephemeral=True, sequence=True, include_data=True)``, answered on the connection thread."""
    result = client.handler.async_result()
    if hook_that_differs() is not None:
        chroot = client.chroot or ""

        def made(created: Any) -> None:
            try:
                node, stat = created.get(block=False)
            except Exception as exc:
                result.set_exception(exc)
            else:
                result.set((chroot + node, stat))

        client.create_async(path, data, ephemeral=True, sequence=True, include_data=True).rawlink(
            made
        )
        return result
    request = Create2(
        client.chroot + path if client.chroot else path,
        data,
        list(client.default_acl or OPEN_ACL_UNSAFE),
        EPHEMERAL_SEQUENTIAL_FLAGS,
    )
    client._call(request, result)
    return result


class CreateWithParent(tuple[CreateContainer, Create2]):
    """A ``multi`` (opcode 14) of ``createContainer`` for a parent and ``create2`` for a node
    under it, made from the pair of them: both are made, or neither. Its answer is one entry per
    operation: ``(full path, stat)``, or the exception of the operation that failed (the other
    one's is ``RolledBackError``)."""

    type: ClassVar[int] = 14

    def serialize(self) -> bytearray:
        body = bytearray()
        for operation in self:
            body.extend(MultiHeader(operation.type, False, -1).serialize())
            body.extend(operation.serialize())
        body.extend(multiheader_struct.pack(-1, True, -1))
        return body

    @classmethod
    def deserialize(
        cls, data: bytes, offset: int
    ) -> list[tuple[str, ZnodeStat | None] | KazooException]:
        results: list[tuple[str, ZnodeStat | None] | KazooException] = []
        header, offset = MultiHeader.deserialize(data, offset)
        while not header.done:
            if header.type == -1:  # an ErrorResult: the operation's error code
                code = int_struct.unpack_from(data, offset)[0]
                offset += int_struct.size
                results.append(EXCEPTIONS[code]())
            else:  # create2 and createContainer answer a path and a stat (create: a path)
                path, offset = read_string(data, offset)
                stat = None
                if header.type != 1:
                    stat = ZnodeStat._make(stat_struct.unpack_from(data, offset))
                    offset += stat_struct.size
                results.append((path, stat))
            header, offset = MultiHeader.deserialize(data, offset)
        return results


def create_node_and_parent_async(client: Any, parent: str, path: str, data: bytes) -> Any:
    """Send one ``multi``: the container ``parent`` and, under it, an ephemeral sequential node
    at ``path`` (as :func:`create_node_async`). Pass kazoo's async result to
    :func:`created_with_parent`."""
    result = client.handler.async_result()
    acl = list(client.default_acl or OPEN_ACL_UNSAFE)
    chroot = client.chroot or ""
    request = CreateWithParent(
        (
            CreateContainer(chroot + parent, b"", acl, CONTAINER_FLAGS),
            Create2(chroot + path, data, acl, EPHEMERAL_SEQUENTIAL_FLAGS),
        )
    )
    client._call(request, result)
    return result


def created_with_parent(answer: Any) -> tuple[str, int | None]:
    """The node's ``(full path, czxid)`` from a :class:`CreateWithParent` answer; raises the
    error of the operation that failed (``NodeExistsError``: the parent was there, so nothing
    was made; ``NoNodeError``: the parent's parent was not).

    ZooKeeper answers the node's create inside a ``multi`` with its path only, but every node a
    ``multi`` makes gets the transaction's one zxid: the parent's ``czxid`` is the node's (None
    if no stat came at all; then read the node's).
    """
    if not isinstance(answer, list) or len(answer) != 2:
        raise TypeError(f"not an answer to CreateWithParent: {answer!r}")
    parent, node = answer
    if isinstance(parent, KazooException) or isinstance(node, KazooException):
        # The other is marked rolled back, or inconsistent after the failure.
        failures = [entry for entry in answer if isinstance(entry, KazooException)]
        causes = [e for e in failures if not isinstance(e, _FOLLOW_ON_ERRORS)]
        raise (causes or failures)[0]
    (_, parent_stat), (node_path, node_stat) = parent, node
    stat = node_stat or parent_stat
    return node_path, (stat.czxid if stat is not None else None)


_FOLLOW_ON_ERRORS: Final = (RolledBackError, RuntimeInconsistency)


def create_container_async(client: Any, path: str, acl: list[ACL] | None = None) -> Any:
    """Send ``createContainer`` for ``path``; returns kazoo's async result (path, stat)."""
    result = client.handler.async_result()
    request = CreateContainer(
        client.chroot + path if client.chroot else path,
        b"",
        list(acl if acl is not None else (client.default_acl or OPEN_ACL_UNSAFE)),
        CONTAINER_FLAGS,
    )
    client._call(request, result)
    return result


def create_ttl_async(
    client: Any,
    path: str,
    data: bytes,
    ttl_ms: int,
    acl: list[ACL] | None = None,
    *,
    sequential: bool = False,
) -> Any:
    """Send ``createTTL`` for ``path`` (with ``sequential``, the server appends the sequence
    number); returns kazoo's async result (full path, stat): pass the path through
    ``client.unchroot``. The server answers ``UnimplementedError`` when TTL nodes are not
    enabled on it (remember it with :func:`note_no_ttl_nodes`)."""
    result = client.handler.async_result()
    request = CreateTTL(
        client.chroot + path if client.chroot else path,
        data,
        list(acl if acl is not None else (client.default_acl or OPEN_ACL_UNSAFE)),
        TTL_SEQUENTIAL_FLAGS if sequential else TTL_FLAGS,
        ttl_ms,
    )
    client._call(request, result)
    return result


_no_ttl_nodes: weakref.WeakSet[Any] = weakref.WeakSet()


def note_no_ttl_nodes(client: Any) -> None:
    """Remember that ``client``'s server answered ``createTTL`` with ``Unimplemented``."""
    _no_ttl_nodes.add(client)


def has_ttl_nodes(client: Any) -> bool:
    """False once ``client``'s server refused a ``createTTL`` (:func:`note_no_ttl_nodes`)."""
    return client not in _no_ttl_nodes


def remove_data_watches_async(client: Any, path: str) -> Any:
    """Send ``removeWatches`` for this session's data watches on ``path``."""
    result = client.handler.async_result()
    full = client.chroot + path if client.chroot else path
    client._call(RemoveWatches(full, DATA_WATCHES), result)
    return result
