"""The connection settings (``client_config``): every one from ``app.conf`` or its ``ZKLOCK_*``
variable, in one documented format, and every bad one refused with what to do."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
from celery import Celery
from kazoo.security import ACL, make_digest_acl

from celery_zklock.errors import ConfigurationError
from celery_zklock.worker.wiring import read_settings_afresh
from celery_zklock.zk.client import KAZOO_CHECKS_HOSTNAMES, new_client
from celery_zklock.zk.settings import (
    CREATOR_ACL,
    DEFAULT_CONNECT_TIMEOUT,
    DEFAULT_SESSION_TIMEOUT,
    ClientConfig,
    client_config,
    host_ports,
    settings_of,
)


@pytest.fixture(autouse=True)
def _no_zklock_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    for name in [n for n in os.environ if n.startswith("ZKLOCK_")]:
        monkeypatch.delenv(name)


def config(**conf: Any) -> ClientConfig:
    return client_config({"zklock_hosts": "zk1:2181", **conf})


def test_the_defaults_are_an_open_plain_connection() -> None:
    c = config()
    assert (c.acl, c.auth, c.sasl, c.use_ssl, c.factory) == ((), (), (), False, None)
    assert c.verify_certs and not c.check_hostname  # hostnames are checked only with TLS on


def test_every_connection_setting_has_an_environment_fallback(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    ca = tmp_path / "ca.pem"
    ca.write_text("x")
    env = {
        "ZKLOCK_HOSTS": "a:1,b:2",
        "ZKLOCK_SESSION_TIMEOUT": "7",
        "ZKLOCK_CONNECT_TIMEOUT": "3",
        "ZKLOCK_AUTH": "digest:alice:s3cret, digest:bob:pw",
        "ZKLOCK_ACL": "creator",
        "ZKLOCK_SASL_MECHANISM": "DIGEST-MD5",
        "ZKLOCK_SASL_USERNAME": "alice",
        "ZKLOCK_SASL_PASSWORD": "pw",
        "ZKLOCK_USE_SSL": "true",
        "ZKLOCK_SSL_CA": str(ca),
        "ZKLOCK_SSL_CERTFILE": str(ca),
        "ZKLOCK_SSL_KEYFILE": str(ca),
        "ZKLOCK_SSL_KEYFILE_PASSWORD": "kp",
        "ZKLOCK_SSL_VERIFY": "yes",
        "ZKLOCK_CLIENT_FACTORY": "myapp.zk:client",
    }
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    c = client_config({})
    assert c.hosts == "a:1,b:2" and c.session_timeout == 7 and c.connect_timeout == 3
    assert c.auth == (("digest", "alice:s3cret"), ("digest", "bob:pw"))
    assert c.acl == CREATOR_ACL
    assert dict(c.sasl) == {"mechanism": "DIGEST-MD5", "username": "alice", "password": "pw"}
    assert c.use_ssl and c.verify_certs and c.check_hostname  # on whenever certs are verified
    assert (c.ca, c.certfile, c.keyfile, c.keyfile_password) == (str(ca), str(ca), str(ca), "kp")
    assert c.factory == "myapp.zk:client"


def test_app_conf_wins_over_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ZKLOCK_ACL", "creator")
    monkeypatch.setenv("ZKLOCK_AUTH", "digest:env:pw")
    c = config(zklock_acl="open", zklock_auth=[("digest", "conf:pw")])
    assert c.acl == () and c.auth == (("digest", "conf:pw"),)


def test_creator_acl_needs_credentials() -> None:
    with pytest.raises(ConfigurationError, match=r"zklock_acl='creator' needs credentials"):
        config(zklock_acl="creator")
    assert config(zklock_acl="creator", zklock_auth=[("digest", "a:b")]).acl == CREATOR_ACL
    sasl = {"mechanism": "DIGEST-MD5", "username": "a", "password": "b"}
    assert config(zklock_acl="creator", zklock_sasl=sasl).acl == CREATOR_ACL


def test_creator_acl_lets_the_creator_do_anything_and_the_world_read() -> None:
    perms = {(acl.id.scheme, acl.id.id): acl.perms for acl in CREATOR_ACL}
    assert perms == {("auth", ""): 31, ("world", "anyone"): 1}


def test_an_acl_list_is_used_as_given_and_bad_ones_are_named() -> None:
    acl = [make_digest_acl("alice", "pw", all=True)]
    assert config(zklock_acl=acl).acl == tuple(acl)
    for bad in ("closed", [], ["world:anyone"], 42):
        with pytest.raises(ConfigurationError, match="zklock_acl must be"):
            config(zklock_acl=bad)
    assert all(isinstance(entry, ACL) for entry in CREATOR_ACL)


@pytest.mark.parametrize(
    ("conf", "message"),
    [
        ({"zklock_use_ssl": "maybe"}, r"zklock_use_ssl must be true or false"),
        ({"zklock_use_ssl": True}, r"needs zklock_ssl_ca"),
        ({"zklock_ssl_ca": "/no/such/ca.pem"}, r"zklock_ssl_ca: no such file"),
        (
            {"zklock_ssl_verify": False, "zklock_ssl_check_hostname": True},
            r"check_hostname needs zklock_ssl_verify",
        ),
        ({"zklock_sasl": {"username": "a"}}, r"zklock_sasl needs a mechanism"),
        ({"zklock_sasl": {"mechanism": "PLAIN", "realm": "x"}}, r"unknown keys \['realm'\]"),
        ({"zklock_sasl": "alice"}, r"zklock_sasl must be a dict"),
        ({"zklock_auth": "digest:a:b"}, r"zklock_auth must be a list of \(scheme, credential\)"),
        ({"zklock_client_factory": "myapp.zk.client"}, r"must be 'module:callable'"),
    ],
)
def test_bad_settings_are_refused_with_what_to_do(conf: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigurationError, match=message):
        config(**conf)


def test_a_bad_auth_variable_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    for bad in ("alice", "digest:", ":alice:pw"):  # no credential, or no scheme
        monkeypatch.setenv("ZKLOCK_AUTH", bad)
        with pytest.raises(ConfigurationError, match=r"ZKLOCK_AUTH must be scheme:credential"):
            config()


def test_the_client_gets_the_acl_auth_sasl_and_tls_settings(tmp_path: Path) -> None:
    ca = tmp_path / "ca.pem"
    ca.write_text("x")
    c = config(
        zklock_acl="creator",
        zklock_auth=[("digest", "alice:pw")],
        zklock_sasl={"mechanism": "DIGEST-MD5", "username": "alice", "password": "pw"},
        zklock_use_ssl=True,
        zklock_ssl_ca=str(ca),
        zklock_ssl_keyfile_password="kp",
    )
    if not KAZOO_CHECKS_HOSTNAMES:  # kazoo < 2.11: hostname checking refused, not dropped
        with pytest.raises(ConfigurationError, match=r"check_hostname needs kazoo 2.11"):
            new_client(c)
        c = dataclasses.replace(c, check_hostname=False)
    client = new_client(c)
    try:
        assert client.default_acl == list(CREATOR_ACL)
        assert client.auth_data == {("digest", "alice:pw")}
        assert client._connection.sasl_options == dict(c.sasl)
        assert client.use_ssl and client.ca == str(ca)
        assert getattr(client, "check_hostname", False) == KAZOO_CHECKS_HOSTNAMES
        assert client.keyfile_password == "kp"
    finally:
        client.close()


def test_a_factory_that_is_not_there_or_returns_no_client_is_named() -> None:
    with pytest.raises(ConfigurationError, match=r"cannot be imported"):
        new_client(config(zklock_client_factory="no_such_module_here:make"))
    with pytest.raises(ConfigurationError, match=r"returned str, not a kazoo"):
        new_client(config(zklock_client_factory="os:getcwd"))


def test_each_connection_setting_has_one_default() -> None:
    """A config built from settings and one built directly agree: the defaults are one constant
    each (once 5 s from the settings and 15 s for a direct ClientConfig)."""
    direct, read = ClientConfig(hosts="zk1:2181"), config()
    assert direct.connect_timeout == read.connect_timeout == DEFAULT_CONNECT_TIMEOUT == 5.0
    assert direct.session_timeout == read.session_timeout == DEFAULT_SESSION_TIMEOUT == 10.0


def test_host_ports_of_a_connection_string() -> None:
    assert host_ports("zk1:2181, zk2:2182,zk3/app") == [
        ("zk1", 2181), ("zk2", 2182), ("zk3", 2181),
    ]  # fmt: skip
    assert host_ports("[::1]:2281,zk.example.com") == [("::1", 2281), ("zk.example.com", 2181)]


@pytest.mark.parametrize(
    ("hosts", "entry", "problem"),
    [
        ("127.0.0.1:abc", "'127.0.0.1:abc'", "its port is not a number from 1 to 65535"),
        ("zk1:2181,zk2:70000", "'zk2:70000'", "its port is not a number from 1 to 65535"),
        ("zk1:0", "'zk1:0'", "its port is not a number from 1 to 65535"),
        ("zk1:2181,,zk3:2181", "''", "it names no host"),
        ("zk1:2181,", "''", "it names no host"),
        (":2181", "':2181'", "it names no host"),
        ("zk 1:2181", "'zk 1:2181'", "it is not host\\[:port\\]"),
    ],
)
def test_a_malformed_host_list_names_the_setting_and_the_entry(
    hosts: str, entry: str, problem: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    expected = rf"zklock_hosts \(env ZKLOCK_HOSTS\) .*the entry {entry} is not valid \({problem}\)"
    with pytest.raises(ConfigurationError, match=expected):
        client_config({"zklock_hosts": hosts})
    monkeypatch.setenv("ZKLOCK_HOSTS", hosts)
    with pytest.raises(ConfigurationError, match=expected):
        client_config({})
    with pytest.raises(ConfigurationError, match="chroot"):
        client_config({"zklock_hosts": "zk1:2181/app//locks"})


def test_an_app_has_one_settings_object_whose_parts_are_read_once_when_asked() -> None:
    """Each reader takes its part of one object per app; a part is read at its first ask and
    kept, a bad one raises and is read again; a worker's start reads them all afresh."""
    app = Celery("one-object", set_as_current=False)
    app.conf.update(zklock_hosts="zk1:2181", zklock_gate_max_held="many", zklock_beat_name="a/b")
    settings = settings_of(app)  # the connection part only: the gate's and beat's are not read
    assert settings_of(app) is settings and settings.root == "/zklock"
    for part, message in (("gate", "zklock_gate_max_held"), ("beat", "one znode name")):
        with pytest.raises(ConfigurationError, match=message):
            getattr(settings, part)
    app.conf.update(zklock_gate_max_held=5, zklock_root="/elsewhere")
    assert settings.gate.max_held == 5 and settings.root == "/zklock"  # kept once valid
    app.conf.zklock_gate = False
    assert settings_of(app).gate.enabled
    read_settings_afresh(sender=type("Worker", (), {"app": app})())
    assert not settings_of(app).gate.enabled and settings_of(app).root == "/elsewhere"


def test_the_brokers_redelivery_bound_is_a_part_read_once() -> None:
    """A run's "may a copy have run" look and the gate's default ``max_hold`` take the broker's
    redelivery bound from the app's one settings object, read at its first ask."""
    app = Celery("bound", set_as_current=False)
    app.conf.update(
        broker_url="redis://r:6379/0", broker_transport_options={"visibility_timeout": 60}
    )
    settings = settings_of(app, connection=False)
    assert settings.redelivery_timeout == 60.0 and settings.gate.max_hold == 48.0
    app.conf.broker_transport_options = {"visibility_timeout": 120}
    assert settings.redelivery_timeout == 60.0  # kept, as every part
    app.conf.broker_url = "amqp://r//"
    read_settings_afresh(sender=type("Worker", (), {"app": app})())
    assert settings_of(app, connection=False).redelivery_timeout == 1800.0
