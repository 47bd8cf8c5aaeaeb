"""The package's layers (docs/how-it-fits-together.md): each folder of ``celery_zklock`` is one
layer, and a module imports only its own layer and the layers below it. Read from the source
with ``ast`` (nothing is imported), every import counts, a function-level one too: a lazy
import that dodges the order is still a breach. The library never imports ``testing/``, and
the layers under the task layer (errors, ZooKeeper plumbing, the lock recipes) never import
Celery.
"""

from __future__ import annotations

import ast
import pathlib
from collections.abc import Iterator

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parents[2] / "celery_zklock"

#: From the bottom up: a layer's name, its rank, and the module prefixes it holds. Two layers
#: of one rank (worker, beat) do not import each other.
LAYERS: tuple[tuple[str, int, tuple[str, ...]], ...] = (
    ("errors", 0, ("celery_zklock.errors",)),
    ("zk", 1, ("celery_zklock.zk",)),
    ("locks", 2, ("celery_zklock.locks",)),
    ("task", 3, ("celery_zklock.task",)),
    ("worker", 4, ("celery_zklock.worker",)),
    ("beat", 4, ("celery_zklock.beat",)),
    ("ops", 5, ("celery_zklock.ops",)),
    # the public names, the fence helper, and the shims kept at documented paths
    (
        "public",
        6,
        (
            "celery_zklock.fence",
            "celery_zklock.signals",
            "celery_zklock.config",
            "celery_zklock.kazoo_handler",
        ),
    ),
    ("testing", 7, ("celery_zklock.testing",)),
)
ROOT = "celery_zklock"  # the package's __init__: the public names, on top
WITHOUT_CELERY = 2  # the layers up to this rank (errors, zk, locks) never import celery


def layer_of(module: str) -> tuple[str, int] | None:
    """The layer ``module`` belongs to, or None for a module of no known layer."""
    if module == ROOT:
        return ("public", 6)
    for name, rank, prefixes in LAYERS:
        if any(module == p or module.startswith(p + ".") for p in prefixes):
            return (name, rank)
    return None


def module_name(path: pathlib.Path, package: pathlib.Path) -> str:
    parts = path.relative_to(package.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: pathlib.Path, module: str) -> Iterator[tuple[int, str]]:
    """``(line, imported module)`` for every import of ``path`` (of module ``module``), at any
    depth; ``from X import name`` yields ``X.name`` (a submodule, or a name of ``X``)."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                source = ".".join([*base, *([node.module] if node.module else [])])
            else:
                source = node.module or ""
            for alias in node.names:
                yield node.lineno, f"{source}.{alias.name}"


def target_layer(imported: str) -> tuple[str, int] | None:
    """The layer of what ``imported`` names: the longest prefix that is a known module."""
    parts = imported.split(".")
    for end in range(len(parts), 0, -1):
        layer = layer_of(".".join(parts[:end]))
        if layer is not None:  # ``celery_zklock.ZkLockTask``: the package's own, public
            return layer
    return None


def breaches(package: pathlib.Path) -> list[str]:
    """Every import of a library module that goes up a layer, sideways between two layers of
    one rank, or into ``testing/`` from outside it; and every module of no known layer."""
    found = []
    for path in sorted(package.rglob("*.py")):
        module = module_name(path, package)
        own = layer_of(module)
        if own is None:
            found.append(f"{module}: in no layer (add its folder to LAYERS)")
            continue
        if own[0] == "testing":
            continue
        for line, imported in imports(path, module):
            if imported.split(".")[0] == "celery" and own[1] <= WITHOUT_CELERY:
                found.append(f"{module}:{line} (layer {own[0]}) imports {imported}: never Celery")
            if imported.split(".")[0] != ROOT:
                continue
            target = target_layer(imported)
            if target is None:
                found.append(f"{module}:{line} imports {imported}, in no layer")
            elif target[0] == "testing":
                found.append(
                    f"{module}:{line} imports {imported}: the library never imports testing"
                )
            elif target[1] > own[1] or (target[1] == own[1] and target[0] != own[0]):
                found.append(
                    f"{module}:{line} (layer {own[0]}) imports {imported} (layer {target[0]}), "
                    "which is not below it"
                )
    return found


def test_every_module_imports_only_its_layer_and_those_below() -> None:
    assert breaches(PACKAGE) == []


def test_a_planted_upward_import_is_found(tmp_path: pathlib.Path) -> None:
    """The check itself: a lock recipe that imports the task layer, inside a function, a task
    module that imports testing/, and the ZooKeeper plumbing importing Celery, in a copy of the
    package, are each named."""
    copy = tmp_path / "celery_zklock"
    for path in PACKAGE.rglob("*.py"):
        target = copy / path.relative_to(PACKAGE)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(path.read_text())
    mutex = copy / "locks" / "mutex.py"
    mutex.write_text(
        mutex.read_text() + "\n\ndef _late():\n    from celery_zklock.task.run import LockedRun\n"
    )
    keys = copy / "task" / "keys.py"
    keys.write_text(keys.read_text() + "\nimport celery_zklock.testing.plugin\n")
    calls = copy / "zk" / "calls.py"
    calls.write_text(calls.read_text() + "\nfrom celery import Celery\n")

    found = breaches(copy)

    assert len(found) == 3, found
    assert "celery_zklock.locks.mutex" in found[0]
    assert "(layer locks) imports celery_zklock.task.run.LockedRun (layer task)" in found[0]
    assert "celery_zklock.task.keys" in found[1] and "never imports testing" in found[1]
    assert "celery_zklock.zk.calls" in found[2] and "celery.Celery: never Celery" in found[2]


@pytest.mark.parametrize(
    ("imported", "layer"),
    [
        ("celery_zklock.ZkLockTask", "public"),
        ("celery_zklock.zk.adapter", "zk"),
        ("celery_zklock.zk", "zk"),
        ("celery_zklock.locks.Mutex", "locks"),
        ("celery_zklock.task.signals", "task"),
        ("celery_zklock.signals", "public"),
        ("celery_zklock.errors.LockLost", "errors"),
    ],
)
def test_what_an_import_names_is_placed_in_its_layer(imported: str, layer: str) -> None:
    target = target_layer(imported)
    assert target is not None and target[0] == layer
