"""The README's first example as a user runs it: a fresh venv with the README's install lines
(the wheel built from a copy of this clone and installed with ``"celery[redis]"``, as
docs/getting-started.md installs it: :func:`tests.fleet.test_wheel_install.install_from_wheel`),
``celery-zklock stack up`` from that venv, a ``celery worker`` of the example's module, and the
example's own call. Only what the README leaves to the reader changes: the hosts and broker
(from the stack's ``export`` lines) and ``write_balance`` (the reader's own function)."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from tests.fleet.test_wheel_install import install_from_wheel

ROOT = Path(__file__).resolve().parents[2]
EXPORT_RE = re.compile(r"^export (ZKLOCK_HOSTS|ZKLOCK_BROKER_URL)=(\S+)$")
STUB = """
from pathlib import Path


def write_balance(account_id, fence):  # the reader's own function
    Path("balance.txt").write_text(f"{account_id} {fence}")

"""

pytestmark = pytest.mark.slow


def readme_example() -> tuple[str, str]:
    """The first python block after "A locked task": (its definitions, its call)."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    section = text[text.index("## A locked task") :]
    block = section[section.index("```python\n") + len("```python\n") :]
    block = block[: block.index("```")]
    split = block.index("result = ")
    return block[:split], block[split:]


def test_the_readme_example_runs_in_a_fresh_venv(tmp_path: Path) -> None:
    venv, _ = install_from_wheel(tmp_path)
    bin_dir = venv.path / "bin"
    stack = subprocess.Popen(
        [str(bin_dir / "celery-zklock"), "stack", "up"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=tmp_path,
    )  # fmt: skip
    worker: subprocess.Popen[str] | None = None
    try:
        assert stack.stdout is not None
        exports: dict[str, str] = {}
        for line in stack.stdout:
            if match := EXPORT_RE.match(line.strip()):
                exports[match[1]] = match[2]
            if len(exports) == 2:
                break
        assert len(exports) == 2, "celery-zklock stack up printed no hosts and broker"
        definitions, call = readme_example()
        definitions = definitions.replace("redis://localhost:6379/0", exports["ZKLOCK_BROKER_URL"])
        definitions = definitions.replace("zk1:2181,zk2:2181,zk3:2181", exports["ZKLOCK_HOSTS"])
        (tmp_path / "example.py").write_text(STUB + definitions)
        (tmp_path / "call.py").write_text(
            "from example import *  # noqa\n" + call + "print('result', result.get())\n"
        )
        worker = subprocess.Popen(
            [str(bin_dir / "celery"), "-A", "example", "worker", "--pool", "solo",
             "--without-mingle", "--without-gossip", "--without-heartbeat", "-l", "warning"],
            cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, text=True,
        )  # fmt: skip
        done = subprocess.run(
            [str(bin_dir / "python"), "call.py"],
            cwd=tmp_path, capture_output=True, text=True, timeout=120, check=False,
        )  # fmt: skip
        assert done.returncode == 0, done.stdout + done.stderr
        account, token = (tmp_path / "balance.txt").read_text().split()
        assert account == "42" and int(token) > 0  # the body ran under the lock, fenced
    finally:
        for process in (worker, stack):
            if process is not None:
                process.terminate()
                try:
                    process.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    process.kill()
