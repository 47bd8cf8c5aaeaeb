"""The library's clients write each request on the thread that makes it
(``DirectSendClient``), on a real ZooKeeper: no request goes through kazoo's queue while the
connection is up, every thread's requests keep their order whichever path each one takes, and
a connection that drops, a write that fails or a stop leaves no request unanswered.
(tests/unit/test_direct_sends.py checks each decision of the write path on its own.)"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Iterator
from typing import Any

import pytest
from kazoo.client import KazooClient
from kazoo.exceptions import ConnectionClosedError, ConnectionDropped, ConnectionLoss
from kazoo.protocol.states import KazooState

from celery_zklock.config import ClientConfig
from celery_zklock.kazoo_handler import DirectSendClient
from celery_zklock.locks import adapter
from celery_zklock.session import new_client
from tests.lockutil import wait_for

#: How long one request may take to be answered or failed, even across a reconnect.
ANSWER_WITHIN = 20.0


@pytest.fixture
def client(zk_hosts: str) -> Iterator[KazooClient]:
    client = new_client(ClientConfig(hosts=zk_hosts, session_timeout=10.0))
    assert type(client) is DirectSendClient
    client.start(timeout=15)
    yield client
    client.stop()
    client.close()


def _states(client: KazooClient) -> list[KazooState]:
    states: list[KazooState] = []
    client.add_listener(states.append)
    return states


def test_requests_are_written_by_the_thread_that_makes_them(
    client: KazooClient, lock_root: str
) -> None:
    connection = client._connection
    queued: list[Any] = []
    original = connection._send_request

    def send_request(*args: Any) -> None:  # the connection thread, sending from kazoo's queue
        queued.append(client._queue[0][0] if client._queue else None)
        original(*args)

    connection._send_request = send_request
    try:
        client.ensure_path(lock_root)
        for _ in range(100):
            client.delete(client.create(f"{lock_root}/n-", sequence=True))
            assert client.exists(lock_root) is not None
    finally:
        del connection._send_request
    assert queued == []


def test_many_threads_on_both_paths_keep_every_thread_s_order(
    client: KazooClient, lock_root: str
) -> None:
    """Eight threads create sequential nodes while a ninth keeps turning direct sends off and
    on, so each thread's requests go now through kazoo's queue, now straight to the socket:
    the server must see every thread's creates in the order it made them."""
    states = _states(client)
    client.ensure_path(lock_root)
    connection = client._connection
    lock = connection._send_lock
    queued = [0]
    original = connection._send_request

    def send_request(*args: Any) -> None:
        queued[0] += 1
        original(*args)

    connection._send_request = send_request
    created: dict[int, list[str]] = {}
    errors: list[BaseException] = []
    start, done = threading.Barrier(9), threading.Event()

    def creator(thread: int) -> None:
        try:
            start.wait()
            results = []
            for i in range(300):
                # Thread 0 also turns direct sends off and on itself every 10 requests: the
                # toggler below may get no CPU at all on a loaded machine, and then one path
                # would take every request.
                if thread == 0 and i % 20 == 0:
                    connection.stop_direct_sends()
                elif thread == 0 and i % 20 == 10:
                    with lock:
                        connection._direct_sends = True
                results.append(
                    client.create_async(f"{lock_root}/n-", f"{thread}".encode(), sequence=True)
                )
            created[thread] = [r.get(timeout=ANSWER_WITHIN) for r in results]
        except BaseException as exc:
            errors.append(exc)

    def toggler() -> None:  # as a reconnect would, without dropping anything
        start.wait()
        while not done.wait(0.0005):
            connection.stop_direct_sends()
            done.wait(0.0005)
            with lock:
                connection._direct_sends = True

    threads = [threading.Thread(target=creator, args=(i,)) for i in range(8)]
    switcher = threading.Thread(target=toggler)
    for thread in [*threads, switcher]:
        thread.start()
    try:
        for thread in threads:
            thread.join(ANSWER_WITHIN * 3)
    finally:
        done.set()
        switcher.join()
        del connection._send_request
    assert errors == [] and len(created) == 8
    assert 0 < queued[0] < 8 * 300, "one path took every request: the test proves nothing"
    for thread, paths in created.items():
        sequence = [int(path.rsplit("-", 1)[1]) for path in paths]
        assert sequence == sorted(sequence), f"thread {thread}'s creates were reordered"
    assert len(client.get_children(lock_root)) == 8 * 300
    assert KazooState.SUSPENDED not in states and not client._pending


def test_a_connection_dropped_under_load_answers_or_fails_every_request(
    client: KazooClient, lock_root: str
) -> None:
    session, states = client.client_id, _states(client)
    client.ensure_path(lock_root)
    stop = threading.Event()
    outcomes: dict[str, int] = {"answered": 0, "lost": 0}
    errors: list[BaseException] = []
    count = threading.Lock()

    def load() -> None:
        while not stop.is_set():
            try:
                client.exists_async(lock_root).get(timeout=ANSWER_WITHIN)
                outcome = "answered"
            except ConnectionLoss:
                outcome = "lost"
            except BaseException as exc:
                errors.append(exc)
                return
            with count:
                outcomes[outcome] += 1

    threads = [threading.Thread(target=load) for _ in range(4)]
    for thread in threads:
        thread.start()
    try:
        for drop in range(1, 6):
            answered, suspended = 100 * drop, states.count(KazooState.SUSPENDED)
            wait_for(lambda a=answered: outcomes["answered"] > a, 30, "answers")
            assert adapter.force_reconnect(client)
            wait_for(
                lambda s=suspended: states.count(KazooState.SUSPENDED) > s and client.connected,
                30,
                "the client to drop and reconnect",
            )
    finally:
        stop.set()
        for thread in threads:
            thread.join(ANSWER_WITHIN * 2)
    assert errors == [] and not any(thread.is_alive() for thread in threads)
    assert outcomes["answered"] > 500
    assert client.exists(lock_root) is not None and client.client_id == session
    assert not client._pending and KazooState.LOST not in states


def test_a_write_that_fails_fails_its_request_and_the_client_reconnects(
    client: KazooClient, lock_root: str
) -> None:
    session, states = client.client_id, _states(client)
    client.ensure_path(lock_root)
    connection = client._connection
    caller = threading.get_ident()
    original = connection._write

    def write(msg: bytes, timeout: float) -> None:
        if threading.get_ident() == caller:
            del connection._write  # once
            original(msg[:6], timeout)  # part of the request is on the wire
            raise ConnectionDropped("injected: the write failed")
        original(msg, timeout)

    connection._write = write
    with pytest.raises(ConnectionLoss):
        client.exists_async(lock_root).get(timeout=ANSWER_WITHIN)
    wait_for(lambda: KazooState.SUSPENDED in states and client.connected, 30,
             "the client to reconnect")  # fmt: skip
    assert client.exists(lock_root) is not None
    assert client.client_id == session and not client._pending


def test_a_stop_under_load_settles_every_request(client: KazooClient, lock_root: str) -> None:
    client.ensure_path(lock_root)
    results: list[Any] = []
    lock = threading.Lock()
    stop = threading.Event()
    errors: list[BaseException] = []

    def load() -> None:  # up to 50 requests in flight per thread
        in_flight: deque[Any] = deque()
        while not stop.is_set():
            try:
                if len(in_flight) == 50:
                    in_flight.popleft().wait(ANSWER_WITHIN)
                result = client.exists_async(lock_root)
            except ConnectionClosedError:
                return  # kazoo refused it up front: the client is stopping
            except BaseException as exc:
                errors.append(exc)
                return
            in_flight.append(result)
            with lock:
                results.append(result)

    threads = [threading.Thread(target=load) for _ in range(4)]
    for thread in threads:
        thread.start()
    wait_for(lambda: len(results) > 500, 30, "requests in flight")
    with lock:
        # Only these: one made while kazoo's stop runs may be queued after kazoo failed its
        # queue (kazoo's own race, on its path as on ours).
        before_stop = list(results)
    client.stop()
    stop.set()
    for thread in threads:
        thread.join(ANSWER_WITHIN)
    assert errors == []
    for result in before_stop:
        result.wait(ANSWER_WITHIN)
        assert result.ready(), "a request was left unanswered by the stop"
