"""A naive ZooKeeper lock that every waiter wakes up for: the herd the real recipes avoid.

The textbook "watch the parent" lock, for the herd benchmark only (:mod:`benchmarks.herd`):
create ``<path>/lock-<seq>``, list the parent's children with a child watch, hold the lock if
ours is lowest, else wait for the watch and list again. Every release wakes every waiter, and
the holder's own watch fires once more at its release. ``acquire`` takes an ``abort`` event so
that the benchmark can send thousands of waiters home without walking them through the lock.
"""

from __future__ import annotations

import threading
from contextlib import suppress

from kazoo.client import KazooClient
from kazoo.exceptions import NoNodeError

#: Watches a holder of this recipe keeps armed while it holds the lock (see the module doc).
HOLDER_WATCHES = 1
_WAIT_SLICE = 0.1


def _sequence(name: str) -> int:
    return int(name.rsplit("-", 1)[1])


class NaiveLock:
    """The herd lock described in the module docstring; one acquire per instance."""

    def __init__(self, client: KazooClient, path: str) -> None:
        self.client = client
        self.path = path
        self.node: str | None = None

    def acquire(self, abort: threading.Event | None = None) -> bool:
        """Wait for the lock; True once held, False if ``abort`` was set first (node removed)."""
        self.enqueue()
        return self.wait(abort)

    def enqueue(self) -> None:
        """Step 1 alone: create our contender node.

        The herd benchmark enqueues every waiter before any of them starts watching, so that
        the joining of a thousand waiters (each create fires every armed child watch too) is
        not part of what it measures.
        """
        client = self.client
        try:
            self.node = client.create(f"{self.path}/lock-", ephemeral=True, sequence=True)
        except NoNodeError:
            client.ensure_path(self.path)
            self.node = client.create(f"{self.path}/lock-", ephemeral=True, sequence=True)

    def wait(self, abort: threading.Event | None = None) -> bool:
        """Steps 2 and 3: wait until our node is the lowest (True) or ``abort`` is set (False)."""
        if self.node is None:
            raise RuntimeError("enqueue() first")
        client = self.client
        ours = _sequence(self.node.rsplit("/", 1)[1])
        while True:
            changed = threading.Event()

            def on_change(_event: object, changed: threading.Event = changed) -> None:
                changed.set()

            children = client.get_children(self.path, watch=on_change)
            if min(_sequence(child) for child in children) == ours:
                return True
            while not changed.wait(_WAIT_SLICE):
                if abort is not None and abort.is_set():
                    break
            if abort is not None and abort.is_set():
                self.release()
                return False

    def release(self) -> None:
        node, self.node = self.node, None
        if node is not None:
            with suppress(NoNodeError):
                self.client.delete(node)
