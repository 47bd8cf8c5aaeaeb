"""The secured local stack on real ZooKeeper: TLS (right CA, wrong CA, hostname mismatch, client
certificates), SASL DIGEST-MD5, digest auth, a TLS-only server, and `stack up --secure`."""

from __future__ import annotations

import logging
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from kazoo.client import KazooClient, KazooState
from kazoo.exceptions import AuthFailedError, ConnectionClosedError, NoAuthError
from kazoo.handlers.threading import KazooTimeoutError
from kazoo.security import make_acl, make_digest_acl

from celery_zklock.testing import StackError, ZooKeeperEnsemble, ZooKeeperServer
from celery_zklock.testing.plugin import StackFactory
from celery_zklock.testing.security import TLS_HOSTNAME, ZooKeeperSecurity
from celery_zklock.zk import four_letter
from celery_zklock.zk.client import new_client
from celery_zklock.zk.settings import client_config

REPO_ROOT = Path(__file__).resolve().parents[2]
REFUSED_WITHIN = 2.0
"""Seconds a client that must not connect is given (its first attempt fails at once)."""

ClientMaker = Callable[..., KazooClient]


@pytest.fixture
def kazoo() -> Iterator[ClientMaker]:
    """Makes (not starts) KazooClients; stops and closes them all after the test."""
    made: list[KazooClient] = []

    def make(hosts: str, **options: Any) -> KazooClient:
        client = KazooClient(hosts=hosts, **options)
        made.append(client)
        return client

    yield make
    for client in made:
        client.stop()
        client.close()


def tls_options(server: ZooKeeperServer | ZooKeeperEnsemble, **overrides: Any) -> dict[str, Any]:
    options: dict[str, Any] = {
        "use_ssl": True,
        "ca": str(server.ca_file),
        "verify_certs": True,
        "check_hostname": True,
    }
    return {**options, **overrides}


def sasl(user: str, password: str) -> dict[str, Any]:
    return {"sasl_options": {"mechanism": "DIGEST-MD5", "username": user, "password": password}}


def listening_ports(pid: int) -> set[int]:
    """The TCP ports process ``pid`` listens on (from /proc)."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:[") : -1])
    ports = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table, encoding="ascii") as fh:
            for line in fh.readlines()[1:]:
                fields = line.split()
                if fields[3] == "0A" and fields[9] in inodes:
                    ports.add(int(fields[1].rsplit(":", 1)[1], 16))
    return ports


def assert_refused(client: KazooClient, caplog: pytest.LogCaptureFixture, reason: str) -> None:
    """``client`` does not connect within REFUSED_WITHIN s, and kazoo logged ``reason``."""
    with (
        caplog.at_level(logging.WARNING, logger="kazoo.client"),
        pytest.raises(KazooTimeoutError),
    ):
        client.start(timeout=REFUSED_WITHIN)
    assert not client.connected
    messages = " | ".join(record.getMessage() for record in caplog.records)
    assert re.search(reason, messages), messages


# ------------------------------------------------------------------------------------- TLS


STACK_UP_SECURE = ("stack", "up", "--secure", "--no-redis")


def test_tls_with_the_right_ca_and_hostname_serves(
    zk_secure_server: ZooKeeperServer, kazoo: ClientMaker
) -> None:
    server = zk_secure_server
    assert server.tls_hosts == f"localhost:{server.secure_port}"
    assert server.secure_port != server.port
    assert listening_ports(server.pid or 0) == {server.port, server.secure_port}
    client = kazoo(server.tls_hosts, **tls_options(server))
    client.start(timeout=10)
    client.create("/tls-node", b"over tls")
    assert client.get("/tls-node")[0] == b"over tls"
    client.delete("/tls-node")
    assert client.exists("/tls-node") is None


def test_a_ca_that_did_not_sign_the_server_certificate_does_not_connect(
    zk_secure_server: ZooKeeperServer, kazoo: ClientMaker, caplog: pytest.LogCaptureFixture
) -> None:
    server = zk_secure_server
    assert server.wrong_ca_file.read_text() != server.ca_file.read_text()
    client = kazoo(server.tls_hosts, **tls_options(server, ca=str(server.wrong_ca_file)))
    assert_refused(client, caplog, "certificate verify failed")


def test_an_ip_address_is_a_hostname_mismatch(
    zk_secure_server: ZooKeeperServer, kazoo: ClientMaker, caplog: pytest.LogCaptureFixture
) -> None:
    server = zk_secure_server
    by_ip = f"127.0.0.1:{server.secure_port}"
    client = kazoo(by_ip, **tls_options(server))
    assert_refused(client, caplog, r"mismatch.*127\.0\.0\.1")
    # The same address without hostname checking connects: only the name was wrong.
    unchecked = kazoo(by_ip, **tls_options(server, check_hostname=False))
    unchecked.start(timeout=10)
    assert unchecked.get_children("/") is not None


def test_a_plain_client_on_the_tls_port_does_not_connect(
    zk_secure_server: ZooKeeperServer, kazoo: ClientMaker
) -> None:
    client = kazoo(zk_secure_server.tls_hosts)
    with pytest.raises(KazooTimeoutError):
        client.start(timeout=REFUSED_WITHIN)


# ---------------------------------------------------------------------------- SASL, digest


def test_sasl_digest_md5_users_log_in_and_sasl_acls_hold(
    zk_secure_server: ZooKeeperServer, kazoo: ClientMaker
) -> None:
    server = zk_secure_server
    users = server.sasl_users
    assert set(users) == {"alice", "bob"}
    assert users["alice"] != users["bob"] and len(users["alice"]) >= 16
    alice = kazoo(server.hosts, **sasl("alice", users["alice"]))
    alice.start(timeout=10)
    path = alice.create("/sasl-alice-", b"alice only", sequence=True,
                        acl=[make_acl("sasl", "alice", all=True)])  # fmt: skip
    try:
        assert alice.get(path)[0] == b"alice only"
        bob = kazoo(server.hosts, **sasl("bob", users["bob"]))
        bob.start(timeout=10)
        with pytest.raises(NoAuthError):
            bob.get(path)
        anonymous = kazoo(server.hosts)
        anonymous.start(timeout=10)
        with pytest.raises(NoAuthError):
            anonymous.get(path)
    finally:
        alice.delete(path)


def test_a_wrong_sasl_password_is_refused(
    zk_secure_server: ZooKeeperServer, kazoo: ClientMaker, caplog: pytest.LogCaptureFixture
) -> None:
    password = zk_secure_server.sasl_users["alice"] + "x"
    client = kazoo(zk_secure_server.hosts, **sasl("alice", password))
    # The session is made, then the SASL exchange fails and kazoo ends it. Not client.start():
    # under load the refusal can come before start() looks at the state, and start() then
    # reports a connection time-out (CI failed so once at double load).
    states: queue.Queue[str] = queue.Queue()
    client.add_listener(states.put)
    client.start_async()
    assert states.get(timeout=10) == KazooState.CONNECTED
    assert states.get(timeout=10) == KazooState.LOST
    assert "AUTH_FAILED" in caplog.text  # kazoo's own word for why it ended the session
    # and it refuses every request after (AuthFailedError, or ConnectionClosedError once closed)
    with pytest.raises((AuthFailedError, ConnectionClosedError)):
        client.get("/")


def test_digest_auth_works_next_to_sasl(
    zk_secure_server: ZooKeeperServer, kazoo: ClientMaker
) -> None:
    owner = kazoo(zk_secure_server.hosts, auth_data=[("digest", "carol:secret")])
    owner.start(timeout=10)
    path = owner.create("/digest-carol-", b"carol", sequence=True,
                        acl=[make_digest_acl("carol", "secret", all=True)])  # fmt: skip
    try:
        assert owner.get(path)[0] == b"carol"
        stranger = kazoo(zk_secure_server.hosts, auth_data=[("digest", "carol:wrong")])
        stranger.start(timeout=10)
        with pytest.raises(NoAuthError):
            stranger.get(path)
    finally:
        owner.delete(path)


# ------------------------------------------------------------------------------- TLS only


def test_a_tls_only_server_listens_on_its_tls_port_alone(
    zk_tls_only_server: ZooKeeperServer, kazoo: ClientMaker
) -> None:
    server = zk_tls_only_server
    port = server.secure_port
    assert listening_ports(server.pid or 0) == {port}
    config = (server.node.directory / "zoo.cfg").read_text()
    assert "clientPort=" not in config and f"secureClientPort={port}" in config
    with pytest.raises(StackError, match="no plain client port"):
        server.hosts  # noqa: B018
    assert four_letter.ask("127.0.0.1", port, "ruok", timeout=0.5) is None  # plain: no answer
    tls = server.security_material.tls_context()
    answer = four_letter.ask("127.0.0.1", port, "srvr", tls=tls, server_hostname=TLS_HOSTNAME)
    assert answer is not None and "Mode: standalone" in answer
    alice = kazoo(
        server.tls_hosts, **tls_options(server), **sasl("alice", server.sasl_users["alice"])
    )
    alice.start(timeout=10)
    path = alice.create(
        "/tls-only-", b"x", sequence=True, acl=[make_acl("sasl", "alice", all=True)]
    )
    assert alice.get(path)[0] == b"x"
    alice.delete(path)


def test_client_auth_need_requires_a_certificate_from_the_ca(
    zk_stack_factory: StackFactory, kazoo: ClientMaker, caplog: pytest.LogCaptureFixture
) -> None:
    server = zk_stack_factory.server(
        security=ZooKeeperSecurity(client_auth="need", sasl_users={}, plain=False)
    )
    assert server.sasl_users == {}
    with_cert = tls_options(
        server, certfile=str(server.client_cert_file), keyfile=str(server.client_key_file)
    )
    client = kazoo(server.tls_hosts, **with_cert)
    client.start(timeout=10)
    assert "zookeeper" in client.get_children("/")
    assert_refused(
        kazoo(server.tls_hosts, **tls_options(server)),
        caplog,
        "bad certificate|certificate required",
    )
    directories = [server.security_material.directory, server.node.directory]
    zk_stack_factory.stop_all()
    assert not any(path.exists() for path in directories)


def test_a_secured_ensemble_serves_tls_on_every_member(
    zk_stack_factory: StackFactory, kazoo: ClientMaker
) -> None:
    ensemble = zk_stack_factory.ensemble(3, security=ZooKeeperSecurity(plain=False))
    hosts = ensemble.tls_hosts.split(",")
    assert hosts == [f"localhost:{node.secure_port}" for node in ensemble.nodes]
    for host in hosts:  # each member on its own: every one has the certificate
        client = kazoo(host, **tls_options(ensemble), read_only=False)
        client.start(timeout=10)
        client.ensure_path("/tls-ensemble")
        assert client.exists("/tls-ensemble") is not None


def test_security_options_are_checked() -> None:
    for bad, message in (
        ({"tls": False, "plain": False}, "tls or plain"),
        ({"client_auth": "always"}, "client_auth"),
        ({"tls": False, "client_auth": "need"}, "needs tls"),
        ({"sasl_users": {"al ice": None}}, "user name"),
        ({"sasl_users": {"alice": 'pa"ss'}}, "password"),
        ({"sasl_users": ["alice"]}, "mapping"),
    ):
        with pytest.raises(ValueError, match=message):
            ZooKeeperSecurity(**bad)
    users = {"alice": "fixed"}
    security = ZooKeeperSecurity(sasl_users=users)
    users["mallory"] = "added later"
    assert dict(security.sasl_users) == {"alice": "fixed"}
    with pytest.raises(StackError, match="not started"):
        ZooKeeperServer(security=security).tls_hosts  # noqa: B018


def test_without_security_the_accessors_say_so(zk_server: Any) -> None:
    if not isinstance(zk_server, ZooKeeperServer):
        pytest.skip("ZKLOCK_TEST_ZK_HOSTS points at an external ZooKeeper")
    with pytest.raises(StackError, match="without security"):
        zk_server.ca_file  # noqa: B018
    assert "secureClientPort" not in (zk_server.node.directory / "zoo.cfg").read_text()


# --------------------------------------------------------------------------- stack up --secure


def test_stack_up_secure_prints_tls_sasl_and_digest_settings_that_work(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-m", "celery_zklock.testing.cli", *STACK_UP_SECURE],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
        text=True,
    )
    lines: queue.Queue[str | None] = queue.Queue()

    def pump() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.put(line.rstrip("\n"))
        lines.put(None)

    threading.Thread(target=pump, daemon=True).start()
    try:
        exports: dict[str, str] = {}
        comments: list[str] = []
        deadline = time.monotonic() + 60
        while not comments or not comments[-1].startswith("# unrelated CA"):
            line = lines.get(timeout=max(0.0, deadline - time.monotonic()))
            if line is None:
                proc.wait(5)
                assert proc.stderr is not None
                pytest.fail(f"stack up ended ({proc.returncode}): {proc.stderr.read()}")
            if line.startswith("#"):
                comments.append(line)
            else:
                name, _, value = line.removeprefix("export ").partition("=")
                exports[name] = value
        assert set(exports) == {
            "ZKLOCK_HOSTS", "ZKLOCK_USE_SSL", "ZKLOCK_SSL_CA", "ZKLOCK_SASL_MECHANISM",
            "ZKLOCK_SASL_USERNAME", "ZKLOCK_SASL_PASSWORD", "ZKLOCK_AUTH",
        }  # fmt: skip
        assert re.fullmatch(r"localhost:\d+", exports["ZKLOCK_HOSTS"])
        assert exports["ZKLOCK_USE_SSL"] == "true"
        assert exports["ZKLOCK_SASL_MECHANISM"] == "DIGEST-MD5"
        user, password = exports["ZKLOCK_SASL_USERNAME"], exports["ZKLOCK_SASL_PASSWORD"]
        assert exports["ZKLOCK_AUTH"] == f"digest:{user}:{password}"
        ca = Path(exports["ZKLOCK_SSL_CA"])
        assert ca.read_text().startswith("-----BEGIN CERTIFICATE-----")
        assert any(re.match(r"# plain port .*ZKLOCK_HOSTS=127\.0\.0\.1:\d+", c) for c in comments)
        assert f"# SASL user {user} password {password}" in comments

        # The library's own settings, from exactly these variables, make a working client.
        for name, value in exports.items():
            monkeypatch.setenv(name, value)
        config = client_config({})
        assert (config.use_ssl, config.check_hostname, config.auth) == (
            True, True, (("digest", f"{user}:{password}"),)
        )  # fmt: skip
        assert dict(config.sasl) == {"mechanism": "DIGEST-MD5", "username": user,
                                     "password": password}  # fmt: skip
        client = new_client(config)
        try:
            client.start(timeout=10)
            path = client.create("/cli-secure-", b"up", sequence=True,
                                 acl=[make_acl("sasl", user, all=True)])  # fmt: skip
            assert client.get(path)[0] == b"up"
        finally:
            client.stop()
            client.close()

        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
        assert not ca.exists()  # the generated material is removed on stop
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for stream in (proc.stdout, proc.stderr):
            if stream is not None:
                stream.close()
