"""docs/getting-started.md as a reader runs it: its install line is the README's (which
tests/fleet/test_readme_example.py installs in a fresh venv), then `celery-zklock stack up`, the
page's `proj.py` and `call.py` written as shown, and its commands run as shown in their
directory (`celery` and `python` being this venv's), with the two `export` lines the stack
printed as their only settings. Nothing of the page is replaced."""

from __future__ import annotations

import os
import queue
import re
import shlex
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.fleet.test_cli_stack import EXPORT_RE
from tests.fleet.test_readme_example import readme_install_line

PAGE = Path(__file__).resolve().parents[2] / "docs" / "getting-started.md"
BIN = Path(sys.executable).parent


def page_blocks(kind: str) -> list[str]:
    """The page's fenced blocks of ``kind`` (``python``, ``sh``), in order."""
    return re.findall(rf"^```{kind}\n(.*?)^```$", PAGE.read_text(), re.S | re.M)


def command(line: str) -> list[str]:
    """A shell line of the page as argv, its program taken from this venv."""
    argv = shlex.split(line.split("#")[0])
    if argv[0] == "python":
        return [sys.executable, *argv[1:]]
    return [str(BIN / argv[0]), *argv[1:]]


@pytest.fixture
def stack() -> Iterator[dict[str, str]]:
    """`celery-zklock stack up` as the page runs it (this venv's), and the exports it printed."""
    line = page_blocks("sh")[1].strip()
    assert line == "celery-zklock stack up"
    up = subprocess.Popen(command(line), stdout=subprocess.PIPE, text=True)
    lines: queue.Queue[str | None] = queue.Queue()

    def pump() -> None:
        assert up.stdout is not None
        for printed in up.stdout:
            lines.put(printed.strip())
        lines.put(None)

    threading.Thread(target=pump, daemon=True).start()
    exports: dict[str, str] = {}
    try:
        while len(exports) < 2:
            printed = lines.get(timeout=60)
            assert printed is not None, "celery-zklock stack up ended before printing its exports"
            if match := EXPORT_RE.match(printed):
                exports[match[1]] = match[2]
        yield exports
    finally:
        up.terminate()
        up.wait(30)


def test_the_getting_started_page_runs_as_written(stack: dict[str, str], tmp_path: Path) -> None:
    install, _, doctor, worker, call = (b.strip() for b in page_blocks("sh"))
    assert install == readme_install_line().split("#")[0].strip()
    files = {block.splitlines()[0].removeprefix("# "): block for block in page_blocks("python")}
    assert set(files) == {"proj.py", "call.py"}
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    # The reader's terminal: the two exports pasted, no ZKLOCK_* or PYTHONPATH of ours.
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ZKLOCK_", "PYTHONPATH"))}
    env.update(stack)

    checked = subprocess.run(
        command(doctor), cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120
    )
    print(checked.stdout)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert checked.stdout.splitlines()[-1].startswith("doctor: ok")

    running = subprocess.Popen(
        command(worker), cwd=tmp_path, env=env, text=True,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
    )  # fmt: skip
    try:
        ready = threading.Event()
        log: list[str] = []

        def read() -> None:
            assert running.stdout is not None
            for line in running.stdout:
                log.append(line)
                if " ready." in line:
                    ready.set()

        threading.Thread(target=read, daemon=True).start()
        assert ready.wait(60), "".join(log)
        done = subprocess.run(
            command(call), cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120
        )
        assert done.returncode == 0, done.stdout + done.stderr
        assert re.fullmatch(r"synced account 42 under token \d+\n", done.stdout), done.stdout
    finally:
        running.terminate()
        running.wait(30)
    assert "proj.sync_account" in "".join(log)  # the worker ran it
