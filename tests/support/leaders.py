"""Leader-latch participants in processes of their own (importable by ``spawn`` children), and
the log they share with the test.

A :class:`LeaderLog` is one file of lines appended with one ``write()`` each on an ``O_APPEND``
descriptor, so the file is a total order of what every process (and the test) wrote:
``<kind> <who> <unit> <token> <monotonic>``. ``unit`` and ``token`` are ``-`` where they do not
apply; ``time.monotonic()`` is one clock for every process of the machine.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kazoo.client import KazooClient

from celery_zklock import LeaderLatch
from celery_zklock.testing.witness import Witness

WAIT_S = 60.0
"""Seconds :meth:`LeaderLog.wait` waits for a line: a hang guard, never a claim."""


@dataclass(frozen=True)
class Line:
    """One line of a :class:`LeaderLog`; ``index`` is its place in the file."""

    index: int
    kind: str
    who: str
    unit: int | None
    token: int | None
    at: float


def line_of(
    kind: str, who: str | None = None, unit: int | None = None, newer_than: int | None = None
) -> Callable[[Line], bool]:
    """A predicate for :meth:`LeaderLog.wait`: a line of ``kind`` (by ``who``, of ``unit``,
    with a token above ``newer_than``, where given)."""

    def matches(line: Line) -> bool:
        return (
            line.kind == kind
            and (who is None or line.who == who)
            and (unit is None or line.unit == unit)
            and (newer_than is None or (line.token is not None and line.token > newer_than))
        )

    return matches


class LeaderLog:
    """Appends lines to the log at ``path`` and reads them back (each byte read once)."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = os.fspath(path)
        self._fd: int | None = None
        self._offset = 0
        self._partial = b""
        self._lines: list[Line] = []

    def write(self, kind: str, who: str, unit: int | None = None, token: int | None = None) -> None:
        if self._fd is None:
            self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        fields = (kind, who, "-" if unit is None else unit, "-" if token is None else token)
        line = " ".join(str(f) for f in fields) + f" {time.monotonic():.6f}\n"
        data = line.encode()
        if os.write(self._fd, data) != len(data):
            raise OSError(f"short write to {self.path}")

    def lines(self) -> list[Line]:
        """Every complete line so far, in file order."""
        path = Path(self.path)
        if path.exists():
            with path.open("rb") as f:
                f.seek(self._offset)
                data = f.read()
            self._offset += len(data)
            *complete, self._partial = (self._partial + data).split(b"\n")
            for raw in complete:
                kind, who, unit, token, at = raw.decode().split(" ")
                self._lines.append(
                    Line(
                        len(self._lines),
                        kind,
                        who,
                        None if unit == "-" else int(unit),
                        None if token == "-" else int(token),
                        float(at),
                    )
                )
        return self._lines

    def wait(self, predicate: Callable[[Line], bool], what: str, after: int = -1) -> Line:
        """The first line after index ``after`` for which ``predicate`` is true, waiting for it
        (a hang guard of :data:`WAIT_S` seconds: AssertionError naming ``what``)."""
        deadline = time.monotonic() + WAIT_S
        seen = after + 1
        while True:
            lines = self.lines()
            for line in lines[seen:]:
                if predicate(line):
                    return line
            seen = len(lines)
            if time.monotonic() >= deadline:
                raise AssertionError(f"no {what} in {self.path} within {WAIT_S:.0f} s")
            time.sleep(0.01)


def participate(
    hosts: str, path: str, name: str, log_path: str, session_timeout: float, every: float
) -> None:
    """Take part in the election on ``path`` as ``name`` until killed, doing units of work.

    The latch's listener logs ``elected`` (with the lease's token) and ``deposed``. Every
    ``every`` seconds a unit: ``check <name> <i>`` is logged, then :attr:`LeaderLatch.is_leader`
    is read, and if it is true the unit starts: ``start <name> <i> <token>``.
    """
    client = KazooClient(hosts, timeout=session_timeout)
    client.start(timeout=30)
    log = LeaderLog(log_path)
    latch = LeaderLatch(client, path, id=name)

    def told(leading: bool) -> None:
        lease = latch.lease
        if leading and lease is not None:
            log.write("elected", name, token=lease.token)
        elif not leading:
            log.write("deposed", name)

    latch.add_listener(told)
    latch.start()
    unit = 0
    while True:
        log.write("check", name, unit)
        if latch.is_leader:
            lease = latch.lease
            if lease is not None:
                log.write("start", name, unit, lease.token)
        unit += 1
        time.sleep(every)


def contend_latch(
    hosts: str,
    path: str,
    iterations: int,
    hold_s: float,
    witness_path: str,
    holder: str,
    start: Any,
) -> None:
    """``iterations`` terms as leader of ``path``, each recorded in the witness as a ``write``
    section ``<holder>-<i>@<token>`` (the lease's token: the czxid of the term's node): a new
    latch (participant id ``<holder>-<i>``), :meth:`~LeaderLatch.await_leader`, the section
    (``hold_s`` seconds), :meth:`~LeaderLatch.close`. Connects, then waits at ``start`` (a
    barrier or an event: anything with ``wait()``) before the first term."""
    client = KazooClient(hosts, timeout=10.0)
    client.start(timeout=30)
    witness = Witness(witness_path)
    start.wait()
    try:
        for i in range(iterations):
            latch = LeaderLatch(client, path, id=f"{holder}-{i}")
            latch.start()
            try:
                if not latch.await_leader(timeout=120):
                    raise AssertionError(f"{holder}-{i} was not elected within 120 s")
                lease = latch.lease
                if lease is None:
                    raise AssertionError(f"{holder}-{i} lost its leadership at once")
                with witness.section(f"{holder}-{i}@{lease.token}", "write"):
                    time.sleep(hold_s)
            finally:
                latch.close()
    finally:
        client.stop()
        client.close()
