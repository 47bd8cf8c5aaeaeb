"""Cooperative revocation, as Apache Curator has it: ask a lock's holder to release.

A caller who wants a lock another process holds writes Curator's revoke marker
(``__REVOKE__``) into the holder's contender node (:func:`attempt_revoke`, the same write as
Curator's ``Revoker.attemptRevoke``); a holder that registered :func:`on_revoke` for its lease
is called back and releases when it is ready (Curator's ``RevocationListener``). Nothing is
forced: a holder that does not listen, or does not release, keeps the lock. (Celery tasks get the
forced kind, which ends the holder's body: ``lock_on_busy="preempt"``, ``celery zklock break``.)
The marker replaces the node's data, so ``celery zklock locks`` no longer shows who the holder
is once it was asked. Neither call waits for ZooKeeper longer than its ``timeout``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Final

from kazoo.client import KazooClient
from kazoo.exceptions import NoNodeError
from kazoo.recipe.watchers import DataWatch

from celery_zklock.locks.lease import Lease
from celery_zklock.zk.calls import Deadline, wait_result

__all__ = ["REVOKE_MARKER", "REVOKE_TIMEOUT", "attempt_revoke", "on_revoke"]

REVOKE_MARKER: Final = b"__REVOKE__"
"""What Curator's ``Revoker.attemptRevoke`` writes into a holder's node."""
REVOKE_TIMEOUT: Final = 5.0
"""Default seconds :func:`attempt_revoke` and :func:`on_revoke` wait for ZooKeeper."""


def attempt_revoke(client: KazooClient, node: str, *, timeout: float = REVOKE_TIMEOUT) -> bool:
    """Ask the holder of contender ``node`` (a full path, as ``Lease.node`` or ``celery zklock
    locks --json`` give it) to release; False if the node is gone already.

    Raises :class:`~celery_zklock.errors.ZooKeeperUnavailable` when ZooKeeper does not answer
    within ``timeout`` seconds; the request may still reach the holder afterwards (it was
    sent), as a request made in time would."""
    what = f"asking the holder of {node} to release"
    try:
        wait_result(client.set_async(node, REVOKE_MARKER), Deadline(timeout), what)
    except NoNodeError:
        return False
    return True


def on_revoke(
    client: KazooClient,
    lease: Lease,
    callback: Callable[[Lease], Any],
    *,
    timeout: float = REVOKE_TIMEOUT,
) -> None:
    """Call ``callback(lease)`` once when someone asks for the lock ``lease`` holds (Curator's
    ``makeRevocable``); ``client`` is the one the lease was acquired with. The callback runs on
    kazoo's event thread, or in this call when the request is there already: keep it short
    (release, or tell the holding thread to).

    Reads the node once, here: raises :class:`~celery_zklock.errors.ZooKeeperUnavailable` when
    ZooKeeper does not answer within ``timeout`` seconds (nothing is watched then). The watch
    that follows is set in the background (kazoo's ``DataWatch``, which waits for ZooKeeper
    without limit and sets its watch again after every reconnect)."""

    def watch(data: bytes | None, _stat: Any, _event: Any = None) -> bool:
        if lease.released or data is None:
            return False  # released or gone: stop watching
        if data == REVOKE_MARKER:
            callback(lease)
            return False
        return True

    what = f"reading {lease.node} for a revoke request"
    try:
        data, _ = wait_result(client.get_async(lease.node), Deadline(timeout), what)
    except NoNodeError:
        return
    if watch(data, None):
        # A request written since our read is seen by the watch's first read.
        client.handler.spawn(DataWatch, client, lease.node, watch)
