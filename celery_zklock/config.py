"""Reading celery-zklock's settings the Celery way: ``app.conf.zklock_*``, else ``ZKLOCK_*`` env."""

from __future__ import annotations

import os
import sys
import threading
import weakref
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from celery_zklock.errors import ConfigurationError
from celery_zklock.session import DEFAULT_SESSION_TIMEOUT, ClientConfig
from celery_zklock.validate import seconds, znode_path

DEFAULT_ROOT = "/zklock"
DEFAULT_CONNECT_TIMEOUT = 5.0


def _setting(conf: Mapping[str, Any], name: str, default: Any = None) -> Any:
    value = conf.get(name)
    if value is None:
        value = os.environ.get(name.upper(), default)
    return value


def lock_root(conf: Mapping[str, Any]) -> str:
    """``zklock_root`` (env ``ZKLOCK_ROOT``): the znode under which task locks live."""
    return znode_path("zklock_root", _setting(conf, "zklock_root", DEFAULT_ROOT))


def client_config(conf: Mapping[str, Any], *, handler: str = "threading") -> ClientConfig:
    """The ZooKeeper connection settings of an app.

    Settings: ``zklock_hosts`` (env ``ZKLOCK_HOSTS``, required), ``zklock_session_timeout``
    (seconds, default 10), ``zklock_connect_timeout`` (seconds a worker waits for ZooKeeper on
    first use, default 5), ``zklock_auth`` (list of ``(scheme, credential)``, e.g.
    ``[("digest", "user:secret")]``), ``zklock_use_ssl``, ``zklock_ssl_certfile``,
    ``zklock_ssl_keyfile``, ``zklock_ssl_ca``, ``zklock_ssl_verify`` (default True).

    Raises ConfigurationError naming the bad setting.
    """
    hosts = _setting(conf, "zklock_hosts", "")
    auth = conf.get("zklock_auth") or ()
    try:
        auth_pairs = tuple((str(scheme), str(cred)) for scheme, cred in auth)
    except (TypeError, ValueError):
        raise ConfigurationError(
            f"zklock_auth must be a list of (scheme, credential) pairs, got {auth!r}"
        ) from None
    config = ClientConfig(
        hosts=str(hosts).strip(),
        session_timeout=seconds(
            "zklock_session_timeout",
            _setting(conf, "zklock_session_timeout", DEFAULT_SESSION_TIMEOUT),
            text=True,
        ),
        connect_timeout=seconds(
            "zklock_connect_timeout",
            _setting(conf, "zklock_connect_timeout", DEFAULT_CONNECT_TIMEOUT),
            text=True,
        ),
        handler=handler,
        auth=auth_pairs,
        use_ssl=bool(conf.get("zklock_use_ssl", False)),
        certfile=conf.get("zklock_ssl_certfile"),
        keyfile=conf.get("zklock_ssl_keyfile"),
        ca=conf.get("zklock_ssl_ca"),
        verify_certs=bool(conf.get("zklock_ssl_verify", True)),
    )
    config.validate()
    return config


@dataclass(frozen=True)
class Settings:
    """An app's celery-zklock settings, read once: the lock root and the client config."""

    root: str
    client: ClientConfig


_settings: weakref.WeakKeyDictionary[Any, Settings] = weakref.WeakKeyDictionary()
_settings_lock = threading.Lock()


def settings_of(app: Any) -> Settings:
    """The settings of ``app``, read from ``app.conf`` (and ``ZKLOCK_*``) at its first locked
    call and kept for the app's life, as Celery reads a task's config once.

    A test that changes ``app.conf.zklock_*`` or a ``ZKLOCK_*`` variable after that calls
    :func:`forget_settings`. An invalid setting raises ConfigurationError and is not kept.
    """
    with _settings_lock:
        settings = _settings.get(app)
    if settings is None:
        handler = "gevent" if _gevent_patched() else "threading"
        settings = Settings(lock_root(app.conf), client_config(app.conf, handler=handler))
        with _settings_lock:
            _settings[app] = settings
    return settings


def forget_settings(app: Any) -> None:
    """Read ``app``'s settings again at its next locked call (for tests that change them)."""
    with _settings_lock:
        _settings.pop(app, None)


def _gevent_patched() -> bool:
    if "gevent" not in sys.modules:
        return False
    from gevent import monkey

    return bool(monkey.is_module_patched("socket"))
