"""Every lock under ``zklock_root`` that someone holds or waits for, with the admissions its
rate limit recorded and the calls its key's records name (a debounce window's latest call, a
``replace`` key's waiting call): what ``celery zklock locks`` lists. One lock is read by
:func:`celery_zklock.locks.holders.read_lock`, with the same :class:`~celery_zklock.locks.
holders.LockState` model (here a :class:`KeyState`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from kazoo.client import KazooClient

from celery_zklock.locks.holders import READ_TIMEOUT, LockState, read_states
from celery_zklock.locks.queue import pipelined
from celery_zklock.locks.rate import ADMISSION_PREFIX, RATE_NODE
from celery_zklock.task.latest import DEBOUNCE_NODE, WAITER_NODE, Record, parse
from celery_zklock.zk.calls import Deadline

__all__ = ["KeyState", "read_locks"]


@dataclasses.dataclass(frozen=True)
class KeyState(LockState):
    """A lock as ``locks`` shows it: its :class:`~celery_zklock.locks.holders.LockState`, the
    latest call of its key's open debounce window (``lock_debounce``) and its key's waiting
    call (``lock_on_busy="replace"``), each a :class:`~celery_zklock.task.latest.Record` or
    None."""

    debounce: Record | None = None
    waiting: Record | None = None


def read_locks(
    client: KazooClient,
    root: str,
    *,
    names: Sequence[str] | None = None,
    timeout: float = READ_TIMEOUT,
) -> list[LockState]:
    """Every lock under ``root`` that has a contender (``<root>/<lock name>/<key>``), sorted by
    path; with ``names``, only those lock names. Raises ZooKeeperUnavailable when ZooKeeper
    does not answer within ``timeout`` seconds."""
    deadline = Deadline(timeout)
    if names is None:
        listed = pipelined(client, [("children", root)], deadline)[0] or []
        names = sorted(listed)
    parents = [f"{root}/{name}" for name in names]
    keys = pipelined(client, [("children", p) for p in parents], deadline)
    paths = [
        f"{parent}/{key}"
        for parent, found in zip(parents, keys, strict=True)
        for key in sorted(found or ())
    ]
    states = _with_admissions(client, read_states(client, paths, deadline), deadline)
    keys = _with_records(client, states, deadline)
    return [k for k in keys if k.entries or k.admissions or k.debounce or k.waiting]


def _with_records(
    client: KazooClient, states: list[LockState], deadline: Deadline
) -> list[KeyState]:
    """``states`` with the calls their keys' records name (one round trip)."""
    nodes = [f"{state.path}/{node}" for state in states for node in (DEBOUNCE_NODE, WAITER_NODE)]
    read = pipelined(client, [("get", node) for node in nodes], deadline)
    records = [None if answer is None else parse(*answer) for answer in read]
    return [
        KeyState(**vars(state), debounce=records[2 * i], waiting=records[2 * i + 1])
        for i, state in enumerate(states)
    ]


def _with_admissions(
    client: KazooClient, states: list[LockState], deadline: Deadline
) -> list[LockState]:
    """``states`` with the admissions their keys' rate limits recorded (two round trips)."""
    rates = [f"{state.path}/{RATE_NODE}" for state in states]
    listings = pipelined(client, [("children", rate) for rate in rates], deadline)
    nodes = [
        (index, f"{rates[index]}/{name}")
        for index, names in enumerate(listings)
        for name in names or ()
        if name.startswith(ADMISSION_PREFIX)
    ]
    read = pipelined(client, [("get", node) for _, node in nodes], deadline)
    made: dict[int, list[float]] = {}
    for (index, _), answer in zip(nodes, read, strict=True):
        if answer is not None:
            made.setdefault(index, []).append(answer[1].ctime / 1000.0)
    return [
        dataclasses.replace(state, admissions=tuple(sorted(made[i]))) if i in made else state
        for i, state in enumerate(states)
    ]
