"""The process's kazoo clients (``session.get_client``): a client started for a configuration
whose login check then fails is stopped, not left running uncached (each retry would start
another)."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
from kazoo.client import KazooClient
from kazoo.exceptions import ConnectionLoss

from celery_zklock.zk import client as session
from celery_zklock.zk.client import get_client
from celery_zklock.zk.settings import ClientConfig


def test_a_client_whose_sasl_login_check_fails_is_stopped(
    zk_hosts: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = ClientConfig(
        hosts=zk_hosts, session_timeout=4.0, sasl=(("mechanism", "DIGEST-MD5"), ("username", "u"))
    )
    made: list[KazooClient] = []
    real_new_client = session.new_client

    def client_without_sasl(given: ClientConfig) -> KazooClient:
        # This server has no SASL: connect without it, and fail the check's read as a
        # connection lost during it fails it.
        client = real_new_client(dataclasses.replace(given, sasl=()))
        made.append(client)

        def exists_async(path: str, *args: Any, **kwargs: Any) -> Any:
            failed = client.handler.async_result()
            failed.set_exception(ConnectionLoss())
            return failed

        client.exists_async = exists_async  # type: ignore[method-assign]
        return client

    monkeypatch.setattr(session, "new_client", client_without_sasl)
    try:
        for _ in range(3):
            with pytest.raises(ConnectionLoss):
                get_client(config)
        assert len(made) == 3
        assert [client for client in made if client.connected] == []
    finally:
        for client in made:
            client.stop()
            client.close()


def test_equal_configs_share_one_client_and_another_config_gets_its_own(zk_hosts: str) -> None:
    """The clients are kept by their ``ClientConfig``: equal configs (two apps' settings, or the
    settings read again at a worker's start) get the same client, any other field another."""
    try:
        first = get_client(ClientConfig(hosts=zk_hosts, session_timeout=4.0))
        assert get_client(ClientConfig(hosts=zk_hosts, session_timeout=4.0)) is first
        other = ClientConfig(hosts=zk_hosts, session_timeout=4.0, connect_timeout=6.0)
        assert other != ClientConfig(hosts=zk_hosts, session_timeout=4.0)
        assert get_client(other) is not first
    finally:
        session.close_clients()
