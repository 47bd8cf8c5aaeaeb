"""Cooperative revocation, as Apache Curator has it: ask a lock's holder to release.

A caller who wants a lock another process holds writes Curator's revoke marker
(``__REVOKE__``) into the holder's contender node (:func:`attempt_revoke`, the same write as
Curator's ``Revoker.attemptRevoke``); a holder that registered :func:`on_revoke` for its lease
is called back and releases when it is ready (Curator's ``RevocationListener``). Nothing is
forced: a holder that does not listen, or does not release, keeps the lock. (Celery tasks get the
forced kind, which ends the holder's body: ``lock_on_busy="preempt"``, ``celery zklock break``.)
The marker replaces the node's data, so ``celery zklock locks`` no longer shows who the holder
is once it was asked.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Final

from kazoo.client import KazooClient
from kazoo.exceptions import NoNodeError
from kazoo.recipe.watchers import DataWatch

from celery_zklock.locks.lease import Lease

__all__ = ["REVOKE_MARKER", "attempt_revoke", "on_revoke"]

REVOKE_MARKER: Final = b"__REVOKE__"
"""What Curator's ``Revoker.attemptRevoke`` writes into a holder's node."""


def attempt_revoke(client: KazooClient, node: str) -> bool:
    """Ask the holder of contender ``node`` (a full path, as ``Lease.node`` or ``celery zklock
    locks --json`` give it) to release; False if the node is gone already."""
    try:
        client.set(node, REVOKE_MARKER)
    except NoNodeError:
        return False
    return True


def on_revoke(client: KazooClient, lease: Lease, callback: Callable[[Lease], Any]) -> None:
    """Call ``callback(lease)`` once when someone asks for the lock ``lease`` holds (Curator's
    ``makeRevocable``); ``client`` is the one the lease was acquired with. The callback runs on
    kazoo's event thread: keep it short (release, or tell the holding thread to)."""

    def watch(data: bytes | None, _stat: Any, _event: Any = None) -> bool:
        if lease.released or data is None:
            return False  # released or gone: stop watching
        if data == REVOKE_MARKER:
            callback(lease)
            return False
        return True

    DataWatch(client, lease.node, watch)
