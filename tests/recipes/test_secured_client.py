"""The library's own client against a secured ZooKeeper (celery_zklock.testing.security):
SASL DIGEST-MD5 logins, TLS that verifies, and each misconfiguration failing at once with an
error that names TLS or SASL and the setting to fix, never a bare timeout."""

from __future__ import annotations

import ssl
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from kazoo.client import KazooClient
from kazoo.exceptions import NoAuthError
from kazoo.protocol.states import KeeperState

from celery_zklock import Mutex
from celery_zklock.errors import ConfigurationError
from celery_zklock.testing import ZooKeeperServer
from celery_zklock.zk.client import close_clients, get_client
from celery_zklock.zk.settings import ClientConfig, client_config


@pytest.fixture(autouse=True)
def _fresh_clients(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    import os

    for name in [n for n in os.environ if n.startswith("ZKLOCK_")]:
        monkeypatch.delenv(name)
    yield
    close_clients()


def config(**conf: Any) -> ClientConfig:
    return client_config({"zklock_connect_timeout": 3, **conf})


def sasl(server: ZooKeeperServer, user: str, password: str | None = None) -> dict[str, str]:
    return {
        "mechanism": "DIGEST-MD5",
        "username": user,
        "password": server.sasl_users[user] if password is None else password,
    }


def test_sasl_login_and_creator_acl(zk_secure_server: ZooKeeperServer) -> None:
    server = zk_secure_server
    client = get_client(
        config(zklock_hosts=server.hosts, zklock_sasl=sasl(server, "alice"), zklock_acl="creator")
    )
    path = f"/sasl-{uuid.uuid4().hex[:8]}"
    lease = Mutex(client, path).acquire()
    try:
        # written only after the SASL login: the node belongs to alice
        acls, _ = client.get_acls(lease.node)
        assert ("sasl", "alice") in {(a.id.scheme, a.id.id) for a in acls}
        bob = KazooClient(hosts=server.hosts, sasl_options=sasl(server, "bob"))
        bob.start(timeout=15)
        try:
            with pytest.raises(NoAuthError):
                bob.delete(lease.node)
            assert bob.get(lease.node)[0] == client.get(lease.node)[0]  # reading is allowed
        finally:
            bob.stop()
            bob.close()
    finally:
        lease.release()
    assert client.exists(lease.node) is None


def test_a_wrong_sasl_password_fails_clearly(zk_secure_server: ZooKeeperServer) -> None:
    server = zk_secure_server
    with pytest.raises(ConfigurationError, match=r"SASL DIGEST-MD5 login as 'alice' was refused"):
        get_client(config(zklock_hosts=server.hosts, zklock_sasl=sasl(server, "alice", "nope")))


def test_tls_with_verification_on_a_tls_only_server(zk_tls_only_server: ZooKeeperServer) -> None:
    server = zk_tls_only_server
    client = get_client(
        config(zklock_hosts=server.tls_hosts, zklock_use_ssl=True, zklock_ssl_ca=server.ca_file)
    )
    lease = Mutex(client, f"/tls-{uuid.uuid4().hex[:8]}").acquire()
    assert lease.token > 0
    lease.release()
    # a TLS socket: DirectSocketConnection leaves its reads and writes to kazoo's own path
    assert isinstance(client._connection._socket, ssl.SSLSocket)


def test_an_untrusted_ca_fails_clearly(zk_tls_only_server: ZooKeeperServer) -> None:
    server = zk_tls_only_server
    with pytest.raises(ConfigurationError, match=r"^TLS: the certificate of localhost:\d+ is not "
                       r"trusted .*zklock_ssl_ca"):  # fmt: skip
        get_client(
            config(
                zklock_hosts=server.tls_hosts,
                zklock_use_ssl=True,
                zklock_ssl_ca=server.wrong_ca_file,
            )
        )


def test_a_hostname_the_certificate_does_not_name_fails_clearly(
    zk_tls_only_server: ZooKeeperServer,
) -> None:
    server = zk_tls_only_server
    hosts = server.tls_hosts.replace("localhost", "127.0.0.1")
    common = {"zklock_use_ssl": True, "zklock_ssl_ca": server.ca_file}
    with pytest.raises(ConfigurationError, match=r"does not name '127.0.0.1'.*check_hostname"):
        get_client(config(zklock_hosts=hosts, **common))
    # The named way out works: the certificate is still verified, only the name is not checked.
    client = get_client(config(zklock_hosts=hosts, zklock_ssl_check_hostname=False, **common))
    assert client.exists("/") is not None


def test_a_plain_client_on_the_tls_port_fails_clearly(zk_tls_only_server: ZooKeeperServer) -> None:
    server = zk_tls_only_server
    with pytest.raises(Exception) as raised:
        get_client(config(zklock_hosts=server.tls_hosts))  # no zklock_use_ssl
    assert not isinstance(raised.value, ConfigurationError)  # not a TLS setting: unavailable


class _SlowStart(KazooClient):  # type: ignore[misc]
    """A client whose ``start`` looks at its state only after the server refused the login:
    kazoo's own ``start`` does that when its thread wakes late (under load), and then raises a
    bare "Connection time-out" at once."""

    def start(self, timeout: float = 15) -> None:
        self.start_async().wait(timeout)
        deadline = time.monotonic() + timeout
        while self.client_state != KeeperState.AUTH_FAILED and time.monotonic() < deadline:
            time.sleep(0.01)
        if not self.connected:
            self.stop()
            self.close()
            raise self.handler.timeout_exception("Connection time-out")


_SLOW_START: dict[str, Any] = {}


def slow_start_client() -> KazooClient:
    """``zklock_client_factory`` of the test below."""
    return _SlowStart(**_SLOW_START)


def test_a_refused_login_seen_only_as_a_timeout_is_named(
    zk_secure_server: ZooKeeperServer,
) -> None:
    server = zk_secure_server
    _SLOW_START.update(hosts=server.hosts, sasl_options=sasl(server, "alice", "nope"))
    with pytest.raises(ConfigurationError, match=r"SASL DIGEST-MD5 login as 'alice' was refused"):
        get_client(
            config(
                zklock_hosts=server.hosts,
                zklock_sasl=sasl(server, "alice", "nope"),
                zklock_client_factory=f"{__name__}:slow_start_client",
            )
        )
