"""One kazoo client per process, fork-safe.

:func:`get_client` returns the process's client for a configuration, creating and starting it
on first use: built from the settings (hosts, auth, SASL, ACL, TLS), or by the application's own
``zklock_client_factory``. A kazoo client must not cross a fork (its threads do not exist in the
child, and sharing its socket with the parent corrupts both), so the registry is keyed by pid and
emptied in a forked child: the child builds its own client and never touches the parent's.

A TLS connection that cannot be made (an untrusted certificate, a hostname the certificate does
not name) only shows in kazoo as a connect timeout; :func:`get_client` then makes one handshake
itself and raises :class:`ConfigurationError` naming TLS and the setting to fix.

Every client built here (not a factory's) reconnects on a bounded schedule,
:func:`reconnect_policy`: kazoo's own doubles its wait after each failed attempt up to an hour,
so after a minute's outage a process could try next a minute after ZooKeeper answered again,
and fail calls meanwhile. Ours waits at most about 0.6 s between attempts, jittered so that a
fleet's processes do not all knock at once.

When a held lock counts as lost is the lease clock's business: see
:mod:`celery_zklock.locks.clock`.
"""

from __future__ import annotations

import importlib
import inspect
import logging
import os
import socket
import ssl
import threading
from typing import Any

from kazoo.client import KazooClient
from kazoo.exceptions import AuthFailedError
from kazoo.protocol.states import KazooState, KeeperState
from kazoo.retry import KazooRetry

from celery_zklock.errors import ConfigurationError
from celery_zklock.zk import adapter, outages
from celery_zklock.zk.calls import Deadline, wait_result
from celery_zklock.zk.settings import ClientConfig, host_ports

logger = logging.getLogger("celery_zklock.session")

TLS_PROBE_TIMEOUT = 5.0
KAZOO_CHECKS_HOSTNAMES = "check_hostname" in inspect.signature(KazooClient.__init__).parameters
"""kazoo 2.11 added ``check_hostname``; older ones (2.9, 2.10) verify certificates only."""
NAME_MISMATCH_CODES = frozenset({62, 64})
"""OpenSSL's X509_V_ERR_HOSTNAME_MISMATCH and X509_V_ERR_IP_ADDRESS_MISMATCH."""
RECONNECT_MAX_DELAY = 0.5
"""Seconds, before jitter, a client waits at most between two attempts to reconnect."""
RECONNECT_JITTER = 0.25
"""Each wait is drawn from +-25 % of its nominal length: at most ``0.5 * 1.25 = 0.625`` s.
A refused attempt costs the server nothing; two a second per process is cheap, and the outage's
logged length (:mod:`celery_zklock.zk.outages`) is off by at most one wait."""
HANDSHAKE_WAIT_SHARE = 1 / 3
"""The share of the session timeout a client waits for the answer to its handshake before it
gives the connection up and tries again (kazoo: the session timeout over the number of hosts,
so with three hosts or more nothing changes). ZooKeeper in its first moments after a start can
take a connection and never answer it (ZOOKEEPER-5051): with kazoo's wait, a reconnect that
landed there cost the session it carried, whose timeout the restarted server counts from its
start."""

# -- one client per process -------------------------------------------------------------------


def _make_handler(name: str) -> Any:
    if name == "gevent":
        from kazoo.handlers.gevent import SequentialGeventHandler

        return SequentialGeventHandler()
    from celery_zklock.zk.handler import PollingThreadingHandler

    return PollingThreadingHandler()


def new_client(config: ClientConfig) -> KazooClient:
    """A new, not yet started kazoo client for ``config`` (the factory's, if it names one);
    its connecting ends this process's outage (:func:`celery_zklock.zk.outages.connected`)."""
    client = _new_client(config)
    client.add_listener(outages.connected)
    return client


def reconnect_policy(sleep_func: Any) -> KazooRetry:
    """The ``connection_retry`` of the clients built here: retry for ever, from 0.1 s doubling
    up to :data:`RECONNECT_MAX_DELAY`, jittered by :data:`RECONNECT_JITTER`, so that a client
    reconnects within about 0.6 s of ZooKeeper answering again however long it was away.
    ``sleep_func`` is the handler's (kazoo insists the two match)."""
    return KazooRetry(
        max_tries=-1,
        delay=0.1,
        backoff=2,
        max_jitter=RECONNECT_JITTER,
        max_delay=RECONNECT_MAX_DELAY,
        sleep_func=sleep_func,
    )


def _new_client(config: ClientConfig) -> KazooClient:
    config.validate()
    if config.factory is not None:
        return _client_from_factory(config.factory)
    handler = _make_handler(config.handler)
    kwargs: dict[str, Any] = dict(config.extra)  # its own connection_retry wins over ours
    kwargs.setdefault("connection_retry", reconnect_policy(handler.sleep_func))
    if config.use_ssl:
        kwargs.update(
            use_ssl=True,
            certfile=config.certfile,
            keyfile=config.keyfile,
            keyfile_password=config.keyfile_password,
            ca=config.ca,
            verify_certs=config.verify_certs,
        )
        if KAZOO_CHECKS_HOSTNAMES:
            kwargs["check_hostname"] = config.check_hostname
        elif config.check_hostname:
            raise ConfigurationError(
                "zklock_ssl_check_hostname needs kazoo 2.11 or later (this kazoo cannot check "
                "a server's hostname): upgrade kazoo, or set zklock_ssl_check_hostname=False "
                "(env ZKLOCK_SSL_CHECK_HOSTNAME=false) to verify the certificate only"
            )
    if config.sasl:
        kwargs["sasl_options"] = dict(config.sasl)
    client = KazooClient(
        hosts=config.hosts,
        timeout=config.session_timeout,
        handler=handler,
        auth_data=list(config.auth) or None,
        default_acl=list(config.acl) or None,
        logger=outages.KAZOO_LOG,  # reconnect warnings: one per outage
        **kwargs,
    )
    adapter.limit_handshake_wait(client, config.session_timeout * HANDSHAKE_WAIT_SHARE)
    adapter.use_direct_socket_io(client)  # threading clients: recv/send before polling
    return client


def _client_from_factory(spec: str) -> KazooClient:
    module_name, _, attribute = spec.partition(":")
    try:
        factory = getattr(importlib.import_module(module_name), attribute)
    except (ImportError, AttributeError) as exc:
        raise ConfigurationError(
            f"zklock_client_factory {spec!r} cannot be imported: {exc}"
        ) from exc
    client = factory()
    if not isinstance(client, KazooClient):
        raise ConfigurationError(
            f"zklock_client_factory {spec!r} returned {type(client).__name__}, not a "
            "kazoo.client.KazooClient"
        )
    return client


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
        if client is not None and adapter.connection_gave_up(client):
            # Its connection loop ended for good (e.g. kazoo's thread died on a protocol
            # error): it would fail every call from now on. Its leases count as lost already
            # (no renewal reaches the leader); a new client is a new session.
            logger.warning(
                "the ZooKeeper client of %s gave up its connection for good: replaced",
                config.hosts,
            )
            stop_quietly(client)
            del _clients[config]
            client = None
        if client is None:
            client = new_client(config)
            adapter.install_connect_hook()
            if not client.connected:
                refused = _watch_for_refused_login(client)
                try:
                    client.start(timeout=config.connect_timeout)
                except Exception as exc:
                    stop_quietly(client)
                    if config.sasl and refused.is_set():
                        raise ConfigurationError(_sasl_refused(config)) from exc
                    problem = tls_problem(config) if config.use_ssl else None
                    if problem is not None:
                        raise ConfigurationError(problem) from exc
                    raise
                if config.sasl:
                    try:
                        _check_sasl_login(client, config)
                    except BaseException:
                        stop_quietly(client)  # started, not cached: nothing else would stop it
                        raise
            _clients[config] = client
        return client


def _watch_for_refused_login(client: KazooClient) -> threading.Event:
    """An event set if ``client`` is lost because the server refused its login: kazoo then
    stops trying and its ``start`` only times out, so the state at the loss is the only trace."""
    refused = threading.Event()

    def listener(state: str) -> bool:
        if state == KazooState.LOST and client.client_state == KeeperState.AUTH_FAILED:
            refused.set()
            return True  # done: remove this listener
        return refused.is_set()

    client.add_listener(listener)
    return refused


def _sasl_refused(config: ClientConfig) -> str:
    options = dict(config.sasl)
    return (
        f"SASL {options.get('mechanism')} login as {options.get('username', '?')!r} was refused "
        f"by {config.hosts}: check zklock_sasl (env ZKLOCK_SASL_USERNAME/ZKLOCK_SASL_PASSWORD) "
        "against the server's JAAS Server section"
    )


def _check_sasl_login(client: KazooClient, config: ClientConfig) -> None:
    """kazoo may report CONNECTED before its SASL exchange ends; a refused login then shows only
    on the next request (``AuthFailedError``, the client lost). One read makes it show here."""
    try:
        wait_result(client.exists_async("/"), Deadline(config.connect_timeout), "a first read")
    except AuthFailedError as exc:
        raise ConfigurationError(_sasl_refused(config)) from exc


def stop_quietly(
    client: KazooClient, failed: str = "error stopping a client that did not connect"
) -> None:
    """Stop and close ``client``; an error doing so is only logged (``failed``, at debug level):
    the client is being let go, and the caller has nothing useful to do with it."""
    try:
        client.stop()
        client.close()
    except Exception:
        logger.debug(failed, exc_info=True)


def tls_context(config: ClientConfig) -> ssl.SSLContext:
    """A client TLS context as ``config`` sets it (the CA, the hostname check, the client
    certificate), for what reaches the servers beside kazoo's own connection: the handshake of
    :func:`tls_problem` and the doctor's four-letter words. Raises ConfigurationError naming
    the setting when its file cannot be loaded."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.check_hostname = config.check_hostname
    if config.verify_certs:
        try:
            context.load_verify_locations(cafile=config.ca)
        except (OSError, ssl.SSLError) as exc:
            raise ConfigurationError(
                f"TLS: zklock_ssl_ca {config.ca!r} is not a readable PEM CA file ({exc})"
            ) from None
    else:
        context.verify_mode = ssl.CERT_NONE
    if config.certfile:
        try:
            context.load_cert_chain(
                config.certfile, config.keyfile, password=config.keyfile_password
            )
        except (OSError, ssl.SSLError) as exc:
            raise ConfigurationError(
                f"TLS: the client certificate zklock_ssl_certfile/zklock_ssl_keyfile cannot be "
                f"loaded ({exc}); check zklock_ssl_keyfile_password"
            ) from None
    return context


def tls_problem(config: ClientConfig) -> str | None:
    """Why a TLS handshake with ``config``'s first answering host fails, naming the setting to
    fix; None if one succeeds or no host accepts a connection (then it is not TLS)."""
    try:
        context = tls_context(config)
    except ConfigurationError as exc:
        return str(exc)
    for host, port in host_ports(config.hosts):
        try:
            raw = socket.create_connection((host, port), timeout=TLS_PROBE_TIMEOUT)
        except OSError:
            continue
        try:
            with context.wrap_socket(raw, server_hostname=host):
                return None
        except ssl.SSLCertVerificationError as exc:
            if exc.verify_code in NAME_MISMATCH_CODES:
                return (
                    f"TLS: the certificate of {host}:{port} does not name {host!r} "
                    f"({exc.verify_message}); connect by a name the certificate holds, or set "
                    "zklock_ssl_check_hostname=False (env ZKLOCK_SSL_CHECK_HOSTNAME=false)"
                )
            return (
                f"TLS: the certificate of {host}:{port} is not trusted ({exc.verify_message}): "
                f"zklock_ssl_ca ({config.ca}) must be the CA that signed the server's "
                "certificate"
            )
        except (ssl.SSLError, OSError) as exc:
            return (
                f"TLS: the handshake with {host}:{port} failed ({exc}); is it the server's "
                "secureClientPort? (zklock_use_ssl=True needs ZooKeeper's TLS port)"
            )
        finally:
            raw.close()
    return None


def close_clients() -> None:
    """Stop and close every client this process created (at worker shutdown)."""
    with _clients_lock:
        clients = list(_clients.values())
        _clients.clear()
    for client in clients:
        stop_quietly(client, "error closing ZooKeeper client")
