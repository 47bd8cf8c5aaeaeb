"""A mutual-exclusion witness: a shared append-only log of critical sections, and its checker.

Every process that takes a lock under test (Python or Java) appends ``enter <holder> <mode>``
right after it acquires and ``exit <holder> <mode>`` right before it releases (mode ``read`` or
``write``; ``Mutex`` records ``write``), each with one ``write()`` on an ``O_APPEND``
descriptor. The kernel serialises appends to one file, so the file is a total order: an
``enter`` that overlaps a holder inside (:mod:`celery_zklock.testing.exclusion`) proves that two
held the lock at once; a clean file proves only that this run caught none. Holder ids have no
whitespace and are unique among holders inside at the same time.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from typing import Any, Literal

from celery_zklock.testing.exclusion import Exclusion

Mode = Literal["read", "write"]

_MODES: frozenset[str] = frozenset(("read", "write"))
_KINDS: frozenset[str] = frozenset(("enter", "exit"))


def _validate(holder: str, mode: str) -> None:
    if not holder or any(c.isspace() for c in holder):
        raise ValueError(f"witness holder id must be non-empty without whitespace: {holder!r}")
    if mode not in _MODES:
        raise ValueError(f"witness mode must be 'read' or 'write', not {mode!r}")


class Witness:
    """Writer side: appends ``enter``/``exit`` lines to the witness file at ``path``.

    The file is created if missing and never truncated. The descriptor is opened lazily and
    reopened after a fork, so one instance may be shared with ``multiprocessing`` children
    (fork or spawn: pickling keeps only the path).
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = os.fspath(path)
        self._fd: int | None = None
        self._pid = -1

    @contextmanager
    def section(self, holder: str, mode: Mode) -> Iterator[None]:
        """Record ``enter`` on entry and ``exit`` on leaving, also when the body raises.

        Use it inside the lock: ``with lock.acquire(): with witness.section(h, "write"): ...``.
        """
        self.enter(holder, mode)
        try:
            yield
        finally:
            self.exit(holder, mode)

    def enter(self, holder: str, mode: Mode) -> None:
        """Append ``enter <holder> <mode>``: call right after the lock is acquired."""
        self._append("enter", holder, mode)

    def exit(self, holder: str, mode: Mode) -> None:
        """Append ``exit <holder> <mode>``: call right before the lock is released."""
        self._append("exit", holder, mode)

    def close(self) -> None:
        """Close the descriptor; a later ``enter``/``exit`` reopens it."""
        if self._fd is not None and self._pid == os.getpid():
            os.close(self._fd)
        self._fd = None

    def _append(self, kind: str, holder: str, mode: str) -> None:
        _validate(holder, mode)
        data = f"{kind} {holder} {mode}\n".encode()
        written = os.write(self._descriptor(), data)
        if written != len(data):
            # A short write would let another process's line land inside ours.
            raise OSError(f"short write to witness {self.path}: {written} of {len(data)} bytes")

    def _descriptor(self) -> int:
        if self._fd is None or self._pid != os.getpid():
            # After a fork the inherited descriptor still works (O_APPEND is per open file),
            # but it belongs to the parent's bookkeeping: open our own.
            self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            self._pid = os.getpid()
        return self._fd

    def __getstate__(self) -> dict[str, Any]:
        return {"path": self.path}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.path = state["path"]
        self._fd = None
        self._pid = -1

    def __del__(self) -> None:
        with suppress(OSError):
            self.close()


@dataclass(frozen=True)
class Overlap:
    """An ``enter`` (at 1-based ``line_no``) that found conflicting holders inside.

    ``inside`` lists the holders inside at that moment that it overlaps (every one, for a
    writer; the writers, for a reader), in the order they entered.
    """

    line_no: int
    holder: str
    mode: str
    inside: tuple[str, ...]


@dataclass(frozen=True)
class WitnessReport:
    """What a witness file shows.

    ``sections``: completed sections (an ``enter`` matched by its ``exit``).
    ``max_readers``: the most ``read`` holders inside at once.
    ``overlaps``: every ``enter`` that broke mutual exclusion, in file order.
    ``unfinished``: holders that entered and never exited, in the order they entered.
    """

    sections: int
    max_readers: int
    overlaps: list[Overlap] = field(default_factory=list)
    unfinished: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """True when no overlap was seen and every section finished."""
        return not self.overlaps and not self.unfinished


def check_witness(path: str | os.PathLike[str]) -> WitnessReport:
    """Replay the witness file at ``path`` and report overlaps.

    Raises ``ValueError`` (naming the line) for a malformed line, a file that does not end with
    a newline, an ``exit`` without a matching ``enter`` (or with another mode than its
    ``enter``), and an ``enter`` by a holder already inside. Those are bugs of the test or of
    the writer, not of the lock, so they are not reported as overlaps.
    """
    name = os.fspath(path)
    with open(path, encoding="utf-8", newline="") as f:
        text = f.read()
    if text and not text.endswith("\n"):
        raise ValueError(f"{name}: last line is not terminated by a newline")
    inside: Exclusion[str] = Exclusion()  # one key; each section keeps its mode
    sections = 0
    max_readers = 0
    overlaps: list[Overlap] = []
    for line_no, line in enumerate(text.splitlines(), start=1):
        parts = line.split(" ")
        if len(parts) != 3 or parts[0] not in _KINDS or parts[2] not in _MODES or not parts[1]:
            raise ValueError(f"{name}:{line_no}: malformed witness line {line!r}")
        kind, holder, mode = parts
        if kind == "enter":
            try:
                overlapped = inside.enter("", holder, mode == "write", mode)
            except ValueError as exc:
                raise ValueError(f"{name}:{line_no}: {exc}") from None
            if overlapped:
                overlaps.append(Overlap(line_no, holder, mode, tuple(h for h, _ in overlapped)))
            max_readers = max(max_readers, inside.shared(""))
            continue
        entered = inside.exit("", holder)
        if entered is None:
            raise ValueError(f"{name}:{line_no}: exit of {holder!r} without enter")
        if entered != mode:
            raise ValueError(
                f"{name}:{line_no}: {holder!r} entered as {entered} but exited as {mode}"
            )
        sections += 1
    return WitnessReport(sections, max_readers, overlaps, unfinished=inside.holders(""))
