"""Every setting name checked (issue 46, item 1), without a server: the one registry of setting
names (celery_zklock.zk.known) holds every name read anywhere, a name that looks like a setting
and is none is named with the one it most likely means, under every spelling Celery reads
(Django's namespace too), once per process; a misspelt hosts setting is named where the hosts
are found empty; a hosts string with a URL scheme is refused with the format."""

from __future__ import annotations

import ast
import logging
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from celery import Celery

from celery_zklock.errors import ConfigurationError
from celery_zklock.ops.commands.checks import setting_name_checks
from celery_zklock.zk import known
from celery_zklock.zk.known import APP_SETTINGS, ENVIRONMENT, Unknown, unknown_settings
from celery_zklock.zk.settings import client_config, host_ports, setting, settings_of
from tests.lockutil import app_with

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def _nothing_said(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Each test starts with no name told (the registry warns once per process) and with no
    ``ZKLOCK_*`` variable of the suite's own environment."""
    monkeypatch.setattr(known, "_said", set())
    for name in [n for n in __import__("os").environ if n.upper().startswith("ZKLOCK_")]:
        monkeypatch.delenv(name)
    yield


def described(conf: Any, environ: dict[str, str] | None = None) -> list[str]:
    return [u.describe() for u in unknown_settings(conf, environ or {})]


# -- what is named ------------------------------------------------------------------------------


def test_a_misspelt_app_setting_and_variable_are_named_with_the_right_name() -> None:
    app = Celery("names")
    app.conf.update(zklock_session_timout=4.0, zklock_hosts="zk1:2181", zklock_root="/x")
    assert described(
        app.conf, {"ZKLOCK_SESSION_TIMOUT": "4", "ZKLOCK_ROOT": "/x", "PATH": "/"}
    ) == [
        "unknown setting zklock_session_timout in app.conf, ignored: "
        "did you mean zklock_session_timeout?",
        "unknown environment variable ZKLOCK_SESSION_TIMOUT, ignored: "
        "did you mean ZKLOCK_SESSION_TIMEOUT?",
    ]


@pytest.mark.parametrize(
    ("key", "meant"),
    [
        ("zklock_host", "zklock_hosts"),
        ("zklock_sesion_timeout", "zklock_session_timeout"),
        ("zklock_gate_max_hol", "zklock_gate_max_hold"),
        ("zklock_use_tls", "zklock_use_ssl"),
        # Celery reads app.conf's names as written: an upper-case one is not the setting.
        ("ZKLOCK_HOSTS", "zklock_hosts"),
        ("Zklock_Root", "zklock_root"),
    ],
)
def test_did_you_mean(key: str, meant: str) -> None:
    (unknown,) = unknown_settings({key: 1}, {})
    assert unknown == Unknown("app.conf", key, meant)


def test_a_name_close_to_none_is_named_without_a_guess() -> None:
    """Compared without the shared prefix: zklock_frobnicate is not 'zklock_root'."""
    (line,) = described({"zklock_frobnicate": 1})
    assert line == (
        "unknown setting zklock_frobnicate in app.conf, ignored: no celery-zklock setting is "
        "close to it (docs/settings.md lists them)"
    )


def test_names_that_are_not_ours_are_left_alone() -> None:
    conf = {"broker_url": "redis://", "zklock": 1, "my_zklock_thing": 2, 3: "not a string"}
    assert unknown_settings(conf, {"CELERY_ZKLOCK_HOSTS": "x", "PATH": "/bin"}) == []


def test_every_known_name_passes_under_each_spelling_celery_reads() -> None:
    assert unknown_settings(dict.fromkeys(APP_SETTINGS, 1), dict.fromkeys(ENVIRONMENT, "")) == []


def test_under_celerys_namespace_names_are_checked_and_suggested_as_written() -> None:
    """``config_from_object(settings, namespace="CELERY")`` (docs/django.md): Celery reads
    ``CELERY_ZKLOCK_HOSTS`` as ``zklock_hosts``, not ``CELERY_zklock_root`` nor
    ``ZKLOCK_ROOT``, and the suggestion is given the way the project writes its settings."""

    class DjangoSettings:
        CELERY_ZKLOCK_HOSTS = "zk1:2181"
        CELERY_ZKLOCK_SESION_TIMEOUT = 4
        CELERY_zklock_root = "/a"
        ZKLOCK_ROOT = "/b"
        CELERY_BROKER_URL = "memory://"

    app = Celery("django")
    app.config_from_object(DjangoSettings, namespace="CELERY")
    assert app.conf.get("zklock_hosts") == "zk1:2181"  # what makes CELERY_ZKLOCK_HOSTS known
    assert app.conf.get("zklock_root") is None  # and the other two spellings unknown
    assert {(u.name, u.meant) for u in unknown_settings(app.conf, {})} == {
        ("CELERY_ZKLOCK_SESION_TIMEOUT", "CELERY_ZKLOCK_SESSION_TIMEOUT"),
        ("CELERY_zklock_root", "CELERY_ZKLOCK_ROOT"),
        ("ZKLOCK_ROOT", "CELERY_ZKLOCK_ROOT"),
    }


def test_a_lower_case_variable_is_not_read_and_is_named() -> None:
    (unknown,) = unknown_settings({}, {"zklock_hosts": "zk1:2181"})
    assert unknown == Unknown("environment", "zklock_hosts", "ZKLOCK_HOSTS")


def test_the_tools_variables_are_known_and_their_typos_named() -> None:
    """The fleet's workers run with ZKLOCK_POOL and the like beside the library's settings."""
    assert unknown_settings({}, {"ZKLOCK_POOL": "prefork", "ZKLOCK_CONCURRENCY": "2"}) == []
    (unknown,) = unknown_settings({}, {"ZKLOCK_CONCURENCY": "2"})
    assert unknown.meant == "ZKLOCK_CONCURRENCY"


# -- when it is said ----------------------------------------------------------------------------


def test_the_first_read_warns_once_per_typo_per_process(caplog: pytest.LogCaptureFixture) -> None:
    """Whichever reader reads first (the connection, the gate, the one setting): one warning
    per typo for the process, however many reads and readers follow."""
    conf = {"zklock_hosts": "zk1:2181", "zklock_session_timout": 4, "zklock_gate_max_hol": 1}
    environ = {"ZKLOCK_SESSION_TIMOUT": "4"}
    app = app_with(conf)
    with pytest.MonkeyPatch.context() as patch, caplog.at_level(logging.WARNING):
        for name, value in environ.items():
            patch.setenv(name, value)
        client_config(conf)
        _ = settings_of(app, connection=False).gate
        setting(conf, "zklock_root")
        client_config({**conf, "zklock_root": "/other"})
    said = [r.getMessage() for r in caplog.records if r.name == "celery_zklock.settings"]
    assert sorted(said) == [
        "celery-zklock: unknown environment variable ZKLOCK_SESSION_TIMOUT, ignored: "
        "did you mean ZKLOCK_SESSION_TIMEOUT?",
        "celery-zklock: unknown setting zklock_gate_max_hol in app.conf, ignored: "
        "did you mean zklock_gate_max_hold?",
        "celery-zklock: unknown setting zklock_session_timout in app.conf, ignored: "
        "did you mean zklock_session_timeout?",
    ]


def test_doctors_check_lines_count_as_said(caplog: pytest.LogCaptureFixture) -> None:
    conf = {"zklock_hosts": "zk1:2181", "zklock_session_timout": 4}
    checks = setting_name_checks(conf, {})
    assert [c.line() for c in checks] == [
        "WARN  setting names: unknown setting zklock_session_timout in app.conf, ignored: "
        "did you mean zklock_session_timeout?"
    ]
    with caplog.at_level(logging.WARNING):
        client_config(conf)
    assert not [r for r in caplog.records if r.name == "celery_zklock.settings"]
    assert [c.status for c in setting_name_checks({"zklock_hosts": "zk1:2181"}, {})] == ["PASS"]


def test_a_reader_of_an_unregistered_name_is_refused() -> None:
    with pytest.raises(ValueError, match=r"'zklock_nobody_registered' is not in .*APP_SETTINGS"):
        setting({}, "zklock_nobody_registered")


# -- the hosts ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("conf", "environ", "named"),
    [
        ({"zklock_host": "zk1:2181"}, {}, "unknown setting zklock_host in app.conf"),
        ({}, {"ZKLOCK_HOST": "zk1:2181"}, "unknown environment variable ZKLOCK_HOST"),
    ],
)
def test_empty_hosts_name_the_misspelt_hosts_setting(
    conf: dict[str, str], environ: dict[str, str], named: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name, value in environ.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ConfigurationError) as raised:
        client_config(conf)
    message = str(raised.value)
    assert message.startswith(f"ZooKeeper hosts are empty ({named}, ignored: did you mean ")
    assert "zklock_hosts" in message and "ZKLOCK_HOSTS" in message


@pytest.mark.parametrize(
    ("hosts", "without"),
    [
        ("zk://127.0.0.1:2181", "'127.0.0.1:2181'"),
        ("zookeeper://zk1:2181,zk2:2181/app", "'zk1:2181,zk2:2181/app'"),
        ("zk1:2181,zk://zk2:2181", "'zk1:2181,zk2:2181'"),
    ],
)
def test_a_hosts_string_with_a_scheme_is_refused_with_the_format(hosts: str, without: str) -> None:
    """Not "chroot must be an absolute znode path ... got '//127.0.0.1:2181'"."""
    with pytest.raises(ConfigurationError) as raised:
        host_ports(hosts)
    message = str(raised.value)
    assert "has no scheme" in message and "chroot" not in message.split("give")[0]
    assert message.endswith(f"give host:port[,host:port...][/chroot], here {without}")
    with pytest.raises(ConfigurationError, match=re.escape("host:port[,host:port...][/chroot]")):
        client_config({"zklock_hosts": hosts})


# -- the registry holds every name read ---------------------------------------------------------

READERS = frozenset({"setting", "text_setting", "_flag", "_path", "_seconds", "get"})
"""The functions through which the package reads an app setting by name (``get`` of a conf)."""


def reads_conf(func: ast.expr) -> bool:
    """``conf.get`` or ``app.conf.get`` (not a message's ``headers.get``)."""
    owner = func.value if isinstance(func, ast.Attribute) else None
    return (isinstance(owner, ast.Name) and owner.id == "conf") or (
        isinstance(owner, ast.Attribute) and owner.attr == "conf"
    )


def names_read_in_the_package() -> set[str]:
    """Every ``zklock_*`` name passed to a reader (a string, or a module constant holding one)."""
    names: set[str] = set()
    for path in (ROOT / "celery_zklock").rglob("*.py"):
        tree = ast.parse(path.read_text())
        constants = {
            target.id: node.value.value
            for node in tree.body
            if isinstance(node, ast.Assign | ast.AnnAssign)
            and isinstance(node.value, ast.Constant)
            and isinstance(node.value.value, str)
            for target in ([node.target] if isinstance(node, ast.AnnAssign) else node.targets)
            if isinstance(target, ast.Name)
        }
        for call in (n for n in ast.walk(tree) if isinstance(n, ast.Call)):
            func = call.func
            called = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
            if called not in READERS or (called == "get" and not reads_conf(func)):
                continue
            for arg in call.args:
                value = arg.value if isinstance(arg, ast.Constant) else None
                if isinstance(arg, ast.Name):
                    value = constants.get(arg.id)
                if isinstance(value, str) and value.startswith("zklock_"):
                    names.add(value)
    return names


def test_the_registry_holds_every_app_setting_read_and_no_other() -> None:
    read = names_read_in_the_package()
    assert read - APP_SETTINGS == set()
    assert APP_SETTINGS - read == set()


ENV_NAME = re.compile(r"(?<=[\"'`{$])ZKLOCK_[A-Z0-9_]*[A-Z0-9](?![A-Za-z0-9_{*])")
"""A ``ZKLOCK_*`` name quoted, in backticks or after ``$``/``${`` (not a Python identifier such as
benchmarks' task-name constants ``ZKLOCK_SKIP``; not a prefix such as ``ZKLOCK_SASL_{key}``)."""


def variables_in_the_project() -> set[str]:
    """Every ``ZKLOCK_*`` variable named in the library, the fleet, benchmarks and compose."""
    files = [
        *(
            p
            for d in ("celery_zklock", "workers", "benchmarks", "compose")
            for p in (ROOT / d).rglob("*")
        ),
        ROOT / "Makefile",
    ]
    found: set[str] = set()
    for path in files:
        if path.is_file() and path.suffix not in (".pyc", ".png", ".jar"):
            found.update(ENV_NAME.findall(path.read_text(errors="replace")))
    return found


def test_the_registry_holds_every_environment_variable_read_and_no_stale_one() -> None:
    named = variables_in_the_project()
    assert named - ENVIRONMENT == set()
    stale = (known.TOOL_ENVIRONMENT | {"ZKLOCK_INTERRUPT_SIGNAL", "ZKLOCK_REVOKE_SIGNAL"}) - named
    assert stale == set()


def test_the_settings_page_lists_every_app_setting() -> None:
    page = (ROOT / "docs" / "settings.md").read_text()
    assert {name for name in APP_SETTINGS if f"`{name}`" not in page} == set()
