"""The library's clients, whose connection reads and writes before it polls
(``DirectSocketConnection``), on a real ZooKeeper: large requests and replies, long listings,
and a connection broken under them. (Whether a read or write waits here depends on the kernel's
timing; tests/unit/test_direct_socket_io.py makes each wait happen for certain.)"""

from __future__ import annotations

import socket
from collections.abc import Iterator

import pytest
from kazoo.client import KazooClient
from kazoo.protocol.states import KazooState

from celery_zklock.zk import adapter
from celery_zklock.zk.client import new_client
from celery_zklock.zk.handler import DirectSocketConnection
from celery_zklock.zk.settings import ClientConfig
from tests.lockutil import wait_for


@pytest.fixture
def client(zk_hosts: str) -> Iterator[KazooClient]:
    client = new_client(ClientConfig(hosts=zk_hosts, session_timeout=10.0))
    assert type(client._connection) is DirectSocketConnection
    client.start(timeout=15)
    yield client
    client.stop()
    client.close()


def test_a_900_kb_node_round_trips_through_small_socket_buffers(
    client: KazooClient, lock_root: str
) -> None:
    sock = client._connection._socket
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 65536)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 65536)
    data = bytes(range(256)) * 3600  # 921,600 bytes, under jute.maxbuffer (1 MiB)
    client.create(f"{lock_root}/big", data, makepath=True)
    value, stat = client.get(f"{lock_root}/big")
    assert value == data and stat.dataLength == len(data)


def test_a_1500_child_listing_comes_back_whole(client: KazooClient, lock_root: str) -> None:
    parent = f"{lock_root}/many"
    client.ensure_path(parent)
    results = [client.create_async(f"{parent}/child-{i:04d}") for i in range(1500)]
    for result in results:
        result.get(timeout=30)
    assert sorted(client.get_children(parent)) == [f"child-{i:04d}" for i in range(1500)]


def test_a_connection_broken_under_it_reconnects_to_the_same_session(
    client: KazooClient, lock_root: str
) -> None:
    session = client.client_id
    states: list[KazooState] = []
    client.add_listener(states.append)
    assert adapter.force_reconnect(client)
    wait_for(lambda: KazooState.SUSPENDED in states and client.connected, 30,
             "the client to drop and reconnect")  # fmt: skip
    client.create(f"{lock_root}/after", b"x", makepath=True)
    assert client.get(f"{lock_root}/after")[0] == b"x"
    assert client.client_id == session and KazooState.LOST not in states
