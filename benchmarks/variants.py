"""A piece of celery-zklock's speed work turned off, for section 4 to time beside the normal
configuration in one run (``python -m benchmarks --contenders control``; none by default, so a
plain run is unchanged).

- ``control``: nothing turned off; in section 4 the normal configuration on a variant worker of
  its own, so that what a second worker costs is not read as a variant's effect. (The speed
  work once measured this way, the prerun send-ahead and the direct writes, was removed:
  ``docs/benchmark-results.md``.) A new variant is a name here and its switch in :func:`apply`.
- ``no-gate``: the worker gate off, to time what it costs a ``wait`` task whose key is free.

Section 4 runs a worker per variant: ``celery -A benchmarks.variants:app`` with
:data:`VARIANT_ENV` naming the variant, applied in the worker's main process before it forks
its pool, so every pool process inherits it.
"""

from __future__ import annotations

import os
from typing import Any, Final

#: Variant name -> what it turns off.
VARIANTS: Final = {
    "control": "nothing off: the normal configuration on a worker of its own",
    "no-gate": "the worker gate off (zklock_gate = False): wait-mode messages go straight to "
    "the pool",
}
#: Variants timed on the ``wait`` task (what they turn off touches only that policy); the others
#: on the ``skip`` task.
ON_WAIT_TASK: Final = frozenset({"no-gate"})
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


def apply(name: str, app: Any) -> None:
    """Turn variant ``name`` on for good in this process (a worker's main process), on ``app``
    before its worker starts."""
    check([name])  # control turns nothing off
    if name == "no-gate":
        app.conf.zklock_gate = False


def __getattr__(attribute: str) -> Any:
    if attribute != "app":
        raise AttributeError(attribute)
    # The worker's -A: apply its variant before the pool forks, then serve the bench app.
    from benchmarks.celery_app import app

    variant = os.environ.get(VARIANT_ENV)
    if variant:
        apply(variant, app)
    return app
