"""Many contenders on real ZooKeeper: exclusion witnessed across processes, herd-free waiting,
grant order, no leftovers, and a leader killed mid-contention."""

from __future__ import annotations

import multiprocessing
import re
import threading
from pathlib import Path
from typing import Any

import pytest
from kazoo.client import KazooClient

from celery_zklock import Mutex
from celery_zklock.testing import ZooKeeperEnsemble
from celery_zklock.testing.witness import WitnessReport, check_witness
from tests.lockutil import wait_for, watches_by_path
from tests.support.contenders import contend

SPAWN = multiprocessing.get_context("spawn")


def run_contenders(
    hosts: str,
    path: str,
    witness: Path,
    modes: list[str],
    iterations: int,
    hold_s: float = 0.005,
    during: Any = None,
) -> WitnessReport:
    start = SPAWN.Event()
    procs = [
        SPAWN.Process(
            target=contend,
            args=(hosts, path, mode, iterations, hold_s, str(witness), f"p{i}", start, i),
        )
        for i, mode in enumerate(modes)
    ]
    for proc in procs:
        proc.start()
    start.set()
    try:
        if during is not None:
            during()
        for proc in procs:
            proc.join(120)
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.kill()
                proc.join()
    assert [p.exitcode for p in procs] == [0] * len(procs)
    return check_witness(witness)


def tokens_rise(witness: Path) -> bool:
    tokens = [
        int(m.group(1))
        for line in witness.read_text().splitlines()
        if line.startswith("enter") and line.endswith(" write")
        for m in [re.search(r"-t(\d+) ", line)]
        if m
    ]
    return tokens == sorted(tokens) and len(set(tokens)) == len(tokens)


def test_processes_on_one_mutex_never_overlap(
    zk_hosts: str, lock_root: str, tmp_path: Path
) -> None:
    witness = tmp_path / "witness"
    report = run_contenders(zk_hosts, lock_root, witness, ["mutex"] * 4, iterations=25)
    assert report.sections == 100
    assert report.overlaps == [] and report.unfinished == []
    assert tokens_rise(witness)


def test_readers_and_writers_mixed_exclusion(zk_hosts: str, lock_root: str, tmp_path: Path) -> None:
    witness = tmp_path / "witness"
    report = run_contenders(zk_hosts, lock_root, witness, ["mix"] * 4 + ["read"] * 2, 20)
    assert report.sections == 120
    assert report.overlaps == []
    assert report.max_readers >= 2  # readers really ran together
    assert tokens_rise(witness)


@pytest.mark.ensemble
def test_leader_killed_during_contention_no_overlap(
    zk_ensemble: ZooKeeperEnsemble, tmp_path: Path
) -> None:
    witness = tmp_path / "witness"

    def kill_leader_mid_run() -> None:
        wait_for(lambda: witness.exists() and len(witness.read_text().splitlines()) > 40, 60)
        leader = zk_ensemble.leader()
        zk_ensemble.kill(leader)

    report = run_contenders(
        zk_ensemble.hosts,
        "/locks/leader-kill",
        witness,
        ["mutex", "mutex", "mix", "mix"],
        iterations=40,
        during=kill_leader_mid_run,
    )
    assert report.sections == 160
    assert report.overlaps == []
    assert tokens_rise(witness)


def test_200_waiters_one_watcher_each_granted_in_queue_order(
    zk_hosts: str, zk_client: KazooClient, lock_root: str
) -> None:
    """Each waiter has its own session; wchp shows every watched node watched by one session."""
    waiters = 200
    first = Mutex(zk_client, lock_root).acquire(timeout=5)
    clients = [KazooClient(zk_hosts, timeout=20) for _ in range(waiters)]
    granted: list[int] = []
    order_lock = threading.Lock()
    errors: list[BaseException] = []
    try:
        for client in clients:
            client.start(timeout=30)

        def wait_turn(client: KazooClient) -> None:
            try:
                lease = Mutex(client, lock_root).acquire(timeout=120)
                with order_lock:
                    granted.append(int(lease.node[-10:]))
                lease.release()
            except BaseException as exc:
                errors.append(exc)

        threads = [threading.Thread(target=wait_turn, args=(c,)) for c in clients]
        for thread in threads:
            thread.start()

        def all_watching() -> bool:
            watched = {
                p: s for p, s in watches_by_path(zk_hosts).items() if p.startswith(lock_root)
            }
            return len(watched) == waiters

        wait_for(all_watching, 60, "every waiter to watch its predecessor")
        watched = {p: s for p, s in watches_by_path(zk_hosts).items() if p.startswith(lock_root)}
        # A node's own session may watch it too: the holder, for break requests (once held
        # T/8), and the waiter next in line, which learns from its node's watch that the node
        # outlived the holder's. Every other watch is a waiter's on the node just before it.
        owner = {p: zk_client.exists(p).ephemeralOwner for p in watched}
        others = {p: [x for x in s if int(x, 16) != owner[p]] for p, s in watched.items()}
        assert max(len(sessions) for sessions in others.values()) == 1
        assert sum(len(sessions) for sessions in others.values()) == waiters
        assert len(zk_client.get_children(lock_root)) == waiters + 1
        first.release()
        for thread in threads:
            thread.join(120)
        assert errors == []
        assert len(granted) == waiters
        assert granted == sorted(granted)
    finally:
        for client in clients:
            client.stop()
            client.close()


def test_2000_distinct_paths_leave_no_znode(zk_client: KazooClient, lock_root: str) -> None:
    for i in range(2000):
        Mutex(zk_client, f"{lock_root}/keys/k{i}").acquire(timeout=5).release()

    def nothing_left() -> bool:
        return zk_client.exists(lock_root) is None

    wait_for(nothing_left, 30, "every container parent under the root to be reaped")
