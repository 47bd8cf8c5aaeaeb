"""The contract of the kazoo hooks the library's clients override (``locks/adapter.py``:
``ConnectionHandler._read`` and ``_write``, replaced by ``kazoo_handler.DirectSocketConnection``),
exercised for behaviour on a real ZooKeeper: kazoo's request path must still pair every answer
with its own request, under concurrency, across dropped connections and through a stop. A kazoo
release that changes what those hooks are called with or must return fails here. ``make
test-kazoo`` runs this module against every supported kazoo minor version.

Every request names its own node and carries its own data, so an answer paired with another
request is a wrong value, not merely a late one."""

from __future__ import annotations

import contextlib
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
from kazoo.protocol.states import KazooState

from celery_zklock.zk import adapter
from celery_zklock.zk.client import new_client
from celery_zklock.zk.handler import DirectSocketConnection
from celery_zklock.zk.settings import ClientConfig
from tests.lockutil import wait_for

#: How long one request may take to be answered or failed, even across a reconnect.
ANSWER_WITHIN = 20.0
#: Requests each thread has in flight at once (a chain of four per node).
CHAINS_PER_BATCH = 12
THREADS = 8
#: What a dropped connection or a stop answers a request in flight with.
LOST = (ConnectionLoss, ConnectionDropped)
CLOSED = (*LOST, ConnectionClosedError, SessionExpiredError)
#: Chains each thread sends while the connection thread is held back. Every request writes one
#: wake-up byte to kazoo's blocking socket pair, which only that thread drains; Linux takes about
#: 278 of them before a send blocks, so the requests held back (5 per chain) stay well below.
HELD_BACK_CHAINS = 5


def _client(hosts: str) -> KazooClient:
    client = new_client(ClientConfig(hosts=hosts, session_timeout=10.0))
    client.start(timeout=15)
    return client


@pytest.fixture
def client(zk_hosts: str) -> Iterator[KazooClient]:
    client = _client(zk_hosts)
    assert type(client) is KazooClient and type(client._connection) is DirectSocketConnection
    yield client
    client.stop()
    client.close()


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


def _chains(root: str, thread: int, batch: int, count: int = CHAINS_PER_BATCH) -> list[Chain]:
    # Data of a length that differs per chain, so even a stat tells the chains apart.
    return [
        Chain(f"{root}/t{thread}-b{batch}-c{i}", f"{thread}/{batch}/{i}|".encode() * (i + 1))
        for i in range(count)
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


def test_concurrent_requests_each_get_their_own_answer(client: KazooClient, lock_root: str) -> None:
    client.ensure_path(lock_root)
    load = Load(client, lock_root)
    load.threads = [threading.Thread(target=load._run, args=(i, 6)) for i in range(THREADS)]
    with load:
        for thread in load.threads:
            thread.join(ANSWER_WITHIN * 3)
    assert load.errors == []
    assert load.outcomes == {"answered": THREADS * 6 * CHAINS_PER_BATCH, "lost": 0}
    assert not client._pending and not client._queue
    assert client.get_children(lock_root) == []


def test_dropped_connections_mid_traffic_fail_or_answer_each_request_with_its_own_answer(
    client: KazooClient, lock_root: str
) -> None:
    session = client.client_id
    states: list[KazooState] = []
    client.add_listener(states.append)
    client.ensure_path(lock_root)
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
    assert client.exists(lock_root) is not None
    assert client.client_id == session and KazooState.LOST not in states
    assert not client._pending and not client._queue


@pytest.mark.parametrize("dropped_first", [False, True], ids=["connected", "dropped"])
def test_a_stop_settles_every_request_in_flight_and_nothing_hangs(
    zk_hosts: str, lock_root: str, dropped_first: bool
) -> None:
    """Threads send their chains while kazoo's connection thread holds the
    answers back, so all are in flight (in ``_pending`` or ``_queue``) when the stop begins; with
    ``dropped_first`` the connection is dropped first. Every request is then answered with its
    own answer or failed, the stop returns, and a request after it fails at once. (The threads
    are done sending before the stop: one that keeps sending while kazoo's stop runs can block
    on kazoo's wake-up socket.)"""
    client = _client(zk_hosts)
    try:
        client.ensure_path(lock_root)
        connection = client._connection
        release, parked = threading.Event(), threading.Event()
        read_socket = connection._read_socket

        def held_back(read_timeout: float) -> Any:  # the connection thread
            parked.set()
            release.wait(ANSWER_WITHIN)
            return read_socket(read_timeout)

        connection._read_socket = held_back
        # One request whose answer parks the connection thread in held_back: from then on no
        # answer is read (on a loaded machine a read already under way took answers before).
        client.exists_async(lock_root)
        assert parked.wait(ANSWER_WITHIN), "the connection thread never read again"
        chains = [_chains(lock_root, thread, 0, HELD_BACK_CHAINS) for thread in range(THREADS)]
        senders = [
            threading.Thread(target=lambda batch=batch: [c.send(client) for c in batch])
            for batch in chains
        ]
        for sender in senders:
            sender.start()
        for sender in senders:
            sender.join(ANSWER_WITHIN)
        # A sender still sending would race the checks below (a CI run found one blocked on
        # kazoo's wake-up socket when each thread sent 12 chains).
        assert not any(sender.is_alive() for sender in senders), "a sender is blocked"
        # sent and awaiting an answer, or queued behind the held-back connection thread
        in_flight = len(client._pending) + len(client._queue)
        assert in_flight >= THREADS * HELD_BACK_CHAINS * 5, "a request was answered"
        if dropped_first:
            assert adapter.force_reconnect(client)
        stopper = threading.Thread(target=client.stop)
        stopper.start()
        wait_for(lambda: client._stopped.is_set(), 10, "the stop to begin")
        release.set()
        stopper.join(ANSWER_WITHIN)
        assert not stopper.is_alive(), "the stop hangs"
        outcomes = [chain.check(CLOSED) for batch in chains for chain in batch]
        assert len(outcomes) == THREADS * HELD_BACK_CHAINS
        # Whether the stop lets answers to requests sent before its Close arrive depends on
        # the kazoo version; a dropped connection fails those whose answers it had not read.
        assert set(outcomes) <= {"answered", "lost"}
        if dropped_first:
            assert "lost" in outcomes
        with pytest.raises(ConnectionClosedError):
            client.exists_async(lock_root).get(timeout=ANSWER_WITHIN)
        assert not client._pending and not client._queue
    finally:
        client.stop()
        client.close()


def test_the_installed_kazoo_has_the_hook_shapes_the_adapter_expects() -> None:
    """Run on every supported kazoo by ``make test-kazoo``: none of them takes the fallback."""
    assert adapter.hook_that_differs() is None


@pytest.fixture
def changed_call(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """``KazooClient._call`` with another shape (as a kazoo release might give it), and the
    adapter's once-per-process check made anew before and after."""
    original = KazooClient._call

    def _call(self: Any, request: Any, async_object: Any, priority: int = 0) -> Any:
        return original(self, request, async_object)

    monkeypatch.setattr(KazooClient, "_call", _call)
    monkeypatch.setattr(adapter, "_shape_checked", False)
    monkeypatch.setattr(adapter, "_differing", None)
    yield
    monkeypatch.undo()
    adapter._shape_checked, adapter._differing = False, None


def test_a_hook_of_another_shape_falls_back_to_kazoos_path_with_one_warning(
    changed_call: None, zk_hosts: str, lock_root: str, caplog: pytest.LogCaptureFixture
) -> None:
    from celery_zklock import Mutex

    caplog.set_level("WARNING", logger=adapter.__name__)
    clients = [_client(zk_hosts) for _ in range(2)]
    try:
        # kazoo's own socket I/O: the connection class was left alone.
        assert all(type(c._connection) is not DirectSocketConnection for c in clients)
        first, second = (Mutex(c, f"{lock_root}/k") for c in clients)
        lease = first.acquire(timeout=5)
        assert second.acquire(blocking=False) is None  # still excludes
        node, token = lease.node, lease.token
        assert clients[0].exists(node).czxid == token  # the create went through, token exact
        lease.release()
        again = second.acquire(timeout=5)
        assert again.token > token
        again.release()
        # Nothing left behind (the empty container parent may already be reaped).
        with contextlib.suppress(NoNodeError):
            assert clients[0].get_children(f"{lock_root}/k") == []
    finally:
        for c in clients:
            c.stop()
            c.close()
    warnings = [r for r in caplog.records if "KazooClient._call" in r.getMessage()]
    assert len(warnings) == 1, [r.getMessage() for r in caplog.records]
