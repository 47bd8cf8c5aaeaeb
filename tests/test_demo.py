"""The worker fleet and the demo: the fence on real Redis, the section checker on hand-written
histories, the settings, the workload plan, and the whole demo end to end on real processes."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
import uuid
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from celery_zklock import cli
from workers import demo
from workers.__main__ import effective_pool, worker_argv, worker_command
from workers.app import create_app
from workers.demo import (
    DemoConfig,
    DemoReport,
    TaskTally,
    Worker,
    main,
    plan_workload,
    tally_results,
    wait_for_workers,
)
from workers.record import (
    FencedResource,
    FenceStats,
    Mode,
    SectionEvent,
    SectionRecorder,
    check_sections,
)
from workers.settings import Settings, SettingsError
from workers.tasks import SHARED_TASK

# ------------------------------------------------------------------------------------- fence


@pytest.fixture
def redis_client(redis_url: str) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(redis_url)
    try:
        yield client
    finally:
        client.close()


@pytest.fixture
def fence(redis_client: redis.Redis) -> Iterator[FencedResource]:
    resource = FencedResource(redis_client, f"test-{uuid.uuid4().hex}")
    try:
        yield resource
    finally:
        resource.clear()


def test_fence_accepts_first_equal_and_higher_tokens(fence: FencedResource) -> None:
    first = fence.write_outcome("k", 10, "a")
    assert first.accepted and first.previous_token is None
    assert fence.write("k", 10, "b")  # the same holder writing again
    higher = fence.write_outcome("k", 11, "c")
    assert higher.accepted and higher.previous_token == 10
    assert fence.last_token("k") == 11
    assert fence.value("k") == "c"
    assert fence.stats() == FenceStats(accepted=3, refused=0)


def test_fence_refuses_a_lower_token_and_counts_it(fence: FencedResource) -> None:
    assert fence.write("k", 20, "new holder")
    refused = fence.write_outcome("k", 19, "stale holder")
    assert not refused.accepted and refused.previous_token == 20
    assert not fence.write("k", 3, "staler holder")
    assert fence.value("k") == "new holder"
    assert fence.last_token("k") == 20
    assert fence.stats() == FenceStats(accepted=1, refused=2)


def test_fence_compares_tokens_as_numbers_not_strings_or_doubles(fence: FencedResource) -> None:
    # "9" > "10" as strings; 2**53 + 1 == 2**53 as Lua doubles. Both must still be ordered right.
    assert fence.write("short", 9, "x")
    assert fence.write("short", 10, "y")
    assert not fence.write("short", 9, "z")
    big = 2**53
    assert fence.write("big", big + 1, "x")
    assert not fence.write("big", big, "y")
    assert fence.last_token("big") == big + 1
    # zxids are (epoch << 32) | counter: a new leader's epoch outranks any old counter
    assert fence.write("zxid", (6 << 32) | 999_999, "x")
    assert fence.write("zxid", (7 << 32) | 5, "y")
    assert not fence.write("zxid", (6 << 32) | 1_000_000, "z")
    assert fence.last_token("zxid") == (7 << 32) | 5


def test_fence_keys_and_namespaces_are_independent(
    fence: FencedResource, redis_client: redis.Redis
) -> None:
    other = FencedResource(redis_client, f"test-{uuid.uuid4().hex}")
    try:
        assert fence.write("a", 100, "x")
        assert fence.write("b", 1, "y")  # another key of the same namespace
        assert other.write("a", 1, "z")  # the same key in another namespace
        assert other.stats() == FenceStats(accepted=1, refused=0)
        assert fence.last_token("a") == 100
    finally:
        other.clear()


def test_fence_rejects_invalid_tokens_and_namespaces(
    fence: FencedResource, redis_client: redis.Redis
) -> None:
    for token in (-1, True, 1.5, "7"):
        with pytest.raises(ValueError, match="fencing token"):
            fence.write("k", token, "x")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="namespace"):
        FencedResource(redis_client, "a{b}")
    assert fence.stats() == FenceStats(0, 0)


def test_fence_under_concurrent_writers_keeps_the_highest_token(
    fence: FencedResource,
) -> None:
    tokens = list(range(1, 401))
    outcomes: list[tuple[int, bool, int | None]] = []
    lock = threading.Lock()
    start = threading.Barrier(8)

    def writer(mine: list[int]) -> None:
        start.wait()
        for token in mine:
            outcome = fence.write_outcome("k", token, str(token))
            with lock:
                outcomes.append((token, outcome.accepted, outcome.previous_token))

    threads = [threading.Thread(target=writer, args=(tokens[i::8],)) for i in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert len(outcomes) == len(tokens)
    assert fence.last_token("k") == max(tokens)
    assert fence.value("k") == str(max(tokens))
    accepted = sum(1 for _, ok, _ in outcomes if ok)
    assert fence.stats() == FenceStats(accepted, len(tokens) - accepted)
    for token, ok, previous in outcomes:
        # Accepted exactly when no higher token had been accepted before it.
        assert ok == (previous is None or token >= previous), (token, ok, previous)


# ----------------------------------------------------------------------------------- records


def _event(kind: str, task: str, key: str, mode: Mode, token: int, **extra: object) -> SectionEvent:
    return SectionEvent(kind=kind, task_id=task, key=key, mode=mode, token=token, **extra)  # type: ignore[arg-type]


def _section(task: str, key: str, mode: Mode, token: int) -> list[SectionEvent]:
    return [
        _event("enter", task, key, mode, token, time=1.0),
        _event("write", task, key, mode, token, accepted=True, previous_token=None),
        _event("exit", task, key, mode, token, time=1.25),
    ]


def test_clean_history_has_no_violation() -> None:
    events = [
        *_section("w1", "k", "exclusive", 1),
        *_section("w2", "k", "exclusive", 2),
        # two readers overlap, then a writer after both left
        _event("enter", "r1", "k", "shared", 3),
        _event("enter", "r2", "k", "shared", 4),
        _event("exit", "r1", "k", "shared", 3),
        _event("exit", "r2", "k", "shared", 4),
        # exclusive sections of different keys may overlap
        _event("enter", "w3", "k", "exclusive", 5),
        _event("enter", "w4", "other", "exclusive", 6),
        _event("exit", "w3", "k", "exclusive", 5),
        _event("exit", "w4", "other", "exclusive", 6),
    ]
    report = check_sections(events)
    assert report.violations == 0 and report.overlaps == ()
    assert report.keys["k"].max_exclusive == 1
    assert report.keys["k"].max_shared == 2
    assert report.keys["k"].sections == 5
    assert (report.keys["k"].exclusive_sections, report.keys["k"].shared_sections) == (3, 2)
    assert report.keys["other"].max_exclusive == 1
    assert report.open_sections == () and report.malformed == ()
    assert report.writes_accepted == 2
    assert report.hold_seconds[:2] == (0.25, 0.25)
    assert report.closed_task_ids == {"w1", "w2", "w3", "w4", "r1", "r2"}


def test_two_exclusive_holders_at_once_are_a_violation() -> None:
    events = [
        _event("enter", "a", "k", "exclusive", 1),
        _event("enter", "b", "k", "exclusive", 2),
        _event("exit", "a", "k", "exclusive", 1),
        _event("exit", "b", "k", "exclusive", 2),
    ]
    report = check_sections(events)
    assert report.violations == 1
    (overlap,) = report.overlaps
    assert (overlap.key, overlap.position, overlap.entering) == ("k", 1, "b#2")
    assert overlap.inside == (("a#1", "exclusive"),)
    assert report.keys["k"].max_exclusive == 2


@pytest.mark.parametrize(
    ("first", "second"), [("exclusive", "shared"), ("shared", "exclusive")], ids=str
)
def test_a_reader_and_a_writer_at_once_are_a_violation(first: Mode, second: Mode) -> None:
    events = [
        _event("enter", "x", "k", first, 1),
        _event("enter", "y", "k", second, 2),
        _event("exit", "y", "k", second, 2),
        _event("exit", "x", "k", first, 1),
    ]
    report = check_sections(events)
    assert report.violations == 1
    assert report.overlaps[0].entering_mode == second
    assert report.keys["k"].max_exclusive == 1  # one of each: only the mode mix is wrong


def test_a_redelivered_task_is_told_apart_by_its_token() -> None:
    # The same task id running twice at once (a duplicate delivery) is still two holders.
    events = [
        _event("enter", "t", "k", "exclusive", 1),
        _event("enter", "t", "k", "exclusive", 2),
    ]
    assert check_sections(events).violations == 1


def test_stale_accepted_writes_and_refusals_are_counted() -> None:
    events = [
        _event("write", "a", "k", "exclusive", 5, accepted=True, previous_token=7),  # stale
        _event("write", "b", "k", "exclusive", 9, accepted=True, previous_token=7),
        _event("write", "c", "k", "exclusive", 3, accepted=False, previous_token=9),
        _event("write", "d", "k", "shared", 8, accepted=False, previous_token=9),
    ]
    report = check_sections(events)
    assert [e.task_id for e in report.stale_writes_accepted] == ["a"]
    assert report.writes_accepted == 2
    assert report.writes_refused == {"exclusive": 1, "shared": 1}


def test_open_and_malformed_sections_are_reported() -> None:
    events = [
        _event("enter", "open", "k", "shared", 1),
        _event("exit", "ghost", "k", "shared", 2),
        _event("enter", "open", "k", "shared", 1),
    ]
    report = check_sections(events)
    assert report.open_sections == ("open#1",)
    assert len(report.malformed) == 2
    assert "without an enter" in report.malformed[0]
    assert "second enter" in report.malformed[1]
    assert "open" not in report.closed_task_ids


def test_section_events_round_trip_through_redis_in_order(redis_client: redis.Redis) -> None:
    recorder = SectionRecorder(redis_client, f"test-{uuid.uuid4().hex}")
    try:
        events = [
            *_section("a", "k", "exclusive", 1),
            _event("enter", "b", "k", "exclusive", 2, hostname="h@x", pid=7, node="/n"),
        ]
        for event in events:
            recorder.record(event)
        assert recorder.events() == events
        assert check_sections(recorder.events()).open_sections == ("b#2",)
    finally:
        recorder.clear()
    assert recorder.events() == []


def test_section_event_rejects_bad_records() -> None:
    with pytest.raises(ValueError, match="kind"):
        _event("start", "a", "k", "exclusive", 1)
    with pytest.raises(ValueError, match="mode"):
        _event("enter", "a", "k", "read", 1)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="not a section event"):
        SectionEvent.from_json('{"kind": "enter"}')
    with pytest.raises(ValueError):
        SectionEvent.from_json("[1, 2]")


# ---------------------------------------------------------------------------------- settings

_MINIMAL = {"ZKLOCK_HOSTS": "127.0.0.1:2181", "ZKLOCK_BROKER_URL": "redis://127.0.0.1:6379/0"}


def test_settings_defaults_follow_the_broker() -> None:
    settings = Settings.from_env(_MINIMAL)
    assert settings.result_backend == settings.record_url == _MINIMAL["ZKLOCK_BROKER_URL"]
    assert (settings.pool, settings.concurrency) == ("prefork", 4)
    assert settings.session_timeout == 10.0
    assert settings.zk_root == "/zklock"


def test_settings_round_trip_through_the_environment() -> None:
    env = {
        **_MINIMAL,
        "ZKLOCK_HOSTS": "zoo1:2181,zoo2:2181,zoo3:2181/apps",
        "ZKLOCK_RESULT_BACKEND": "redis://127.0.0.1:6379/1",
        "ZKLOCK_RECORD_URL": "rediss://records:6380/2",
        "ZKLOCK_POOL": "threads",
        "ZKLOCK_CONCURRENCY": " 8 ",
        "ZKLOCK_SESSION_TIMEOUT": "2.5",
        "ZKLOCK_ROOT": "/locks/fleet",
    }
    settings = Settings.from_env(env)
    assert settings.concurrency == 8 and settings.session_timeout == 2.5
    assert settings.record_url == "rediss://records:6380/2"
    assert Settings.from_env(settings.to_env()) == settings


def test_settings_report_every_problem_at_once() -> None:
    with pytest.raises(SettingsError) as missing:
        Settings.from_env({"ZKLOCK_HOSTS": "  "})
    assert [p.split()[0] for p in missing.value.problems] == ["ZKLOCK_HOSTS", "ZKLOCK_BROKER_URL"]

    with pytest.raises(SettingsError) as bad:
        Settings.from_env(
            {
                "ZKLOCK_HOSTS": "zk1:2181,zk2",
                "ZKLOCK_BROKER_URL": "amqp://guest@localhost//",
                "ZKLOCK_RECORD_URL": "redis://:99999999/0",
                "ZKLOCK_POOL": "eventlett",
                "ZKLOCK_CONCURRENCY": "0",
                "ZKLOCK_SESSION_TIMEOUT": "soon",
                "ZKLOCK_ROOT": "zklock/",
            }
        )
    text = str(bad.value)
    for name in (
        "ZKLOCK_HOSTS: 'zk2' is not host:port",
        "ZKLOCK_BROKER_URL must be a Redis URL",
        "ZKLOCK_RECORD_URL",
        "ZKLOCK_POOL must be one of prefork, threads, gevent, solo; got 'eventlett'",
        "ZKLOCK_CONCURRENCY must be a whole number >= 1, got 0",
        "ZKLOCK_SESSION_TIMEOUT must be a number of seconds > 0, got 'soon'",
        "ZKLOCK_ROOT must be an absolute znode path",
    ):
        assert name in text
    assert len(bad.value.problems) == 7
    assert "ZKLOCK_RESULT_BACKEND" not in text  # unset: it follows the broker, checked once


def test_settings_validate_when_built_directly() -> None:
    with pytest.raises(SettingsError, match="ZKLOCK_CONCURRENCY"):
        Settings("h:1", "redis://h/0", "redis://h/0", "redis://h/0", concurrency=-2)


def test_worker_command_line_uses_the_settings_and_appends_extras() -> None:
    settings = Settings.from_env({**_MINIMAL, "ZKLOCK_POOL": "gevent", "ZKLOCK_CONCURRENCY": "50"})
    argv = worker_argv(settings, ["-n", "w1@%h"])
    assert argv[0] == "worker"
    assert argv[argv.index("--pool") + 1] == "gevent"
    assert argv[argv.index("--concurrency") + 1] == "50"
    assert {"--without-mingle", "--without-gossip", "--without-heartbeat"} <= set(argv)
    assert argv[-2:] == ["-n", "w1@%h"]
    assert worker_command(["-c", "2"]) == [sys.executable, "-m", "workers", "-c", "2"]


@pytest.mark.parametrize(
    ("argv", "pool"),
    [
        (["worker"], "prefork"),
        (["worker", "--pool", "threads"], "threads"),
        (["worker", "-P", "threads", "-Pgevent"], "gevent"),
        (["worker", "--pool", "solo", "--pool=gevent"], "gevent"),
    ],
)
def test_effective_pool_is_the_last_pool_option(argv: list[str], pool: str) -> None:
    assert effective_pool(argv) == pool


def test_demo_subcommand_plugs_into_the_cli(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cli, "SUBCOMMAND_MODULES", ("workers.demo",))
    args = cli.build_parser().parse_args(["demo", "--tasks", "3", "--keep-logs"])
    assert args._run is demo.COMMAND.run
    assert demo.config_from_args(args) == DemoConfig(tasks=3, keep_logs=True)


def test_python_m_workers_names_missing_settings_and_exits_2() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ZKLOCK_")}
    done = subprocess.run(
        worker_command(), env=env, capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 2
    assert "ZKLOCK_HOSTS is not set" in done.stderr
    assert "ZKLOCK_BROKER_URL is not set" in done.stderr


# ---------------------------------------------------------------------------------- workload


def test_workload_plan_is_seeded_and_mixes_every_kind() -> None:
    config = DemoConfig(tasks=40, keys=4, hold_ms=100, seed=3)
    plan = plan_workload(config)
    assert plan == plan_workload(config)
    assert plan != plan_workload(DemoConfig(tasks=40, keys=4, hold_ms=100, seed=4))
    assert len(plan) == 40
    kinds = Counter((item.mode, item.on_busy) for item in plan)
    assert kinds == {("exclusive", "wait"): 16, ("exclusive", "skip"): 12, ("shared", "wait"): 12}
    assert {item.key for item in plan} <= {f"key-{i}" for i in range(4)}
    assert all(50 <= item.hold_ms <= 150 for item in plan)
    for tasks in (1, 2, 3, 7):
        assert len(plan_workload(DemoConfig(tasks=tasks))) == tasks
    assert len({(i.mode, i.on_busy) for i in plan_workload(DemoConfig(tasks=3))}) == 3


def _report(
    states: dict[str, tuple[str, object]], events: list[SectionEvent], leftovers: int = 0
) -> DemoReport:
    return DemoReport(tally_results(states), check_sections(events), FenceStats(0, 0), leftovers)


def test_report_counts_lost_tasks_and_fails_on_them() -> None:
    skipped = {"__zklock_skipped__": True, "reason": "busy"}
    states: dict[str, tuple[str, object]] = {
        "a": ("SUCCESS", {"token": 1}),
        "b": ("SUCCESS", skipped),
        "c": ("FAILURE", TimeoutError("x")),
        "d": ("PENDING", None),  # never finished: lost
        "e": ("SUCCESS", {"token": 2}),  # "ran" but left no section record: lost
    }
    report = _report(states, _section("a", "k", "exclusive", 1))
    assert report.report_line() == (
        "zklock-report: tasks=5 ran=2 skipped=1 failed=1 lost=2 violations=0 "
        "stale_writes_accepted=0 leftover_nodes=0"
    )
    assert not report.ok
    assert any("TimeoutError 1" in line for line in report.summary())


def test_report_is_ok_only_with_all_four_zeros() -> None:
    states: dict[str, tuple[str, object]] = {"a": ("SUCCESS", {}), "b": ("SUCCESS", {})}
    clean = _section("a", "k", "exclusive", 1) + _section("b", "k", "exclusive", 2)
    assert _report(states, clean).ok
    assert not _report(states, clean, leftovers=1).ok
    overlapping = [
        _event("enter", "a", "k", "exclusive", 1),
        _event("enter", "b", "k", "exclusive", 2),
        _event("exit", "a", "k", "exclusive", 1),
        _event("exit", "b", "k", "exclusive", 2),
    ]
    bad = _report(states, overlapping)
    assert (bad.violations, bad.ok) == (1, False)
    assert any("VIOLATION" in line for line in bad.summary())
    stale = [*clean, _event("write", "b", "k", "exclusive", 1, accepted=True, previous_token=2)]
    assert _report(states, stale).stale_writes_accepted == 1
    assert TaskTally().sent == 0


# ------------------------------------------------------------------------------- end to end

_REPORT_RE = re.compile(
    r"^zklock-report: tasks=(?P<tasks>\d+) ran=(?P<ran>\d+) skipped=(?P<skipped>\d+) "
    r"failed=(?P<failed>\d+) lost=(?P<lost>\d+) violations=(?P<violations>\d+) "
    r"stale_writes_accepted=(?P<stale>\d+) leftover_nodes=(?P<leftover>\d+)$"
)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"


def _group_members(pgid: int) -> list[int]:
    members = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[2]) == pgid:
                members.append(int(entry.name))
    return members


@pytest.mark.slow
def test_demo_end_to_end(capsys: pytest.CaptureFixture[str]) -> None:
    status = main(["--tasks", "16", "--keys", "2", "--hold-ms", "60", "--seed", "1"])
    out = capsys.readouterr().out
    lines = out.strip().splitlines()
    match = _REPORT_RE.match(lines[-1])
    assert match, out
    counts = {name: int(value) for name, value in match.groupdict().items()}
    assert status == 0, out
    assert counts["tasks"] == 16
    assert counts["lost"] == counts["violations"] == counts["stale"] == counts["leftover"] == 0
    assert counts["ran"] + counts["skipped"] + counts["failed"] == 16
    assert counts["ran"] >= 2, out
    assert "max simultaneous exclusive holders 1" in out
    assert "max simultaneous exclusive holders 2" not in out
    # Every worker (and, for prefork, its pool children) is gone once main returned.
    pids = [int(pid) for pid in re.findall(r"pid (\d+)\)", out)]
    assert len(pids) == 2, out
    for pid in pids:
        assert not _alive(pid)
        assert _group_members(pid) == []


@pytest.mark.slow
def test_gevent_worker_runs_sections_concurrently(
    zk_hosts: str, redis_url: str, lock_root: str, tmp_path: Path, redis_client: redis.Redis
) -> None:
    # Only a monkey-patched gevent worker runs four 400 ms sections at once: without the patch
    # time.sleep blocks the whole worker and the sections run one after another.
    run_id = uuid.uuid4().hex[:12]
    settings = Settings(
        zk_hosts=zk_hosts,
        broker_url=redis_url,
        result_backend=redis_url,
        record_url=redis_url,
        pool="gevent",
        concurrency=4,
        zk_root=lock_root,
    )
    queue = f"test-gevent-{run_id}"
    app = create_app(settings, main="test-gevent")
    worker = Worker("gevent", settings, run_id, tmp_path, extra=["-Q", queue])
    recorder = SectionRecorder(redis_client, run_id)
    try:
        worker.start()
        wait_for_workers(app, [worker], timeout=60)
        results = [
            app.tasks[SHARED_TASK].apply_async((run_id, "k", 400), queue=queue) for _ in range(4)
        ]
        values = [result.get(timeout=60) for result in results]
        report = check_sections(recorder.events())
    finally:
        worker.stop()
        app.close()
        recorder.clear()
    assert len({value["pid"] for value in values}) == 1  # one process: the overlap is greenlets
    assert report.keys["k"].max_shared == 4, worker.log_tail()
    assert report.violations == 0
    assert report.closed_task_ids == {result.id for result in results}
