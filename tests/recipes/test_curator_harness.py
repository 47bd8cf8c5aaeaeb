"""Apache Curator's lock recipes as a reference: the harness works, the layout is as FACTS.md says.

Curator contenders (tests/java/CuratorContender.java) run as subprocesses against a real
ZooKeeper; the witness file proves their mutual exclusion, and kazoo lists the children of the
lock path while a Curator contender holds it, so our Python recipes can be held to the same
facts.
"""

from __future__ import annotations

import itertools
import re
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TypeVar

import pytest
from kazoo.client import KazooClient

from celery_zklock.testing.witness import check_witness
from tests.support.curator import (
    ContenderKind,
    CuratorUnavailable,
    build_curator_contender,
    release_contenders,
    release_hold,
    start_curator_contender,
    stop_curator_contender,
    wait_curator_contender,
)

T = TypeVar("T")

UUID = r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}"
MUTEX_NODE = re.compile(rf"^_c_(?P<uuid>{UUID})-lock-(?P<seq>\d{{10}})$")
RW_NODE = re.compile(rf"^_c_(?P<uuid>{UUID})-(?P<kind>__READ__|__WRIT__)(?P<seq>\d{{10}})$")


def poll(what: str, probe: Callable[[], T | None], timeout: float = 15.0) -> T:
    """Call ``probe`` until it returns something other than None; fail after ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        found = probe()
        if found is not None:
            return found
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.01)


@pytest.fixture
def lock_parent(zk_client: KazooClient, lock_root: str) -> str:
    """``lock_root``, created as a persistent node.

    Curator creates missing parents as container nodes; made here, only the lock paths below
    ``lock_root`` are Curator's containers and the shared parents stay put.
    """
    zk_client.ensure_path(lock_root)
    return lock_root


@pytest.fixture(scope="module")
def contender_classes(tmp_path_factory: pytest.TempPathFactory) -> Path:
    try:
        return build_curator_contender(tmp_path_factory.mktemp("curator"))
    except CuratorUnavailable as exc:
        pytest.fail(str(exc))


@pytest.fixture
def contenders() -> Iterator[list[subprocess.Popen[bytes]]]:
    """Processes registered here are killed at teardown if a test left them running."""
    procs: list[subprocess.Popen[bytes]] = []
    yield procs
    for proc in procs:
        stop_curator_contender(proc)


def _prefix_switches(path: Path) -> int:
    """How often consecutive sections belong to different contenders (holder `<prefix>-<i>`)."""
    enters = [
        line.split()[1].rsplit("-", 1)[0]
        for line in path.read_text(encoding="utf-8").splitlines()
        if line.startswith("enter ")
    ]
    return sum(a != b for a, b in itertools.pairwise(enters))


def test_curator_mutexes_exclude_each_other(
    zk_hosts: str,
    lock_parent: str,
    contender_classes: Path,
    contenders: list[subprocess.Popen[bytes]],
    tmp_path: Path,
) -> None:
    witness = tmp_path / "witness.log"
    path = f"{lock_parent}/mutex"
    iterations = 12
    for name in ("a", "b", "c"):
        contenders.append(
            start_curator_contender(
                contender_classes,
                zk_hosts,
                path,
                "mutex",
                iterations,
                15,
                witness,
                name,
                gate=True,
            )
        )
    release_contenders(contenders)
    for proc in contenders:
        wait_curator_contender(proc)

    report = check_witness(witness)
    assert report.overlaps == []
    assert report.unfinished == []
    assert report.sections == 3 * iterations
    assert report.max_readers == 0
    # Curator's queue is FIFO, so once all three wait they take turns: proof they contended.
    assert _prefix_switches(witness) >= iterations


def test_curator_readers_share_and_writers_exclude(
    zk_hosts: str,
    lock_parent: str,
    contender_classes: Path,
    contenders: list[subprocess.Popen[bytes]],
    tmp_path: Path,
) -> None:
    witness = tmp_path / "witness.log"
    path = f"{lock_parent}/rw"
    iterations = 10
    plan: list[tuple[str, ContenderKind]] = [("r1", "read"), ("r2", "read"), ("w1", "write")]
    for name, kind in plan:
        contenders.append(
            start_curator_contender(
                contender_classes, zk_hosts, path, kind, iterations, 20, witness, name, gate=True
            )
        )
    release_contenders(contenders)
    for proc in contenders:
        wait_curator_contender(proc)

    report = check_witness(witness)
    assert report.overlaps == []
    assert report.unfinished == []
    assert report.sections == 3 * iterations
    assert report.max_readers == 2


def _entered(witness: Path, holder: str) -> bool | None:
    text = witness.read_text(encoding="utf-8") if witness.exists() else ""
    return True if f"enter {holder} " in text else None


def _children_when(
    client: KazooClient, path: str, ready: Callable[[list[str]], bool]
) -> Callable[[], list[str] | None]:
    def probe() -> list[str] | None:
        children: list[str] = sorted(client.get_children(path))
        return children if ready(children) else None

    return probe


def test_curator_mutex_node_layout(
    zk_hosts: str,
    zk_client: KazooClient,
    lock_parent: str,
    contender_classes: Path,
    contenders: list[subprocess.Popen[bytes]],
    tmp_path: Path,
) -> None:
    witness = tmp_path / "witness.log"
    path = f"{lock_parent}/mutex"
    holder = start_curator_contender(
        contender_classes, zk_hosts, path, "mutex", 1, -1, witness, "holder"
    )
    contenders.append(holder)
    poll("the holder to enter", lambda: _entered(witness, "holder-0"))
    contenders.append(
        start_curator_contender(contender_classes, zk_hosts, path, "mutex", 1, 0, witness, "waiter")
    )
    children = poll(
        "a held node and a waiting node",
        _children_when(zk_client, path, lambda c: len(c) == 2),
    )
    assert _entered(witness, "waiter-0") is None, "the waiter must still be waiting"

    matches = [MUTEX_NODE.match(name) for name in children]
    assert all(matches), children
    held, waiting = sorted((m for m in matches if m), key=lambda m: m["seq"])
    assert held["uuid"] != waiting["uuid"]  # one protection uuid per create
    assert int(waiting["seq"]) > int(held["seq"])
    data, stat = zk_client.get(f"{path}/{held.string}")
    assert stat.ephemeralOwner != 0
    assert data == b"127.0.0.1"  # Curator's default node data: the client's local address

    release_hold(holder)
    for proc in contenders:
        wait_curator_contender(proc)
    assert check_witness(witness).ok
    # Curator creates the lock path as a container node: the server reaps it once it is empty
    # (within the test server's znode.container.checkIntervalMs).
    poll("the empty lock parent to be reaped", lambda: True if not zk_client.exists(path) else None)


def test_curator_read_write_node_layout(
    zk_hosts: str,
    zk_client: KazooClient,
    lock_parent: str,
    contender_classes: Path,
    contenders: list[subprocess.Popen[bytes]],
    tmp_path: Path,
) -> None:
    witness = tmp_path / "witness.log"
    path = f"{lock_parent}/rw"
    first_reader = start_curator_contender(
        contender_classes, zk_hosts, path, "read", 1, -1, witness, "r1"
    )
    contenders.append(first_reader)
    poll("the first reader to enter", lambda: _entered(witness, "r1-0"))
    contenders.append(
        start_curator_contender(contender_classes, zk_hosts, path, "write", 1, 0, witness, "w")
    )
    poll(
        "the writer's node",
        _children_when(zk_client, path, lambda c: any("__WRIT__" in n for n in c)),
    )
    # A reader behind a waiting writer must wait too.
    contenders.append(
        start_curator_contender(contender_classes, zk_hosts, path, "read", 1, 0, witness, "r2")
    )
    children = poll(
        "reader, writer, reader", _children_when(zk_client, path, lambda c: len(c) == 3)
    )
    assert _entered(witness, "w-0") is None
    assert _entered(witness, "r2-0") is None

    matches = [RW_NODE.match(name) for name in children]
    assert all(matches), children
    ordered = sorted((m for m in matches if m), key=lambda m: m["seq"])
    assert [m["kind"] for m in ordered] == ["__READ__", "__WRIT__", "__READ__"]
    assert len({m["uuid"] for m in ordered}) == 3

    release_hold(first_reader)
    for proc in contenders:
        wait_curator_contender(proc)
    report = check_witness(witness)
    assert report.ok
    assert report.sections == 3
    enters = [line for line in witness.read_text().splitlines() if line.startswith("enter")]
    assert enters == ["enter r1-0 read", "enter w-0 write", "enter r2-0 read"]
    poll("the empty lock parent to be reaped", lambda: True if not zk_client.exists(path) else None)
