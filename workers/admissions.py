"""Rate admissions of the fleet's sections: where a section reads its own, and the window check.

A ``lock_rate`` run is admitted once it holds its lock: :class:`celery_zklock.RateLimit` creates
an admission node ``<lock path>/rate/adm-<seq>`` (``adm-t-<seq>`` where it is a TTL node)
holding the run's identity (task id, retries, worker, pid) and keeps it if fewer than N others
have a ``ctime`` in the period before its own.
The ``ctime`` is stamped by the ZooKeeper leader, so it is the one clock every admission of a
key shares, and the very time the rate limit compares: :func:`find_admission` reads it back in
the section (the body runs right after the admission, long before a later decision may remove
the node as older than a period), and the section records it (``SectionEvent.admitted``).

:func:`rate_overruns` is the checker's side: per key, an admission is *one too many* when, with
the admissions of the same key before it whose ``ctime`` is less than one period older (the
half-open window ``(ctime - period, ctime]``, the library's own rule: an admission exactly one
period old no longer counts), there are more than N. So N + 1 admissions in some ``[t, t +
period)`` give one overrun, and N in every such window none. No slack is needed: both ends
of every comparison are ``ctime``s of one ensemble (a leader change between servers whose
clocks disagree shifts them by the skew; the fleet's servers share one host's clock). It
counts the admissions the sections recorded: one whose process died before its ``enter`` was
recorded is not seen, so the count is a lower bound of what the rate limit admitted.
"""

from __future__ import annotations

import bisect
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Final

from kazoo.client import KazooClient
from kazoo.exceptions import KazooException, NoNodeError
from kazoo.retry import KazooRetry

from celery_zklock.locks.identity import parse_identity
from celery_zklock.locks.rate import ADMISSION_PREFIX, RATE_NODE, parse_rate

__all__ = ["Admission", "RateOverrun", "find_admission", "rate_overruns"]

LOOKUP_DEADLINE: Final = 5.0
"""Seconds a section keeps retrying the read of its admission across a lost connection."""


@dataclass(frozen=True)
class Admission:
    """A section's admission: its ``key``, the ``rate`` it was admitted under (Celery's
    syntax), its node's ``ctime`` ``at`` (ms) and its ``holder`` (``task_id#token``)."""

    key: str
    rate: str
    at: int
    holder: str


@dataclass(frozen=True)
class RateOverrun:
    """An admission that made more than N in one period of its key: the admissions of
    ``holders`` (oldest first, the one too many last) all have a ``ctime`` in
    ``[window_start, window_start + period)`` (ms)."""

    key: str
    rate: str
    window_start: int
    holders: tuple[str, ...]

    @property
    def period_ms(self) -> int:
        return round(parse_rate(self.rate).period * 1000)

    def describe(self) -> str:
        end = self.window_start + self.period_ms
        return (
            f"{len(self.holders)} admissions in [{self.window_start}, {end}) ms (rate "
            f"{self.rate}) on {self.key}: {', '.join(self.holders)}"
        )


def rate_overruns(admissions: Iterable[Admission]) -> tuple[RateOverrun, ...]:
    """Every admission that is one too many for its own rate (see the module docstring), in
    key then ``ctime`` order."""
    by_key: dict[str, list[Admission]] = defaultdict(list)
    for admission in admissions:
        by_key[admission.key].append(admission)
    overruns = []
    for key in sorted(by_key):
        ordered = sorted(by_key[key], key=lambda a: (a.at, a.holder))
        times = [a.at for a in ordered]
        for index, admission in enumerate(ordered):
            rate = parse_rate(admission.rate)
            period = round(rate.period * 1000)
            first = bisect.bisect_right(times, admission.at - period, 0, index)
            window = ordered[first : index + 1]
            if len(window) > rate.limit:
                overruns.append(
                    RateOverrun(key, admission.rate, window[0].at, tuple(a.holder for a in window))
                )
    return tuple(overruns)


def find_admission(
    client: KazooClient, lock_path: str, task_id: str, pid: int, retries: int
) -> int | None:
    """The ``ctime`` (ms) of the newest admission under ``lock_path``'s rate whose identity is
    this run's (``task_id``, ``retries``, made by process ``pid``), or None if there is none or
    ZooKeeper did not answer within :data:`LOOKUP_DEADLINE` seconds."""
    path = f"{lock_path}/{RATE_NODE}"
    retry = KazooRetry(max_tries=-1, delay=0.05, max_delay=0.5, deadline=LOOKUP_DEADLINE)
    try:
        children = retry(client.get_children, path)
        newest: tuple[int, int] | None = None  # (czxid, ctime): the newest is the last created
        for name in children:
            if not name.startswith(ADMISSION_PREFIX):
                continue
            try:
                data, stat = retry(client.get, f"{path}/{name}")
            except NoNodeError:
                continue  # removed as old by another decision meanwhile: not ours
            who = parse_identity(data)
            if (who.task_id, who.pid, who.retries) != (task_id, pid, retries):
                continue
            if newest is None or stat.czxid > newest[0]:
                newest = (stat.czxid, stat.ctime)
    except KazooException:
        return None
    return None if newest is None else newest[1]
