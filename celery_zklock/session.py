"""ZooKeeper sessions: one kazoo client per process, and the policy that says when a lock is lost.

Two things live here.

**One client per process, fork-safe.** :func:`get_client` returns the process's client for a
configuration, creating and starting it on first use. A kazoo client must not cross a fork (its
threads do not exist in the child, and sharing its socket with the parent corrupts both), so the
registry is keyed by pid and emptied in a forked child: the child builds its own client and never
touches the parent's.

**The loss policy.** A held lock is only as good as the ZooKeeper session that owns its ephemeral
node. kazoo reports ``LOST`` only once it has reconnected and the server said the session expired;
while it is cut off it stays ``SUSPENDED`` and the server may expire the session meanwhile, after
which another process can take the lock. :class:`SessionWatch` therefore declares every lease of the
client lost

- at once on ``LOST`` (the server expired the session), and
- when ``SUSPENDED`` has lasted :attr:`SessionWatch.lost_after` seconds, even if the session later
  turns out to have survived.

Timing, with ``T`` the negotiated session timeout: kazoo sends a ping after ``T/3`` without sending
anything and drops the connection when the next deadline (another ``T/3``) passes with the ping
unanswered. So if the server last heard from us at time ``L``, kazoo turns SUSPENDED no later than
``L + 2T/3``; the server expires the session no earlier than ``L + T``. Declaring the lease lost
``lost_after = T/3 - margin`` after SUSPENDED (``margin = max(0.25 s, T/20)``) therefore happens
at least ``margin`` before the server can hand the lock to someone else, which leaves that margin
for the task to be interrupted. The price is that a connection blip longer than ``lost_after`` (and
shorter than ``T``) revokes a lease whose session survives: safety wins over availability here.

Limits of any client-side policy: a process paused (SIGSTOP, a long GC-like stall) runs no timer;
when it resumes it may run on after the server expired its session. That is what fencing tokens
(:attr:`Lease.token`) are for, and the release of such a lease reports it lost. kazoo measures its
ping deadline from the last *send*, so a client that sends requests continuously into a silent
partition can stay CONNECTED past ``T``; lock waiters and holders are idle on the connection, so
this does not arise from the recipes themselves.
"""

from __future__ import annotations

import logging
import os
import threading
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Protocol

from kazoo.client import KazooClient
from kazoo.exceptions import NoNodeError
from kazoo.protocol.states import KazooState

from celery_zklock.errors import ConfigurationError

logger = logging.getLogger("celery_zklock.session")

DEFAULT_SESSION_TIMEOUT = 10.0


class LossListener(Protocol):
    """Something held under a session: told once when the policy declares the session lost."""

    session_id: int

    def mark_lost(self, reason: str) -> None: ...


def lost_after_for(session_timeout: float) -> float:
    """Seconds of SUSPENDED after which leases count as lost, for a session timeout in seconds."""
    margin = max(0.25, session_timeout / 20.0)
    return max(0.0, session_timeout / 3.0 - margin)


class SessionWatch:
    """Connection-state policy for one kazoo client: tracks held leases and declares them lost.

    One instance per client (see :func:`watch_for`). The kazoo listener only flips state and
    starts a timer: listeners run on kazoo's connection thread and must not block.
    """

    def __init__(self, client: KazooClient) -> None:
        self.client = client
        self._lock = threading.Lock()
        self._held: set[LossListener] = set()
        self._wakeups: set[Any] = set()
        self._suspended_generation = 0
        self._pending_purges: set[tuple[str, str]] = set()
        self._negotiated_timeout: float | None = None
        #: Incremented each time the session is lost; lets a caller see "the session changed".
        self.epoch = 0
        self._capture_negotiated_timeout()
        client.add_listener(self._on_state)

    # -- timing ---------------------------------------------------------------------------
    @property
    def session_timeout(self) -> float:
        """The session timeout in seconds: the negotiated one once known, else the requested one."""
        requested = float(self.client._session_timeout) / 1000.0
        negotiated = self._negotiated_timeout
        return min(requested, negotiated) if negotiated else requested

    @property
    def lost_after(self) -> float:
        """Seconds of SUSPENDED after which every lease of this client counts as lost."""
        return lost_after_for(self.session_timeout)

    def _capture_negotiated_timeout(self) -> None:
        # kazoo keeps the negotiated timeout in a local variable of its connect routine; wrap
        # that routine on this client's connection object to see it (read-only).
        connection = self.client._connection
        original = connection._connect
        watch_ref = weakref.ref(self)

        def connect(*args: Any, **kwargs: Any) -> Any:
            read_timeout, connect_timeout = original(*args, **kwargs)
            watch = watch_ref()
            if watch is not None:
                watch._negotiated_timeout = read_timeout * 1.5 / 1000.0
            return read_timeout, connect_timeout

        connection._connect = connect

    # -- identity -------------------------------------------------------------------------
    def session_id(self) -> int | None:
        """The current session id, or None while not connected."""
        client_id = self.client.client_id
        return int(client_id[0]) if client_id else None

    # -- held leases ----------------------------------------------------------------------
    def track(self, held: LossListener) -> None:
        """Start telling ``held`` about loss of its session.

        If the session already changed since ``held`` was created, it is declared lost at once.
        """
        with self._lock:
            self._held.add(held)
        current = self.session_id()
        if current is not None and current != held.session_id:
            self._declare_lost("the ZooKeeper session changed", only_session=held.session_id)

    def untrack(self, held: LossListener) -> None:
        with self._lock:
            self._held.discard(held)

    @contextmanager
    def wakeup_on_state_change(self, event: Any) -> Iterator[None]:
        """Set ``event`` whenever the connection state changes, while the block runs."""
        with self._lock:
            self._wakeups.add(event)
        try:
            yield
        finally:
            with self._lock:
                self._wakeups.discard(event)

    # -- orphans --------------------------------------------------------------------------
    def purge_later(self, parent: str, prefix: str) -> None:
        """Delete children of ``parent`` whose name starts with ``prefix`` once connected.

        Used when an acquire gave up while the outcome of its create was unknown: with Curator's
        protected names the prefix (``_c_<uuid>-``) identifies that one attempt's node.
        """
        with self._lock:
            self._pending_purges.add((parent, prefix))
        if self.client.state == KazooState.CONNECTED:
            self.client.handler.spawn(self._run_purges)

    def _run_purges(self) -> None:
        with self._lock:
            pending = list(self._pending_purges)
        for parent, prefix in pending:
            try:
                children = self.client.get_children_async(parent).get(timeout=self.lost_after)
                for child in children:
                    if child.startswith(prefix):
                        self.client.delete_async(f"{parent}/{child}").get(timeout=self.lost_after)
                        logger.info("removed orphaned contender %s/%s", parent, child)
            except NoNodeError:
                pass  # the parent (and so our node) is gone already
            except Exception as exc:  # a timeout: try again on the next reconnect
                logger.debug("purge of %s/%s* deferred: %r", parent, prefix, exc)
                continue
            with self._lock:
                self._pending_purges.discard((parent, prefix))

    # -- the policy -----------------------------------------------------------------------
    def _on_state(self, state: str) -> bool:
        with self._lock:
            wakeups = list(self._wakeups)
            self._suspended_generation += 1
            generation = self._suspended_generation
        for event in wakeups:
            event.set()
        if state == KazooState.LOST:
            self.epoch += 1
            self._declare_lost("the ZooKeeper session expired")
        elif state == KazooState.SUSPENDED:
            self.client.handler.spawn(self._expire_if_still_suspended, generation)
        elif state == KazooState.CONNECTED:
            current = self.session_id()
            if current is not None:
                self._declare_lost("the ZooKeeper session changed", except_session=current)
            if self._pending_purges:
                self.client.handler.spawn(self._run_purges)
        return False

    def _expire_if_still_suspended(self, generation: int) -> None:
        delay = self.lost_after
        self.client.handler.sleep_func(delay)
        with self._lock:
            still = generation == self._suspended_generation
        if still and self.client.state == KazooState.SUSPENDED:
            self._declare_lost(
                f"the connection to ZooKeeper was suspended for {delay:.2f}s; the server may "
                "have expired the session"
            )

    def _declare_lost(
        self, reason: str, *, only_session: int | None = None, except_session: int | None = None
    ) -> None:
        with self._lock:
            victims = [
                held
                for held in self._held
                if (only_session is None or held.session_id == only_session)
                and (except_session is None or held.session_id != except_session)
            ]
            for held in victims:
                self._held.discard(held)
        for held in victims:
            held.mark_lost(reason)


_watches: weakref.WeakKeyDictionary[KazooClient, SessionWatch] = weakref.WeakKeyDictionary()
_watches_lock = threading.Lock()


def watch_for(client: KazooClient) -> SessionWatch:
    """The :class:`SessionWatch` of ``client`` (created and attached on first use)."""
    with _watches_lock:
        watch = _watches.get(client)
        if watch is None:
            watch = _watches[client] = SessionWatch(client)
        return watch


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
        if self.session_timeout <= 0:
            raise ConfigurationError(
                f"zklock_session_timeout must be a positive number of seconds, got "
                f"{self.session_timeout!r}"
            )
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
            watch_for(client)
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
