"""The RateLimit of celery_zklock before issue 42 (commit 774dd01), frozen: the "old version"
of the mixed-version tests (``test_rate_cleanup.py``). It decides on the same nodes
(``<path>/adm-<seq>``, persistent) under the same decision lock (``<path>/lock``), without the
check of its lock after the listing, TTL nodes or sweeps. Do not change it."""

from __future__ import annotations

import re
import threading
import time
from contextlib import suppress
from dataclasses import dataclass
from typing import Final

from kazoo.client import KazooClient
from kazoo.exceptions import NoNodeError

from celery_zklock.errors import ConfigurationError, LockTimeout
from celery_zklock.locks.mutex import Mutex
from celery_zklock.locks.queue import make_containers, pipelined, validate_lock_path
from celery_zklock.zk.calls import Deadline, wait_result, wait_slice

__all__ = ["Rate", "RateLimit", "parse_rate"]

RATE_NODE: Final = "rate"
"""The child of a task lock's path that holds its key's rate admissions (``lock_rate``)."""
ADMISSION_PREFIX: Final = "adm-"
"""Name prefix of an admission node (ZooKeeper appends the sequence number)."""
DECISION_LOCK: Final = "lock"
"""The child of a rate limit's path under which decisions take their turn."""
TRY_WAIT: Final = 2.0
"""Seconds a try (``blocking=False``) waits for its turn to decide: others decide in a few
milliseconds, so this bounds only a slow ZooKeeper."""
IO_TIMEOUT: Final = 10.0
"""Seconds ZooKeeper may take to answer one decision's requests (else ZooKeeperUnavailable)."""
_PERIODS: Final = {"s": 1.0, "m": 60.0, "h": 3600.0}
_RATE = re.compile(r"^\s*(\d+)\s*(?:/\s*([smh]))?\s*$")


@dataclass(frozen=True)
class Rate:
    """``limit`` admissions per ``period`` seconds."""

    limit: int
    period: float

    def __str__(self) -> str:
        unit = {1.0: "s", 60.0: "m", 3600.0: "h"}.get(self.period)
        return f"{self.limit}/{unit}" if unit else f"{self.limit}/{self.period}s"


def parse_rate(rate: object, label: str = "rate") -> Rate:
    """A rate in Celery's syntax: ``"10/s"``, ``"100/m"``, ``"1/h"`` (a bare number is per
    second), or a :class:`Rate`. Raises ConfigurationError naming ``label`` otherwise."""
    if isinstance(rate, Rate):
        return rate
    match = _RATE.match(rate) if isinstance(rate, str) else None
    if match is None or int(match[1]) < 1:
        raise ConfigurationError(
            f"{label} must be 'N/s', 'N/m' or 'N/h' with N >= 1 (Celery's rate syntax, e.g. "
            f"'10/s', '100/m', '1/h'), got {rate!r}"
        )
    return Rate(int(match[1]), _PERIODS[match[2] or "s"])


class RateLimit:
    """At most ``rate`` admissions per period on ``path``, fleet-wide; see the module
    docstring for the guarantee and its edges. Thread-safe; usable without Celery."""

    def __init__(self, client: KazooClient, path: str, rate: str | Rate) -> None:
        self.client = client
        self.path = validate_lock_path(path)
        self.rate = parse_rate(rate)
        self._decisions = Mutex(client, f"{self.path}/{DECISION_LOCK}")
        self._last = threading.local()

    @property
    def admitted_at(self) -> float | None:
        """When this thread's last admission was decided: its node's ``ctime`` (ZooKeeper's
        clock, seconds since the epoch); None before the first."""
        return getattr(self._last, "ctime", None)

    def acquire(
        self, blocking: bool = True, timeout: float | None = None, data: bytes = b""
    ) -> bool:
        """Be admitted: True once admitted. A try (``blocking=False``) over the limit answers
        False at once; a blocking call over the limit sleeps until the window can admit one
        (the oldest admission's age, from ZooKeeper's clock), then tries again, up to
        ``timeout`` seconds (None: no limit), and answers False when that passes. ``data`` is
        stored in the admission's node (who was admitted, for operators).

        Raises ZooKeeperUnavailable when ZooKeeper does not answer, ValueError for a negative
        timeout."""
        if timeout is not None and timeout < 0:
            raise ValueError(f"timeout must be >= 0 or None, got {timeout!r}")
        deadline = Deadline(timeout)
        while True:
            try:
                wait = self.admit(data, TRY_WAIT if not blocking else deadline.remaining())
            except LockTimeout:
                return False
            if wait is None:
                return True
            remaining = deadline.remaining()
            if not blocking or (remaining is not None and wait > remaining):
                return False
            pause = Deadline(wait)
            while not pause.expired():
                time.sleep(wait_slice(pause))

    def admit(self, data: bytes = b"", turn: float | None = TRY_WAIT) -> float | None:
        """One decision: None when admitted, else the seconds until the window can admit one.
        Waits up to ``turn`` seconds for its turn to decide (LockTimeout past it)."""
        lease = self._decisions.acquire(timeout=turn)
        try:
            return self._decide(data)
        finally:
            lease.release()

    def admissions(self) -> list[float]:
        """The ``ctime`` (ZooKeeper's clock, seconds since the epoch) of the admissions of the
        last period, oldest first, as seen now (for operators)."""
        io = Deadline(IO_TIMEOUT)
        nodes = self._nodes(io)
        if not nodes:
            return []
        newest = max(ctime for _, ctime in nodes)
        return sorted(c / 1000.0 for _, c in nodes if c > newest - self.rate.period * 1000)

    def _decide(self, data: bytes) -> float | None:
        """Under the decision lock: None when admitted, else seconds until the window admits."""
        io = Deadline(IO_TIMEOUT)
        client = self.client
        try:
            created = client.create_async(
                f"{self.path}/{ADMISSION_PREFIX}", data, sequence=True, include_data=True
            )
            ours, stat = wait_result(created, io, f"creating an admission under {self.path}")
        except NoNodeError:
            make_containers(client, self.path, io)
            return self._decide(data)
        now: int = stat.ctime
        window = self.rate.period * 1000
        others = [(name, ctime) for name, ctime in self._nodes(io) if name != ours]
        old = [name for name, ctime in others if ctime <= now - window]
        recent = sorted(ctime for _, ctime in others if ctime > now - window)
        gone = [ours] if len(recent) >= self.rate.limit else []
        for result in [client.delete_async(name) for name in old + gone]:
            with suppress(NoNodeError):
                wait_result(result, io, f"removing old admissions under {self.path}")
        if not gone:
            self._last.ctime = now / 1000.0
            return None
        opens = recent[len(recent) - self.rate.limit] + window
        return max(0.001, (opens - now) / 1000.0 + 0.001)

    def _nodes(self, io: Deadline) -> list[tuple[str, int]]:
        """``(node path, ctime in ms)`` of every admission under the path."""
        (children,) = pipelined(self.client, [("children", self.path)], io)
        paths = [f"{self.path}/{n}" for n in children or () if n.startswith(ADMISSION_PREFIX)]
        answers = pipelined(self.client, [("get", p) for p in paths], io)
        return [(p, a[1].ctime) for p, a in zip(paths, answers, strict=True) if a is not None]
