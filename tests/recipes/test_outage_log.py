"""kazoo's reconnect warnings during an outage: one line per outage per process
(celery_zklock.zk.outages), on a real ZooKeeper behind a proxy that refuses connections."""

from __future__ import annotations

import logging
import threading

import pytest
from kazoo.client import KazooClient
from kazoo.protocol.states import KazooState

from celery_zklock.testing.proxy import TcpProxy
from celery_zklock.zk import outages
from celery_zklock.zk.client import new_client
from celery_zklock.zk.settings import ClientConfig
from tests.lockutil import wait_for


def kazoo_warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.name == "kazoo.client" and r.levelno == logging.WARNING
    ]


def attempts(caplog: pytest.LogCaptureFixture) -> int:
    return sum(r.getMessage().startswith("Connecting to") for r in caplog.records)


def test_one_reconnect_warning_per_outage(
    proxy: TcpProxy, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="kazoo.client")
    caplog.set_level(logging.INFO, logger="celery_zklock.session")
    outages.reset()
    client: KazooClient = new_client(ClientConfig(hosts=proxy.address, session_timeout=10.0))
    up = threading.Event()
    client.add_listener(lambda state: up.set() if state == KazooState.CONNECTED else up.clear())
    client.start(timeout=10)
    try:
        for outage in (1, 2):
            before = attempts(caplog)
            proxy.refuse = True
            proxy.cut()
            wait_for(lambda b=before: attempts(caplog) >= b + 4, 30, "reconnect attempts")
            assert not client.connected
            assert len(kazoo_warnings(caplog)) == outage, kazoo_warnings(caplog)
            proxy.refuse = False
            assert up.wait(30) and client.connected
            client.exists("/")  # the session is alive (10 s timeout, a short outage)
    finally:
        client.stop()
        client.close()
    print("\n".join(kazoo_warnings(caplog)))
    (first, second) = kazoo_warnings(caplog)
    assert "reconnect warnings are left out" in first and "left out" in second
    back = [r.getMessage() for r in caplog.records if "answers again" in r.getMessage()]
    assert len(back) == 2 and all("reconnect warnings left out" in m for m in back)
