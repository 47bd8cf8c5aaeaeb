"""LeaderLatch on a real ZooKeeper: one participant leads, in queue order, with Curator's node
names; close leaves the election at once, also while waiting; a lost session ends leadership and
the latch joins again.

The slow tests run participants in processes of their own (tests.support.leaders.participate):
a leader SIGKILLed is followed by exactly one new leader (the takeover time is printed against
the acceptance figure, a session timeout plus 1.5 s); a leader SIGSTOPped past its session and
SIGCONTed again reads ``is_leader`` false from its first look, so no unit of work that checks it
starts after another participant was elected. The log every participant appends to is one total
order (O_APPEND); a unit's ``check`` line is written before ``is_leader`` is read, its ``start``
line (with the lease's token) after. The claim, checked over the whole log: no ``start`` whose
``check`` came after a line of another participant carrying a newer token (its ``elected`` or a
``start``). Tokens are czxids: a newer election has a higher one. And a leader whose link turns
silent (a black-hole proxy) counts its leadership lost before the standby is elected.
"""

from __future__ import annotations

import multiprocessing
import os
import random
import re
import signal
import statistics
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from kazoo.client import KazooClient

from celery_zklock.locks import LeaderLatch
from celery_zklock.testing.plugin import StackFactory
from celery_zklock.testing.processes import pause_process
from celery_zklock.testing.proxy import TcpProxy
from tests.lockutil import children, expire_session, wait_for
from tests.support.leaders import LeaderLog, Line, line_of, participate

SPAWN = multiprocessing.get_context("spawn")
UUID = r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}"
LATCH_NODE = re.compile(rf"^_c_(?P<uuid>{UUID})-latch-(?P<seq>\d{{10}})$")
WAIT_S = 30.0
"""Seconds any single wait may last before the test fails (a hang guard)."""
SESSION_TIMEOUT = 4.0
"""The participant processes' session timeout (seconds): a lease stays valid about 2 s past
its last renewal (5T/8 - T/10), so a loaded machine's stalls seldom cost a leader its lease."""
UNIT_EVERY = 0.02
"""Seconds between two units of work of a participant process."""
PAUSE_TRIALS = 20
KILL_ROUNDS = 3


class Told:
    """A listener that records what it was told."""

    def __init__(self) -> None:
        self.calls: list[bool] = []

    def __call__(self, leading: bool) -> None:
        self.calls.append(leading)


def queue(client: KazooClient, path: str) -> list[str]:
    """The latch nodes under ``path`` in sequence order (every child must be one)."""
    names = children(client, path)
    assert all(LATCH_NODE.match(name) for name in names), names
    return sorted(names, key=lambda name: int(name[-10:]))


def await_nodes(client: KazooClient, path: str, count: int) -> list[str]:
    wait_for(lambda: len(children(client, path)) == count, WAIT_S, f"{count} nodes under {path}")
    return queue(client, path)


@pytest.fixture
def latches() -> Iterator[list[LeaderLatch]]:
    """Latches registered here are closed after the test."""
    made: list[LeaderLatch] = []
    yield made
    for latch in made:
        latch.close()


@pytest.mark.parametrize("sessions", [3], indirect=True)
def test_the_first_in_the_queue_leads_and_close_hands_over(
    sessions: list[KazooClient],
    zk_client: KazooClient,
    lock_root: str,
    latches: list[LeaderLatch],
) -> None:
    path = f"{lock_root}/election"
    told = [Told() for _ in sessions]
    for i, client in enumerate(sessions):
        latch = LeaderLatch(client, path, id=f"p{i}")
        latch.add_listener(told[i])
        latches.append(latch)
        latch.start()  # one at a time: the queue is in start order
        await_nodes(zk_client, path, i + 1)
    first, second, third = latches
    assert first.await_leader(timeout=WAIT_S)

    nodes = queue(zk_client, path)
    assert len({node[3:39] for node in nodes}) == 3  # one uuid each
    assert [zk_client.get(f"{path}/{node}")[0] for node in nodes] == [b"p0", b"p1", b"p2"]
    assert [latch.is_leader for latch in latches] == [True, False, False]
    lease = first.lease
    assert lease is not None and lease.node == f"{path}/{nodes[0]}"
    assert told[0].calls == [True] and told[1].calls == told[2].calls == []
    assert not second.await_leader(timeout=0.1)  # a timeout: False

    first.close()  # returns once the listeners were told and the node is gone
    assert told[0].calls == [True, False]
    assert not first.is_leader and first.lease is None
    assert not first.await_leader(timeout=WAIT_S)  # closed: False at once
    assert second.await_leader(timeout=WAIT_S)
    assert queue(zk_client, path) == nodes[1:]
    assert not third.is_leader
    second_lease = second.lease
    assert second_lease is not None and second_lease.token > lease.token
    second.close()
    assert third.await_leader(timeout=WAIT_S)
    third.close()
    assert children(zk_client, path) == []
    assert [t.calls for t in told] == [[True, False]] * 3


@pytest.mark.parametrize("sessions", [3], indirect=True)
def test_close_while_waiting_returns_and_leaves_no_node(
    sessions: list[KazooClient], zk_client: KazooClient, lock_root: str
) -> None:
    """A waiter's thread blocks in the queue; close() ends that wait (third and second in
    line: watching a node that is not the last one ahead, and the one that is)."""
    path = f"{lock_root}/close-waiting"
    leader, second, third = (LeaderLatch(client, path) for client in sessions)
    with leader:
        assert leader.await_leader(timeout=WAIT_S)
        second.start()
        await_nodes(zk_client, path, 2)
        third.start()
        nodes = await_nodes(zk_client, path, 3)
        for latch, gone in ((third, nodes[2]), (second, nodes[1])):
            closer = threading.Thread(target=latch.close, daemon=True)
            closer.start()
            closer.join(WAIT_S)
            assert not closer.is_alive(), "close() of a waiting latch did not return"
            assert gone not in children(zk_client, path)
            assert not latch.is_leader
        assert queue(zk_client, path) == nodes[:1]
        assert leader.is_leader
    assert children(zk_client, path) == []


def test_a_lost_session_ends_leadership_and_the_latch_joins_again(
    zk_hosts: str, zk_client: KazooClient, other_client: KazooClient, lock_root: str
) -> None:
    path = f"{lock_root}/expired"
    owner = KazooClient(zk_hosts, timeout=10)
    owner.start(timeout=15)
    told = Told()
    first = LeaderLatch(owner, path, id="first")
    first.add_listener(told)
    second = LeaderLatch(other_client, path, id="second")
    try:
        first.start()
        assert first.await_leader(timeout=WAIT_S)
        second.start()
        await_nodes(zk_client, path, 2)

        expire_session(zk_hosts, owner)
        assert second.await_leader(timeout=WAIT_S)
        wait_for(lambda: told.calls == [True, False], WAIT_S, "the first latch to be told")
        # The first joined again, behind the new leader.
        rejoined = await_nodes(zk_client, path, 2)
        assert [zk_client.get(f"{path}/{node}")[0] for node in rejoined] == [b"second", b"first"]
        assert not first.is_leader

        second.close()
        assert first.await_leader(timeout=WAIT_S)
        assert told.calls == [True, False, True]
    finally:
        first.close()
        second.close()
        owner.stop()
        owner.close()


def test_start_once_and_await_before_start(zk_client: KazooClient, lock_root: str) -> None:
    latch = LeaderLatch(zk_client, f"{lock_root}/once")
    assert not latch.await_leader(timeout=WAIT_S)  # not started: False at once
    with pytest.raises(ValueError):
        latch.await_leader(timeout=-1)
    with latch:
        assert latch.await_leader(timeout=WAIT_S)
        with pytest.raises(RuntimeError):
            latch.start()
    with pytest.raises(RuntimeError):
        latch.start()
    with pytest.raises(ValueError):
        LeaderLatch(zk_client, "relative/path")


# -- participants in processes of their own ------------------------------------------------


class Election:
    """Participant processes on one path, appending to one log."""

    def __init__(self, hosts: str, path: str, log: LeaderLog) -> None:
        self.hosts, self.path, self.log = hosts, path, log
        self.procs: dict[str, multiprocessing.process.BaseProcess] = {}

    def spawn(self, name: str) -> None:
        proc = SPAWN.Process(
            target=participate,
            args=(self.hosts, self.path, name, self.log.path, SESSION_TIMEOUT, UNIT_EVERY),
            name=name,
            daemon=True,
        )
        proc.start()
        self.procs[name] = proc

    def pid(self, name: str) -> int:
        pid = self.procs[name].pid
        assert pid is not None
        return pid

    def leader(self) -> Line:
        """The latest ``elected`` line (waiting for a first one)."""
        self.log.wait(line_of("elected"), "an election")
        return [line for line in self.log.lines() if line.kind == "elected"][-1]

    def kill_all(self) -> None:
        for proc in self.procs.values():
            if proc.is_alive():
                assert proc.pid is not None
                os.kill(proc.pid, signal.SIGCONT)
                proc.kill()
            proc.join(WAIT_S)


@pytest.fixture
def election(zk_hosts: str, lock_root: str, tmp_path: Path) -> Iterator[Election]:
    running = Election(zk_hosts, f"{lock_root}/processes", LeaderLog(tmp_path / "leaders.log"))
    yield running
    running.kill_all()


def late_starts(lines: list[Line]) -> list[str]:
    """Units that started although, when their ``check`` line was written, the log already
    showed a newer leadership of another participant (a higher token)."""
    newest: dict[str, int] = {}  # participant -> the highest token it logged
    seen_at_check: dict[tuple[str, int], int] = {}  # (who, unit) -> newest other token then
    late = []
    for line in lines:
        if line.kind == "check" and line.unit is not None:
            others = [token for who, token in newest.items() if who != line.who]
            seen_at_check[(line.who, line.unit)] = max(others, default=-1)
        elif line.kind == "start" and line.unit is not None and line.token is not None:
            newer = seen_at_check[(line.who, line.unit)]
            if newer > line.token:
                late.append(
                    f"line {line.index}: {line.who} unit {line.unit} started with token "
                    f"{line.token} after a leadership with token {newer} was logged"
                )
        if line.token is not None:
            newest[line.who] = max(newest.get(line.who, -1), line.token)
    return late


@pytest.mark.slow
def test_a_killed_leader_is_followed_by_exactly_one_new_leader(
    election: Election, zk_client: KazooClient, capsys: pytest.CaptureFixture[str]
) -> None:
    log = election.log
    names = (f"p{i}" for i in range(KILL_ROUNDS + 3))
    for _ in range(3):
        election.spawn(next(names))
    takeovers = []
    for round_ in range(KILL_ROUNDS):
        await_nodes(zk_client, election.path, 3)  # all three contend
        leader = election.leader()
        assert leader.token is not None
        log.write("kill", leader.who, round_)
        marker = log.wait(line_of("kill", unit=round_), "the kill marker")
        killed_at = time.monotonic()
        election.procs[leader.who].kill()
        election.procs[leader.who].join(WAIT_S)
        new = log.wait(line_of("elected", newer_than=leader.token), "a new leader", leader.index)
        takeovers.append(new.at - killed_at)
        survivors = [name for name, proc in election.procs.items() if proc.is_alive()]
        assert len(survivors) == 2 and new.who in survivors
        for name in survivors:  # each has looked at is_leader a few times since
            seen = new.index
            for _ in range(5):
                seen = log.wait(line_of("check", name), f"a check by {name}", seen).index
        after_kill = [line for line in log.lines()[marker.index :] if line.who in survivors]
        assert [line.who for line in after_kill if line.kind == "elected"] == [new.who]
        assert {line.who for line in after_kill if line.kind == "start"} == {new.who}
        election.spawn(next(names))
    assert late_starts(log.lines()) == []
    summary = (
        f"leader latch takeover after SIGKILL of the leader (session timeout "
        f"{SESSION_TIMEOUT:g} s; acceptance: within {SESSION_TIMEOUT + 1.5:g} s): "
        + ", ".join(f"{t:.2f} s" for t in takeovers)
    )
    with capsys.disabled():
        print(f"\n{summary}")


@pytest.mark.slow
@pytest.mark.fault
@pytest.mark.timeout(900)
def test_a_paused_leader_starts_no_unit_after_another_was_elected(
    election: Election, zk_client: KazooClient, capsys: pytest.CaptureFixture[str]
) -> None:
    log = election.log
    for name in ("p0", "p1", "p2"):
        election.spawn(name)
    await_nodes(zk_client, election.path, 3)
    valid, trials, pauses = 0, 0, []
    while valid < PAUSE_TRIALS and trials < 2 * PAUSE_TRIALS:
        trials += 1
        leader = election.leader()
        assert leader.token is not None
        pid = election.pid(leader.who)
        time.sleep(random.uniform(0.0, 0.5))  # a random moment of its units and renewals
        log.write("pause", leader.who, trials)
        paused_at = time.monotonic()
        pause_process(pid)
        pause = log.wait(line_of("pause", unit=trials), "the pause marker")
        log.wait(line_of("elected", newer_than=leader.token), "a new leader", leader.index)
        log.write("resume", leader.who, trials)
        resume = log.wait(line_of("resume", unit=trials), "the resume marker", pause.index)
        os.kill(pid, signal.SIGCONT)
        pauses.append(time.monotonic() - paused_at)
        first = log.wait(line_of("check", leader.who), "a check after SIGCONT", resume.index)
        log.wait(line_of("check", leader.who), "the next check", first.index)  # after its start
        moved = [line_of("elected"), line_of("deposed", leader.who)]
        if any(is_(line) for line in log.lines()[leader.index + 1 : pause.index] for is_ in moved):
            continue  # leadership moved before the pause (a loaded machine): no leader paused
        started = [
            line
            for line in log.lines()[first.index :]
            if line_of("start", leader.who, first.unit)(line)
        ]
        assert started == [], f"{leader.who} started a unit at its first look after SIGCONT"
        valid += 1
    assert valid >= PAUSE_TRIALS, f"only {valid} of {trials} trials paused a leader"
    assert late_starts(log.lines()) == []
    summary = (
        f"leader latch: {valid} leaders paused past the session ({SESSION_TIMEOUT:g} s) and "
        f"resumed after another was elected (pauses {min(pauses):.2f}-{max(pauses):.2f} s, "
        f"median {statistics.median(pauses):.2f} s): no unit started after the election"
    )
    with capsys.disabled():
        print(f"\n{summary}")


PARTITION_TRIALS = 5
"""Cut-off leaders measured; void trials (leadership lost before the cut) are run again."""
VOID_TRIALS = 3 * PARTITION_TRIALS
"""Void trials after which the test gives up. The trials of a round run at once, so one stall
of a loaded machine voids a whole round (all 5 did in a .ci/run here)."""


def _partition_trial(server_port: int, hosts: str, index: int) -> tuple[float, float, float]:
    """A leader reaching ZooKeeper through a proxy that turns silent at a random moment, a
    standby on a direct link: ``(cut_at, lost_at, elected_at)``, the moment the leader's lease
    counted as lost and the standby's election (``time.monotonic()``)."""
    proxy = TcpProxy("127.0.0.1", server_port).start()
    clients = [KazooClient(proxy.address, timeout=4.0), KazooClient(hosts, timeout=10.0)]
    path = f"/partition/trial-{index}-{random.getrandbits(32):08x}"
    leader, standby = (LeaderLatch(client, path) for client in clients)
    lost_at: list[float] = []
    elected_at: list[float] = []
    standby.add_listener(lambda leading: elected_at.append(time.monotonic()) if leading else None)
    try:
        for client in clients:
            client.start(timeout=WAIT_S)
        leader.start()
        assert leader.await_leader(timeout=WAIT_S)
        lease = leader.lease
        assert lease is not None
        lease.on_lost(lambda _reason: lost_at.append(time.monotonic()))
        standby.start()
        wait_for(lambda: len(children(clients[1], path)) == 2, WAIT_S, "the standby queued")
        time.sleep(random.uniform(0.2, 4.2))  # a random phase of pings and renewals
        cut_at = time.monotonic()
        proxy.blackhole = True
        assert standby.await_leader(timeout=WAIT_S)
        wait_for(lambda: bool(lost_at), WAIT_S, "the leader to count its leadership lost")
        assert not leader.is_leader
        return cut_at, lost_at[0], elected_at[0]
    finally:
        proxy.stop()
        for latch in (leader, standby):
            latch.close()
        for client in clients:
            client.stop()
            client.close()


def _collect(
    port: int,
    hosts: str,
    index: int,
    found: list[tuple[float, float, float]],
    errors: list[BaseException],
) -> None:
    try:
        found.append(_partition_trial(port, hosts, index))
    except BaseException as exc:  # reported by the test
        errors.append(exc)


@pytest.mark.slow
def test_a_cut_off_leader_knows_before_another_is_elected(
    zk_stack_factory: StackFactory, capsys: pytest.CaptureFixture[str]
) -> None:
    """The leader's link turns silent (a black-hole proxy, T = 4 s): its lease clock counts the
    leadership lost before ZooKeeper expires its session and elects the standby."""
    server = zk_stack_factory.server()
    margins: list[float] = []
    voids = 0
    while len(margins) < PARTITION_TRIALS and voids < VOID_TRIALS:
        found: list[tuple[float, float, float]] = []
        errors: list[BaseException] = []
        threads = [
            threading.Thread(
                target=_collect, args=(server.port, server.hosts, len(margins) + i, found, errors)
            )
            for i in range(PARTITION_TRIALS - len(margins))
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(4 * WAIT_S)
        assert errors == [] and not any(t.is_alive() for t in threads), errors
        for cut_at, lost_at, elected_at in found:
            if lost_at < cut_at:
                voids += 1  # lost before the cut (a loaded machine): measures nothing
            else:
                margins.append(elected_at - lost_at)
    assert len(margins) >= PARTITION_TRIALS, f"{voids} void trials"
    assert all(margin > 0 for margin in margins), margins
    summary = (
        f"leader latch cut off (T = 4 s): lost before the standby was elected in "
        f"{len(margins)}/{len(margins)} trials, by {min(margins):.2f}-{max(margins):.2f} s"
    )
    with capsys.disabled():
        print(f"\n{summary}")
