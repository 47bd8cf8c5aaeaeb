"""The worker fleet and the demo: the settings every fleet worker reads, the worker entry point,
the fleet launcher, and the demo (the load test, demo-sized) end to end on real processes."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import uuid
from dataclasses import replace
from pathlib import Path

import pytest
import redis
from celery.utils import worker_direct

from workers import demo
from workers.__main__ import (
    build_parser,
    effective_pool,
    main,
    worker_argv,
)
from workers.app import celery_config, create_app
from workers.checker import check_run
from workers.fleet import Fleet, WorkerSpec, descendants, pid_alive, worker_command
from workers.loadtest import config_from_args
from workers.record import SectionRecorder
from workers.settings import Settings, SettingsError
from workers.tasks import SHARED_TASK

REPO_ROOT = Path(__file__).resolve().parents[2]

# ---------------------------------------------------------------------------------- settings

_MINIMAL = {"ZKLOCK_HOSTS": "127.0.0.1:2181", "ZKLOCK_BROKER_URL": "redis://127.0.0.1:6379/0"}


def test_settings_defaults_follow_the_broker() -> None:
    settings = Settings.from_env(_MINIMAL)
    assert settings.result_backend == settings.record_url == _MINIMAL["ZKLOCK_BROKER_URL"]
    assert (settings.pool, settings.concurrency) == ("prefork", 4)
    assert settings.session_timeout == 10.0
    assert settings.zk_root == "/zklock"
    assert settings.visibility_timeout == 60.0


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
        "ZKLOCK_VISIBILITY_TIMEOUT": "30",
    }
    settings = Settings.from_env(env)
    assert settings.concurrency == 8 and settings.session_timeout == 2.5
    assert settings.visibility_timeout == 30.0
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
                "ZKLOCK_BROKER_URL": "kafka://localhost:9092",
                "ZKLOCK_RECORD_URL": "redis://:99999999/0",
                "ZKLOCK_POOL": "eventlett",
                "ZKLOCK_CONCURRENCY": "0",
                "ZKLOCK_SESSION_TIMEOUT": "soon",
                "ZKLOCK_ROOT": "zklock/",
                "ZKLOCK_VISIBILITY_TIMEOUT": "-1",
            }
        )
    text = str(bad.value)
    for name in (
        "ZKLOCK_HOSTS: 'zk2' is not host:port",
        "ZKLOCK_BROKER_URL must be a Redis or RabbitMQ URL",
        "ZKLOCK_RECORD_URL",
        "ZKLOCK_POOL must be one of prefork, threads, gevent, solo; got 'eventlett'",
        "ZKLOCK_CONCURRENCY must be a whole number >= 1, got 0",
        "ZKLOCK_SESSION_TIMEOUT must be a number of seconds > 0, got 'soon'",
        "ZKLOCK_ROOT must be an absolute znode path",
        "ZKLOCK_VISIBILITY_TIMEOUT must be a number of seconds > 0, got -1.0",
    ):
        assert name in text
    assert len(bad.value.problems) == 8
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
    assert worker_command(["-c", "2"]) == [sys.executable, "-m", "workers", "worker", "-c", "2"]


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


def test_demo_is_a_fleet_subcommand() -> None:
    args = build_parser().parse_args(["demo", "--tasks", "3", "--keep-logs"])
    assert args._command is demo.COMMAND
    config = config_from_args(args, "demo")
    assert config == replace(demo.DEMO, tasks=3, keep_logs=True)
    # The demo's defaults: about a minute, every fault that needs neither an ensemble nor root.
    assert set(demo.DEMO.faults) == {
        "kill",
        "pause",
        "expire",
        "broker_restart",
        "stall_before_write",
    }
    assert {"prefork", "threads"} <= set(demo.DEMO.pools)
    assert 0 < demo.DEMO.shared_ratio < 1 and 0 < demo.DEMO.skip_ratio < 1


def test_python_m_workers_usage_errors_exit_2_before_anything_starts(
    capsys: pytest.CaptureFixture[str],
) -> None:
    for argv in (
        [],
        ["nonsense"],
        ["demo", "--tasks", "0"],
        ["loadtest", "--broker", "redis://h/0"],
    ):
        with pytest.raises(SystemExit) as info:
            main(argv)
        assert info.value.code == 2, argv
    err = capsys.readouterr().err
    assert "--zk-hosts and --broker go together" in err
    assert "invalid choice: 'nonsense'" in err
    assert all(f"'{name}'" in err for name in ("worker", "demo", "loadtest"))  # the choices


def test_fleet_config_redelivers_what_a_dead_worker_held() -> None:
    settings = Settings("h:1", "redis://h/0", "redis://h/1", "redis://h/1", visibility_timeout=25)
    conf = celery_config(settings)
    assert conf["task_acks_late"] and conf["task_reject_on_worker_lost"]
    assert conf["worker_prefetch_multiplier"] == 1
    transport = conf["broker_transport_options"]
    assert transport["visibility_timeout"] == 25
    # Swept often enough that a dead worker's message waits about the visibility timeout.
    assert transport["unacked_restore_interval"] * transport["unacked_restore_throttle"] <= 5
    # RabbitMQ: no visibility timeout (a dead worker's connection closes); publisher confirms.
    amqp = replace(settings, broker_url="amqp://guest:guest@h:5672//")
    assert celery_config(amqp)["broker_transport_options"] == {"confirm_publish": True}


def test_python_m_workers_names_missing_settings_and_exits_2() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ZKLOCK_")}
    done = subprocess.run(
        worker_command(), cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=60,
        check=False,
    )  # fmt: skip
    assert done.returncode == 2
    assert "ZKLOCK_HOSTS is not set" in done.stderr
    assert "ZKLOCK_BROKER_URL is not set" in done.stderr


# ------------------------------------------------------------------------------------ fleet


@pytest.mark.slow
def test_fleet_starts_finds_restarts_and_stops_its_workers(
    zk_hosts: str, redis_url: str, lock_root: str, tmp_path: Path
) -> None:
    settings = Settings(zk_hosts, redis_url, redis_url, redis_url, zk_root=lock_root)
    app = create_app(settings, main="test-fleet")
    specs = [WorkerSpec("p", "prefork", 2), WorkerSpec("t", "threads", 2)]
    fleet = Fleet(app, settings, specs, uuid.uuid4().hex[:8], tmp_path)
    try:
        fleet.start(timeout=60)
        prefork, threads = fleet.workers
        assert prefork.pid is not None and threads.pid is not None
        children = descendants(prefork.pid)
        assert len(children) == 2  # the pool processes
        assert all(fleet.find(pid) is prefork for pid in children)
        assert fleet.find(threads.pid) is threads and fleet.find(os.getpid()) is None
        assert fleet.by_nodename(threads.nodename) is threads
        assert "ready" in threads.log_path.read_text()
        # A worker that dies is found by revive() and started again under the same name.
        old = threads.pid
        threads.kill()
        assert fleet.revive(timeout=60) == [threads]
        assert threads.pid != old and threads.restarts == 1
        assert fleet.unexpected_exits[0][0] == "t"
        result = app.tasks[SHARED_TASK].apply_async(
            (uuid.uuid4().hex, "k", 10), queue=worker_direct(threads.nodename)
        )
        assert result.get(timeout=30)["pid"] == threads.pid
    finally:
        fleet.stop()
        app.close()
    for pid in (prefork.pid, threads.pid, *children):
        assert pid is None or not pid_alive(pid)


@pytest.mark.slow
def test_gevent_worker_runs_sections_concurrently(
    zk_hosts: str, redis_url: str, lock_root: str, tmp_path: Path
) -> None:
    # Only a monkey-patched gevent worker runs four 400 ms sections at once: without the patch
    # time.sleep blocks the whole worker and the sections run one after another.
    run_id = uuid.uuid4().hex[:12]
    settings = Settings(zk_hosts, redis_url, redis_url, redis_url, zk_root=lock_root)
    app = create_app(settings, main="test-gevent")
    client = redis.Redis.from_url(redis_url)
    recorder = SectionRecorder(client, run_id)
    with Fleet(app, settings, [WorkerSpec("gevent", "gevent", 4)], run_id, tmp_path) as fleet:
        fleet.start(timeout=60)
        (worker,) = fleet.workers
        results = [
            app.tasks[SHARED_TASK].apply_async(
                (run_id, "k", 400), queue=worker_direct(worker.nodename)
            )
            for _ in range(4)
        ]
        values = [result.get(timeout=60) for result in results]
        events = recorder.events()
    app.close()
    recorder.clear()
    client.close()
    assert len({value["pid"] for value in values}) == 1  # one process: the overlap is greenlets
    enters = [i for i, e in enumerate(events) if e.kind == "enter"]
    first_exit = next(i for i, e in enumerate(events) if e.kind == "exit")
    assert len(enters) == 4 and max(enters) < first_exit, worker.log_tail()
    report = check_run(
        submitted={r.id: 0.0 for r in results}, outcomes={}, events=events, faults=[],
        leftover_nodes=0,
    )  # fmt: skip
    assert report.violations == 0


# ------------------------------------------------------------------------------- end to end

_REPORT_RE = re.compile(
    r"^zklock-report: tasks=(?P<tasks>\d+) ran=(?P<ran>\d+) skipped=(?P<skipped>\d+) "
    r"failed=(?P<failed>\d+) lost=(?P<lost>\d+) violations=(?P<violations>\d+) "
    r"stale_writes_accepted=(?P<stale>\d+) leftover_nodes=(?P<leftover>\d+) "
    r"broker_dropped=(?P<dropped>\d+) rate_violations=(?P<rate>\d+) "
    r"duplicate_completions=(?P<twice>\d+)$"
)


def _group_members(pgid: int) -> list[int]:
    """The live processes of process group ``pgid``. Not zombies: a pool process that the
    group's SIGKILL took after its worker exited is reparented to PID 1 and stays a zombie until
    PID 1 reaps it, up to about 2 s later on these machines (seen failing ``.ci/run``: one
    zombie of a stopped worker's group)."""
    members = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[2]) == pgid and fields[0] not in ("Z", "X"):
                members.append(int(entry.name))
    return members


@pytest.mark.slow
def test_demo_end_to_end(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # Demo-shaped, smaller: the full demo takes about a minute.
    status = demo.main(
        [
            *("--tasks", "24", "--duration", "4", "--faults", "expire:1,broker_restart:1"),
            *("--out", str(tmp_path), "--no-progress"),
        ]
    )
    out = capsys.readouterr().out
    lines = out.strip().splitlines()
    match = _REPORT_RE.match(lines[-1])
    assert match, out
    counts = {name: int(value) for name, value in match.groupdict().items()}
    assert status == 0, out
    assert counts["tasks"] == 24
    assert counts["lost"] == counts["violations"] == counts["stale"] == counts["leftover"] == 0
    # The broker restart may drop a message it was handing out (workers/whereabouts.py): the
    # checker counts it apart, and at most one per restart.
    assert counts["dropped"] <= 1, out
    assert counts["ran"] + counts["skipped"] + counts["failed"] + counts["dropped"] == 24, out
    assert counts["ran"] >= 2, out
    assert "fault expire at" in out and "fault broker_restart at" in out
    assert (tmp_path / "report.html").is_file()
    # Every worker (and, for prefork, its pool processes) is gone once main returned.
    pids = [int(pid) for pid in re.findall(r"^worker \S+ \(\w+ x\d+, pid (\d+)", out, re.M)]
    assert len(pids) == 3, out
    for pid in pids:
        assert not pid_alive(pid)
        assert _group_members(pid) == []
