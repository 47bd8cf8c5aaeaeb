"""A contender node's data: the identity of the run that made it, and a break request.

Every node a ``ZkLockTask`` run creates stores the run's identity as one JSON object
(:func:`identity`: ``task_id``, ``task``, ``retries``, the call's ``generation`` when it has one,
``worker``, ``pid``), which duplicate delivery, ``preempt``, ``task.lock_holder(...)`` and the
``celery zklock`` commands read back (:func:`parse_identity`). The bytes are fixed: workers of
several versions share one lock during a rolling deploy, and Curator contenders store other
data (their IP address) in the same queue, which parses as a foreign :class:`Identity` (``ours``
False). Fields are only ever added: a reader finds a field of a newer version ignored, and one
an older version did not write missing (``generation`` None: such a holder counts as older
than any call, see :mod:`celery_zklock.task.generation`).

A **break request** (:func:`with_break_request`, :func:`break_reason`): an operator asks a stuck
holder to let go by writing ``{"broken": {"by", "at", "reason"}}`` into the holder's own node
data, merged into the JSON object already there. The holder's lease clock reads its node once the
lease has been held for a renewal interval, with a data watch, and counts a break request it
finds as the loss of the lease (:mod:`celery_zklock.locks.breaks`); the holder's release then
deletes the node, so the lock is granted to the next contender only after the holder was told.

Pure: no ZooKeeper I/O.
"""

from __future__ import annotations

import json
import os
import socket
from collections.abc import Mapping
from dataclasses import dataclass
from json.encoder import encode_basestring_ascii
from typing import Any, Final

#: The key of a break request in a node's JSON data.
BREAK_FIELD: Final = "broken"


def identity(task: Any, request: Any = None, generation: int | None = None) -> bytes:
    """What a run stores in its contender node: who it is, as JSON (also for operators);
    ``request`` is the run's (default ``task.request``), ``generation`` its call's (left out
    when None)."""
    request = task.request if request is None else request
    # The text json.dumps(..., separators=(",", ":")) gives, built by hand: once per run, with
    # the parts a task and a worker process keep from run to run built once.
    parts = (task.name, request.hostname)
    middle_and_end = _identity_parts.get(parts)
    if middle_and_end is None:
        middle_and_end = _identity_parts[parts] = (
            f',"task":{_json(task.name)},"retries":',
            f',"worker":{_json(request.hostname or socket.gethostname())},"pid":{os.getpid()}}}',
        )
    middle, end = middle_and_end
    retries = int(request.retries or 0)
    if generation is not None:
        end = f',"generation":{int(generation)}{end}'
    task_id = request.id  # as _json does, without the call: once per run
    task_id = encode_basestring_ascii(task_id) if isinstance(task_id, str) else json.dumps(task_id)
    return f'{{"task_id":{task_id}{middle}{retries}{end}'.encode()


_identity_parts: dict[tuple[Any, Any], tuple[str, str]] = {}
# A forked child is another process: its identity names its own pid.
os.register_at_fork(after_in_child=_identity_parts.clear)


def _json(value: Any) -> str:
    return encode_basestring_ascii(value) if isinstance(value, str) else json.dumps(value)


@dataclass(frozen=True)
class Identity:
    """Who a contender node belongs to, from its data.

    ``ours`` is False for data that is not a JSON object (a Curator contender stores its IP
    address): such a holder is named by its node only, and cannot hear a break request.
    ``broken`` is the break request written into the node, if any (``by``, ``at``, ``reason``).
    ``generation`` is the call's (:mod:`celery_zklock.task.generation`), None when the node has none
    (an older version's run, a holder that is not a task run).
    """

    task_id: str | None = None
    task: str | None = None
    worker: str | None = None
    pid: int | None = None
    retries: int = 0
    broken: Mapping[str, Any] | None = None
    ours: bool = True
    generation: int | None = None


def node_object(data: bytes | None) -> dict[str, Any] | None:
    """A contender node's data as a JSON object (``{}`` for no data); None if it is something
    else (a Curator contender stores its IP address): such a holder cannot be asked to break."""
    if not data:
        return {}
    try:
        parsed = json.loads(data)
    except ValueError:
        return None
    return parsed if isinstance(parsed, dict) else None


def parse_identity(data: bytes | None) -> Identity:
    """The :class:`Identity` stored in a contender node's data (fields that are missing or of
    the wrong type are None; ``retries`` is then 0)."""
    found = node_object(data)
    if found is None:
        return Identity(ours=False)

    def text(key: str) -> str | None:
        value = found.get(key)
        return value if isinstance(value, str) else None

    def integer(key: str) -> int | None:
        value = found.get(key)
        return value if isinstance(value, int) and not isinstance(value, bool) else None

    broken = found.get(BREAK_FIELD)
    return Identity(
        task_id=text("task_id"),
        task=text("task"),
        worker=text("worker"),
        pid=integer("pid"),
        retries=integer("retries") or 0,
        broken=broken if isinstance(broken, Mapping) else None,
        generation=integer("generation"),
    )


def break_request(data: bytes | None) -> Mapping[str, Any] | None:
    """The break request written into a node's data (``by``, ``at``, ``reason``), or None."""
    return parse_identity(data).broken


def break_reason(data: bytes | None) -> str | None:
    """The reason a holder whose node holds ``data`` counts its lease lost, or None if the data
    carries no break request: ``broken by operator <by>`` and the operator's reason, if any."""
    request = break_request(data)
    if request is None:
        return None
    reason = f"broken by operator {request.get('by') or 'unknown'}"
    detail = request.get("reason")
    return f"{reason}: {detail}" if detail else reason


def with_break_request(data: bytes | None, by: str, at: float, reason: str | None) -> bytes:
    """``data`` with a break request added (what ``celery zklock break`` writes).

    ``by`` names the operator (``user@host``), ``at`` is a Unix time, ``reason`` is optional.
    The rest of the JSON object (the run's identity) is kept, so readers of the queue still
    know whose node it is. Raises ValueError if ``data`` is not a JSON object or empty.
    """
    existing = node_object(data)
    if existing is None:
        raise ValueError("the node's data is not a JSON object: not a celery-zklock holder")
    request: dict[str, Any] = {"by": by, "at": at}
    if reason:
        request["reason"] = reason
    return json.dumps({**existing, BREAK_FIELD: request}, separators=(",", ":")).encode()
