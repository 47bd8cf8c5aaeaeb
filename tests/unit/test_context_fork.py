"""A forked child gets a lock of its own for the registry of client contexts: one a thread of
the parent held at the fork would otherwise stay held in the child for ever."""

from __future__ import annotations

import os

from celery_zklock.locks import context


def test_the_contexts_lock_is_free_in_a_child_forked_while_it_was_held() -> None:
    with context._contexts_lock:
        pid = os.fork()
        if pid == 0:  # the child: exit 0 if it can take the lock
            os._exit(0 if context._contexts_lock.acquire(timeout=5) else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
