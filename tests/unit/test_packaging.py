"""The library's distribution: its wheel holds ``celery_zklock`` only, and the library never
imports the repository's fleet (``workers/``), which has its own entry point."""

from __future__ import annotations

import ast
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LIBRARY = ROOT / "celery_zklock"
REPO_ONLY = ("workers", "benchmarks", "tests", "compose")


def _clean_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}


def test_the_wheel_holds_the_library_only(tmp_path: Path) -> None:
    # Built from a copy of the tree, so that the build's scratch files never land in the repo.
    source = tmp_path / "src"
    shutil.copytree(
        ROOT,
        source,
        ignore=shutil.ignore_patterns(
            ".*", "build", "dist", "*.egg-info", "__pycache__", "reports", "results"
        ),
    )
    # The venv's own build backend (the `test` extra has it): no network, a few seconds.
    done = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
         "--disable-pip-version-check", "-q", "-w", str(tmp_path / "dist"), str(source)],
        capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    (wheel,) = (tmp_path / "dist").glob("celery_zklock-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
        (entry_points,) = [n for n in names if n.endswith(".dist-info/entry_points.txt")]
        entry_text = archive.read(entry_points).decode()
    assert "celery_zklock/py.typed" in names
    assert "celery_zklock/testing/plugin.py" in names  # the local stack ships with the library
    top_level = {name.split("/", 1)[0] for name in names}
    assert {t for t in top_level if not t.endswith(".dist-info")} == {"celery_zklock"}, names
    assert not [n for n in names if n.startswith(tuple(f"{d}/" for d in REPO_ONLY))]
    # The console script is the library's; the pytest plugin is opt-in (no pytest11 entry).
    assert "celery-zklock = celery_zklock.testing.cli:main" in entry_text
    assert "pytest11" not in entry_text


def test_the_library_never_imports_the_fleet() -> None:
    offenders = []
    for path in sorted(LIBRARY.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
            if isinstance(node, ast.Import):
                modules = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                modules = [node.module]
            else:
                continue
            offenders += [
                f"{path.relative_to(ROOT)}:{node.lineno} imports {module}"
                for module in modules
                if module.split(".")[0] in REPO_ONLY
            ]
    assert not offenders


def test_the_cli_runs_without_the_repository(tmp_path: Path) -> None:
    # From a directory outside the repository, as an installed library is used: `celery-zklock`
    # works, nothing of the fleet is loaded, and the install maps no top-level `workers`.
    script = (
        "import sys, celery_zklock.testing.cli as cli\n"
        "assert not [m for m in sys.modules if m.split('.')[0] == 'workers'], 'workers loaded'\n"
        "print(cli.build_parser().format_help())\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script],
        cwd=tmp_path, env=_clean_env(), capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "stack" in done.stdout and "demo" not in done.stdout
    missing = subprocess.run(
        [sys.executable, "-c", "import workers"],
        cwd=tmp_path, env=_clean_env(), capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert missing.returncode == 1, "`workers` is importable outside the repository: reinstall"
    assert "No module named 'workers'" in missing.stderr
