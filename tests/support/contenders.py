"""Contender processes for multi-process lock tests (importable by `spawn` children)."""

from __future__ import annotations

import random
import time
from typing import Any

from kazoo.client import KazooClient

from celery_zklock import LockLost, Mutex, ReadWriteLock
from celery_zklock.testing.witness import Mode, Witness


def contend(
    hosts: str,
    path: str,
    modes: str,
    iterations: int,
    hold_s: float,
    witness_path: str,
    holder: str,
    start: Any,
    seed: int = 0,
    session_timeout: float = 10.0,
) -> None:
    """Acquire ``path`` ``iterations`` times and record each section in the witness.

    ``modes``: "mutex" (Mutex), "read", "write" (ReadWriteLock sides) or "mix" (random read/write).
    Holder ids carry the lease's fencing token: ``<holder>-<i>-t<token>``. A lease lost while
    inside ends the section at once (the witness then still proves no overlap while held).
    """
    rng = random.Random(seed)
    client = KazooClient(hosts, timeout=session_timeout)
    client.start(timeout=30)
    witness = Witness(witness_path)
    start.wait()
    try:
        for i in range(iterations):
            mode = rng.choice(("read", "write")) if modes == "mix" else modes
            if mode == "mutex":
                side: Any = Mutex(client, path)
            else:
                rw = ReadWriteLock(client, path)
                side = rw.read if mode == "read" else rw.write
            lease = side.acquire(timeout=60)
            kind: Mode = "read" if mode == "read" else "write"
            name = f"{holder}-{i}-t{lease.token}"
            try:
                with witness.section(name, kind):
                    lease.check()
                    time.sleep(hold_s * rng.random() * 2)
            except LockLost:
                pass
            finally:
                lease.release()
    finally:
        client.stop()
        client.close()
