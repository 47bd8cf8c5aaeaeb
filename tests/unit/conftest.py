"""The unit tier tests the library and starts no server: a test here that asks for a stack
fixture, or a module here that imports the repository's tools (``workers``, ``benchmarks``:
their tests are the tools tier, tests/tools), stops the run at once."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SERVER_FIXTURES = frozenset(
    {"zk_server", "zk_hosts", "zk_client", "zk_ensemble", "zk_stack_factory", "lock_root",
     "redis_server", "redis_url", "taskenv"}
)  # fmt: skip

TOOLS = frozenset({"workers", "benchmarks"})
"""The top-level packages of the repository's tools, which the unit tier does not import."""


def tools_imported(module: Path) -> list[str]:
    """The modules of :data:`TOOLS` that the Python file ``module`` imports, anywhere in it."""
    names: list[str] = []
    for node in ast.walk(ast.parse(module.read_text(), str(module))):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.append(node.module)
    return sorted({name for name in names if name.split(".")[0] in TOOLS})


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    here = str(__file__).rsplit("/", 1)[0] + "/"
    mine = [item for item in items if str(item.path).startswith(here)]
    offenders = [
        f"{item.nodeid} uses {sorted(used)}"
        for item in mine
        if (used := SERVER_FIXTURES.intersection(getattr(item, "fixturenames", ())))
    ]
    if offenders:
        raise pytest.UsageError(
            "the unit tier starts no server; move these tests up a tier (tests/recipes, "
            "tests/task): " + "; ".join(offenders)
        )
    importers = [
        f"{path.name} imports {', '.join(names)}"
        for path in sorted({item.path for item in mine})
        if (names := tools_imported(path))
    ]
    if importers:
        raise pytest.UsageError(
            "the unit tier tests the library, not the repository's tools; move these modules "
            "to tests/tools (make test-tools): " + "; ".join(importers)
        )
