"""The worker fleet's settings, read from ``ZKLOCK_*`` environment variables.

The same variables configure a worker started by hand, by the demo, by the fleet launcher and by
the compose ``worker`` service (compose/docker-compose.yml):

============================= ======== ======================================================
variable                      default  meaning
============================= ======== ======================================================
``ZKLOCK_HOSTS``              required ZooKeeper connection string ``host:port[,...][/chroot]``
``ZKLOCK_BROKER_URL``         required Celery broker, a Redis URL (``redis://``, ``rediss://``)
                                       or a RabbitMQ one (``amqp://``, ``amqps://``)
``ZKLOCK_RESULT_BACKEND``     broker   Celery result backend, a Redis URL (set it with a
                                       RabbitMQ broker)
``ZKLOCK_RECORD_URL``         broker   Redis URL where critical sections and fenced writes go
``ZKLOCK_POOL``               prefork  worker pool: ``prefork``, ``threads``, ``gevent``, ``solo``
``ZKLOCK_CONCURRENCY``        4        processes/threads/greenlets per worker, ``>= 1``
``ZKLOCK_SESSION_TIMEOUT``    10       ZooKeeper session timeout in seconds, ``> 0``
``ZKLOCK_ROOT``               /zklock  znode under which the task locks live
``ZKLOCK_VISIBILITY_TIMEOUT`` 60       seconds after which the broker hands a message that was
                                       taken and never acknowledged (its worker died) to
                                       another worker, ``> 0``; must exceed the longest task
                                       (Redis; RabbitMQ hands it out when the worker's
                                       connection closes)
``ZKLOCK_GATE``               true     the gate: a busy ``wait`` task's message waits in the
                                       worker's main process, not a pool slot (``docs/waiting.md``);
                                       ``true`` or ``false``
============================= ======== ======================================================

An empty variable counts as unset. Every bad or missing value is reported at once, in one
:class:`SettingsError`.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields
from typing import Any, Final
from urllib.parse import urlsplit

from celery_zklock.errors import ConfigurationError
from celery_zklock.zk.validate import positive_int, seconds, znode_path

__all__ = [
    "AMQP_SCHEMES",
    "POOLS",
    "REDIS_SCHEMES",
    "Settings",
    "SettingsError",
    "broker_transport_options",
    "is_amqp",
    "load_settings",
]

POOLS: Final[tuple[str, ...]] = ("prefork", "threads", "gevent", "solo")
REDIS_SCHEMES: Final[tuple[str, ...]] = ("redis", "rediss")
AMQP_SCHEMES: Final[tuple[str, ...]] = ("amqp", "amqps", "pyamqp")

DEFAULT_POOL: Final = "prefork"
DEFAULT_CONCURRENCY: Final = 4
DEFAULT_SESSION_TIMEOUT: Final = 10.0
DEFAULT_ROOT: Final = "/zklock"
DEFAULT_VISIBILITY_TIMEOUT: Final = 60.0
SWITCH_WORDS: Final[Mapping[str, bool]] = {
    "true": True, "on": True, "yes": True, "1": True,
    "false": False, "off": False, "no": False, "0": False,
}  # fmt: skip


class SettingsError(ValueError):
    """One or more ``ZKLOCK_*`` variables are missing or invalid; ``problems`` lists each one."""

    def __init__(self, problems: list[str]) -> None:
        self.problems = list(problems)
        super().__init__(
            "invalid worker fleet settings:\n" + "\n".join(f"  - {p}" for p in self.problems)
        )


@dataclass(frozen=True)
class Settings:
    """Validated fleet settings; construct with :meth:`from_env` (or directly, which validates)."""

    zk_hosts: str
    broker_url: str
    result_backend: str
    record_url: str
    pool: str = DEFAULT_POOL
    concurrency: int = DEFAULT_CONCURRENCY
    session_timeout: float = DEFAULT_SESSION_TIMEOUT
    zk_root: str = DEFAULT_ROOT
    visibility_timeout: float = DEFAULT_VISIBILITY_TIMEOUT
    gate: bool = True

    def __post_init__(self) -> None:
        values, problems = _checked({f.name: getattr(self, f.name) for f in fields(self)})
        if problems:
            raise SettingsError(problems)
        for name, value in values.items():
            object.__setattr__(self, name, value)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> Settings:
        """Read the settings from ``environ`` (default ``os.environ``).

        Raises :class:`SettingsError` naming every missing or invalid variable.
        """
        env = os.environ if environ is None else environ
        raw = {
            field: text
            for field, (variable, _) in _VARIABLES.items()
            if (text := env.get(variable, "").strip())
        }
        problems = [
            f"{_VARIABLES[field][0]} is not set: {example}"
            for field, example in _REQUIRED.items()
            if field not in raw
        ]
        # An unset backend or record URL follows the broker, which is checked once, as the broker.
        values, more = _checked(raw, text=True)
        if problems or more:
            raise SettingsError(problems + more)
        broker = values["broker_url"]
        values.setdefault("result_backend", broker)
        values.setdefault("record_url", broker)
        return cls(**values)

    def to_env(self) -> dict[str, str]:
        """The ``ZKLOCK_*`` variables that :meth:`from_env` reads back as these settings."""
        return {
            variable: _env_text(value)
            for field, (variable, _) in _VARIABLES.items()
            if (value := getattr(self, field)) is not None
        }


def _env_text(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return repr(value) if isinstance(value, float) else str(value)


def load_settings(environ: Mapping[str, str] | None = None) -> Settings:
    """Shorthand for :meth:`Settings.from_env`."""
    return Settings.from_env(environ)


# ------------------------------------------------------------------------------------ checks


def _hosts(name: str, hosts: object, *, text: bool = False) -> str:
    """``host:port[,host:port...]`` with an optional ``/chroot`` after the last host."""
    if not isinstance(hosts, str):
        raise ConfigurationError(f"{name} must be a connection string, got {hosts!r}")
    addresses, _, chroot = hosts.strip().partition("/")
    problems: list[str] = []
    if chroot and (chroot.endswith("/") or "//" in chroot):
        problems.append(f"bad chroot '/{chroot}'")
    for entry in (e.strip() for e in addresses.split(",")):
        host, sep, port = entry.rpartition(":")
        if not entry:
            problems.append("empty host")
        elif not sep or not host:
            problems.append(f"{entry!r} is not host:port")
        elif not port.isdigit() or not 0 < int(port) < 65536:
            problems.append(f"bad port {port!r}")
    if problems:
        raise ConfigurationError(f"{name}: {'; '.join(problems)} in {hosts!r}")
    return hosts


def _redis_url(name: str, url: object, *, text: bool = False) -> str:
    return _url(name, url, REDIS_SCHEMES, "a Redis URL (redis:// or rediss://)")


def _broker_url(name: str, url: object, *, text: bool = False) -> str:
    return _url(name, url, REDIS_SCHEMES + AMQP_SCHEMES, "a Redis or RabbitMQ URL (redis://, "
                "rediss://, amqp:// or amqps://)")  # fmt: skip


def _url(name: str, url: object, schemes: tuple[str, ...], what: str) -> str:
    if not isinstance(url, str):
        raise ConfigurationError(f"{name} must be {what.split(' (')[0]}, got {url!r}")
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018  (parsed only to validate it)
    except ValueError as exc:
        raise ConfigurationError(f"{name}: {url!r} is not a URL ({exc})") from None
    if parts.scheme not in schemes:
        raise ConfigurationError(f"{name} must be {what}, got {url!r}")
    if not parts.hostname:
        raise ConfigurationError(f"{name}: no host in {url!r}")
    return url


def is_amqp(url: str) -> bool:
    """Whether the broker at ``url`` is RabbitMQ (an AMQP URL)."""
    return urlsplit(url).scheme in AMQP_SCHEMES


def _pool(name: str, pool: object, *, text: bool = False) -> str:
    if pool not in POOLS:
        raise ConfigurationError(f"{name} must be one of {', '.join(POOLS)}; got {pool!r}")
    return str(pool)


def _path(name: str, path: object, *, text: bool = False) -> str:
    return znode_path(name, path)


def _switch(name: str, value: object, *, text: bool = False) -> bool:
    if isinstance(value, bool):
        return value
    word = SWITCH_WORDS.get(str(value).strip().lower()) if isinstance(value, str) else None
    if word is None:
        raise ConfigurationError(f"{name} must be true or false, got {value!r}")
    return word


_VARIABLES: Final[Mapping[str, tuple[str, Callable[..., Any]]]] = {
    "zk_hosts": ("ZKLOCK_HOSTS", _hosts),
    "broker_url": ("ZKLOCK_BROKER_URL", _broker_url),
    "result_backend": ("ZKLOCK_RESULT_BACKEND", _redis_url),
    "record_url": ("ZKLOCK_RECORD_URL", _redis_url),
    "pool": ("ZKLOCK_POOL", _pool),
    "concurrency": ("ZKLOCK_CONCURRENCY", positive_int),
    "session_timeout": ("ZKLOCK_SESSION_TIMEOUT", seconds),
    "zk_root": ("ZKLOCK_ROOT", _path),
    "visibility_timeout": ("ZKLOCK_VISIBILITY_TIMEOUT", seconds),
    "gate": ("ZKLOCK_GATE", _switch),
}
"""Settings field -> (its variable, the check that names it in a message)."""

_REQUIRED: Final[Mapping[str, str]] = {
    "zk_hosts": "the ZooKeeper connection string, e.g. '127.0.0.1:2181' or "
    "'zk1:2181,zk2:2181,zk3:2181'",
    "broker_url": "the Celery broker, e.g. 'redis://127.0.0.1:6379/0'",
}


def _checked(values: Mapping[str, object], text: bool = False) -> tuple[dict[str, Any], list[str]]:
    """The checked and normalised ``values`` (by field), and every problem found."""
    checked: dict[str, Any] = {}
    problems: list[str] = []
    for field, value in values.items():
        variable, check = _VARIABLES[field]
        try:
            checked[field] = check(variable, value, text=text)
        except ConfigurationError as exc:
            problems.append(str(exc))
    return checked, problems


def broker_transport_options(visibility_timeout: float, broker_url: str = "") -> dict[str, Any]:
    """The transport options of the fleet. Redis: redelivery after ``visibility_timeout`` s.
    RabbitMQ (``broker_url`` an AMQP URL): publisher confirms, so that a publish returns only
    once the node has the message (a persistent one on disk) and a publish cut off by a broker
    restart raises and is retried; without them a message the node took just before a SIGKILL
    can be gone after the restart."""
    if broker_url and is_amqp(broker_url):
        return {"confirm_publish": True}
    # kombu sweeps for overdue messages every interval * throttle seconds (100 s by default):
    # sweep often enough that a dead worker's message waits about the visibility timeout.
    interval = max(1, min(10, int(visibility_timeout // 10)))
    return {
        "visibility_timeout": visibility_timeout,
        "unacked_restore_interval": interval,
        "unacked_restore_throttle": 1,
        # A sweep holds a Redis mutex that lapses after this long (300 s by default). A worker
        # killed inside a sweep (it takes milliseconds, more when Redis fsyncs every write)
        # stopped all redelivery for five minutes; concurrent sweeps are safe (kombu restores
        # each message in a transaction), so a short lapse costs nothing.
        "unacked_mutex_expire": RESTORE_MUTEX_EXPIRE,
    }


RESTORE_MUTEX_EXPIRE = 5
"""Seconds kombu's restore mutex outlives a sweeper that died holding it (see above)."""
