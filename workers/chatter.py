"""ZooKeeper traffic on demand inside a fleet worker: what a worker's *other* tasks send.

A steady stream of requests keeps a kazoo client CONNECTED through a silent link (kazoo pings
only after T/3 without sending), which is the dangerous case the ``blackhole`` fault tests. The
remote control command ``zklock_chatter`` (:func:`start_chatter`) starts, in a threads, gevent
or solo worker, a thread that sends one ``exists`` request every ``interval`` seconds on the
client its tasks use, never waiting for answers, and replies with that client's session id. A
prefork worker's tasks have clients of their own: there it starts nothing and says so.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from typing import Any, Final

from celery.worker.control import control_command

from celery_zklock.errors import ConfigurationError
from celery_zklock.zk.client import get_client
from celery_zklock.zk.settings import settings_of
from celery_zklock.zk.validate import seconds

__all__ = ["CHATTER_COMMAND", "IN_PROCESS_POOLS", "start_chatter", "stop_chatter"]

CHATTER_COMMAND: Final = "zklock_chatter"
IN_PROCESS_POOLS: Final = frozenset({"threads", "gevent", "solo"})
"""Pools whose task bodies run in the worker's main process, on its one ZooKeeper client."""
_POOL_MODULES: Final = {"thread": "threads", "gevent": "gevent", "solo": "solo"}

logger = logging.getLogger(__name__)

_current: threading.Event | None = None
_current_lock = threading.Lock()


def _pool_name(state: Any) -> str:
    pool = getattr(getattr(state, "consumer", None), "pool", None)
    module = type(pool).__module__.rsplit(".", 1)[-1] if pool is not None else ""
    return _POOL_MODULES.get(module, module or "unknown")


def _chatter(client: Any, path: str, interval: float, until: float, stop: threading.Event) -> None:
    sent = 0
    while not stop.is_set() and time.monotonic() < until:
        try:
            client.exists_async(path)  # queued and sent; the answer is never waited for
            sent += 1
        except Exception as exc:  # a closed client: nothing left to chatter on
            logger.info("zklock chatter stopped after %d requests: %r", sent, exc)
            return
        stop.wait(interval)
    logger.info("zklock chatter done: %d requests every %.2f s", sent, interval)


@control_command(  # type: ignore[untyped-decorator]
    args=[("interval", float), ("duration", float)],
    signature="<interval> <duration>",
)
def zklock_chatter(state: Any, interval: float = 1.0, duration: float = 0.0) -> dict[str, Any]:
    """Send ZooKeeper requests every ``interval`` s for ``duration`` s (0: stop); see the
    module docstring."""
    global _current
    with _current_lock:
        if _current is not None:
            _current.set()
            _current = None
    pool = _pool_name(state)
    if duration <= 0:
        return {"ok": "stopped", "pool": pool}
    if pool not in IN_PROCESS_POOLS:
        return {"error": f"a {pool} worker runs its tasks in other processes", "pool": pool}
    try:
        seconds("interval", interval)
    except ConfigurationError as exc:
        return {"error": str(exc), "pool": pool}
    settings = settings_of(state.app)
    client = get_client(settings.client)  # the very client the tasks use
    session_id = client.client_id[0] if client.client_id else None
    stop = threading.Event()
    with _current_lock:
        _current = stop
    thread = threading.Thread(
        target=_chatter,
        args=(client, settings.root, interval, time.monotonic() + duration, stop),
        name="zklock-chatter",
        daemon=True,
    )
    thread.start()
    return {"ok": "started", "pool": pool, "session": session_id}


def start_chatter(
    app: Any, nodename: str, interval: float, duration: float, timeout: float = 5.0
) -> dict[str, Any]:
    """Ask worker ``nodename`` to chatter (see the module docstring); return its reply.

    Raises RuntimeError if it does not answer within ``timeout`` seconds or refuses.
    """
    reply = _command(app, nodename, interval, duration, timeout)
    if "error" in reply:
        raise RuntimeError(f"worker {nodename} will not chatter: {reply['error']}")
    return reply


def stop_chatter(app: Any, nodename: str, timeout: float = 5.0) -> None:
    """Stop worker ``nodename``'s chatter (no error if it has none or does not answer)."""
    with contextlib.suppress(RuntimeError):
        _command(app, nodename, 0.0, 0.0, timeout)


def _command(
    app: Any, nodename: str, interval: float, duration: float, timeout: float
) -> dict[str, Any]:
    replies = app.control.broadcast(
        CHATTER_COMMAND,
        arguments={"interval": interval, "duration": duration},
        destination=[nodename],
        reply=True,
        timeout=timeout,
        limit=1,
    )
    for reply in replies or ():
        if nodename in reply:
            answer: dict[str, Any] = reply[nodename]
            return answer
    raise RuntimeError(f"worker {nodename} did not answer {CHATTER_COMMAND} within {timeout:g} s")
