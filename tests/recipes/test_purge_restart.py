"""Orphan purges (``OrphanPurge.later``) are never lost to a race with the reconnect.

The purge thread stops when it finds the client not connected and leaves the rest to the
CONNECTED listener; the listener starts no second purge thread while the first is running. A
listener that ran between the thread's look at the state and its exit used to find it still
running, so the purge was left to no one and the orphan lived as long as the session.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import pytest
from kazoo.client import KazooClient
from kazoo.protocol.states import KazooState

from celery_zklock.locks.context import context_for
from celery_zklock.locks.queue import OrphanPurge
from celery_zklock.testing.proxy import TcpProxy
from tests.lockutil import wait_for


class HeldStateClient(KazooClient):
    """A KazooClient whose ``state``, read by the thread ``hold_thread`` while not CONNECTED, is
    handed to it (the value it read) only once ``release_read`` is set: a thread preempted right
    after its read."""

    hold_thread: int | None = None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.read_held = threading.Event()
        self.release_read = threading.Event()
        super().__init__(*args, **kwargs)

    @property
    def state(self) -> str:
        value: str = self.__dict__.get("_held_state", KazooState.LOST)
        if threading.get_ident() == self.hold_thread and value != KazooState.CONNECTED:
            self.hold_thread = None
            self.read_held.set()
            assert self.release_read.wait(20), "the reconnect's listener never ran"
        return value

    @state.setter
    def state(self, value: str) -> None:
        self.__dict__["_held_state"] = value


@pytest.fixture
def proxied(zk_client: KazooClient) -> Iterator[tuple[HeldStateClient, TcpProxy]]:
    host, port = zk_client.hosts[0]
    with TcpProxy(host, port) as proxy:
        client = HeldStateClient(proxy.address, timeout=10)
        client.start(timeout=15)
        try:
            yield client, proxy
        finally:
            client.release_read.set()
            client.stop()
            client.close()


def test_a_purge_survives_a_reconnect_met_while_the_purge_thread_is_leaving(
    zk_client: KazooClient,
    proxied: tuple[HeldStateClient, TcpProxy],
    lock_root: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    client, proxy = proxied
    parent = f"{lock_root}/k"
    zk_client.ensure_path(parent)
    orphan = client.create(f"{parent}/_c_orphan-lock-", ephemeral=True, sequence=True)
    purge = OrphanPurge.of(context_for(client))

    run_purges = purge._run
    start_purges = purge._start
    listener_saw_purging: list[bool] = []

    def purge_thread() -> None:
        if not client.read_held.is_set():
            client.hold_thread = threading.get_ident()
        run_purges()

    def start_purges_then_release() -> None:
        connected = client.__dict__["_held_state"] == KazooState.CONNECTED
        if connected:  # the reconnect's listener (kazoo sets the state before calling them)
            listener_saw_purging.append(purge._purging)
        start_purges()
        if connected:
            client.release_read.set()

    monkeypatch.setattr(purge, "_run", purge_thread)
    monkeypatch.setattr(purge, "_start", start_purges_then_release)

    proxy.refuse = True
    proxy.cut()
    wait_for(lambda: client.state != KazooState.CONNECTED, 10, "the client to see the cut")
    purge.later(parent, "_c_orphan-")  # e.g. an abandon() that met ConnectionLoss
    assert client.read_held.wait(10), "the purge thread did not look at the state"
    proxy.refuse = False

    # The same session reconnects: the orphan is ours and must go now that we are connected.
    wait_for(lambda: zk_client.exists(orphan) is None, 10, f"the purge to remove {orphan}")
    assert listener_saw_purging == [True], "the race was not produced"
    wait_for(lambda: not purge.pending(), 10, "no purge to be left pending")
