"""The worker fleet's settings, read from ``ZKLOCK_*`` environment variables.

The same variables configure a worker started by hand, by the demo, by the fleet launcher and by
the compose ``worker`` service (compose/docker-compose.yml):

============================= ======== ======================================================
variable                      default  meaning
============================= ======== ======================================================
``ZKLOCK_HOSTS``              required ZooKeeper connection string ``host:port[,...][/chroot]``
``ZKLOCK_BROKER_URL``         required Celery broker, a Redis URL (``redis://``, ``rediss://``)
``ZKLOCK_RESULT_BACKEND``     broker   Celery result backend, a Redis URL
``ZKLOCK_RECORD_URL``         broker   Redis URL where critical sections and fenced writes go
``ZKLOCK_POOL``               prefork  worker pool: ``prefork``, ``threads``, ``gevent``, ``solo``
``ZKLOCK_CONCURRENCY``        4        processes/threads/greenlets per worker, ``>= 1``
``ZKLOCK_SESSION_TIMEOUT``    10       ZooKeeper session timeout in seconds, ``> 0``
``ZKLOCK_ROOT``               /zklock  znode under which the task locks live
``ZKLOCK_VISIBILITY_TIMEOUT`` 60       seconds after which the broker hands a message that was
                                       taken and never acknowledged (its worker died) to
                                       another worker, ``> 0``; must exceed the longest task
============================= ======== ======================================================

An empty variable counts as unset. :meth:`Settings.from_env` reports every bad or missing value
at once in one :class:`SettingsError`; :meth:`Settings.to_env` is its inverse, for starting a
worker subprocess with exactly these settings.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Final, TypeVar
from urllib.parse import urlsplit

__all__ = ["POOLS", "REDIS_SCHEMES", "Settings", "SettingsError", "load_settings"]

POOLS: Final[tuple[str, ...]] = ("prefork", "threads", "gevent", "solo")
REDIS_SCHEMES: Final[tuple[str, ...]] = ("redis", "rediss")

DEFAULT_POOL: Final = "prefork"
DEFAULT_CONCURRENCY: Final = 4
DEFAULT_SESSION_TIMEOUT: Final = 10.0
DEFAULT_ROOT: Final = "/zklock"
DEFAULT_VISIBILITY_TIMEOUT: Final = 60.0


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

    def __post_init__(self) -> None:
        problems = _field_problems(
            hosts=self.zk_hosts,
            broker=self.broker_url,
            backend=self.result_backend,
            record=self.record_url,
            pool=self.pool,
            concurrency=self.concurrency,
            session_timeout=self.session_timeout,
            root=self.zk_root,
            visibility_timeout=self.visibility_timeout,
        )
        if problems:
            raise SettingsError(problems)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> Settings:
        """Read the settings from ``environ`` (default ``os.environ``).

        Raises :class:`SettingsError` naming every missing or invalid variable.
        """
        env = os.environ if environ is None else environ

        def get(name: str) -> str | None:
            value = env.get(name, "").strip()
            return value or None

        problems: list[str] = []
        hosts = get("ZKLOCK_HOSTS")
        if hosts is None:
            problems.append(
                "ZKLOCK_HOSTS is not set: the ZooKeeper connection string, e.g. "
                "'127.0.0.1:2181' or 'zk1:2181,zk2:2181,zk3:2181'"
            )
        broker = get("ZKLOCK_BROKER_URL")
        if broker is None:
            problems.append(
                "ZKLOCK_BROKER_URL is not set: the Celery broker, e.g. 'redis://127.0.0.1:6379/0'"
            )
        concurrency = _parse(
            get("ZKLOCK_CONCURRENCY"), int, DEFAULT_CONCURRENCY, problems,
            "ZKLOCK_CONCURRENCY must be a whole number >= 1",
        )  # fmt: skip
        session_timeout = _parse(
            get("ZKLOCK_SESSION_TIMEOUT"), float, DEFAULT_SESSION_TIMEOUT, problems,
            "ZKLOCK_SESSION_TIMEOUT must be a number of seconds > 0",
        )  # fmt: skip
        visibility_timeout = _parse(
            get("ZKLOCK_VISIBILITY_TIMEOUT"), float, DEFAULT_VISIBILITY_TIMEOUT, problems,
            "ZKLOCK_VISIBILITY_TIMEOUT must be a number of seconds > 0",
        )  # fmt: skip
        backend = get("ZKLOCK_RESULT_BACKEND")
        record = get("ZKLOCK_RECORD_URL")
        pool = get("ZKLOCK_POOL") or DEFAULT_POOL
        root = get("ZKLOCK_ROOT") or DEFAULT_ROOT
        # Missing and unparsable values are None here: reported above, skipped below. An unset
        # backend or record URL defaults to the broker URL, which is checked once, as the broker.
        problems += _field_problems(
            hosts=hosts,
            broker=broker,
            backend=backend,
            record=record,
            pool=pool,
            concurrency=concurrency,
            session_timeout=session_timeout,
            root=root,
            visibility_timeout=visibility_timeout,
        )
        if problems or hosts is None or broker is None:
            raise SettingsError(problems)
        # else a problem above
        assert concurrency is not None and session_timeout is not None
        assert visibility_timeout is not None
        return cls(
            zk_hosts=hosts,
            broker_url=broker,
            result_backend=backend or broker,
            record_url=record or broker,
            pool=pool,
            concurrency=concurrency,
            session_timeout=session_timeout,
            zk_root=root,
            visibility_timeout=visibility_timeout,
        )

    def to_env(self) -> dict[str, str]:
        """The ``ZKLOCK_*`` variables that :meth:`from_env` reads back as these settings."""
        return {
            "ZKLOCK_HOSTS": self.zk_hosts,
            "ZKLOCK_BROKER_URL": self.broker_url,
            "ZKLOCK_RESULT_BACKEND": self.result_backend,
            "ZKLOCK_RECORD_URL": self.record_url,
            "ZKLOCK_POOL": self.pool,
            "ZKLOCK_CONCURRENCY": str(self.concurrency),
            "ZKLOCK_SESSION_TIMEOUT": repr(self.session_timeout),
            "ZKLOCK_ROOT": self.zk_root,
            "ZKLOCK_VISIBILITY_TIMEOUT": repr(self.visibility_timeout),
        }


def load_settings(environ: Mapping[str, str] | None = None) -> Settings:
    """Shorthand for :meth:`Settings.from_env`."""
    return Settings.from_env(environ)


_N = TypeVar("_N", int, float)


def _parse(
    raw: str | None, kind: type[_N], default: _N, problems: list[str], message: str
) -> _N | None:
    """``raw`` converted with ``kind``; ``default`` if unset; None (and a problem) if bad."""
    if raw is None:
        return default
    try:
        return kind(raw)
    except ValueError:
        problems.append(f"{message}, got {raw!r}")
        return None


def _field_problems(
    *,
    hosts: str | None,
    broker: str | None,
    backend: str | None,
    record: str | None,
    pool: str | None,
    concurrency: int | None,
    session_timeout: float | None,
    root: str | None,
    visibility_timeout: float | None,
) -> list[str]:
    """Every problem with the given values; a None value is skipped (reported elsewhere)."""
    problems: list[str] = []
    if hosts is not None:
        problems += _check_hosts("ZKLOCK_HOSTS", hosts)
    for name, url in (
        ("ZKLOCK_BROKER_URL", broker),
        ("ZKLOCK_RESULT_BACKEND", backend),
        ("ZKLOCK_RECORD_URL", record),
    ):
        if url is not None:
            problems += _check_redis_url(name, url)
    if pool is not None:
        problems += _check_pool(pool)
    if concurrency is not None:
        problems += _check_concurrency(concurrency)
    if session_timeout is not None:
        problems += _check_session_timeout(session_timeout)
    if root is not None:
        problems += _check_root(root)
    if visibility_timeout is not None:
        problems += _check_seconds("ZKLOCK_VISIBILITY_TIMEOUT", visibility_timeout)
    return problems


# ------------------------------------------------------------------------------------ checks


def _check_hosts(name: str, hosts: str) -> list[str]:
    """``host:port[,host:port...]`` with an optional ``/chroot`` after the last host."""
    text, _, chroot = hosts.strip().partition("/")
    problems: list[str] = []
    if chroot and (chroot.endswith("/") or "//" in chroot):
        problems.append(f"{name}: bad chroot '/{chroot}' in {hosts!r}")
    entries = text.split(",")
    for entry in entries:
        host, sep, port = entry.strip().rpartition(":")
        if not entry.strip():
            problems.append(f"{name}: empty host in {hosts!r}")
        elif not sep or not host:
            problems.append(f"{name}: {entry.strip()!r} is not host:port (in {hosts!r})")
        elif not port.isdigit() or not 0 < int(port) < 65536:
            problems.append(f"{name}: bad port {port!r} in {hosts!r}")
    return problems


def _check_redis_url(name: str, url: str) -> list[str]:
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as exc:
        return [f"{name}: {url!r} is not a URL ({exc})"]
    if parts.scheme not in REDIS_SCHEMES:
        return [f"{name} must be a Redis URL (redis:// or rediss://), got {url!r}"]
    if not parts.hostname:
        return [f"{name}: no host in {url!r}"]
    del port  # parsed only to validate it
    return []


def _check_pool(pool: str) -> list[str]:
    if pool not in POOLS:
        return [f"ZKLOCK_POOL must be one of {', '.join(POOLS)}; got {pool!r}"]
    return []


def _check_concurrency(concurrency: int) -> list[str]:
    if isinstance(concurrency, bool) or not isinstance(concurrency, int) or concurrency < 1:
        return [f"ZKLOCK_CONCURRENCY must be a whole number >= 1, got {concurrency!r}"]
    return []


def _check_session_timeout(seconds: float) -> list[str]:
    return _check_seconds("ZKLOCK_SESSION_TIMEOUT", seconds)


def _check_seconds(name: str, seconds: float) -> list[str]:
    if not isinstance(seconds, (int, float)) or not math.isfinite(seconds) or seconds <= 0:
        return [f"{name} must be a number of seconds > 0, got {seconds!r}"]
    return []


def _check_root(root: str) -> list[str]:
    if not root.startswith("/") or root == "/" or root.endswith("/") or "//" in root:
        return [f"ZKLOCK_ROOT must be an absolute znode path like '/zklock', got {root!r}"]
    return []
