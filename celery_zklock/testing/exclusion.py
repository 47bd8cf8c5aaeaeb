"""The one overlap rule, replayed over a record of critical sections.

The witness file (:mod:`celery_zklock.testing.witness`) and the worker fleet's section records
(``workers.checker``) both feed their sections, in the order they were recorded, to an
:class:`Exclusion`: it keeps who is inside each key and tells, at each entry, which of them the
entering section overlaps. An exclusive (write) section overlaps anyone inside; a shared (read)
one overlaps exclusive sections only.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

__all__ = ["Exclusion"]

S = TypeVar("S")


class Exclusion(Generic[S]):
    """The sections inside each key; ``S`` is whatever a caller keeps about a section."""

    def __init__(self) -> None:
        self._inside: dict[str, dict[str, tuple[bool, S]]] = {}  # key -> holder -> section

    def enter(self, key: str, holder: str, exclusive: bool, section: S) -> list[tuple[str, S]]:
        """Put ``holder`` inside ``key``; return the ``(holder, section)`` pairs it overlaps,
        in the order they entered. Raises ValueError if ``holder`` is inside ``key`` already."""
        holders = self._inside.setdefault(key, {})
        if holder in holders:
            where = f" key {key!r}" if key else ""
            raise ValueError(f"{holder!r} entered again while inside{where}")
        overlapped = [
            (other, kept) for other, (other_exclusive, kept) in holders.items()
            if exclusive or other_exclusive
        ]  # fmt: skip
        holders[holder] = (exclusive, section)
        return overlapped

    def exit(self, key: str, holder: str) -> S | None:
        """Take ``holder`` out of ``key``; its section, or None if it was not inside."""
        found = self._inside.get(key, {}).pop(holder, None)
        return None if found is None else found[1]

    def close(self, which: Callable[[S], bool]) -> list[S]:
        """Take every section for which ``which`` is true out of every key (a process died)."""
        closed: list[S] = []
        for holders in self._inside.values():
            for holder, (_, section) in list(holders.items()):
                if which(section):
                    del holders[holder]
                    closed.append(section)
        return closed

    def holders(self, key: str) -> list[str]:
        """The holders inside ``key``, in the order they entered."""
        return list(self._inside.get(key, {}))

    def shared(self, key: str) -> int:
        """How many shared sections are inside ``key``."""
        return sum(not exclusive for exclusive, _ in self._inside.get(key, {}).values())

    def __iter__(self) -> Iterator[tuple[str, S]]:
        """Every ``(holder, section)`` inside, key by key, in the order they entered."""
        for holders in self._inside.values():
            for holder, (_, section) in holders.items():
                yield holder, section
