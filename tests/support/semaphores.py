"""Semaphore contender processes for multi-process tests (importable by `spawn` children)."""

from __future__ import annotations

import random
import time
from typing import Any

from kazoo.client import KazooClient

from celery_zklock import LockLost, Semaphore
from celery_zklock.testing.witness import Witness


def contend(
    hosts: str,
    path: str,
    max_leases: int,
    iterations: int,
    hold_s: float,
    witness_path: str,
    holder: str,
    start: Any,
    seed: int,
) -> None:
    """Take a lease of the semaphore at ``path`` ``iterations`` times, each on its own session's
    client, and record each lease as a ``read`` section of the witness (so the witness counts
    holders at once as readers). Holder ids are ``<holder>-<i>-t<token>``."""
    rng = random.Random(seed)
    client = KazooClient(hosts, timeout=10.0)
    client.start(timeout=30)
    witness = Witness(witness_path)
    semaphore = Semaphore(client, path, max_leases=max_leases)
    start.wait()
    try:
        for i in range(iterations):
            lease = semaphore.acquire(timeout=120)
            try:
                with witness.section(f"{holder}-{i}-t{lease.token}", "read"):
                    lease.check()
                    time.sleep(hold_s * rng.random() * 2)
            except LockLost:
                pass
            finally:
                lease.release()
    finally:
        client.stop()
        client.close()
