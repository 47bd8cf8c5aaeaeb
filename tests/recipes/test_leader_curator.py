"""Apache Curator's ``LeaderLatch`` (Java, tests/java/CuratorContender.java in ``latch`` mode)
and our :class:`~celery_zklock.LeaderLatch` in one election on the SAME path.

The layout test holds the leadership on one side for certain, queues the other side behind it
and checks that both write Curator's names into one queue, ordered by sequence in both
languages, and that each side waits for the other's node. The contention test runs terms as
leader in both languages (witness sections, ``j``/``p`` holder prefixes) and replays the
witness: never two leaders at once.
"""

from __future__ import annotations

import itertools
import multiprocessing
import re
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from kazoo.client import KazooClient

from celery_zklock.locks import LeaderLatch
from celery_zklock.testing.witness import Witness, check_witness
from tests.lockutil import children, wait_for
from tests.support.curator import (
    CuratorUnavailable,
    build_curator_contender,
    release_contenders,
    release_hold,
    start_curator_contender,
    stop_curator_contender,
    wait_curator_contender,
)
from tests.support.leaders import contend_latch

SPAWN = multiprocessing.get_context("spawn")
UUID = r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}"
LATCH_NODE = re.compile(rf"^_c_(?P<uuid>{UUID})-latch-(?P<seq>\d{{10}})$")
WAIT_S = 30.0
"""Seconds any single wait may last before the test fails (a hang guard)."""


@pytest.fixture(scope="module")
def contender_classes(tmp_path_factory: pytest.TempPathFactory) -> Path:
    try:
        return build_curator_contender(tmp_path_factory.mktemp("curator"))
    except CuratorUnavailable as exc:
        pytest.fail(str(exc))


@pytest.fixture
def java() -> Iterator[list[subprocess.Popen[bytes]]]:
    """Curator contenders registered here are killed at teardown if a test left them running."""
    procs: list[subprocess.Popen[bytes]] = []
    yield procs
    for proc in procs:
        stop_curator_contender(proc)


@pytest.fixture
def python() -> Iterator[list[multiprocessing.process.BaseProcess]]:
    """Python contender processes registered here are killed at teardown if left running."""
    procs: list[multiprocessing.process.BaseProcess] = []
    yield procs
    for proc in procs:
        if proc.is_alive():
            proc.kill()
        proc.join(WAIT_S)


def latch_queue(client: KazooClient, path: str, count: int) -> list[re.Match[str]]:
    """Wait for ``count`` children of ``path``; return them parsed (all must be latch nodes),
    in sequence order."""
    wait_for(lambda: len(children(client, path)) == count, WAIT_S, f"{count} nodes under {path}")
    matches = [LATCH_NODE.match(name) for name in children(client, path)]
    assert all(matches), f"children outside Curator's LeaderLatch layout: {matches}"
    return sorted((m for m in matches if m), key=lambda m: int(m["seq"]))


def entered(witness: Path, holder: str) -> bool:
    return witness.exists() and f"enter {holder} " in witness.read_text()


def enters(witness: Path) -> list[str]:
    return [line.split(" ")[1] for line in witness.read_text().splitlines() if line[:5] == "enter"]


def test_curator_latch_and_ours_form_one_queue(
    zk_hosts: str,
    zk_client: KazooClient,
    lock_root: str,
    contender_classes: Path,
    java: list[subprocess.Popen[bytes]],
    tmp_path: Path,
) -> None:
    zk_client.ensure_path(lock_root)  # persistent: only the election's node is a container
    witness_path = tmp_path / "witness.log"
    witness = Witness(witness_path)
    path = f"{lock_root}/leader"

    # Curator leads, we wait.
    curator = start_curator_contender(
        contender_classes, zk_hosts, path, "latch", 1, -1, witness_path, "jlead"
    )
    java.append(curator)
    wait_for(lambda: entered(witness_path, "jlead-0"), WAIT_S, "Curator to lead")
    ours = LeaderLatch(zk_client, path, id="ours")
    ours.start()
    try:
        first, second = latch_queue(zk_client, path, 2)
        assert first["uuid"] != second["uuid"]
        # Curator's participant id and ours, each in its node's data.
        assert zk_client.get(f"{path}/{first.string}")[0] == b"jlead"
        assert zk_client.get(f"{path}/{second.string}")[0] == b"ours"
        # Curator sorts by the text after "latch-": the same order as our sequence numbers.
        names = [first.string, second.string]
        assert sorted(reversed(names), key=lambda n: n[n.rindex("latch-") + 6 :]) == names
        assert not ours.is_leader

        release_hold(curator)  # Curator closes its latch
        assert ours.await_leader(timeout=WAIT_S)
        lease = ours.lease
        assert lease is not None and lease.node == f"{path}/{second.string}"
        wait_curator_contender(curator)
        witness.enter("pours", "write")

        # We lead, Curator waits.
        follower = start_curator_contender(
            contender_classes, zk_hosts, path, "latch", 1, 0, witness_path, "jwait"
        )
        java.append(follower)
        queued = latch_queue(zk_client, path, 2)
        assert queued[0].string == second.string
        assert zk_client.get(f"{path}/{queued[1].string}")[0] == b"jwait"
        assert not entered(witness_path, "jwait-0"), "Curator must wait behind our node"
        witness.exit("pours", "write")
    finally:
        ours.close()
    wait_curator_contender(follower)
    report = check_witness(witness_path)
    assert report.ok
    assert enters(witness_path) == ["jlead-0", "pours", "jwait-0"]


def test_curator_latches_and_ours_elect_one_leader_at_a_time(
    zk_hosts: str,
    lock_root: str,
    contender_classes: Path,
    java: list[subprocess.Popen[bytes]],
    python: list[multiprocessing.process.BaseProcess],
    tmp_path: Path,
) -> None:
    witness = tmp_path / "witness.log"
    path = f"{lock_root}/terms"
    iterations = 10
    barrier = SPAWN.Barrier(3)
    for holder in ("pa", "pb"):  # Python children start slowest (spawn + imports): first
        proc = SPAWN.Process(
            target=contend_latch,
            args=(zk_hosts, path, iterations, 0.01, str(witness), holder, barrier),
            name=f"latch-{holder}",
        )
        proc.start()
        python.append(proc)
    for holder in ("ja", "jb"):
        java.append(
            start_curator_contender(
                contender_classes, zk_hosts, path, "latch", iterations, 10, witness, holder,
                gate=True,
            )
        )  # fmt: skip
    barrier.wait(timeout=60)  # every Python contender is connected and now contending
    release_contenders(java)
    for jproc in java:
        wait_curator_contender(jproc)
    for child in python:
        child.join(120)
    assert [child.exitcode for child in python] == [0, 0]

    report = check_witness(witness)
    assert report.overlaps == []
    assert report.unfinished == []
    assert report.sections == 4 * iterations
    languages = [holder[0] for holder in enters(witness)]
    assert languages.count("j") == languages.count("p") == 2 * iterations
    # One queue: the languages take turns, not one block each (which is one switch).
    assert sum(a != b for a, b in itertools.pairwise(languages)) >= 4, languages
