"""``DirectSocketConnection.send_now``: when a request is written by the thread that makes it,
and what it leaves for kazoo's connection thread (kazoo_handler). On a real socket pair, with a
stand-in for the two queues of kazoo's client; tests/recipes/test_direct_sends.py runs the same
path against a real ZooKeeper."""

from __future__ import annotations

import logging
import socket
import struct
import threading
from collections import deque
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
from kazoo.client import KazooClient
from kazoo.protocol.connection import ConnectionHandler
from kazoo.protocol.serialization import Auth, CloseInstance, Exists

from celery_zklock import kazoo_handler
from celery_zklock.config import ClientConfig
from celery_zklock.kazoo_handler import (
    DirectSendClient,
    DirectSocketConnection,
    PollingThreadingHandler,
)
from celery_zklock.locks import adapter
from celery_zklock.session import new_client


@pytest.fixture
def conn() -> Iterator[tuple[DirectSocketConnection, socket.socket]]:
    """A connection after its handshake (direct sends on, xid 0) and the server's end."""
    ours, peer = socket.socketpair()
    ours.setblocking(False)
    peer.settimeout(5)
    connection = DirectSocketConnection.__new__(DirectSocketConnection)
    connection.handler = PollingThreadingHandler()
    connection.logger = logging.getLogger("test.direct_sends")
    connection.client = SimpleNamespace(_queue=deque(), _pending=deque())
    connection._socket = ours
    connection._xid = 0
    connection.enable_direct_sends()
    connection._direct_sends = True
    connection._send_timeout = 1.0
    try:
        yield connection, peer
    finally:
        ours.close()
        peer.close()


def _nothing_written(peer: socket.socket) -> bool:
    peer.setblocking(False)
    try:
        return peer.recv(1) == b""
    except BlockingIOError:
        return True


def test_a_request_is_written_whole_after_it_awaits_its_answer(
    conn: tuple[DirectSocketConnection, socket.socket],
) -> None:
    connection, peer = conn
    request, result = Exists("/a", None), object()
    assert connection.send_now(request, result) is True
    body = bytes(request.serialize())
    length, xid, opcode = struct.unpack("!iii", peer.recv(12))
    assert (length, xid, opcode) == (len(body) + 8, 1, Exists.type)
    assert peer.recv(len(body)) == body
    assert list(connection.client._pending) == [(request, result, 1)]
    assert connection.send_now(Exists("/b", None), object()) is True
    assert struct.unpack("!iii", peer.recv(12))[1] == 2  # the next xid


def test_nothing_is_written_ahead_of_kazoo_s_queue(
    conn: tuple[DirectSocketConnection, socket.socket],
) -> None:
    connection, peer = conn
    connection.client._queue.append((Exists("/first", None), object()))
    assert connection.send_now(Exists("/second", None), object()) is False
    assert _nothing_written(peer)
    assert not connection.client._pending and connection._xid == 0


@pytest.mark.parametrize(
    "request_",
    [Auth(0, "digest", "u:p"), CloseInstance, object()],
    ids=["auth", "close", "kazoo-test-sentinel"],
)
def test_requests_only_the_connection_thread_sends_go_to_the_queue(
    conn: tuple[DirectSocketConnection, socket.socket], request_: Any
) -> None:
    connection, peer = conn
    assert connection.send_now(request_, object()) is False
    assert _nothing_written(peer) and not connection.client._pending


def test_before_a_handshake_or_without_the_lock_kazoo_s_path_is_taken(
    conn: tuple[DirectSocketConnection, socket.socket],
) -> None:
    connection, peer = conn
    connection.stop_direct_sends()
    assert connection.send_now(Exists("/a", None), object()) is False
    connection._direct_sends = True
    connection._send_lock = None  # a connection that never had enable_direct_sends
    assert connection.send_now(Exists("/a", None), object()) is False
    assert _nothing_written(peer) and not connection.client._pending


def test_a_request_that_cannot_be_serialised_raises_and_sends_nothing(
    conn: tuple[DirectSocketConnection, socket.socket],
) -> None:
    connection, peer = conn

    class Unwritable(Exists):  # type: ignore[misc]
        def serialize(self) -> bytearray:
            raise ValueError("cannot be written")

    with pytest.raises(ValueError, match="cannot be written"):
        connection.send_now(Unwritable("/a", None), object())
    assert _nothing_written(peer)
    assert not connection.client._pending and connection._xid == 0


def test_a_failed_write_ends_the_connection_and_leaves_the_request_to_be_failed(
    conn: tuple[DirectSocketConnection, socket.socket],
) -> None:
    connection, peer = conn
    peer.close()
    request, result = Exists("/a", None), object()
    assert connection.send_now(request, result) is True  # taken: the connection thread fails it
    assert list(connection.client._pending) == [(request, result, 1)]
    assert connection._direct_sends is False
    assert connection._socket.recv(1) == b""  # shut down: the connection thread's read fails
    assert connection.send_now(Exists("/b", None), object()) is False


def test_an_interruption_during_the_write_ends_the_connection_and_is_raised(
    conn: tuple[DirectSocketConnection, socket.socket],
) -> None:
    connection, peer = conn

    def interrupted(msg: bytes, timeout: float) -> None:
        peer.settimeout(None)
        connection._socket.send(msg[:6])  # part of the request is on the wire
        raise KeyboardInterrupt

    connection._write = interrupted  # type: ignore[method-assign]
    with pytest.raises(KeyboardInterrupt):
        connection.send_now(Exists("/a", None), object())
    assert connection._direct_sends is False
    assert len(connection.client._pending) == 1  # failed by the connection thread, as it drops
    assert len(peer.recv(6)) == 6 and peer.recv(1) == b""  # shut down: the server sees the end


def test_stopping_waits_for_a_write_in_progress(
    conn: tuple[DirectSocketConnection, socket.socket],
) -> None:
    connection, _ = conn
    lock = connection._send_lock
    assert lock is not None
    lock.acquire()  # a write in progress
    stopped = threading.Event()
    stopper = threading.Thread(target=lambda: (connection.stop_direct_sends(), stopped.set()))
    stopper.start()
    assert not stopped.wait(0.2)
    lock.release()
    assert stopped.wait(5)
    stopper.join()
    assert connection._direct_sends is False


def test_sending_a_close_stops_direct_sends(
    conn: tuple[DirectSocketConnection, socket.socket],
) -> None:
    connection, peer = conn
    wake_read, wake_write = socket.socketpair()
    try:
        connection._read_sock = wake_read
        wake_write.send(b"\0")
        connection.client._queue.append((CloseInstance, None))
        connection._send_request(1.0, 1.0)
        assert connection._direct_sends is False
        assert struct.unpack("!iii", peer.recv(12))[2] == CloseInstance.type
        assert connection.send_now(Exists("/a", None), object()) is False
    finally:
        wake_read.close()
        wake_write.close()


@pytest.mark.parametrize("send", ["queued request", "ping"])
def test_the_connection_thread_s_writes_wait_for_a_direct_write_in_progress(
    conn: tuple[DirectSocketConnection, socket.socket], send: str
) -> None:
    """A queued request's xid and its place among those awaiting an answer, and a ping's
    bytes, must not interleave with a direct write: kazoo's writes take the same lock."""
    connection, peer = conn
    wake_read, wake_write = socket.socketpair()
    lock = connection._send_lock
    assert lock is not None
    try:
        connection._read_sock = wake_read
        connection._ro_mode = None
        connection.ping_outstanding = threading.Event()
        wake_write.send(b"\0")
        connection.client._queue.append((Exists("/queued", None), object()))
        if send == "ping":
            target = lambda: connection._send_ping(1.0)  # noqa: E731
        else:
            target = lambda: connection._send_request(1.0, 1.0)  # noqa: E731
        lock.acquire()  # a direct write in progress
        writer = threading.Thread(target=target)
        writer.start()
        writer.join(0.3)
        assert writer.is_alive() and _nothing_written(peer)
        lock.release()
        writer.join(5)
        peer.setblocking(True)
        assert len(peer.recv(12)) == 12  # written once the lock was free
    finally:
        if lock.locked():
            lock.release()
        wake_read.close()
        wake_write.close()


def test_the_library_s_clients_send_directly_and_others_keep_kazoo_s_path() -> None:
    client = new_client(ClientConfig(hosts="127.0.0.1:1"))
    assert type(client) is DirectSendClient
    assert client._connection._send_lock is not None

    class Custom(KazooClient):  # type: ignore[misc]
        pass

    custom = Custom("127.0.0.1:1", handler=PollingThreadingHandler())
    assert adapter.use_direct_socket_io(custom) is True  # the socket I/O, not the sends
    assert type(custom) is Custom and custom._connection._send_lock is None


# --- The shape check (adapter.write_path_hooks_differ) ----------------------------------------


@pytest.fixture
def fresh_check(monkeypatch: pytest.MonkeyPatch) -> None:
    """The shape check and its one warning, as in a process that has not run them yet."""
    monkeypatch.setattr(adapter, "_checked", False)
    monkeypatch.setattr(kazoo_handler, "_differing_hook", None)


def test_the_installed_kazoo_has_the_write_path_the_direct_sends_rely_on() -> None:
    assert adapter._check_write_path() is None


def test_a_pending_entry_of_another_shape_is_found(monkeypatch: pytest.MonkeyPatch) -> None:
    original = ConnectionHandler._send_request

    def _send_request(self: Any, read_timeout: float, connect_timeout: float) -> None:
        original(self, read_timeout, connect_timeout)
        self.client._pending.append((*self.client._pending.pop(), "priority"))

    monkeypatch.setattr(ConnectionHandler, "_send_request", _send_request)
    found = adapter._check_write_path()
    assert found is not None and found[0] == "KazooClient._pending"


def test_an_answer_paired_another_way_is_found(monkeypatch: pytest.MonkeyPatch) -> None:
    original = ConnectionHandler._read_response

    def _read_response(self: Any, header: Any, buffer: bytes, offset: int) -> Any:
        self.client._pending.appendleft(self.client._pending[0])  # kazoo pops twice, say
        return original(self, header, buffer, offset)

    monkeypatch.setattr(ConnectionHandler, "_read_response", _read_response)
    found = adapter._check_write_path()
    assert found is not None and found[0] == "ConnectionHandler._read_response"


def test_a_request_written_another_way_is_found(monkeypatch: pytest.MonkeyPatch) -> None:
    original = ConnectionHandler._write

    def _write(self: Any, msg: bytes, timeout: float) -> None:
        original(self, msg + b"\0", timeout)

    monkeypatch.setattr(ConnectionHandler, "_write", _write)
    found = adapter._check_write_path()
    assert found is not None and found[0] == "ConnectionHandler._send_request"


@pytest.mark.parametrize(
    ("owner", "name"),
    [(KazooClient, "_call"), (ConnectionHandler, "_send_ping"), (ConnectionHandler, "_connect")],
)
def test_a_method_with_other_parameters_is_found(
    monkeypatch: pytest.MonkeyPatch, owner: type, name: str
) -> None:
    monkeypatch.setattr(owner, name, lambda self, *args: None)
    found = adapter._check_write_path()
    assert found is not None and found[0] == f"{owner.__name__}.{name}"


def test_an_attribute_of_another_type_is_found(monkeypatch: pytest.MonkeyPatch) -> None:
    original = KazooClient.__init__

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        self._pending = list(self._pending)

    monkeypatch.setattr(KazooClient, "__init__", __init__)
    assert adapter._check_write_path() == ("KazooClient._pending", "is list")


@pytest.mark.usefixtures("fresh_check")
def test_a_hook_that_differs_gives_new_clients_kazoo_s_path_and_one_warning(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(ConnectionHandler, "_send_ping", lambda self, timeout: None)
    caplog.set_level(logging.WARNING, logger="celery_zklock")
    clients = [new_client(ClientConfig(hosts="127.0.0.1:1")) for _ in range(3)]
    assert [type(c) for c in clients] == [KazooClient] * 3
    assert [type(c._connection) for c in clients] == [ConnectionHandler] * 3
    assert not adapter.direct_writes()
    (record,) = [r for r in caplog.records if r.name.startswith("celery_zklock")]
    assert "ConnectionHandler._send_ping" in record.getMessage()
    assert f"kazoo {adapter.kazoo_version()}" in record.getMessage()


@pytest.mark.usefixtures("fresh_check")
def test_direct_writes_can_be_turned_off_for_new_clients(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(adapter, "_direct_writes", True)
    adapter.set_direct_writes(False)
    off = new_client(ClientConfig(hosts="127.0.0.1:1"))
    adapter.set_direct_writes(True)
    on = new_client(ClientConfig(hosts="127.0.0.1:1"))
    assert type(off) is KazooClient and type(off._connection) is DirectSocketConnection
    assert off._connection._send_lock is None  # never writes on its callers' threads
    assert type(on) is DirectSendClient
