"""docs/getting-started.md as a reader runs it, from a fresh virtual environment: in a copy of the
clone, the page's install commands build the wheel with the standard tools (``python -m
build``), check it (``twine check``) and install it (``pip install --find-links dist ...``,
its dependencies from the package index); then ``celery-zklock stack up``, the page's
``proj.py`` and ``call.py`` written as shown, and its commands run as shown, each in bash with
the fresh environment first on ``PATH`` (as ``. venv/bin/activate`` does), with the two ``export``
lines the stack printed as their only settings. Nothing of the page is replaced.

The README's install lines are the page's; tests/fleet/test_readme_example.py runs the README's
example on a wheel installed the same way (:func:`install_from_wheel`)."""

from __future__ import annotations

import os
import queue
import re
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.fleet.test_cli_stack import EXPORT_RE

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "getting-started.md"

pytestmark = pytest.mark.slow


def page_blocks(kind: str, path: Path = PAGE) -> list[str]:
    """The fenced blocks of ``kind`` (``python``, ``sh``) of ``path``, in order."""
    return re.findall(rf"^```{kind}\n(.*?)^```$", path.read_text(encoding="utf-8"), re.S | re.M)


def install_lines() -> list[str]:
    """The page's install commands: its first two ``sh`` blocks, line by line."""
    build, install = page_blocks("sh")[:2]
    return [*build.splitlines(), *install.splitlines()]


@dataclass
class Venv:
    """A fresh virtual environment, and the environment a shell has once it is activated."""

    path: Path
    env: dict[str, str]

    def run(self, line: str, cwd: Path, timeout: float = 300) -> str:
        """``line`` in bash in ``cwd``, as typed in an activated shell; its output."""
        done = subprocess.run(
            ["bash", "-c", line], cwd=cwd, env=self.env, capture_output=True, text=True,
            timeout=timeout, check=False,
        )  # fmt: skip
        assert done.returncode == 0, f"{line!r} failed:\n{done.stdout}\n{done.stderr[-4000:]}"
        return done.stdout

    def start(self, line: str, cwd: Path, env: dict[str, str]) -> subprocess.Popen[str]:
        """``line`` in bash (``exec``-ed, so that a signal reaches it), its output piped."""
        return subprocess.Popen(
            ["bash", "-c", f"exec {line}"], cwd=cwd, env=env, text=True,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        )  # fmt: skip


def fresh_venv(where: Path) -> Venv:
    """``python -m venv`` at ``where``; its ``env`` is ours, activated: no ``PYTHONPATH`` and no
    ``ZKLOCK_*`` of ours, ``VIRTUAL_ENV`` set and its ``bin`` first on ``PATH``."""
    subprocess.run([sys.executable, "-m", "venv", str(where)], check=True, timeout=120)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ZKLOCK_", "PYTHONPATH"))}
    env.pop("PYTHONHOME", None)
    env["VIRTUAL_ENV"] = str(where)
    env["PATH"] = f"{where / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    return Venv(where, env)


def clone_copy(where: Path) -> Path:
    """A copy of this clone's tree (the build writes into it: build/, dist/, *.egg-info)."""
    shutil.copytree(
        ROOT,
        where,
        ignore=shutil.ignore_patterns(
            ".*", "build", "dist", "site", "*.egg-info", "__pycache__", "reports", "results"
        ),
    )
    return where


def install_from_wheel(tmp_path: Path) -> tuple[Venv, dict[str, str]]:
    """The page's install commands, each run as written in a copy of the clone with a fresh
    venv active. Returns the venv and each command's output (by line)."""
    clone = clone_copy(tmp_path / "celery-zklock")
    venv = fresh_venv(tmp_path / "venv")
    outputs = {}
    for line in install_lines():
        started = time.monotonic()
        outputs[line] = venv.run(line, cwd=clone)
        print(f"[{time.monotonic() - started:5.1f} s] {line}")
    return venv, outputs


@dataclass
class Stack:
    """`celery-zklock stack up` of the venv running, and the exports it printed."""

    process: subprocess.Popen[str]
    exports: dict[str, str]


@pytest.fixture
def wheel_venv(tmp_path: Path) -> Venv:
    venv, outputs = install_from_wheel(tmp_path)
    checked = outputs["twine check dist/*"]
    assert re.findall(r"Checking dist/(\S+): .*PASSED", checked) == [
        "celery_zklock-0.1.0-py3-none-any.whl", "celery_zklock-0.1.0.tar.gz"
    ], checked  # fmt: skip
    # The library is the wheel's, in the venv: not this clone's.
    where = venv.run('python -c "import celery_zklock; print(celery_zklock.__file__)"', tmp_path)
    assert where.startswith(str(venv.path)), where
    return venv


@pytest.fixture
def stack(wheel_venv: Venv, tmp_path: Path) -> Iterator[Stack]:
    line = page_blocks("sh")[2].strip()
    assert line == "celery-zklock stack up"
    up = wheel_venv.start(line, cwd=tmp_path, env=wheel_venv.env)
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
        yield Stack(up, exports)
    finally:
        up.terminate()
        try:
            up.wait(30)
        except subprocess.TimeoutExpired:
            up.kill()
            up.wait(10)


def test_the_getting_started_page_runs_from_a_fresh_wheel(
    wheel_venv: Venv, stack: Stack, tmp_path: Path
) -> None:
    _, _, _, doctor, worker, call = (b.strip() for b in page_blocks("sh"))
    files = {block.splitlines()[0].removeprefix("# "): block for block in page_blocks("python")}
    assert set(files) == {"proj.py", "call.py"}
    project = tmp_path / "proj"  # "In an empty directory"
    project.mkdir()
    for name, text in files.items():
        (project / name).write_text(text)
    # The reader's terminals: the venv active and the two exports pasted.
    env = {**wheel_venv.env, **stack.exports}

    checked = subprocess.run(
        ["bash", "-c", doctor], cwd=project, env=env, capture_output=True, text=True, timeout=120
    )
    print(checked.stdout)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert checked.stdout.splitlines()[-1].startswith("doctor: ok")

    running = wheel_venv.start(worker, cwd=project, env=env)
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
            ["bash", "-c", call], cwd=project, env=env, capture_output=True, text=True,
            timeout=120,
        )  # fmt: skip
        assert done.returncode == 0, done.stdout + done.stderr
        assert re.fullmatch(r"synced account 42 under token \d+\n", done.stdout), done.stdout
    finally:
        running.terminate()
        try:
            running.wait(30)
        except subprocess.TimeoutExpired:
            running.kill()
            running.wait(10)
    assert "proj.sync_account" in "".join(log)  # the worker ran it
    # The worker's celery is the venv's (a script whose interpreter is the venv's python).
    assert f"#!{wheel_venv.path}/bin/python" in (wheel_venv.path / "bin" / "celery").read_text()


def test_the_readme_installs_as_the_page_does() -> None:
    readme = ROOT / "README.md"
    section = readme.read_text(encoding="utf-8").split("## Installing the library", 1)[1]
    (block,) = re.findall(r"^```sh\n(.*?)^```$", section.split("\n## ", 1)[0], re.S | re.M)
    assert block.splitlines() == install_lines()
