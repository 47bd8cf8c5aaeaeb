"""The documentation's code examples: every ```python block of docs/*.md and README.md is
compiled and its imports of ``celery_zklock`` run (and every ``celery_zklock.module:Name`` the
pages name resolves); the runnable ones run against real ZooKeeper and Redis.

A block runs here when the line before its fence is an HTML comment (not shown on the site):

* ``<!-- doc-test -->``: a complete example; it starts a new namespace.
* ``<!-- doc-test: context -->``: an example written for a reader's project, in which ``app``
  (the reader's Celery app) and ``client`` (a started ``KazooClient``) exist, and the reader's
  own functions the pages call (``write_somewhere``, ``export_everything``, ... in
  :data:`READERS_OWN`) are stand-ins that record their calls. It starts a new namespace that
  holds those, ``ZkLockTask`` and ``is_skipped``; after the block its app is finalized (so each
  task it defined is made, its lock options checked). ``client`` is chrooted to the test's lock
  root, so the page's paths (``/app/locks/...``) are made under it and removed after; so is the
  app's ``zklock_hosts``, so that ``Mutex(client, task.lock_path(...))`` holds the lock a call
  of ``task`` takes, as another run would.
* ``<!-- doc-test: worker -->``: runs in the namespace of the page's previous example, after an
  in-process worker (Celery's ``celery.contrib.testing.worker``, threads pool) was started for
  that namespace's ``app``; the block sends tasks to it like a caller would.

The examples are written for a reader's machine: ``localhost:2181`` is replaced with the test's
ZooKeeper and ``redis://localhost:6379/0`` with a database of the test's Redis that is flushed
after each example (so no message or celery-once key outlives it); ``ZKLOCK_ROOT`` is a fresh
lock root per example, for examples that set no ``zklock_root``. celery-once, which
docs/coming-from-celery-once.md's first example imports, is in the ``test`` extra: that example
runs in ``make test`` like the others (never skipped: a missing package fails it).
"""

from __future__ import annotations

import ast
import importlib
import re
import threading
from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import pytest
import redis
from celery import Celery
from celery import _state as celery_state
from celery.contrib.testing.worker import start_worker
from kazoo.client import KazooClient

from celery_zklock import ZkLockTask, is_skipped
from celery_zklock.zk.settings import settings_of

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
PAGES = [*sorted(DOCS.glob("*.md")), ROOT / "README.md"]
MARKER = re.compile(r"^<!--\s*doc-test(?::\s*(?P<kind>[\w-]+))?\s*-->\s*$")
KINDS = (None, "context", "worker")
STARTS = (None, "context")
"""The kinds that start a new example (``worker`` continues the previous one)."""
READERS_OWN = (
    "write_somewhere",
    "export_everything",
    "compute_balance",
    "expire_stale_rows",
    "alert",
)
"""The reader's own functions the ``context`` examples call: stand-ins that record their calls."""
DOCS_REDIS_DB = 9
"""The Redis database the examples use instead of their ``/0`` (flushed after each)."""


@dataclass
class Block:
    page: str
    line: int
    kind: str | None
    code: str


@dataclass
class Example:
    """One ``doc-test`` (or ``doc-test: context``) block and the ``doc-test: worker`` blocks
    that continue it."""

    blocks: list[Block] = field(default_factory=list)

    @property
    def id(self) -> str:
        return f"{self.blocks[0].page}:{self.blocks[0].line}"


def _blocks(page: Path) -> Iterator[Block]:
    lines = page.read_text().splitlines()
    for number, line in enumerate(lines):
        match = MARKER.match(line.strip())
        if not match:
            continue
        kind = match.group("kind")
        fence = lines[number + 1] if number + 1 < len(lines) else ""
        if kind not in KINDS or fence.strip() != "```python":
            raise AssertionError(
                f"{page.name}:{number + 1}: a doc-test marker ({kind=}) must be one of {KINDS} "
                f"and stand right before a ```python fence, found {fence!r}"
            )
        end = lines.index("```", number + 2)
        where = str(page.relative_to(ROOT))
        yield Block(where, number + 3, kind, "\n".join(lines[number + 2 : end]) + "\n")


def _examples() -> list[Example]:
    examples: list[Example] = []
    for page in PAGES:
        current: Example | None = None
        for block in _blocks(page):
            if block.kind in STARTS or current is None:
                current = Example()
                examples.append(current)
            current.blocks.append(block)
    return examples


EXAMPLES = _examples()


def test_the_pages_that_must_have_running_examples_have_them() -> None:
    """docs/getting-started.md is run as a reader runs it, from a wheel installed in a fresh
    venv, with `celery-zklock stack up` and a `celery worker` process:
    tests/fleet/test_wheel_install.py."""
    pages = {Path(example.blocks[0].page).name for example in EXAMPLES}
    assert {"settings.md", "django.md", "coming-from-celery-once.md", "leader.md"} <= pages
    assert {"concepts.md", "semaphore.md", "rate-limits.md", "multilock-and-preempt.md"} <= pages
    assert {"when-busy.md", "debounce-and-replace.md"} <= pages
    assert (ROOT / "tests" / "fleet" / "test_wheel_install.py").exists()


def test_every_busy_policy_is_shown_running() -> None:
    """docs/when-busy.md puts every policy side by side: each policy's section has a worker
    example (a call sent to a running worker, printing what it got)."""
    sections = (DOCS / "when-busy.md").read_text().split("\n## ")[1:]
    for policy in ("`skip`", "`wait`", "`retry`", "`raise`", "`preempt`", "`replace`",
                   "Debounce", "Rate"):  # fmt: skip
        section = next((s for s in sections if s.startswith(policy)), "")
        assert "<!-- doc-test: worker -->" in section, f"when-busy.md: no running {policy}"


@dataclass
class Shown:
    """A ```python block of a page, whether it runs or not."""

    page: Path
    line: int
    code: str

    @property
    def id(self) -> str:
        return f"{self.page.name}:{self.line}"


def _shown(page: Path) -> Iterator[Shown]:
    """Every ```python block of ``page`` (also one indented in a list), dedented."""
    lines = page.read_text(encoding="utf-8").splitlines()
    number = 0
    while number < len(lines):
        fence = lines[number]
        if fence.strip() == "```python":
            indent = fence[: len(fence) - len(fence.lstrip())]
            end = lines.index(f"{indent}```", number + 1)
            code = "\n".join(line.removeprefix(indent) for line in lines[number + 1 : end])
            yield Shown(page, number + 2, code + "\n")
            number = end
        number += 1


SHOWN = [shown for page in PAGES for shown in _shown(page)]
REFERENCE = re.compile(r"\bcelery_zklock(?:\.\w+)*:\w+")
"""``module:Name`` as the pages name a scheduler, a factory or a command's entry point."""


def _imports(tree: ast.AST) -> Iterator[ast.stmt]:
    """The import statements of ``tree`` that import from ``celery_zklock``."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            modules = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            modules = [node.module or ""]
        else:
            continue
        if any(module.split(".")[0] == "celery_zklock" for module in modules):
            yield node


@pytest.mark.parametrize("shown", SHOWN, ids=[s.id for s in SHOWN])
def test_every_python_block_compiles_and_its_imports_resolve(shown: Shown) -> None:
    """Also the blocks that do not run (they need a reader's project, or Django): each compiles,
    and each of its imports of celery_zklock imports what it names."""
    where = f"{shown.page.relative_to(ROOT)}:{shown.line}"
    tree = ast.parse("\n" * (shown.line - 1) + shown.code, where)
    for statement in _imports(tree):
        module = ast.Module(body=[statement], type_ignores=[])
        exec(compile(module, where, "exec"), {"__name__": "docs_imports"})


def test_the_blocks_are_all_seen() -> None:
    """Every ```python fence of the pages is one :data:`SHOWN` block, and every ``doc-test``
    block is one of them."""
    fences = sum(p.read_text().count("```python\n") for p in PAGES)
    assert len(SHOWN) == fences > 40
    shown = {(str(s.page.relative_to(ROOT)), s.line) for s in SHOWN}
    ran = {(b.page, b.line) for e in EXAMPLES for b in e.blocks}
    assert ran <= shown and len(ran) > 15


@pytest.mark.parametrize("page", PAGES, ids=[p.name for p in PAGES])
def test_every_module_name_reference_resolves(page: Path) -> None:
    for reference in sorted(set(REFERENCE.findall(page.read_text(encoding="utf-8")))):
        module, name = reference.split(":")
        assert hasattr(importlib.import_module(module), name), f"{page.name}: {reference}"


def test_the_testing_page_shows_the_test_our_suite_runs() -> None:
    """docs/testing.md's example is tests/task/test_pytest_celery_inprocess.py, line for line
    (the module's docstring and one assertion aside)."""
    page = (DOCS / "testing.md").read_text()
    shown = page.split("# test_sync_account.py\n", 1)[1].split("```", 1)[0]
    source = (Path(__file__).parent / "test_pytest_celery_inprocess.py").read_text()
    assert shown.strip() and shown in source.replace(
        "    assert isinstance(celery_worker, WorkController)  # Celery's in-process worker, "
        "no Docker\n",
        "",
    )


def _docs_redis(redis_url: str) -> str:
    parts = urlsplit(redis_url)
    return urlunsplit(parts._replace(path=f"/{DOCS_REDIS_DB}"))


def _restore_finalizers(kept: set[Any]) -> None:
    celery_state._on_app_finalizers.intersection_update(kept)


class Recorder:
    """A reader's own function in a ``context`` example: records its calls."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.calls: list[tuple[tuple[Any, ...], dict[str, Any]]] = []

    def __call__(self, *args: Any, **kwargs: Any) -> None:
        self.calls.append((args, kwargs))


@dataclass
class Context:
    """What a ``context`` example's namespace starts with; closed after the example."""

    app: Celery
    client: KazooClient
    readers_own: dict[str, Recorder]

    def namespace(self) -> dict[str, Any]:
        return {
            "app": self.app,
            "client": self.client,
            "ZkLockTask": ZkLockTask,
            "is_skipped": is_skipped,
            **self.readers_own,
        }

    def close(self) -> None:
        self.client.stop()
        self.client.close()
        self.app.close()


def _context(docs_redis: str, zk_hosts: str, lock_root: str) -> Context:
    setup = KazooClient(hosts=zk_hosts)
    setup.start(timeout=30)
    try:
        setup.ensure_path(lock_root)
    finally:
        setup.stop()
        setup.close()
    client = KazooClient(hosts=zk_hosts + lock_root)
    client.start(timeout=30)
    app = Celery("docs", broker=docs_redis, backend=docs_redis)
    # The same chroot as ``client``: a task's lock_path() is then a path of ``client`` too.
    app.conf.zklock_hosts = zk_hosts + lock_root
    return Context(app, client, {name: Recorder(name) for name in READERS_OWN})


@pytest.mark.parametrize("example", EXAMPLES, ids=[e.id for e in EXAMPLES])
def test_example(
    example: Example,
    zk_hosts: str,
    redis_url: str,
    lock_root: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    docs_redis = _docs_redis(redis_url)
    monkeypatch.setenv("ZKLOCK_ROOT", lock_root)
    module = re.sub(r"\W", "_", f"docs_{example.id}")
    namespace: dict[str, Any] = {"__name__": module}
    store = redis.Redis.from_url(docs_redis)
    with ExitStack() as stack:
        stack.callback(store.close)
        stack.callback(store.flushdb)
        # An example's @app.task is a shared task: Celery makes it again in every app finalized
        # later in this process, where one the page shows being refused (docs/migration.md)
        # would break other tests' apps. Forget the example's shared tasks after it.
        finalizers = set(celery_state._on_app_finalizers)
        stack.callback(_restore_finalizers, finalizers)
        context: Context | None = None
        for block in example.blocks:
            if block.kind == "context":
                context = _context(docs_redis, zk_hosts, lock_root)
                stack.callback(context.close)
                namespace.update(context.namespace())
            if block.kind == "worker":
                app = namespace["app"]
                stack.enter_context(
                    start_worker(app, pool="threads", concurrency=2, perform_ping_check=False)
                )
            source = block.code.replace("redis://localhost:6379/0", docs_redis)
            source = source.replace("localhost:2181", zk_hosts)
            # Blank lines keep the page's line numbers in tracebacks.
            compiled = compile("\n" * (block.line - 1) + source, block.page, "exec")
            exec(compiled, namespace)
            printed = capsys.readouterr().out
            if "print(" in source and block.kind != "context":
                # Every example prints only on the path it documents (a skip, a duplicate).
                assert printed, f"{block.page}:{block.line} printed nothing"
            with capsys.disabled():
                print(f"\n[{block.page}:{block.line}] {printed.strip()}")
        if context is not None:
            # Each task the example defined is made (its options checked) by the app's finalize,
            # and the zklock_* settings it set are read as a worker reads them.
            context.app.finalize(auto=True)
            settings_of(context.app)
            defined = [t for t in context.app.tasks.values() if isinstance(t, ZkLockTask)]
            called = {r.name: r.calls for r in context.readers_own.values() if r.calls}
            with capsys.disabled():
                print(f"[{example.id}] tasks {sorted(t.name for t in defined)}, called {called}")
    leftover = [t.name for t in threading.enumerate() if t.name.startswith("WorkController")]
    assert not leftover, f"worker threads left running: {leftover}"
