"""Two pieces of celery-zklock's speed work turned off, for sections 4 and 7 to time beside the
normal configuration in one run (``python -m benchmarks --contenders kazoo-writes,no-send-ahead``;
none by default, so a plain run is unchanged).

- ``kazoo-writes``: requests written by kazoo's own connection thread instead of the thread
  that makes them: clients made with :func:`celery_zklock.locks.adapter.set_direct_writes`
  False (the same path the adapter falls back to when a kazoo hook differs).
- ``no-send-ahead``: no lock request sent at ``task_prerun``; ``ZkLockTask.__call__`` sends
  it (the library's ``task_prerun`` receiver disconnected).
- ``control``: nothing turned off; in section 4 the normal configuration on a variant worker of
  its own, so that what a second worker costs is not read as a variant's effect.

Section 7 applies a variant around each of its measurements (:func:`applied`), in-process.
Section 4 runs a worker per variant: ``celery -A benchmarks.variants:app`` with
:data:`VARIANT_ENV` naming the variant, applied in the worker's main process before it forks
its pool, so every pool process inherits it.
"""

from __future__ import annotations

import os
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Final

from celery.signals import task_prerun
from kazoo.client import KazooClient

from celery_zklock import ahead
from celery_zklock.config import ClientConfig
from celery_zklock.locks import adapter
from celery_zklock.session import new_client

#: Variant name -> what it turns off.
VARIANTS: Final = {
    "kazoo-writes": "direct writes off (kazoo's own write path)",
    "no-send-ahead": "prerun send-ahead off",
    "control": "nothing off: the normal configuration on a worker of its own",
}
#: The environment variable naming a section-4 worker's variant (read by this module only).
VARIANT_ENV: Final = "ZKLOCK_BENCH_VARIANT"
#: The worker app of a variant (``-A``): the benchmark app with the variant applied.
WORKER_APP: Final = "benchmarks.variants:app"


def check(names: list[str]) -> list[str]:
    """``names`` if each is a variant; ValueError naming the first that is not."""
    for name in names:
        if name not in VARIANTS:
            raise ValueError(f"unknown contender {name!r}; choose from {', '.join(VARIANTS)}")
    return names


def kazoo_writes_client() -> KazooClient:
    """``zklock_client_factory`` of section 7's ``kazoo-writes`` app: the client the library
    would make for :data:`hosts`, made with direct writes off."""
    adapter.set_direct_writes(False)
    try:
        return new_client(ClientConfig(hosts=hosts))
    finally:
        adapter.set_direct_writes(True)


#: The ZooKeeper :func:`kazoo_writes_client` connects to (set by section 7).
hosts = ""


_receivers: dict[str, Any] = {}


def _send_ahead_receiver() -> Any:
    """The library's ``task_prerun`` receiver that sends the lock request ahead (found once,
    while it is connected, and remembered for the reconnect)."""
    if "send" in _receivers:
        return _receivers["send"]
    for _lookup, receiver in task_prerun.receivers:
        function = receiver() if isinstance(receiver, weakref.ReferenceType) else receiver
        if getattr(function, "__module__", None) == ahead.__name__ and (
            getattr(function, "__name__", None) == "send_at_prerun"
        ):
            _receivers["send"] = function
            return function
    raise LookupError("celery_zklock.ahead's send_at_prerun is not connected to task_prerun")


def apply(name: str) -> None:
    """Turn variant ``name`` on in this process for good (a worker's main process)."""
    if name == "kazoo-writes":
        adapter.set_direct_writes(False)
    elif name == "no-send-ahead":
        task_prerun.disconnect(_send_ahead_receiver())
    elif name != "control":
        check([name])


@contextmanager
def applied(name: str | None) -> Iterator[None]:
    """Variant ``name`` (None: none) on in this process while the block runs. For
    ``kazoo-writes`` the clients must be made inside (section 7 uses its own app and client)."""
    if name is None or name == "control":
        yield
        return
    apply(name)
    try:
        yield
    finally:
        if name == "kazoo-writes":
            adapter.set_direct_writes(True)
        else:
            task_prerun.connect(_send_ahead_receiver(), weak=False)


def __getattr__(attribute: str) -> Any:
    if attribute != "app":
        raise AttributeError(attribute)
    # The worker's -A: apply its variant before the pool forks, then serve the bench app.
    variant = os.environ.get(VARIANT_ENV)
    if variant:
        apply(variant)
    from benchmarks.celery_app import app

    return app
