"""``poll_select``: kazoo's ``select`` contract with one ``poll`` call (kazoo_handler).

Checked on real sockets against what kazoo's own ``selector_select`` answers for the same
question, so the connection thread sees no difference.
"""

from __future__ import annotations

import socket
from collections.abc import Iterator

import pytest
from kazoo.handlers.utils import selector_select

from celery_zklock.zk.client import _make_handler
from celery_zklock.zk.handler import PollingThreadingHandler, poll_select


@pytest.fixture
def pair() -> Iterator[tuple[socket.socket, socket.socket]]:
    left, right = socket.socketpair()
    try:
        yield left, right
    finally:
        left.close()
        right.close()


def both(rlist: list[object], wlist: list[object], timeout: float) -> tuple[object, object]:
    return poll_select(rlist, wlist, [], timeout), selector_select(rlist, wlist, [], timeout)


def test_nothing_to_read_times_out_empty(pair: tuple[socket.socket, socket.socket]) -> None:
    left, _ = pair
    ours, kazoos = both([left], [], 0.01)
    assert ours == kazoos == ([], [], [])


def test_a_byte_makes_the_socket_readable(pair: tuple[socket.socket, socket.socket]) -> None:
    left, right = pair
    other_left, other_right = socket.socketpair()
    try:
        right.send(b"\0")
        ours, kazoos = both([other_left, left], [], 1.0)
        assert ours == kazoos == ([left], [], [])
    finally:
        other_left.close()
        other_right.close()


def test_a_socket_with_room_is_writable(pair: tuple[socket.socket, socket.socket]) -> None:
    left, _ = pair
    ours, kazoos = both([], [left], 1.0)
    assert ours == kazoos == ([], [left], [])


def test_a_closed_peer_makes_the_socket_readable(
    pair: tuple[socket.socket, socket.socket],
) -> None:
    left, right = pair
    right.close()
    ours, _ = both([left], [], 1.0)
    assert ours == ([left], [], [])  # the read that follows finds the end of the stream
    assert left.recv(1) == b""


def test_file_descriptors_are_accepted_and_returned_as_given(
    pair: tuple[socket.socket, socket.socket],
) -> None:
    left, right = pair
    right.send(b"\0")
    assert poll_select([left.fileno()], [], [], 1.0) == ([left.fileno()], [], [])


def test_bad_timeouts_are_refused_as_kazoo_refuses_them(
    pair: tuple[socket.socket, socket.socket],
) -> None:
    left, _ = pair
    for select in (poll_select, selector_select):
        with pytest.raises(ValueError, match="non-negative"):
            select([left], [], [], -1)
        with pytest.raises(TypeError, match="number"):
            select([left], [], [], "1")  # type: ignore[arg-type]


def test_the_library_s_threading_clients_use_it() -> None:
    handler = _make_handler("threading")
    assert isinstance(handler, PollingThreadingHandler)
