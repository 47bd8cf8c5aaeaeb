"""``DirectSocketConnection``: kazoo's ``_read``/``_write`` contract, polling only when the
socket would block (kazoo_handler). On real non-blocking sockets, with the peer reading or
writing slowly, closing mid-message, or going silent."""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator
from typing import Any

import pytest
from kazoo.client import KazooClient
from kazoo.exceptions import ConnectionDropped
from kazoo.handlers.threading import KazooTimeoutError
from kazoo.protocol.connection import ConnectionHandler

from celery_zklock.zk import adapter
from celery_zklock.zk.client import new_client
from celery_zklock.zk.handler import DirectSocketConnection, PollingThreadingHandler
from celery_zklock.zk.settings import ClientConfig


class _Counting(PollingThreadingHandler):
    """Counts the polls the connection makes (the slow path) and tells of the first."""

    def __init__(self) -> None:
        super().__init__()
        self.reads = self.writes = 0
        self.polled = threading.Event()

    def select(self, rlist: Any, wlist: Any, xlist: Any, timeout: Any = None) -> Any:
        self.reads += bool(rlist)
        self.writes += bool(wlist)
        self.polled.set()
        return super().select(rlist, wlist, xlist, timeout)


@pytest.fixture
def conn() -> Iterator[tuple[DirectSocketConnection, socket.socket]]:
    ours, peer = socket.socketpair()
    ours.setblocking(False)
    connection = DirectSocketConnection.__new__(DirectSocketConnection)
    connection.handler = _Counting()
    connection._socket = ours
    try:
        yield connection, peer
    finally:
        ours.close()
        peer.close()


def test_a_reply_already_there_is_read_without_a_poll(
    conn: tuple[DirectSocketConnection, socket.socket],
) -> None:
    connection, peer = conn
    peer.sendall(b"\x00\x00\x00\x05hello")
    assert connection._read(4, 1.0) == b"\x00\x00\x00\x05"
    assert connection._read(5, 1.0) == b"hello"
    assert connection.handler.reads == 0


def test_a_reply_that_arrives_in_pieces_is_read_whole(
    conn: tuple[DirectSocketConnection, socket.socket],
) -> None:
    connection, peer = conn
    body = bytes(range(256)) * 4000  # 1 MB
    peer.sendall(body[:1000])

    def send_the_rest() -> None:  # once the reader waits for it
        if connection.handler.polled.wait(10):
            peer.sendall(body[1000:])

    sender = threading.Thread(target=send_the_rest)
    sender.start()
    assert connection._read(len(body), 10.0) == body
    sender.join()
    assert connection.handler.reads >= 1  # it waited for the rest


def test_a_message_larger_than_the_send_buffer_is_written_whole(
    conn: tuple[DirectSocketConnection, socket.socket],
) -> None:
    connection, peer = conn
    msg = bytes(range(256)) * 4000  # 1 MB, more than the socket buffers hold
    received = bytearray()

    def read_all() -> None:  # once the writer waits for room
        if not connection.handler.polled.wait(10):
            return
        while len(received) < len(msg):
            chunk = peer.recv(65536)
            if not chunk:
                return
            received.extend(chunk)

    reader = threading.Thread(target=read_all)
    reader.start()
    connection._write(msg, 5.0)
    reader.join(10)
    assert bytes(received) == msg
    assert connection.handler.writes >= 1  # the buffer filled: it waited to write the rest


def test_a_peer_closing_mid_message_is_a_dropped_connection(
    conn: tuple[DirectSocketConnection, socket.socket],
) -> None:
    connection, peer = conn
    peer.sendall(b"abc")
    peer.close()
    with pytest.raises(ConnectionDropped, match="broken"):
        connection._read(10, 1.0)


def test_writing_to_a_closed_peer_is_a_dropped_connection(
    conn: tuple[DirectSocketConnection, socket.socket],
) -> None:
    connection, peer = conn
    peer.close()
    with pytest.raises(ConnectionDropped, match="socket connection error"):
        connection._write(b"x" * 1_000_000, 1.0)


def test_a_silent_peer_is_a_time_out_as_in_kazoo(
    conn: tuple[DirectSocketConnection, socket.socket],
) -> None:
    connection, _ = conn
    with pytest.raises(KazooTimeoutError, match="during read"):
        connection._read(4, 0.05)


def test_a_closed_socket_is_a_dropped_connection(
    conn: tuple[DirectSocketConnection, socket.socket],
) -> None:
    connection, _ = conn
    connection._socket.close()
    for call in (lambda: connection._read(4, 0.05), lambda: connection._write(b"x", 0.05)):
        with pytest.raises(ConnectionDropped):
            call()


def test_the_library_s_threading_clients_get_it_and_others_do_not() -> None:
    client = new_client(ClientConfig(hosts="127.0.0.1:1"))
    assert type(client._connection) is DirectSocketConnection
    assert type(client) is KazooClient  # kazoo's own client: requests take its write path
    gevent_like = KazooClient("127.0.0.1:1")  # kazoo's own handler: left as it is
    assert adapter.use_direct_socket_io(gevent_like) is False
    assert type(gevent_like._connection) is ConnectionHandler
