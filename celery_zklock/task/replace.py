"""``lock_on_busy="replace"``: while a run holds the key, at most one call waits; a newer call
replaces the waiting one, which ends at once with a skip (reason ``replaced``) naming it.

The key's waiting call is named by one record (:mod:`celery_zklock.task.latest`, node
:data:`~celery_zklock.task.latest.WAITER_NODE` under the key's lock path). A ``replace`` run
that finds the lock busy (:class:`Waiter`):

1. records itself as the waiting call, unless the record names a newer call (a higher
   generation, :mod:`celery_zklock.task.generation`): then it is replaced at once;
2. waits for the lock in the key's queue as a ``wait`` call does (in its pool slot: one per key,
   fleet-wide), watching the record: when a newer call records itself, the watch ends the wait,
   the contender node goes, and the run ends with the skip naming that call;
3. once granted, deletes the record, versioned against its own write: if a newer call wrote
   meanwhile the delete fails, the lease is released and the run is skipped as replaced. So a
   replaced call never runs, and the call that replaced it is the one that waits.

A call that finds the lock free takes it, as any call. Each call waits for itself: a crash of
the waiting call's worker takes only that call (its contender node goes with its session; the
record naming it is replaced by the next call, which waits itself, or by the call's own
redelivery), and a newer call made before or after the crash is the waiter. A record left by a
waiter that died and was never delivered again stays until the next call of the key replaces
it. A ``lock_timeout`` that passes ends the wait as for ``wait`` (``lock_on_timeout``), and the
run deletes the record if it still names it.

An older version's worker refuses the policy (``lock_on_busy='replace' is not valid``) when the
task is defined there: roll every worker to a version that has it before calls use it.
"""

from __future__ import annotations

import contextlib
import threading
import time
from typing import Any

from kazoo.client import KazooClient
from kazoo.exceptions import BadVersionError, NoNodeError

from celery_zklock.errors import LockTimeout
from celery_zklock.locks import Lease, Mutex
from celery_zklock.task import latest
from celery_zklock.task.generation import is_newer
from celery_zklock.zk import adapter
from celery_zklock.zk.calls import Deadline, wait_result

__all__ = ["Waiter"]


class Waiter:
    """One ``replace`` run as its key's waiting call; see the module docstring. Use once:
    :meth:`acquire`, then :meth:`close`."""

    def __init__(self, client: KazooClient, path: str, task_id: str, generation: int | None):
        self.client = client
        self.node = f"{path}/{latest.WAITER_NODE}"
        self.task_id = task_id
        self.generation = generation
        self.version: int | None = None
        """The version of the record as this run wrote it (None: not recorded)."""
        self.replaced_by: str | None = None
        """The newer call that replaced this one, once it did."""
        self._changed = threading.Event()
        self._watching = False

    def acquire(self, side: Mutex, timeout: float | None, data: bytes) -> Lease | None:
        """Wait for the lock of ``side`` up to ``timeout`` seconds as the key's waiting call:
        the lease, or None when a newer call replaced this one (:attr:`replaced_by`). Raises
        ``LockTimeout`` (the record is then left to :meth:`close`)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            if not self._enter():
                return None
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            try:
                lease = side.acquire(timeout=left, data=data, cancel=self._changed.is_set)
            except LockTimeout:
                if not self._changed.is_set():
                    raise
                if self.replaced_by is not None:
                    return None
                continue  # the record went (not by a newer call): record this call again
            if self._claim():
                return lease
            lease.release()
            return None

    def close(self) -> None:
        """The run no longer waits: its record goes if it still names it, the watch is dropped.
        ZooKeeper failing here is left alone (the next call of the key replaces the record)."""
        if self._watching:
            adapter.discard_data_watcher(self.client, self.node, self._on_change)
        if self.version is not None:
            # Replaced, gone, or unreachable: the record is not this run's to keep.
            with contextlib.suppress(Exception):
                latest.delete(self.client, self.node, self.version)
            self.version = None

    def _enter(self) -> bool:
        """Be the record's call (False: a newer call is, :attr:`replaced_by`), and watch it."""
        self._changed.clear()
        self.replaced_by = None

        def step(record: latest.Record | None) -> latest.Record | None:
            """The record as this run wrote it, or None (a newer call is named)."""
            if record is None:
                return latest.create(self.client, self.node, self._data())
            if record.task_id == self.task_id:
                return record  # our own record, or our message's earlier delivery's
            if record.task_id is not None and not is_newer(self.generation, record.generation):
                self._replaced(record.task_id)
                return None
            return latest.write(self.client, self.node, self._data(), record.version)

        mine = latest.versioned(self.client, self.node, step)
        if mine is None:
            return False
        self.version = mine.version
        return self._watch()

    def _watch(self) -> bool:
        """Watch the record; False if a newer call is named already (replaced)."""
        self._watching = True
        answer = self.client.get_async(self.node, watch=self._on_change)
        try:
            record = latest.parse(*wait_result(answer, Deadline(latest.IO_TIMEOUT), "watching"))
        except NoNodeError:
            self._changed.set()  # gone already (no watch set): the wait ends at once
            return True
        if record.task_id != self.task_id:
            return self._replaced(record.task_id)
        return True

    def _on_change(self, _event: Any) -> None:  # a kazoo thread: must not block
        """The record changed: read whom it names (and watch again) before the wait may end.
        The read comes while this run's contender node is still queued, ahead of the newer
        call's (which records itself before it queues), so that call cannot have been granted
        and have deleted the record yet: the skip names it."""
        try:
            self.client.get_async(self.node, watch=self._on_change).rawlink(self._read)
        except Exception:
            self._changed.set()

    def _read(self, answer: Any) -> None:  # a kazoo thread
        try:
            record = latest.parse(*answer.get_nowait())
        except Exception:
            self._changed.set()  # gone (no watch left), or unreadable: end the wait, look again
            return
        if record.task_id != self.task_id:
            self.replaced_by = record.task_id
            self._changed.set()

    def _claim(self) -> bool:
        """Granted: delete the record this run wrote; False if a newer call wrote over it."""
        assert self.version is not None
        try:
            latest.delete(self.client, self.node, self.version)
        except NoNodeError:
            pass  # gone meanwhile (not by a newer call: its write would have made it fail)
        except BadVersionError:
            record = latest.read(self.client, self.node)
            if record is not None and record.task_id != self.task_id:
                return self._replaced(record.task_id)
        self.version = None
        return True

    def _replaced(self, by: str | None) -> bool:
        """A newer call ``by`` is the waiting call now, not this run: False (not ours)."""
        self.replaced_by, self.version = by, None
        return False

    def _data(self) -> bytes:
        return latest.encode(self.task_id, self.generation)
