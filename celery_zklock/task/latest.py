"""One call named per key: the record that ``lock_debounce`` and ``lock_on_busy="replace"`` keep.

Both keep, beside a key's contender nodes, one persistent znode naming the one call of the key
that counts now (:data:`DEBOUNCE_NODE`: the latest call of a debounce window;
:data:`WAITER_NODE`: the call waiting for the lock): ``<lock path>/<node>``, JSON data
``{"task_id", "generation"}``, a debounce window's ``"quiet"`` and ``"cap"`` (seconds: for
``celery zklock locks``) and, once written by a check, ``"at"``. Curator's recipes and ours
see only contender nodes (their names hold ``lock-``, ``__READ__`` or ``__WRIT__``): the lock
layout is untouched, and the key's container node stays while the record does.

Every change is *versioned* against the record as read: of two runs that write on the same
read, one fails on the version (or the node gone) and reads again, so the record only ever names
one call, and a call that a newer one replaced can tell, at the one write that would let it go
on (its versioned delete), that it was replaced. ZooKeeper's clock is read from the writes'
stats (``ctime``, ``mtime``, milliseconds since the epoch), never from a worker's.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Final, TypeVar

from kazoo.client import KazooClient
from kazoo.exceptions import BadVersionError, NodeExistsError, NoNodeError

from celery_zklock.errors import ZooKeeperUnavailable
from celery_zklock.locks.queue import make_containers
from celery_zklock.zk.calls import Deadline, wait_result

DEBOUNCE_NODE: Final = "debounce"
"""The child of a key's lock path naming the latest call of its debounce window."""
WAITER_NODE: Final = "waiter"
"""The child of a key's lock path naming its one waiting call (``lock_on_busy="replace"``)."""
IO_TIMEOUT: Final = 5.0
"""Seconds ZooKeeper may take to answer one record request (else ZooKeeperUnavailable)."""
ROUNDS: Final = 20
"""Versioned writes a run tries (:func:`versioned`) before it gives the record up as unreachable."""

T = TypeVar("T")


@dataclass(frozen=True)
class Record:
    """A record as read: the call it names (``task_id``, ``generation``), ``at`` (ms, ZooKeeper's
    clock: when that call was recorded), ``first`` (ms: when the node was made), ``mtime`` (ms:
    its last write) and the node's ``version`` (for the versioned writes); a debounce
    window's ``quiet`` and ``cap`` (seconds, as its writer's task has them)."""

    task_id: str | None
    generation: int | None
    at: int
    first: int
    mtime: int
    version: int
    quiet: float | None = None
    cap: float | None = None

    @property
    def ends(self) -> int | None:
        """When a debounce window ends (ms) unless a newer call comes, if the record says."""
        if self.quiet is None or self.cap is None:
            return None
        return min(self.at + round(self.quiet * 1000), self.first + round(self.cap * 1000))


def encode(
    task_id: str,
    generation: int | None,
    at: int | None = None,
    window: tuple[float, float] | None = None,
) -> bytes:
    """The data naming call ``task_id`` of ``generation``; ``at`` kept by a check's write; a
    debounce ``window`` (quiet, cap)."""
    fields: dict[str, Any] = {"task_id": task_id, "generation": generation}
    if at is not None:
        fields["at"] = at
    if window is not None:
        fields["quiet"], fields["cap"] = window
    return json.dumps(fields, separators=(",", ":")).encode()


def parse(data: bytes, stat: Any) -> Record:
    """The :class:`Record` of a node's ``data`` and ``stat`` (data that is not ours names no
    call, and counts as the oldest)."""
    try:
        fields = json.loads(data.decode())
    except (ValueError, UnicodeDecodeError):
        fields = {}
    if not isinstance(fields, dict):
        fields = {}
    task_id, generation, at = fields.get("task_id"), fields.get("generation"), fields.get("at")
    quiet, cap = _seconds(fields.get("quiet")), _seconds(fields.get("cap"))
    return Record(
        task_id if isinstance(task_id, str) else None,
        generation if isinstance(generation, int) and not isinstance(generation, bool) else None,
        at if isinstance(at, int) and not isinstance(at, bool) else int(stat.mtime),
        int(stat.ctime),
        int(stat.mtime),
        int(stat.version),
        quiet,
        cap,
    )


def _seconds(value: object) -> float | None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    return float(value) if ok else None  # type: ignore[arg-type]


def versioned(client: KazooClient, path: str, step: Callable[[Record | None], T]) -> T:
    """``step`` applied to the record at ``path`` as read (None: there is none), which writes
    against that read (:func:`create`, :func:`write`, :func:`delete`); read again and applied
    again when another run's write came first, at most :data:`ROUNDS` times, then
    ``ZooKeeperUnavailable``."""
    for _ in range(ROUNDS):
        try:
            return step(read(client, path))
        except (BadVersionError, NoNodeError, NodeExistsError):
            continue  # another call's write came first: read again
    name = path.rsplit("/", 1)[1]
    raise ZooKeeperUnavailable(f"the {name} record {path} changed at each of {ROUNDS} writes")


def read(client: KazooClient, path: str) -> Record | None:
    """The record at ``path``, or None."""
    try:
        data, stat = wait_result(client.get_async(path), Deadline(IO_TIMEOUT), f"reading {path}")
    except NoNodeError:
        return None
    return parse(data, stat)


def create(client: KazooClient, path: str, data: bytes) -> Record:
    """Create the record at ``path`` (its parents as containers where missing). Raises
    ``NodeExistsError`` when another run made it first."""
    io = Deadline(IO_TIMEOUT)
    what = f"creating {path}"
    try:
        _, stat = wait_result(client.create_async(path, data, include_data=True), io, what)
    except NoNodeError:
        make_containers(client, path.rsplit("/", 1)[0], io)
        _, stat = wait_result(client.create_async(path, data, include_data=True), io, what)
    return parse(data, stat)


def write(client: KazooClient, path: str, data: bytes, version: int) -> Record:
    """Set the record's data if it is still at ``version``; the record written (its ``mtime``:
    ZooKeeper's time of the write). Raises ``BadVersionError`` or ``NoNodeError`` otherwise."""
    stat = wait_result(
        client.set_async(path, data, version), Deadline(IO_TIMEOUT), f"setting {path}"
    )
    return parse(data, stat)


def delete(client: KazooClient, path: str, version: int) -> None:
    """Delete the record if it is still at ``version``. Raises ``BadVersionError`` or
    ``NoNodeError`` otherwise."""
    wait_result(client.delete_async(path, version), Deadline(IO_TIMEOUT), f"deleting {path}")
