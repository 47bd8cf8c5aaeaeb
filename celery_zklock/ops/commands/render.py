"""How ``celery zklock locks`` and ``holder`` show locks: a table for people, JSON for programs.

Pure functions of :class:`~celery_zklock.locks.holders.LockState` values and a reading time.

The JSON document (``--json``) is stable: fields are only ever added, and ``schema`` changes
if one is removed or changes meaning::

    {
      "schema": 1,
      "root": "/zklock",             # zklock_root
      "time": 1718000000.25,         # Unix time of the reading (this host's clock)
      "locks": [                     # sorted by path; only locks with a contender
        {
          "path": "/zklock/sync_account/account_id=42~1f0c...",
          "name": "sync_account",    # the lock name (None for a path outside the root)
          "key": "account_id=42~1f0c...",
          "mode": "exclusive",       # exclusive | shared | semaphore | null (nobody holds)
          "limit": null,             # a semaphore's N (at most N holders), else null
          "admissions": [1718000000.1],  # lock_rate: when its recorded admissions were made
                                     # (server's clock), those of the last period
          "debounce": {              # lock_debounce: the key's open window, else null
            "task_id": "...",        # its latest call: the one that runs unless a newer comes
            "first": 1717999999.0,   # when the window began (server's clock)
            "last": 1718000000.0,    # when its latest call was recorded (server's clock)
            "ends": 1718000001.0     # when it ends unless a newer call comes (or null)
          },
          "waiting_call": {          # lock_on_busy="replace": the key's one waiting call,
            "task_id": "...",        # else null
            "since": 1718000000.0    # when it was recorded as such (server's clock)
          },
          "holders": [NODE, ...],    # one writer, the readers ahead of the first writer,
                                     # or a semaphore's first N nodes
          "waiters": [NODE, ...]     # in the order they will be granted
        }
      ],
      "held": [                      # ``locks`` only: messages held at the workers' gates
        {
          "path": "/zklock/...",     # sorted by path
          "count": 3,                # messages held for this lock, every answering worker
          "oldest": 12.5,            # seconds the oldest of them has been held
          "workers": ["w1@host"],    # the workers holding them
          "messages": [              # by position, then worker; a worker of an older
                                     # version counts its messages in count, names none
            {"task_id": "...", "task": "...", "worker": "w1@host",
             "held_for": 12.5,       # seconds since it reached the gate
             "position": 1}          # in its worker's line for this key: 1 goes first
          ]
        }
      ]
    }

and each NODE::

    {
      "node": "/zklock/.../_c_<uuid>-__WRIT__0000000007",  # what `break` takes
      "seq": 7,                      # ZooKeeper's sequence number: the queue order
      "mode": "exclusive",           # exclusive (lock-, __WRIT__) | shared (__READ__) |
                                     # semaphore (lock- under a node holding max_leases=N)
      "task_id": "...", "task": "...", "worker": "...", "pid": 1234, "retries": 0,
      "token": 4294967302,           # fencing token: the node's czxid
      "session": "0x1000a3f2c0004",  # the ZooKeeper session that owns the node
      "created": 1717999997.05,      # Unix time the node was created (server's clock)
      "held_for": 3.2,               # holders: seconds since created (includes any wait)
      "waiting_for": 1.0,            # waiters instead: seconds since created
      "position": 1,                 # waiters only: 1 is granted next
      "broken": null,                # or {"by": "alice@host", "at": ..., "reason": ...}
      "celery_zklock": true          # false: not a celery-zklock contender (Curator, kazoo
                                     # recipes): it cannot hear a break request
    }

``task_id``, ``task``, ``worker`` and ``pid`` are null for a node that is not a task run's.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, Final

from celery_zklock.locks.contenders import Contender
from celery_zklock.locks.holders import LockState, breakable
from celery_zklock.task.latest import Record
from celery_zklock.worker.gate.step import HeldMessages

SCHEMA: Final = 1
"""Version of the ``--json`` document."""
COLUMNS: Final = ("LOCK", "MODE", "ROLE", "TOKEN", "FOR", "TASK ID", "TASK", "WORKER", "PID")


def name_and_key(root: str, path: str) -> tuple[str | None, str | None]:
    """A lock path's lock name and key, if it is ``<root>/<name>/<key>``."""
    prefix = root.rstrip("/") + "/"
    if not path.startswith(prefix):
        return None, None
    name, sep, key = path[len(prefix) :].partition("/")
    if not sep or not key or "/" in key:
        return None, None
    return name, key


def node_document(
    state: LockState, entry: Contender, now: float, position: int | None
) -> dict[str, Any]:
    """One NODE of the JSON document (see the module docstring)."""
    identity = entry.identity
    age = round(entry.age(now), 3)
    timing = {"held_for": age} if position is None else {"waiting_for": age, "position": position}
    return {
        "node": f"{state.path}/{entry.name}",
        "seq": entry.seq,
        "mode": entry.mode,
        "task_id": identity.task_id,
        "task": identity.task,
        "worker": identity.worker,
        "pid": identity.pid,
        "retries": identity.retries,
        "token": entry.token,
        "session": hex(entry.session),
        "created": entry.created,
        **timing,
        "broken": dict(identity.broken) if identity.broken is not None else None,
        "celery_zklock": breakable(entry.name, entry.identity),
    }


def lock_document(root: str, state: LockState, now: float) -> dict[str, Any]:
    """One lock of the JSON document."""
    name, key = name_and_key(root, state.path)
    return {
        "path": state.path,
        "name": name,
        "key": key,
        "mode": state.mode,
        "limit": state.limit,
        "admissions": list(state.admissions),
        "debounce": _window(getattr(state, "debounce", None)),
        "waiting_call": _waiting(getattr(state, "waiting", None)),
        "holders": [node_document(state, e, now, None) for e in state.holders],
        "waiters": [
            node_document(state, e, now, position)
            for position, e in enumerate(state.waiters, start=1)
        ],
    }


def _window(record: Record | None) -> dict[str, Any] | None:
    if record is None:
        return None
    ends = None if record.ends is None else record.ends / 1000.0
    return {"task_id": record.task_id, "first": record.first / 1000.0,
            "last": record.at / 1000.0, "ends": ends}  # fmt: skip


def _waiting(record: Record | None) -> dict[str, Any] | None:
    if record is None:
        return None
    return {"task_id": record.task_id, "since": record.mtime / 1000.0}


def _record_rows(state: LockState, now: float) -> list[list[str]]:
    """The rows of what a key recorded besides its contenders: the admissions of its
    ``lock_rate`` (ROLE: how many, the last one's age), its debounce window's latest call (ROLE
    ``debounce``, FOR: the window's age, NOTE: when it ends) and its ``replace`` waiting call
    (ROLE ``queued (replace)``, FOR: since when). Without the LOCK column."""
    rows = []
    if state.admissions:
        newest = duration(max(0.0, now - state.admissions[-1]))
        rows.append(
            _record_row("rate", f"rate: {len(state.admissions)} admitted, last {newest} ago")
        )
    window: Record | None = getattr(state, "debounce", None)
    if window is not None:
        ends = window.ends
        note = "" if ends is None else f"window ends in {duration(max(0.0, ends / 1000 - now))}"
        age = duration(max(0.0, now - window.first / 1000))
        rows.append(_record_row("debounce", "latest call", age, window.task_id or "-", note))
    waiting: Record | None = getattr(state, "waiting", None)
    if waiting is not None:
        age = duration(max(0.0, now - waiting.mtime / 1000))
        rows.append(_record_row("replace", "queued call", age, waiting.task_id or "-"))
    return rows


def _record_row(
    mode: str, role: str, age: str = "", task_id: str = "", note: str = ""
) -> list[str]:
    """A row (without the LOCK column) of a call or admission a key's records name."""
    return [mode, role, "", age, task_id, "", "", "", note]


def _under(path: str, rows: Sequence[Sequence[str]]) -> list[list[str]]:
    """``rows`` with a first column: ``path`` on the first row, blank on the others."""
    return [[path if i == 0 else "", *row] for i, row in enumerate(rows)]


def locks_document(root: str, states: Sequence[LockState], now: float) -> dict[str, Any]:
    """The ``--json`` document of ``locks`` (and of ``holder``, with one lock)."""
    return {
        "schema": SCHEMA,
        "root": root,
        "time": now,
        "locks": [lock_document(root, state, now) for state in states],
    }


def duration(seconds: float) -> str:
    """A short human duration: ``0.4s``, ``12.0s``, ``4m05s``, ``2h03m``, ``3d04h``."""
    if seconds < 60:
        return f"{seconds:.1f}s"
    whole = int(seconds)
    if whole < 3600:
        return f"{whole // 60}m{whole % 60:02d}s"
    if whole < 86400:
        return f"{whole // 3600}h{whole % 3600 // 60:02d}m"
    return f"{whole // 86400}d{whole % 86400 // 3600:02d}h"


def _note(entry: Contender) -> str:
    if entry.identity.broken is not None:
        return f"break requested by {entry.identity.broken.get('by')}"
    if not breakable(entry.name, entry.identity):
        return "not celery-zklock"
    return ""


def _row(entry: Contender, role: str, now: float, limit: int | None) -> list[str]:
    identity = entry.identity
    return [
        f"semaphore/{limit}" if limit is not None else entry.mode,
        role,
        str(entry.token),
        duration(entry.age(now)),
        identity.task_id or "-",
        identity.task or "-",
        identity.worker or "-",
        str(identity.pid) if identity.pid is not None else "-",
        _note(entry),
    ]


def table(rows: Sequence[Sequence[str]]) -> str:
    """``rows`` (the first is the header) as left-aligned columns two spaces apart; trailing
    blanks are cut."""
    if not rows:
        return ""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = [
        "  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True))
        for row in rows
    ]
    return "\n".join(line.rstrip() for line in lines)


def locks_table(states: Sequence[LockState], now: float) -> str:
    """The human table of ``locks``: one row per contender node, holders first, the lock's
    path on its first row only; a NOTE column when a node has a break request or is not a
    task run's. ``no locks held`` when there is none."""
    body: list[list[str]] = []
    for state in states:
        rows = [_row(entry, "holder", now, state.limit) for entry in state.holders]
        for position, entry in enumerate(state.waiters, start=1):
            rows.append(_row(entry, f"waiter {position}", now, state.limit))
        body += _under(state.path, rows + _record_rows(state, now))
    if not body:
        return "no locks held"
    header = [*COLUMNS, "NOTE"]
    if not any(row[-1] for row in body):
        header = header[:-1]
        body = [row[:-1] for row in body]
    return table([header, *body])


def held_document(held: Sequence[HeldMessages]) -> list[dict[str, Any]]:
    """The ``held`` list of the JSON document (see the module docstring)."""
    return [
        {
            "path": h.path,
            "count": h.count,
            "oldest": h.oldest,
            "workers": list(h.workers),
            "messages": [dataclasses.asdict(m) for m in h.messages],
        }
        for h in held
    ]


def held_table(held: Sequence[HeldMessages]) -> str:
    """The messages held at the workers' gates: a row per message, each lock's path on its
    first row, in the order of :class:`~celery_zklock.worker.gate.step.HeldMessages`; LINE is
    the position in its worker's line for the key. Messages of workers that name none (an
    older version) are one row per lock: how many, the oldest's wait, those workers."""
    rows = [["HELD AT GATES", "LINE", "FOR", "TASK ID", "TASK", "WORKER"]]
    for h in held:
        lines = [
            [str(m.position), duration(m.held_for), m.task_id, m.task, m.worker] for m in h.messages
        ]
        if h.unnamed:
            naming = {m.worker for m in h.messages}
            older = ",".join(w for w in h.workers if w not in naming)
            unnamed = f"{h.unnamed} not named (older version)"
            lines.append(["-", duration(h.oldest), unnamed, "-", older])
        rows += _under(h.path, lines)
    return table(rows)
