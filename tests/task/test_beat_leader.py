"""celery_zklock.beat.LeaderScheduler on real `celery beat` processes, ZooKeeper and Redis.

Three beats of one group run at once; what they sent is counted exactly: each beat_mark message a
beat published is recorded by the beat itself (tests.taskapp's after_task_publish hook: pid,
entry, time), no worker consumes the queue, and at the end the queue's length in Redis must equal
the number of records. "Each due time sent once" then reads, for an entry of period P: no two
consecutive sends less than P apart (a due time sent twice, by two beats or by a new leader
re-sending the old one's), none 2P or more apart (a due time skipped) except across a takeover
after a crash, where Celery coalesces the due times of the gap into the one send made at once.
The run counts the leaders recorded in ZooKeeper must equal the sends.

A fault is injected only while the victim is stopped at a moment when its last send is recorded
in ZooKeeper (freeze_when_settled): a send whose record never reached ZooKeeper is sent again by
the next leader (the documented window, docs/beat.md), and these tests check the
guarantee outside it.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import pytest
import redis
from celery import Celery
from kazoo.client import KazooClient
from kazoo.exceptions import NoNodeError

from celery_zklock.beat import (
    DEFAULT_SCHEDULER,
    BeatSettings,
    RunRecord,
    decode_state,
    encode_state,
)
from celery_zklock.beat.state import Superseded, ZooKeeperState
from celery_zklock.testing.processes import ChildProcess, pause_process
from tests.conftest import SESSION_TIMEOUT
from tests.lockutil import wait_for
from tests.taskapp import read_records
from tests.workerproc import ROOT

SCHEDULER = "celery_zklock.beat:LeaderScheduler"
TOLERANCE = 0.1
"""Seconds two send records may sit closer than the period: each is taken just after its
publish, while Celery measures the period between reserves, just before."""
TAKEOVER_BOUND = 1.5 * SESSION_TIMEOUT + 1.0 + 1.0
"""A crashed leader's node lives at most 1.5 T + 1 s; then one tick to the first send."""
STEADY = 25.0
"""Seconds of sends watched with three beats and no fault."""


def beat_env(env: dict[str, str], tmp: Path, periods: str) -> tuple[dict[str, str], BeatSettings]:
    name = f"beat-{tmp.name}"
    env = {**env, "TASKAPP_BEAT_LEADER": periods, "TASKAPP_BEAT_QUEUE": name,
           "TASKAPP_BEAT_NAME": name}  # fmt: skip
    return env, BeatSettings("/taskapp", name, DEFAULT_SCHEDULER)


@contextmanager
def beats(
    env: dict[str, str], tmp: Path, count: int, zk: KazooClient, settings: BeatSettings
) -> Iterator[list[ChildProcess]]:
    """``count`` `celery beat -S LeaderScheduler` processes, each with its own schedule file.
    At the end the standbys stop first, so that no handover happens while the test ends."""
    started: list[ChildProcess] = []
    try:
        for i in range(count):
            beat = ChildProcess(
                f"beat{i}",
                [sys.executable, "-m", "celery", "-A", "tests.taskapp", "beat", "-S", SCHEDULER,
                 "-s", str(tmp / f"beat{i}-schedule"), "-l", "info"],
                log_path=tmp / f"beat{i}.log", cwd=ROOT,
                env={**os.environ, **env, "PYTHONPATH": str(ROOT)},
            )  # fmt: skip
            beat.spawn()
            started.append(beat)
        yield started
    finally:
        queue = contenders(zk, settings)
        leader = pid_of(queue[0]) if queue else None
        for beat in sorted(started, key=lambda b: b.pid == leader):
            beat.stop(grace=10)


def sends(tmp: Path, entry: str | None = None) -> list[dict[str, Any]]:
    records = read_records(tmp / "beat-sends")
    return [r for r in records if entry is None or r["entry"] == entry]


def contenders(zk: KazooClient, settings: BeatSettings) -> list[str]:
    """The identities (``host:pid``) queued for the leadership, the leader first."""
    try:
        children = zk.get_children(settings.election)
    except NoNodeError:
        return []
    found = []
    for child in sorted(children, key=lambda name: int(name.rsplit("-", 1)[1])):
        try:
            found.append(zk.get(f"{settings.election}/{child}")[0].decode())
        except NoNodeError:
            continue
    return found


def stored(zk: KazooClient, settings: BeatSettings) -> dict[str, RunRecord]:
    try:
        return decode_state(zk.get(settings.state)[0])
    except NoNodeError:
        return {}


def all_recorded(zk: KazooClient, settings: BeatSettings, tmp: Path) -> bool:
    """Every send so far is counted in the state the leader wrote to ZooKeeper."""
    records = stored(zk, settings)
    counts: dict[str, int] = {}
    for record in sends(tmp):
        counts[record["entry"]] = counts.get(record["entry"], 0) + 1
    return bool(counts) and all(
        name in records and records[name].total_run_count == n for name, n in counts.items()
    )


def gaps(records: list[dict[str, Any]]) -> list[tuple[float, dict[str, Any]]]:
    """(seconds since the previous send, the send) for each send after the first."""
    times = [r["time"] for r in records]
    return [(b - a, r) for a, b, r in zip(times, times[1:], records[1:], strict=False)]


def queue_length(redis_url: str, queue: str) -> int:
    client = redis.Redis.from_url(redis_url)
    try:
        return int(client.llen(queue))
    finally:
        client.close()


def pid_of(identity: str) -> int:
    return int(identity.rsplit(":", 1)[1])


def freeze_when_settled(pid: int, settled: Callable[[], bool], timeout: float = 30.0) -> float:
    """SIGSTOP the beat ``pid`` at a moment when ``settled()`` holds (every send it published is
    in the queue, in the send records and in the state in ZooKeeper); return when it stopped.

    Checked while the process is stopped, so nothing can change between the check and the fault;
    when the check fails (stopped between a publish and its record), it is resumed and stopped
    again a moment later. A fault a few milliseconds after a successful check instead would now
    and then land inside that window (the documented resend, which these tests keep outside).
    """
    deadline = time.monotonic() + timeout
    while True:
        stopped_at = time.time()
        pause_process(pid)
        if settled():
            return stopped_at
        os.kill(pid, signal.SIGCONT)
        if time.monotonic() >= deadline:
            raise AssertionError(f"pid {pid}: its sends never settled within {timeout}s")
        time.sleep(0.05)  # let it finish the send it was stopped in


def test_three_beats_send_each_due_time_once_and_hand_over_on_stop(
    taskenv: tuple[Celery, dict[str, str], Path], redis_url: str, zk_client: KazooClient
) -> None:
    _, env, tmp = taskenv
    env, settings = beat_env(env, tmp, "fast=1")
    with beats(env, tmp, 3, zk_client, settings) as processes:
        wait_for(lambda: len(contenders(zk_client, settings)) == 3, 60, "three beats contending")
        wait_for(lambda: sends(tmp), 30, "the first send")
        start = sends(tmp)[0]["time"]
        wait_for(lambda: sends(tmp)[-1]["time"] - start >= STEADY, STEADY + 10, "steady sends")
        leader_pid = pid_of(contenders(zk_client, settings)[0])
        # A graceful stop right after a recorded send: the standby next in line is granted at
        # once and must send the next due time one period after the old leader's last send.
        seen = len(sends(tmp))
        wait_for(
            lambda: len(sends(tmp)) > seen and all_recorded(zk_client, settings, tmp),
            10, "a recorded send",
        )  # fmt: skip
        (leader,) = [p for p in processes if p.pid == leader_pid]
        leader.stop(grace=10)
        wait_for(lambda: sum(r["pid"] != leader_pid for r in sends(tmp)) >= 3, 15, "the new leader")
        wait_for(lambda: all_recorded(zk_client, settings, tmp), 5, "the last send recorded")
    records = sends(tmp)
    handed_over = next(i for i, r in enumerate(records) if r["pid"] != leader_pid)
    before, after = records[:handed_over], records[handed_over:]
    assert len(before) >= STEADY, "one leader among three sent everything until it stopped"
    assert len({r["pid"] for r in after}) == 1, "one standby took over"
    for gap, record in gaps(records):
        assert 1.0 - TOLERANCE <= gap < 2.0, f"send {record} came {gap:.3f}s after the previous"
    handover = after[0]["time"] - before[-1]["time"]
    steady = before[-1]["time"] - before[0]["time"]
    print(f"\nsteady: {len(before)} sends by one of three beats over {steady:.1f}s; after a "
          f"graceful stop the standby sent the next due time {handover:.3f}s after the old "
          "leader's last send")  # fmt: skip
    assert queue_length(redis_url, settings.name) == len(records)
    assert stored(zk_client, settings)["fast"].total_run_count == len(records)


def test_a_killed_leader_is_replaced_and_a_paused_one_sends_nothing_when_it_resumes(
    taskenv: tuple[Celery, dict[str, str], Path], redis_url: str, zk_client: KazooClient
) -> None:
    _, env, tmp = taskenv
    env, settings = beat_env(env, tmp, "fast=1,slow=10")

    def by(pid: int, entry: str = "fast", since: float = 0.0) -> list[dict[str, Any]]:
        return [r for r in sends(tmp, entry) if r["pid"] == pid and r["time"] >= since]

    def settled() -> bool:
        return all_recorded(zk_client, settings, tmp) and queue_length(
            redis_url, settings.name
        ) == len(sends(tmp))

    with beats(env, tmp, 3, zk_client, settings) as processes:
        wait_for(lambda: len(contenders(zk_client, settings)) == 3, 60, "three beats contending")
        wait_for(lambda: sends(tmp, "slow"), 30, "the slow entry's first send")
        first_slow = sends(tmp, "slow")[0]
        leader1 = first_slow["pid"]
        (victim,) = [p for p in processes if p.pid == leader1]
        killed_at = freeze_when_settled(leader1, settled)
        victim.kill()  # SIGKILL: the node goes only when the server expires the session
        wait_for(lambda: [r for r in sends(tmp) if r["pid"] != leader1], 20, "a takeover")
        first_new = next(r for r in sends(tmp) if r["pid"] != leader1)
        leader2 = first_new["pid"]
        takeover = first_new["time"] - killed_at

        # The slow entry is due 10 s after its recorded send: not at the takeover (the new
        # leader's own fresh entry would say "10 s after I started").
        wait_for(lambda: by(leader2, "slow"), 20, "the slow entry's second send")
        second_slow = by(leader2, "slow")[0]

        seen = len(by(leader2))
        wait_for(lambda: len(by(leader2)) > seen, 10, "another send by the second leader")
        stopped_at = freeze_when_settled(leader2, settled)
        wait_for(
            lambda: [r for r in sends(tmp) if r["pid"] not in (leader1, leader2)], 20,
            "a takeover from the paused leader",
        )  # fmt: skip
        first_third = next(r for r in sends(tmp) if r["pid"] not in (leader1, leader2))
        leader3 = first_third["pid"]
        (paused,) = [p for p in processes if p.pid == leader2]
        takeover_from_pause = first_third["time"] - stopped_at
        wait_for(lambda: len(by(leader3)) >= 2, 10, "the third leader sending")
        os.kill(leader2, signal.SIGCONT)
        resumed_at = time.time()
        # Resumed past its session: it must find its lease lost, send nothing, and queue again.
        wait_for(
            lambda: any(pid_of(c) == leader2 for c in contenders(zk_client, settings)[1:]),
            15, "the resumed beat contending again as a standby",
        )  # fmt: skip
        wait_for(lambda: len(by(leader3, since=resumed_at)) >= 3, 10, "sends after the resume")
        wait_for(lambda: all_recorded(zk_client, settings, tmp), 5, "the last send recorded")

    print(f"\nkill -9 of the leader: the new leader's first send came {takeover:.2f}s after the "
          f"kill; SIGSTOP of the next: {takeover_from_pause:.2f}s (session timeout "
          f"{SESSION_TIMEOUT:g}s)")  # fmt: skip
    assert takeover < TAKEOVER_BOUND and takeover_from_pause < TAKEOVER_BOUND
    assert [r for r in sends(tmp) if r["pid"] == leader2 and r["time"] >= stopped_at] == []
    assert "stopped sending" in paused.log_path.read_text()
    slow_gap = second_slow["time"] - first_slow["time"]
    assert 10.0 - TOLERANCE <= slow_gap < 10.0 + 1.0, f"slow entry resent after {slow_gap:.2f}s"
    fast = sends(tmp, "fast")
    takeovers = {first_new["id"], first_third["id"]}
    for gap, record in gaps(fast):
        assert gap >= 1.0 - TOLERANCE, f"due time sent twice: {record}, {gap:.3f}s apart"
        # a takeover's one send stands for every due time of the gap (Celery coalesces them)
        limit = TAKEOVER_BOUND + 1.0 if record["id"] in takeovers else 2.0
        assert gap < limit, f"due time skipped before {record} ({gap:.3f}s)"
    assert queue_length(redis_url, settings.name) == len(sends(tmp))
    records = stored(zk_client, settings)
    assert records["fast"].total_run_count == len(fast)
    assert records["slow"].total_run_count == len(sends(tmp, "slow"))


def test_a_new_leaders_claim_fences_off_the_old_leaders_late_write(
    zk_client: KazooClient, lock_root: str
) -> None:
    path = f"{lock_root}/schedule"
    now = datetime.now(timezone.utc)

    def document(count: int, token: int) -> bytes:
        records = {"fast": RunRecord(now, count)}
        return encode_state(records, leader=f"beat:{token}", token=token, written_at=now)

    old = ZooKeeperState(zk_client, path, lambda: 5.0)
    assert old.load() == {}
    old.save(document(1, token=10))  # creates the node
    old.save(document(2, token=10))
    new = ZooKeeperState(zk_client, path, lambda: 5.0)
    assert new.load() == {"fast": RunRecord(now, 2)}
    new.save(document(2, token=11))  # the claim: same records, the new leader's token
    with pytest.raises(Superseded):
        old.save(document(3, token=10))  # a deposed leader's record arrives late
    new.save(document(3, token=11))
    data, stat = zk_client.get(path)
    assert decode_state(data) == {"fast": RunRecord(now, 3)} and b'"token": 11' in data
    assert stat.version == 3
