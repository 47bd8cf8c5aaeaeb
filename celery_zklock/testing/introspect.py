"""``zklock_live``: what a worker's main process keeps alive, for the memory tests and benchmark.

Importing this module in a worker's app registers the inspect command; ``app.control.broadcast(
"zklock_live", reply=True)`` then answers, per worker, the number of live Celery request
objects (after a garbage collection), the entries in the consumer's timer (kombu keeps a
cancelled entry until its due time), the messages its gate holds, the keys whose held messages
wait only for a pool slot, and the main process's resident memory in bytes. The library never
imports it.
"""

from __future__ import annotations

import gc
import os
from typing import Any

from celery.worker.control import inspect_command
from celery.worker.request import Request


@inspect_command()  # type: ignore[untyped-decorator]
def zklock_live(state: Any) -> dict[str, int]:
    """Live requests, timer entries, held messages and RSS of this worker's main process."""
    gc.collect()
    requests = sum(1 for o in gc.get_objects() if isinstance(o, Request))
    gate = getattr(state.consumer, "zklock_gate", None)
    return {
        "requests": requests,
        "timer_entries": len(state.consumer.timer.queue),
        "held": gate.held if gate is not None else 0,
        "wanting_a_slot": gate.wanting_a_slot if gate is not None else 0,
        "rss_bytes": _rss_bytes(),
    }


def _rss_bytes() -> int:
    with open(f"/proc/{os.getpid()}/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
