"""Apache Curator's ``LeaderLatch`` (Java, tests/java/CuratorContender.java in ``latch`` mode)
and our :class:`~celery_zklock.LeaderLatch` in one election on the SAME path.

The layout test holds the leadership on one side for certain, queues the other side behind it
and checks that both write Curator's names into one queue, ordered by sequence in both
languages, and that each side waits for the other's node. The contention test queues two
contenders of each language alternately behind a leader of its own, then lets them run terms as
leader (witness sections, ``j``/``p`` holder prefixes, each with its node's czxid) and replays
the witness: never two leaders at once, and leadership passed in the queue's order (FIFO), so
the languages took turns as they were queued.
"""

from __future__ import annotations

import itertools
import multiprocessing
import re
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

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
JOIN_S = 60.0
"""The hang guard for a contender's first node: a spawned Python child may still be importing."""


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


def latch_queue(
    client: KazooClient, path: str, count: int, timeout: float = WAIT_S
) -> list[re.Match[str]]:
    """Wait for ``count`` children of ``path`` (a hang guard of ``timeout`` seconds); return
    them parsed (all must be latch nodes), in sequence order."""
    wait_for(lambda: len(children(client, path)) == count, timeout, f"{count} nodes under {path}")
    matches = [LATCH_NODE.match(name) for name in children(client, path)]
    assert all(matches), f"children outside Curator's LeaderLatch layout: {matches}"
    return sorted((m for m in matches if m), key=lambda m: int(m["seq"]))


def terms(witness: Path) -> list[tuple[str, int | None]]:
    """The witness's sections in order of entry: (holder, czxid of the term's latch node), the
    czxid where the holder id carries it (``<holder>@<czxid>``, as every latch contender
    of these tests records it; None for the test's own sections)."""
    found: list[tuple[str, int | None]] = []
    for line in witness.read_text().splitlines():
        if line[:5] == "enter":
            holder, _, czxid = line.split(" ")[1].partition("@")
            found.append((holder, int(czxid) if czxid else None))
    return found


def enters(witness: Path) -> list[str]:
    return [holder for holder, _ in terms(witness)]


def entered(witness: Path, holder: str) -> bool:
    return witness.exists() and holder in enters(witness)


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
    zk_client: KazooClient,
    lock_root: str,
    contender_classes: Path,
    java: list[subprocess.Popen[bytes]],
    python: list[multiprocessing.process.BaseProcess],
    tmp_path: Path,
) -> None:
    witness = tmp_path / "witness.log"
    path = f"{lock_root}/terms"
    iterations = 10
    # The test leads first and lets the contenders join one at a time behind it, each once its
    # predecessor's node is in the queue: Python, Java, Python, Java. How fast a process joins
    # (spawn and imports, a JVM's start) then decides nothing the test asserts.
    gate = LeaderLatch(zk_client, path, id="gate")
    gate.start()
    assert gate.await_leader(timeout=WAIT_S)
    go: dict[str, Any] = {}
    for holder in ("pa", "pb"):
        go[holder] = SPAWN.Event()
        proc = SPAWN.Process(
            target=contend_latch,
            args=(zk_hosts, path, iterations, 0.01, str(witness), holder, go[holder]),
            name=f"latch-{holder}",
        )
        proc.start()
        python.append(proc)
    for holder in ("ja", "jb"):
        jproc = start_curator_contender(
            contender_classes, zk_hosts, path, "latch", iterations, 10, witness, holder, gate=True
        )
        java.append(jproc)
        go[holder] = jproc
    order = [("pa", "pa-0"), ("ja", "ja"), ("pb", "pb-0"), ("jb", "jb")]
    for count, (holder, participant) in enumerate(order, start=2):
        if holder[0] == "p":
            go[holder].set()
        else:
            release_contenders([go[holder]])
        queue = latch_queue(zk_client, path, count, JOIN_S)
        assert zk_client.get(f"{path}/{queue[-1].string}")[0] == participant.encode()
    queued = [zk_client.get(f"{path}/{m.string}") for m in queue]
    assert [data for data, _ in queued] == [b"gate", b"pa-0", b"ja", b"pb-0", b"jb"]
    gate.close()

    for jproc in java:
        wait_curator_contender(jproc)
    for child in python:
        child.join(120)
    assert [child.exitcode for child in python] == [0, 0]

    report = check_witness(witness)
    assert report.overlaps == []
    assert report.unfinished == []
    assert report.sections == 4 * iterations
    held = terms(witness)
    # FIFO: each term went to the oldest node in the queue, so the terms' nodes were created
    # in the order they led. czxid, not the sequence suffix, is that order across the whole
    # run: when the last contender runs alone, its parent container can be reaped between two
    # terms and the suffixes start again at 0 (within one parent the two orders agree).
    czxids = [czxid for _, czxid in held]
    assert all(c is not None for c in czxids), held
    assert czxids == sorted(czxids) and len(set(czxids)) == len(czxids), held
    # The queue read from ZooKeeper behind the gate is the order of the first four terms.
    assert held[:4] == [
        ("pa-0", queued[1][1].czxid),
        ("ja-0", queued[2][1].czxid),
        ("pb-0", queued[3][1].czxid),
        ("jb-0", queued[4][1].czxid),
    ]
    languages = [holder[0] for holder, _ in held]
    assert languages.count("j") == languages.count("p") == 2 * iterations
    # One queue: the languages take turns, not one block each (which is one switch). Implied
    # by the above (p j p j, then Python's 18 other terms after a Java one); checked as such.
    assert sum(a != b for a, b in itertools.pairwise(languages)) >= 4, languages
