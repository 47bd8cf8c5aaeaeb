"""The unit tier starts no server: a test here that asks for a stack fixture fails at once."""

from __future__ import annotations

import pytest

SERVER_FIXTURES = frozenset(
    {"zk_server", "zk_hosts", "zk_client", "zk_ensemble", "zk_stack_factory", "lock_root",
     "redis_server", "redis_url", "taskenv"}
)  # fmt: skip


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    here = str(__file__).rsplit("/", 1)[0] + "/"
    offenders = [
        f"{item.nodeid} uses {sorted(used)}"
        for item in items
        if str(item.path).startswith(here)
        and (used := SERVER_FIXTURES.intersection(getattr(item, "fixturenames", ())))
    ]
    if offenders:
        raise pytest.UsageError(
            "the unit tier starts no server; move these tests up a tier (tests/recipes, "
            "tests/task): " + "; ".join(offenders)
        )
