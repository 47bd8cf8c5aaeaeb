"""``.ci/system-deps``: two set-ups side by side on a fresh machine must not race apt.

``apt-get update`` gives up at once when another one holds the package lists' lock (the
``DPkg::Lock::Timeout`` option does not cover that lock), so two clones' ``make test`` started
together on a fresh machine failed one of them. Here apt is a stub that refuses a second
concurrent ``update`` the way apt does; the real script runs twice at once against it."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# Refuses an overlapping `update` (exit 100, as apt does); the one that holds the lock keeps it
# until it has seen the other refused, or for 1.5 s, so an overlap cannot slip by unseen.
APT_STUB = """#!/bin/bash
state="$STUB_STATE"
case "$*" in
  *update*)
    if ! mkdir "$state/lists.lock" 2>/dev/null; then
        echo "E: Could not get lock $state/lists.lock" >&2
        touch "$state/refused"
        exit 100
    fi
    for _ in $(seq 15); do [ -e "$state/refused" ] && break; sleep 0.1; done
    rmdir "$state/lists.lock" ;;
esac
exit 0
"""


@pytest.mark.skipif(os.geteuid() != 0, reason="the script installs (and locks) only as root")
def test_two_setups_side_by_side_both_succeed(tmp_path: Path) -> None:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in ("flock", "id", "grep", "mkdir", "rmdir", "touch", "seq", "sleep"):
        found = shutil.which(tool)
        assert found, f"{tool} is needed by .ci/system-deps or the apt stub"
        (bin_dir / tool).symlink_to(found)
    # No java, python3 or dpkg-query on this PATH: the script finds packages missing.
    apt = bin_dir / "apt-get"
    apt.write_text(APT_STUB)
    apt.chmod(0o755)
    env = {"PATH": str(bin_dir), "STUB_STATE": str(tmp_path)}
    script = ["/bin/bash", str(ROOT / ".ci" / "system-deps")]
    runs = [
        subprocess.Popen(
            script, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        for _ in range(2)
    ]
    outputs = [run.communicate(timeout=60)[0] for run in runs]
    assert [run.returncode for run in runs] == [0, 0], outputs
    assert not (tmp_path / "refused").exists(), outputs
