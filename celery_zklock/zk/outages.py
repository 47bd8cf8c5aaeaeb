"""What a process says when ZooKeeper is out of its reach: one line per outage, not one per try.

kazoo logs a warning for every failed attempt to reconnect ("Connection dropped: ...",
"Connection time-out: ...", "Transition to CONNECTING", "Cannot resolve ...", "Failed connecting
to Zookeeper within the connection retry policy."): several a second at first, then one every
few seconds for as long as the outage lasts, in every process. The clients this library makes
(:func:`celery_zklock.zk.client.new_client`) log through :data:`KAZOO_LOG` instead of kazoo's
logger directly: the same logger (``kazoo.client``), but of the reconnect warnings only the
first of an outage gets through, saying that the rest are left out, until one of the process's
clients connects again (:func:`connected`, a state listener ``new_client`` adds); that is logged
too, with the outage's length: from the first failed attempt to the connect, and how long before
the connect an attempt last failed (ZooKeeper came back in between). The length is as true as the
reconnect schedule is tight: the library's clients try at least every 0.625 s
(:func:`celery_zklock.zk.client.reconnect_policy`); with kazoo's own schedule, whose waits grow
to a minute, a process told "after 176 s" of an 89 s outage. The outage is the process's: a
forked child starts without one.
Other kazoo messages, and clients made elsewhere (a ``zklock_client_factory``'s, your own),
are untouched.

:func:`warn_unreachable` is the one line a worker writes when it cannot reach ZooKeeper at start
(the hosts, what it means for locked tasks, what to check), at most once per process.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Any, Final

from kazoo.protocol.states import KazooState

from celery_zklock.zk.settings import ClientConfig

__all__ = ["KAZOO_LOG", "OutageLog", "connected", "reset", "warn_unreachable"]

logger = logging.getLogger("celery_zklock.session")

KAZOO_LOGGER: Final = "kazoo.client"
"""The logger kazoo's client and connection log on by default."""
RECONNECT_WARNINGS: Final = (
    "Connection dropped",
    "Connection time-out",
    "Transition to CONNECTING",
    "Cannot resolve",
    "Failed connecting to Zookeeper",
)
"""The openings of kazoo's warnings about a connection that failed or is being retried."""


class _Outage:
    """This process's outage: when its first reconnect warning was let through (None: no
    outage), and when the last one came, let through or not."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.since: float | None = None
        self.last_failed: float | None = None
        self.dropped = 0
        self.warned_unreachable = False


_outage = _Outage()


def reset() -> None:
    """Forget this process's outage and start warning (done in a forked child; for tests)."""
    global _outage
    _outage = _Outage()


os.register_at_fork(after_in_child=reset)


class OutageLog(logging.LoggerAdapter):  # type: ignore[type-arg]
    """kazoo's logger for the library's clients: passes the first reconnect warning of an
    outage, with a note, drops the rest of that outage's (see the module docstring), and
    passes every other record as it is.

    Only ``warning`` is overridden: kazoo (2.9 to 2.11) logs every reconnect warning with
    ``logger.warning(...)``, and its other records (a debug line or two per request) take
    ``LoggerAdapter``'s own path."""

    def warning(self, msg: object, *args: Any, **kwargs: Any) -> None:
        if str(msg).startswith(RECONNECT_WARNINGS):
            outage = _outage
            with outage.lock:
                outage.last_failed = time.monotonic()
                if outage.since is not None:
                    outage.dropped += 1
                    return
                outage.since, outage.dropped = outage.last_failed, 0
            msg = (
                f"{msg} (ZooKeeper out of reach; kazoo keeps reconnecting: its other reconnect "
                "warnings are left out until a client of this process connects again)"
            )
        self.log(logging.WARNING, msg, *args, **kwargs)

    # kazoo's one ``logger.warn(...)`` call (``LoggerAdapter.warn`` is gone in newer Pythons).
    warn = warning


KAZOO_LOG: Final = OutageLog(logging.getLogger(KAZOO_LOGGER), {})
"""The ``logger`` of every client :func:`celery_zklock.zk.client.new_client` builds."""


def connected(state: str) -> bool:
    """A kazoo state listener: a connected client ends this process's outage (and says how long
    it lasted, when an attempt last failed and how many warnings were left out). Returns False:
    stay registered."""
    if state != KazooState.CONNECTED:
        return False
    now = time.monotonic()
    outage = _outage
    with outage.lock:
        since, last_failed, dropped = outage.since, outage.last_failed, outage.dropped
        outage.since = outage.last_failed = None
    if since is not None:
        logger.warning(
            "celery-zklock: ZooKeeper answers again after %.1fs out of reach (an attempt "
            "failed %.1fs before; %d reconnect warnings left out)",
            now - since, now - (last_failed or since), dropped,
        )  # fmt: skip
    return False


def warn_unreachable(config: ClientConfig, error: BaseException, meanwhile: str) -> None:
    """Say once in this process that ZooKeeper could not be reached at ``config.hosts``, what
    happens ``meanwhile`` and what to check."""
    outage = _outage
    with outage.lock:
        if outage.warned_unreachable:
            return
        outage.warned_unreachable = True
    logger.warning(
        "celery-zklock: cannot reach ZooKeeper at %s within %gs (%r); %s. Check that "
        "zklock_hosts (env ZKLOCK_HOSTS) names the ensemble's client ports, that ZooKeeper runs "
        "there and that this host may connect to them (firewall; TLS needs zklock_use_ssl): "
        "`celery -A <app> zklock doctor` checks each.",
        config.hosts, config.connect_timeout, error, meanwhile,
    )  # fmt: skip
