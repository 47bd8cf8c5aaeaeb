"""The contract of kazoo's private hooks the direct write path relies on (``locks/adapter.py``,
``kazoo_handler.DirectSendClient``), exercised for behaviour on a real ZooKeeper: ``_xid``,
``_pending``'s ``(request, async_object, xid)`` entries, ``_queue`` and ``_connect``'s answer
must pair every answer with its own request, under concurrency, across dropped connections and
through a stop. A kazoo release that changes one of them fails here, or in the shape check, whose
fallback to kazoo's own path (one warning) is tested last. ``make test-kazoo`` runs this module
against every supported kazoo minor version.

Every request names its own node and carries its own data, so an answer paired with another
request is a wrong value, not merely a late one."""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
from kazoo.client import KazooClient
from kazoo.exceptions import (
    ConnectionClosedError,
    ConnectionDropped,
    ConnectionLoss,
    NoNodeError,
    SessionExpiredError,
)
from kazoo.protocol.connection import ConnectionHandler
from kazoo.protocol.states import KazooState

from celery_zklock import Mutex, kazoo_handler
from celery_zklock.config import ClientConfig
from celery_zklock.kazoo_handler import DirectSendClient, DirectSocketConnection
from celery_zklock.locks import adapter
from celery_zklock.session import new_client
from tests.lockutil import wait_for

#: How long one request may take to be answered or failed, even across a reconnect.
ANSWER_WITHIN = 20.0
#: Requests each thread has in flight at once (a chain of four per node).
CHAINS_PER_BATCH = 12
THREADS = 8
#: What a dropped connection or a stop answers a request in flight with.
LOST = (ConnectionLoss, ConnectionDropped)
CLOSED = (*LOST, ConnectionClosedError, SessionExpiredError)


def _client(hosts: str) -> KazooClient:
    client = new_client(ClientConfig(hosts=hosts, session_timeout=10.0))
    client.start(timeout=15)
    return client


@pytest.fixture
def client(zk_hosts: str) -> Iterator[KazooClient]:
    client = _client(zk_hosts)
    assert type(client) is DirectSendClient and client._connection._direct_sends
    yield client
    client.stop()
    client.close()


def _count_direct_sends(client: KazooClient) -> list[int]:
    """[written on the caller's thread, handed to kazoo's queue]: counts from now on."""
    connection = client._connection
    counts = [0, 0]
    send_now = connection.send_now

    def counted(request: Any, async_object: Any) -> bool:
        sent = bool(send_now(request, async_object))
        counts[0 if sent else 1] += 1
        return sent

    connection.send_now = counted
    return counts


@dataclass
class Chain:
    """create, get, exists, delete of one node, and a get after the delete: five requests in
    flight together, each with an answer only its own request can have."""

    path: str
    data: bytes
    results: list[Any] = field(default_factory=list)

    def send(self, client: KazooClient) -> None:
        self.results = [
            client.create_async(self.path, self.data),
            client.get_async(self.path),
            client.exists_async(self.path),
            client.delete_async(self.path),
            client.get_async(self.path),
        ]

    def check(self, lost: tuple[type[BaseException], ...] = ()) -> str:
        """Wait for all five answers; raise AssertionError on an answer that belongs to another
        request. 'answered' if all came, 'lost' if one failed with an error of ``lost``."""
        outcomes = []
        for result in self.results:
            result.wait(ANSWER_WITHIN)
            assert result.ready(), f"a request on {self.path} was never answered"
            try:
                outcomes.append(result.get(block=False))
            except lost as exc:
                outcomes.append(exc)
            except NoNodeError as exc:
                outcomes.append(exc)
        created, got, stat, deleted, after = outcomes
        if lost and any(isinstance(o, lost) for o in outcomes):
            self._check_partly(created, got, stat, deleted, after, lost)
            return "lost"
        assert created == self.path, f"create of {self.path} answered {created!r}"
        assert not isinstance(got, Exception) and got[0] == self.data, (
            f"get of {self.path} answered {got!r}"
        )
        assert stat is not None and not isinstance(stat, Exception), stat
        assert stat.czxid == got[1].czxid and stat.dataLength == len(self.data), (
            f"exists of {self.path} answered another node's stat {stat!r}"
        )
        assert deleted is True, f"delete of {self.path} answered {deleted!r}"
        assert isinstance(after, NoNodeError), f"get after delete answered {after!r}"
        return "answered"

    def _check_partly(
        self, created: Any, got: Any, stat: Any, deleted: Any, after: Any, lost: tuple[type, ...]
    ) -> None:
        # Some failed with the connection: whatever did come must still be this chain's.
        made = created == self.path
        assert made or isinstance(created, lost), f"create answered {created!r}"
        for value in (got, after):
            assert isinstance(value, (lost, NoNodeError)) or (
                isinstance(value, tuple) and value[0] == self.data
            ), f"a get of {self.path} answered {value!r}"
        if made and not isinstance(got, lost):
            assert isinstance(got, tuple), f"get of a node just made answered {got!r}"
        assert stat is None or isinstance(stat, lost) or stat.dataLength == len(self.data), (
            f"exists of {self.path} answered {stat!r}"
        )
        assert deleted is True or isinstance(deleted, (*lost, NoNodeError)), deleted


def _chains(root: str, thread: int, batch: int) -> list[Chain]:
    # Data of a length that differs per chain, so even a stat tells the chains apart.
    return [
        Chain(f"{root}/t{thread}-b{batch}-c{i}", f"{thread}/{batch}/{i}|".encode() * (i + 1))
        for i in range(CHAINS_PER_BATCH)
    ]


class Load:
    """``THREADS`` threads, each sending batches of chains and checking every answer."""

    def __init__(self, client: KazooClient, root: str, lost: tuple[type, ...] = ()) -> None:
        self.client, self.root, self.lost = client, root, lost
        self.stop = threading.Event()
        self.errors: list[BaseException] = []
        self.outcomes = {"answered": 0, "lost": 0}
        self._lock = threading.Lock()
        self.threads = [threading.Thread(target=self._run, args=(i,)) for i in range(THREADS)]

    def _run(self, thread: int, batches: int | None = None) -> None:
        batch = 0
        try:
            while not self.stop.is_set() and (batches is None or batch < batches):
                chains = _chains(self.root, thread, batch)
                for chain in chains:
                    chain.send(self.client)
                for chain in chains:
                    outcome = chain.check(self.lost)
                    with self._lock:
                        self.outcomes[outcome] += 1
                batch += 1
        except ConnectionClosedError as exc:  # kazoo refused a request up front: stopped
            if ConnectionClosedError not in self.lost:
                self.errors.append(exc)
        except BaseException as exc:
            self.errors.append(exc)

    def answered(self) -> int:
        with self._lock:
            return self.outcomes["answered"]

    def __enter__(self) -> Load:
        for thread in self.threads:
            thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join(ANSWER_WITHIN * 3)
        assert not any(thread.is_alive() for thread in self.threads), "a thread hangs"


def test_concurrent_requests_on_the_direct_path_each_get_their_own_answer(
    client: KazooClient, lock_root: str
) -> None:
    client.ensure_path(lock_root)
    counts = _count_direct_sends(client)
    load = Load(client, lock_root)
    load.threads = [threading.Thread(target=load._run, args=(i, 6)) for i in range(THREADS)]
    with load:
        for thread in load.threads:
            thread.join(ANSWER_WITHIN * 3)
    assert load.errors == []
    assert load.outcomes == {"answered": THREADS * 6 * CHAINS_PER_BATCH, "lost": 0}
    # The direct path carried the load (a request finds kazoo's queue busy now and then).
    assert counts[0] >= 0.8 * THREADS * 6 * CHAINS_PER_BATCH * 5, counts
    assert not client._pending and not client._queue
    assert client.get_children(lock_root) == []


def test_dropped_connections_mid_traffic_fail_or_answer_each_request_with_its_own_answer(
    client: KazooClient, lock_root: str
) -> None:
    session = client.client_id
    states: list[KazooState] = []
    client.add_listener(states.append)
    client.ensure_path(lock_root)
    counts = _count_direct_sends(client)
    with Load(client, lock_root, lost=LOST) as load:
        for _drop in range(1, 5):
            answered, suspended = load.answered(), states.count(KazooState.SUSPENDED)
            wait_for(lambda a=answered: load.answered() > a + 50, 30, "answers")
            assert adapter.force_reconnect(client)
            wait_for(
                lambda s=suspended: states.count(KazooState.SUSPENDED) > s and client.connected,
                30,
                "the client to drop and reconnect",
            )
        answered = load.answered()
        wait_for(lambda: load.answered() > answered + 50, 30, "answers after the last reconnect")
    assert load.errors == []
    # Under load the backlog queued while disconnected keeps requests on kazoo's queue (they
    # must not overtake it); once it is gone they are written directly again.
    direct_before = counts[0]
    assert client.exists(lock_root) is not None
    assert counts[0] == direct_before + 1, "direct sends did not resume after the reconnect"
    assert client.client_id == session and KazooState.LOST not in states
    assert not client._pending and not client._queue


@pytest.mark.parametrize("dropped_first", [False, True], ids=["connected", "dropped"])
def test_a_stop_settles_every_request_in_flight_and_nothing_hangs(
    zk_hosts: str, lock_root: str, dropped_first: bool
) -> None:
    """Threads send their chains on the direct path while kazoo's connection thread holds the
    answers back, so all are in flight (in ``_pending``) when the stop begins; with
    ``dropped_first`` the connection is dropped first. Every request is then answered with its
    own answer or failed, the stop returns, and a request after it fails at once. (The threads
    are done sending before the stop: one that keeps sending while kazoo's stop runs can block
    on kazoo's wake-up socket, on kazoo's own path as on ours.)"""
    client = _client(zk_hosts)
    try:
        client.ensure_path(lock_root)
        connection = client._connection
        release = threading.Event()
        read_socket = connection._read_socket

        def held_back(read_timeout: float) -> Any:  # the connection thread
            release.wait(ANSWER_WITHIN)
            return read_socket(read_timeout)

        connection._read_socket = held_back
        chains = [_chains(lock_root, thread, 0) for thread in range(THREADS)]
        senders = [
            threading.Thread(target=lambda batch=batch: [c.send(client) for c in batch])
            for batch in chains
        ]
        for sender in senders:
            sender.start()
        for sender in senders:
            sender.join(ANSWER_WITHIN)
        assert len(client._pending) >= THREADS * CHAINS_PER_BATCH, "too few in flight"
        if dropped_first:
            assert adapter.force_reconnect(client)
        stopper = threading.Thread(target=client.stop)
        stopper.start()
        wait_for(lambda: client._stopped.is_set(), 10, "the stop to begin")
        release.set()
        stopper.join(ANSWER_WITHIN)
        assert not stopper.is_alive(), "the stop hangs"
        outcomes = [chain.check(CLOSED) for batch in chains for chain in batch]
        assert len(outcomes) == THREADS * CHAINS_PER_BATCH
        # Whether the stop lets answers to requests sent before its Close arrive depends on
        # the kazoo version; a dropped connection fails those whose answers it had not read.
        assert set(outcomes) <= {"answered", "lost"}
        if dropped_first:
            assert "lost" in outcomes
        with pytest.raises(ConnectionClosedError):
            client.exists_async(lock_root).get(timeout=ANSWER_WITHIN)
        assert not client._pending and not connection._direct_sends
    finally:
        client.stop()
        client.close()


# --- The fallback: a hook whose shape differs sends everything through kazoo's own path ------


@pytest.fixture
def fresh_check(monkeypatch: pytest.MonkeyPatch) -> None:
    """The shape check and its one warning, as in a process that has not run them yet."""
    monkeypatch.setattr(adapter, "_checked", False)
    monkeypatch.setattr(kazoo_handler, "_differing_hook", None)


def _locks_correctly(first: KazooClient, second: KazooClient, path: str) -> None:
    lease = Mutex(first, path).acquire(blocking=False)
    assert lease is not None
    assert Mutex(second, path).acquire(blocking=False) is None
    lease.release()
    again = Mutex(second, path).acquire(timeout=10)
    assert again is not None
    again.release()


def _warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    """The library's warnings (kazoo logs its own reconnects)."""
    return [
        r.getMessage()
        for r in caplog.records
        if r.levelno >= logging.WARNING and r.name.startswith("celery_zklock")
    ]


def _queued_sends(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    counts = [0]
    original = ConnectionHandler._send_request

    def counted(self: Any, read_timeout: float, connect_timeout: float) -> None:
        counts[0] += 1
        original(self, read_timeout, connect_timeout)

    monkeypatch.setattr(ConnectionHandler, "_send_request", counted)
    return counts


@pytest.mark.usefixtures("fresh_check")
def test_a_method_hook_that_differs_falls_back_to_kazoo_s_path_with_one_warning(
    zk_hosts: str, lock_root: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    original = KazooClient._call

    def _call(self: Any, request: Any, async_object: Any, priority: int = 0) -> Any:
        return original(self, request, async_object)

    monkeypatch.setattr(KazooClient, "_call", _call)
    queued = _queued_sends(monkeypatch)
    caplog.set_level(logging.WARNING)
    clients = [_client(zk_hosts), _client(zk_hosts)]
    try:
        assert all(type(c) is KazooClient for c in clients)
        assert all(type(c._connection) is ConnectionHandler for c in clients)
        _locks_correctly(*clients, f"{lock_root}/lock")
        assert queued[0] >= 6
    finally:
        for c in clients:
            c.stop()
            c.close()
    (warning,) = _warnings(caplog)
    assert "KazooClient._call" in warning and adapter.kazoo_version() in warning
    assert not adapter.direct_writes()


@pytest.mark.usefixtures("fresh_check")
def test_a_connect_answer_that_differs_falls_back_to_kazoo_s_path_with_one_warning(
    zk_hosts: str, lock_root: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The answer of ``_connect`` is seen only in a handshake: a list where a tuple was."""
    original = ConnectionHandler._connect

    def _connect(self: Any, host: str, hostip: str, port: int) -> Any:
        return list(original(self, host, hostip, port))

    monkeypatch.setattr(ConnectionHandler, "_connect", _connect)
    queued = _queued_sends(monkeypatch)
    caplog.set_level(logging.WARNING)
    clients = [_client(zk_hosts), _client(zk_hosts)]
    try:
        assert type(clients[0]) is DirectSendClient  # made before the first handshake
        assert type(clients[1]) is KazooClient  # made after it
        assert not any(getattr(c._connection, "_direct_sends", False) for c in clients)
        _locks_correctly(*clients, f"{lock_root}/lock")
        assert queued[0] >= 6
        states: list[KazooState] = []
        clients[0].add_listener(states.append)
        assert adapter.force_reconnect(clients[0])  # a new handshake: still kazoo's path
        wait_for(
            lambda: KazooState.SUSPENDED in states and clients[0].connected, 30, "the reconnect"
        )
        clients[0].exists(lock_root)
        assert not clients[0]._connection._direct_sends
    finally:
        for c in clients:
            c.stop()
            c.close()
    (warning,) = _warnings(caplog)
    assert "ConnectionHandler._connect" in warning and adapter.kazoo_version() in warning


@pytest.mark.usefixtures("fresh_check")
def test_direct_writes_turned_off_on_purpose_lock_through_kazoo_s_path_without_a_warning(
    zk_hosts: str, lock_root: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(adapter, "_direct_writes", True)
    adapter.set_direct_writes(False)
    queued = _queued_sends(monkeypatch)
    caplog.set_level(logging.WARNING)
    clients = [_client(zk_hosts), _client(zk_hosts)]
    try:
        assert all(type(c) is KazooClient for c in clients)
        assert all(type(c._connection) is DirectSocketConnection for c in clients)
        _locks_correctly(*clients, f"{lock_root}/lock")
        assert queued[0] >= 6
    finally:
        for c in clients:
            c.stop()
            c.close()
    assert _warnings(caplog) == []
