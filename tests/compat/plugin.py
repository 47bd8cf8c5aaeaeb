"""Loaded by `make test-compat` only (``-p tests.compat.plugin``): the oldest supported Celery.

Celery before 5.7 unsubscribes a garbage-collected ``AsyncResult`` from the Redis result backend
in ``AsyncResult.__del__``, retrying while Redis is unreachable (20 tries per result). The session
fixtures stop Redis before pytest's last garbage collection, so a run that sent tasks would hang
there for minutes. Collecting before the last teardown lets those results go while Redis is up.
"""

from __future__ import annotations

import gc
from collections.abc import Generator

import pytest


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> Generator[None]:
    if nextitem is None:
        gc.collect()
    return (yield)
