"""A loss the lease clock declares is recorded before the lease leaves the clock's set.

The clock's thread takes the lost leases out of its set under its lock, and runs their lost
callbacks (the interruption, the log) after letting it go. A reader on another thread that
looked in between (``Lease.lost``, which declares an expired clock itself, as a process paused
past its lease runs no timer) found the lease gone from the set and its loss not yet recorded:
``check()`` passed. Held here: the clock's telling is stopped where a preemption would stop it.
"""

from __future__ import annotations

import threading
from typing import Any

import pytest
from kazoo.client import KazooClient

from celery_zklock import LockLost, Mutex
from celery_zklock.errors import LossCode
from celery_zklock.locks.context import context_for
from celery_zklock.locks.lease import Hold


def test_a_loss_being_declared_is_seen_by_check_on_another_thread(
    zk_client: KazooClient, lock_root: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    lease = Mutex(zk_client, f"{lock_root}/k").acquire(timeout=5)
    clock = context_for(zk_client).clock
    telling, go_on = threading.Event(), threading.Event()
    clock_thread: list[threading.Thread] = []

    def held_at(original: Any) -> Any:
        def hold_then(hold: Hold, *args: Any) -> Any:
            if threading.current_thread() in clock_thread:  # the clock's thread: stop here
                telling.set()
                assert go_on.wait(10)
            return original(hold, *args)

        return hold_then

    # The step after the clock's lock is let go: the whole mark_lost before, tell_lost after.
    monkeypatch.setattr(Hold, "mark_lost", held_at(Hold.mark_lost))
    if hasattr(Hold, "tell_lost"):
        monkeypatch.setattr(Hold, "tell_lost", held_at(Hold.tell_lost))
    declaring = threading.Thread(
        target=clock.declare_lost, args=(LossCode.LEASE_CLOCK, "the clock ran out")
    )
    clock_thread.append(declaring)
    declaring.start()
    try:
        assert telling.wait(10), "the clock did not get to telling the loss"
        assert lease.lost
        with pytest.raises(LockLost, match="the clock ran out") as raised:
            lease.check()
        assert raised.value.code == LossCode.LEASE_CLOCK
    finally:
        go_on.set()
        declaring.join(10)
        lease.release()
