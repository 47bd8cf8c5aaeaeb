"""A piece of celery-zklock's speed work turned off, for sections 4 and 7 to time beside the
normal configuration in one run (``python -m benchmarks --contenders kazoo-writes,control``;
none by default, so a plain run is unchanged).

- ``kazoo-writes``: requests written by kazoo's own connection thread instead of the thread
  that makes them: clients made with :func:`celery_zklock.locks.adapter.set_direct_writes`
  False (the same path the adapter falls back to when a kazoo hook differs).
- ``control``: nothing turned off; in section 4 the normal configuration on a variant worker of
  its own, so that what a second worker costs is not read as a variant's effect.

Section 7 times ``kazoo-writes`` in-process, on an app of its own whose client factory is
:func:`kazoo_writes_client`. Section 4 runs a worker per variant: ``celery -A
benchmarks.variants:app`` with :data:`VARIANT_ENV` naming the variant, applied in the worker's
main process before it forks its pool, so every pool process inherits it.
"""

from __future__ import annotations

import os
from typing import Any, Final

from kazoo.client import KazooClient

from celery_zklock.config import ClientConfig
from celery_zklock.locks import adapter
from celery_zklock.session import new_client

#: Variant name -> what it turns off.
VARIANTS: Final = {
    "kazoo-writes": "direct writes off (kazoo's own write path)",
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


def apply(name: str) -> None:
    """Turn variant ``name`` on in this process for good (a worker's main process)."""
    if name == "kazoo-writes":
        adapter.set_direct_writes(False)
    elif name != "control":
        check([name])


def __getattr__(attribute: str) -> Any:
    if attribute != "app":
        raise AttributeError(attribute)
    # The worker's -A: apply its variant before the pool forks, then serve the bench app.
    variant = os.environ.get(VARIANT_ENV)
    if variant:
        apply(variant)
    from benchmarks.celery_app import app

    return app
