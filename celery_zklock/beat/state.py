"""The schedule's state of a beat group, kept in ZooKeeper so that any new leader starts from
the last recorded send: one record per entry (:class:`RunRecord`: last run time, run count),
encoded as one JSON document (:func:`encode_state`) at ``<zklock_root>/beat/<name>/schedule``,
read after a ``sync`` and written only with versioned requests (:class:`ZooKeeperState`), so a
write of an older leader either lands before a new leader's read or fails with
:class:`Superseded`. The pure functions here apply records to Celery schedule entries and back;
why the state is kept this way: ``docs/beat.md``.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any, Final, Protocol

from kazoo.client import KazooClient
from kazoo.exceptions import BadVersionError, NodeExistsError, NoNodeError

from celery_zklock.zk.calls import Deadline, wait_result

logger = logging.getLogger("celery_zklock.beat")

STATE_FORMAT: Final = 1
"""The version of the state document's layout (:func:`encode_state`)."""


@dataclass(frozen=True)
class RunRecord:
    """The last send of one schedule entry: when (timezone-aware) and how many sends so far."""

    last_run_at: datetime
    total_run_count: int


def _as_utc(moment: datetime) -> datetime:
    # Celery reads a naive last_run_at as UTC (celery.utils.time.maybe_make_aware).
    if moment.tzinfo is None:
        return moment.replace(tzinfo=timezone.utc)
    return moment.astimezone(timezone.utc)


def record_of(entry: Any) -> RunRecord:
    """The record of a schedule entry's ``last_run_at`` and ``total_run_count``."""
    return RunRecord(_as_utc(entry.last_run_at), int(entry.total_run_count or 0))


def apply_record(entry: Any, record: RunRecord) -> bool:
    """Give ``entry`` the recorded last run time and run count; True if either changed.

    The stored time replaces the entry's own (a scheduler's fresh entry holds the time it was
    created, which is not a send). It keeps the entry's convention: naive UTC stays naive, an
    aware time is given in the entry's own zone.
    """
    current = getattr(entry, "last_run_at", None)
    if current is None or current.tzinfo is not None:
        zone = timezone.utc if current is None else current.tzinfo
        moment = record.last_run_at.astimezone(zone)
    else:
        moment = record.last_run_at.astimezone(timezone.utc).replace(tzinfo=None)
    changed = current != moment or entry.total_run_count != record.total_run_count
    if changed:
        entry.last_run_at = moment
        entry.total_run_count = record.total_run_count
    return changed


def apply_records(entries: Mapping[str, Any], records: Mapping[str, RunRecord]) -> list[str]:
    """:func:`apply_record` for every entry with a record; the names of the entries changed.
    Entries without a record keep their own times; records without an entry are ignored."""
    return [
        name
        for name, entry in entries.items()
        if name in records and apply_record(entry, records[name])
    ]


def records_of_new_entries(
    entries: Mapping[str, Any], records: Mapping[str, RunRecord]
) -> dict[str, RunRecord]:
    """:func:`record_of` each entry without a record (and with a last run time): for an entry
    no leader has sent yet that is the time its scheduler first saw it (a fresh entry's
    ``last_run_at`` is its creation time), which its first interval counts from."""
    return {
        name: record_of(entry)
        for name, entry in entries.items()
        if name not in records and getattr(entry, "last_run_at", None) is not None
    }


def encode_state(
    records: Mapping[str, RunRecord], *, leader: str, token: int, written_at: datetime
) -> bytes:
    """The state document: ``{"format", "leader", "token", "written_at", "entries": {name:
    {"last_run_at": ISO 8601 UTC, "total_run_count"}}}`` as UTF-8 JSON, entries sorted."""
    document = {
        "format": STATE_FORMAT,
        "leader": leader,
        "token": token,
        "written_at": _as_utc(written_at).isoformat(),
        "entries": {
            name: {
                "last_run_at": _as_utc(record.last_run_at).isoformat(),
                "total_run_count": record.total_run_count,
            }
            for name, record in sorted(records.items())
        },
    }
    return json.dumps(document, sort_keys=True).encode()


def decode_state(data: bytes) -> dict[str, RunRecord]:
    """The records of a state document; ``{}`` for an empty node.

    Raises ValueError for anything :func:`encode_state` did not write (another format, bad JSON,
    a missing or malformed field).
    """
    if not data:
        return {}
    try:
        document = json.loads(data)
        if document.get("format") != STATE_FORMAT:
            raise ValueError(f"unknown format {document.get('format')!r}")
        return {
            str(name): RunRecord(
                _as_utc(datetime.fromisoformat(fields["last_run_at"])),
                int(fields["total_run_count"]),
            )
            for name, fields in document["entries"].items()
        }
    except (AttributeError, KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"not a celery-zklock beat state document: {exc!r}") from exc


class Superseded(Exception):
    """The state node was written by someone else since this beat read or wrote it."""


class StateStore(Protocol):
    """The schedule's state node (:class:`ZooKeeperState`)."""

    def load(self) -> dict[str, RunRecord]: ...

    def save(self, data: bytes) -> None: ...


class ZooKeeperState:
    """The state node at ``path``: read after a ``sync``, written with versioned requests.

    :meth:`save` raises :class:`Superseded` when someone else wrote since our last read or
    write. After a write whose outcome is unknown (no answer in time, connection lost), the
    next :meth:`save` reads the node first: holding our own last attempt it was written, holding
    what we last knew it was not, anything else is someone else's write.
    """

    def __init__(self, client: KazooClient, path: str, timeout: Callable[[], float]) -> None:
        self._client = client
        self._path = path
        self._timeout = timeout
        self._version: int | None = None  # None: the node does not exist
        self._known = b""
        self._attempted: bytes | None = None

    def _wait(self, request: Any, what: str) -> Any:
        return wait_result(request, Deadline(self._timeout()), f"{what} {self._path}")

    def _read(self) -> tuple[bytes, int | None]:
        self._wait(self._client.sync_async(self._path), "syncing before reading")
        try:
            data, stat = self._wait(self._client.get_async(self._path), "reading")
        except NoNodeError:
            return b"", None
        return bytes(data or b""), int(stat.version)

    def load(self) -> dict[str, RunRecord]:
        data, version = self._read()
        self._known, self._version, self._attempted = data, version, None
        try:
            return decode_state(data)
        except ValueError:
            logger.error(
                "beat: the schedule's state at %s cannot be read; starting from the "
                "scheduler's own last run times and overwriting it",
                self._path,
                exc_info=True,
            )
            return {}

    def save(self, data: bytes) -> None:
        if self._attempted is not None:
            current, version = self._read()
            if version is not None and current == self._attempted:
                self._known, self._version = current, version
            elif current != self._known or version != self._version:
                raise Superseded(f"{self._path} changed under us (version {version})")
            self._attempted = None
        self._attempted = data
        try:
            if self._version is None:
                self._wait(self._client.create_async(self._path, data, makepath=True), "creating")
                self._version = 0
            else:
                stat = self._wait(
                    self._client.set_async(self._path, data, version=self._version), "writing"
                )
                self._version = int(stat.version)
        except (BadVersionError, NodeExistsError, NoNodeError) as exc:
            self._attempted = None
            raise Superseded(f"{self._path}: {type(exc).__name__}") from exc
        self._known, self._attempted = data, None
