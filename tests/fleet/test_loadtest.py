"""`python -m workers loadtest`: its options, its workload, and whole runs on real processes: a
quick one without faults, and a CI-sized one with every fault kind three times over a 3-node
ensemble with prefork and threads workers (blackhole and follower_partition included: the
lease-safety faults of issue 10)."""

from __future__ import annotations

import argparse
import json
import re
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from celery_zklock.testing.zookeeper import partition_unavailable_reason
from workers import __main__ as fleet_cli
from workers import loadtest
from workers.loadtest import (
    LoadConfig,
    _netns_places,
    config_from_args,
    plan_workload,
    run_loadtest,
)
from workers.netns import blackhole_unavailable_reason, unavailable_reason
from workers.record import FAULT_KINDS

REPORT_LINE = re.compile(
    r"^zklock-report: tasks=(?P<tasks>\d+) ran=(?P<ran>\d+) skipped=(?P<skipped>\d+) "
    r"failed=(?P<failed>\d+) lost=(?P<lost>\d+) violations=(?P<violations>\d+) "
    r"stale_writes_accepted=(?P<stale>\d+) leftover_nodes=(?P<leftover>\d+) "
    r"broker_dropped=(?P<dropped>\d+)$"
)


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    loadtest.configure_parser(parser)
    return parser.parse_args(argv)


def test_workload_is_seeded_and_follows_the_ratios() -> None:
    config = LoadConfig(tasks=2000, keys=5, shared_ratio=0.25, skip_ratio=0.4, hold_ms=100)
    plan = plan_workload(config)
    assert plan == plan_workload(config)
    assert plan != plan_workload(LoadConfig(tasks=2000, keys=5, seed=1))
    modes = Counter(item.mode for item in plan)
    busy = Counter(item.on_busy for item in plan)
    assert 400 < modes["shared"] < 600 and 700 < busy["skip"] < 900
    assert {item.key for item in plan} == {f"key-{i}" for i in range(5)}
    assert all(50 <= item.hold_ms <= 150 for item in plan)
    assert {i.mode for i in plan_workload(LoadConfig(tasks=50, shared_ratio=0))} == {"exclusive"}


def test_options_become_a_config() -> None:
    args = _parse(
        [
            *("--tasks", "10", "--faults", "kill:2,expire:1", "--pools", "threads,prefork"),
            *("--zk-nodes", "3", "--session-timeout", "4", "--out", "/tmp/x", "--no-progress"),
        ]
    )
    config = config_from_args(args)
    assert config.tasks == 10 and config.zk_nodes == 3 and config.session_timeout == 4.0
    assert config.faults == {"kill": 2, "expire": 1}
    assert config.pools == ("threads", "prefork")
    assert config.out_dir == Path("/tmp/x") and config.progress is False
    assert config.external is None
    # With faults, tasks are sent over the time the faults take; without, at once.
    assert config.effective_duration() >= 10
    assert LoadConfig().effective_duration() == 0
    assert config.effective_visibility_timeout() > config.wait_timeout
    for bad in (["--pools", "eventlet"], ["--shared-ratio", "2"], ["--faults", "nap:1"]):
        with pytest.raises(SystemExit):
            _parse(bad)


def test_partition_faults_shape_the_stack() -> None:
    # Black holes need a namespace worker whose tasks share one client: an in-process pool.
    assert _netns_places(["prefork", "threads", "prefork", "threads"], 1, in_process=False) == [3]
    assert _netns_places(["prefork", "threads", "prefork"], 1, in_process=False) == [2]
    assert _netns_places(["prefork", "threads", "prefork"], 1, in_process=True) == [1]
    assert _netns_places(["prefork", "prefork"], 1, in_process=True) == [1]
    assert LoadConfig(faults={"blackhole": 1}).effective_netns_workers() == 1
    assert LoadConfig(faults={"kill": 1}).effective_netns_workers() == 0
    # A follower cut off from its leader must outlive the session timeout (200 ms ticks).
    assert LoadConfig(session_timeout=4.0).effective_sync_limit() == 5
    config = LoadConfig(session_timeout=4.0, faults={"follower_partition": 3})
    assert config.effective_sync_limit() == 50  # (2 * 4 + 2) s / 0.2 s
    assert LoadConfig(zk_sync_limit=7, faults={"follower_partition": 1}).effective_sync_limit() == 7


def test_external_mode_needs_hosts_and_broker_and_defaults_the_rest() -> None:
    args = _parse(["--zk-hosts", "127.0.0.1:21811", "--broker", "redis://127.0.0.1:16379/0"])
    external = config_from_args(args).external
    assert external is not None
    assert external.record_url == external.result_backend == "redis://127.0.0.1:16379/0"
    with pytest.raises(ValueError, match="go together"):
        config_from_args(_parse(["--broker", "redis://127.0.0.1:16379/0"]))


def test_loadtest_is_a_fleet_subcommand() -> None:
    args = fleet_cli.build_parser().parse_args(["loadtest", "--tasks", "5", "--faults", "all:1"])
    assert args._command is loadtest.COMMAND
    assert config_from_args(args).faults == {kind: 1 for kind in FAULT_KINDS}


def _run(config: LoadConfig, capsys: pytest.CaptureFixture[str]) -> tuple[int, str, dict[str, int]]:
    status = run_loadtest(config)
    out = capsys.readouterr().out
    match = REPORT_LINE.match(out.strip().splitlines()[-1])
    assert match, out
    return status, out, {name: int(value) for name, value in match.groupdict().items()}


def _verdict_first(out: str) -> str:
    """A run's output with its verdict (from the settle line on) first: a CI log that shows
    only part of a long failure message still shows which tasks went wrong and why."""
    at = out.find("tasks sent and settled")
    return out if at < 0 else f"{out[at:]}\n--- the whole run ---\n{out}"


def _report(out_dir: Path) -> dict[str, Any]:
    data: dict[str, Any] = json.loads((out_dir / "report.json").read_text())
    return data


@pytest.mark.slow
def test_a_small_run_without_faults(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = LoadConfig(
        tasks=40, keys=3, hold_ms=60, workers=2, concurrency=2, out_dir=tmp_path, progress=False
    )
    status, out, counts = _run(config, capsys)
    assert status == 0, out
    assert counts["tasks"] == 40
    assert counts["lost"] == counts["violations"] == counts["stale"] == counts["leftover"] == 0
    assert counts["ran"] + counts["skipped"] + counts["failed"] == 40
    assert counts["ran"] >= 10, out
    report = _report(tmp_path)
    assert report["ok"] is True and report["tasks"] == 40
    assert report["faults_by_kind"] == {}
    assert {p.name for p in tmp_path.iterdir()} >= {"report.json", "summary.txt", "report.html"}


@pytest.mark.slow
@pytest.mark.ensemble
@pytest.mark.timeout(600)
def test_every_fault_three_times_over_an_ensemble(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = LoadConfig(
        tasks=150,
        keys=6,
        hold_ms=300,
        workers=4,
        pools=("prefork", "threads"),
        concurrency=2,
        session_timeout=4.0,
        wait_timeout=12.0,
        zk_nodes=3,
        faults={kind: 3 for kind in FAULT_KINDS},
        fault_gap=0.5,
        result_timeout=60.0,
        out_dir=tmp_path,
        progress=False,
        keep_logs=True,
    )
    started = time.monotonic()
    status, out, counts = _run(config, capsys)
    took = time.monotonic() - started
    verdict = _verdict_first(out)
    assert counts["tasks"] == 150
    assert counts["violations"] == 0, verdict
    assert counts["stale"] == 0, verdict
    assert counts["lost"] == 0, verdict
    assert counts["leftover"] == 0, verdict
    # kombu's Redis transport may drop a message the broker was handing out when it is killed
    # (workers/whereabouts.py; never started, so no lock was involved): rare, a few in a hundred
    # restarts here, and bounded here by the restarts.
    assert counts["dropped"] <= config.faults["redis_restart"], verdict
    assert status == 0, verdict
    report = _report(tmp_path)
    faults = report["faults_by_kind"]
    not_run_details = [f"{f['kind']}: {f['detail']}" for f in report["faults_not_run"]]
    missing = {
        "partition": unavailable_reason(),
        "blackhole": blackhole_unavailable_reason(),
        "follower_partition": partition_unavailable_reason(),
    }
    for kind in FAULT_KINDS:
        injected, not_run = faults[kind]
        if missing.get(kind) is not None:
            assert not_run == 3 and f"{kind} faults will not run" in out, out
            continue
        assert (injected, not_run) == (3, 0), f"{kind}: not run: {not_run_details}"
    with capsys.disabled():  # the run's figures, visible in CI's log (its time is no target)
        print(f"\nfault run ({took:.0f} s): {report['report_line']}; injected per kind: "
              + ", ".join(f"{kind}={faults[kind][0]}" for kind in FAULT_KINDS))  # fmt: skip
