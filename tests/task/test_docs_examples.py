"""The documentation's code examples, run against real ZooKeeper and Redis.

A ```python block in docs/*.md runs here when the line before its fence is an HTML comment (not
shown on the site):

* ``<!-- doc-test -->``: a complete example; it starts a new namespace.
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
from celery import _state as celery_state
from celery.contrib.testing.worker import start_worker

DOCS = Path(__file__).resolve().parents[2] / "docs"
MARKER = re.compile(r"^<!--\s*doc-test(?::\s*(?P<kind>[\w-]+))?\s*-->\s*$")
KINDS = (None, "worker")
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
    """One ``doc-test`` block and the ``doc-test: worker`` blocks that continue it."""

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
        yield Block(page.name, number + 3, kind, "\n".join(lines[number + 2 : end]) + "\n")


def _examples() -> list[Example]:
    examples: list[Example] = []
    for page in sorted(DOCS.glob("*.md")):
        current: Example | None = None
        for block in _blocks(page):
            if block.kind is None or current is None:
                current = Example()
                examples.append(current)
            current.blocks.append(block)
    return examples


EXAMPLES = _examples()


def test_the_pages_that_must_have_running_examples_have_them() -> None:
    """docs/getting-started.md is run as a reader runs it, with `celery-zklock stack up` and a
    `celery worker` process: tests/task/test_getting_started.py."""
    pages = {example.blocks[0].page for example in EXAMPLES}
    assert {"settings.md", "django.md", "coming-from-celery-once.md"} <= pages
    assert (Path(__file__).parent / "test_getting_started.py").exists()


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
        for block in example.blocks:
            if block.kind == "worker":
                app = namespace["app"]
                stack.enter_context(
                    start_worker(app, pool="threads", concurrency=2, perform_ping_check=False)
                )
            source = block.code.replace("redis://localhost:6379/0", docs_redis)
            source = source.replace("localhost:2181", zk_hosts)
            # Blank lines keep the page's line numbers in tracebacks.
            compiled = compile("\n" * (block.line - 1) + source, f"docs/{block.page}", "exec")
            exec(compiled, namespace)
            printed = capsys.readouterr().out
            if "print(" in source:
                # Every example prints only on the path it documents (a skip, a duplicate).
                assert printed, f"docs/{block.page}:{block.line} printed nothing"
            with capsys.disabled():
                print(f"\n[docs/{block.page}:{block.line}] {printed.strip()}")
    leftover = [t.name for t in threading.enumerate() if t.name.startswith("WorkController")]
    assert not leftover, f"worker threads left running: {leftover}"
