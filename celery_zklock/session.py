"""One kazoo client per process, fork-safe.

:func:`get_client` returns the process's client for a configuration, creating and starting it
on first use. A kazoo client must not cross a fork (its threads do not exist in the child, and
sharing its socket with the parent corrupts both), so the registry is keyed by pid and emptied in
a forked child: the child builds its own client and never touches the parent's.

When a held lock counts as lost is the lease clock's business: see
:mod:`celery_zklock.locks.clock` and :mod:`celery_zklock.locks.context`.
"""

from __future__ import annotations

import logging
import os
import threading
from dataclasses import dataclass, field
from typing import Any

from kazoo.client import KazooClient

from celery_zklock import validate
from celery_zklock.errors import ConfigurationError
from celery_zklock.locks import adapter

logger = logging.getLogger("celery_zklock.session")

DEFAULT_SESSION_TIMEOUT = 10.0

# -- one client per process -------------------------------------------------------------------


@dataclass(frozen=True)
class ClientConfig:
    """Everything that identifies a ZooKeeper connection; equal configs share one client."""

    hosts: str
    session_timeout: float = DEFAULT_SESSION_TIMEOUT
    handler: str = "threading"
    auth: tuple[tuple[str, str], ...] = ()
    use_ssl: bool = False
    certfile: str | None = None
    keyfile: str | None = None
    ca: str | None = None
    verify_certs: bool = True
    connect_timeout: float = 15.0
    extra: tuple[tuple[str, Any], ...] = field(default=())

    def validate(self) -> None:
        """Raise :class:`ConfigurationError` naming the bad setting."""
        if not self.hosts or not self.hosts.strip():
            raise ConfigurationError(
                "ZooKeeper hosts are empty: set app.conf.zklock_hosts or the ZKLOCK_HOSTS "
                "environment variable, e.g. 'zk1:2181,zk2:2181,zk3:2181'"
            )
        validate.seconds("zklock_session_timeout", self.session_timeout)
        validate.seconds("zklock_connect_timeout", self.connect_timeout)
        if self.handler not in ("threading", "gevent"):
            raise ConfigurationError(
                f"kazoo handler must be 'threading' or 'gevent', got {self.handler!r}"
            )


def _make_handler(name: str) -> Any:
    if name == "gevent":
        from kazoo.handlers.gevent import SequentialGeventHandler

        return SequentialGeventHandler()
    from kazoo.handlers.threading import SequentialThreadingHandler

    return SequentialThreadingHandler()


def new_client(config: ClientConfig) -> KazooClient:
    """A new, not yet started kazoo client for ``config``."""
    config.validate()
    kwargs: dict[str, Any] = dict(config.extra)
    if config.use_ssl:
        kwargs.update(
            use_ssl=True,
            certfile=config.certfile,
            keyfile=config.keyfile,
            ca=config.ca,
            verify_certs=config.verify_certs,
        )
    return KazooClient(
        hosts=config.hosts,
        timeout=config.session_timeout,
        handler=_make_handler(config.handler),
        auth_data=list(config.auth) or None,
        **kwargs,
    )


_clients: dict[ClientConfig, KazooClient] = {}
_clients_pid = os.getpid()
_clients_lock = threading.Lock()


def _forget_clients_after_fork() -> None:
    # The child must never use (nor stop: that would send a close for the parent's session)
    # the parent's clients. Dropping the references is enough.
    global _clients, _clients_pid, _clients_lock
    _clients = {}
    _clients_pid = os.getpid()
    _clients_lock = threading.Lock()


os.register_at_fork(after_in_child=_forget_clients_after_fork)


def get_client(config: ClientConfig) -> KazooClient:
    """The started client of this process for ``config``.

    Raises:
        ConfigurationError: the config is invalid (empty hosts, bad timeout).
        kazoo.handlers.threading.KazooTimeoutError: ZooKeeper could not be reached within
            ``config.connect_timeout`` seconds; nothing is cached, the next call tries again.
    """
    if os.getpid() != _clients_pid:  # forked without register_at_fork having run (defensive)
        _forget_clients_after_fork()
    with _clients_lock:
        client = _clients.get(config)
        if client is None:
            client = new_client(config)
            adapter.install_connect_hook()
            client.start(timeout=config.connect_timeout)
            _clients[config] = client
        return client


def close_clients() -> None:
    """Stop and close every client this process created (at worker shutdown)."""
    with _clients_lock:
        clients = list(_clients.values())
        _clients.clear()
    for client in clients:
        try:
            client.stop()
            client.close()
        except Exception:  # shutting down: nothing useful to do with the error
            logger.debug("error closing ZooKeeper client", exc_info=True)
