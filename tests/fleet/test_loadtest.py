"""`python -m workers loadtest`: its options, its workload, and whole runs on real processes: a
quick one without faults, the hot-key scenario with the gate on and off, and a CI-sized one
with every fault kind three times over a 3-node ensemble with prefork and threads workers
(blackhole and follower_partition included: the lease-safety faults of issue 10; kill_held, a
worker killed while its gate holds messages, issue 33; quorum_loss, 2 of the 3 members down past
the session timeout, issue 44), in the hot-key scenario."""

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
    HOT_KEY,
    LoadConfig,
    _netns_places,
    config_from_args,
    plan_workload,
    run_loadtest,
)
from workers.netns import blackhole_unavailable_reason, unavailable_reason
from workers.record import FAULT_KINDS

UNRELATED_LINE = re.compile(
    r"^unrelated tasks \(no lock\): (?P<count>\d+), send to result p50 (?P<p50>[\d.]+) s, "
    r"p95 (?P<p95>[\d.]+) s, p99 (?P<p99>[\d.]+) s, max [\d.]+ s "
    r"\(gate (?P<gate>on|off), at most (?P<held>\d+) held at once\)$",
    re.MULTILINE,
)
REPORT_LINE = re.compile(
    r"^zklock-report: tasks=(?P<tasks>\d+) ran=(?P<ran>\d+) skipped=(?P<skipped>\d+) "
    r"failed=(?P<failed>\d+) lost=(?P<lost>\d+) violations=(?P<violations>\d+) "
    r"stale_writes_accepted=(?P<stale>\d+) leftover_nodes=(?P<leftover>\d+) "
    r"broker_dropped=(?P<dropped>\d+) rate_violations=(?P<rate>\d+) "
    r"duplicate_completions=(?P<twice>\d+)$"
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


def test_the_hot_key_scenario_puts_a_share_on_one_key_among_unrelated_traffic() -> None:
    config = LoadConfig(
        tasks=400, keys=4, scenario="hot-key", hot_share=0.5, unrelated=1000, hot_hold_ms=2000
    )
    plan = plan_workload(config)
    sections = [item for item in plan if not item.unrelated]
    hot = [item for item in sections if item.key == HOT_KEY]
    assert len(sections) == 400 and len(plan) == 1400 and 150 < len(hot) < 250
    assert {(i.mode, i.on_busy) for i in hot} == {("exclusive", "wait")}
    assert all(1000 <= i.hold_ms <= 3000 for i in hot)
    assert all(100 <= i.hold_ms <= 300 for i in sections if i.key != HOT_KEY)
    assert {i.key for i in sections} - {HOT_KEY} == {f"key-{i}" for i in range(4)}
    # Spread evenly: between two sections, 2 or 3 unrelated tasks (1000 over 400).
    runs = "".join("u" if item.unrelated else "s" for item in plan).split("s")[1:]
    assert {len(run) for run in runs} == {2, 3}
    # The bench's shape: 8 hot sections of exactly 1 s, 20 unrelated tasks after the first.
    bench = LoadConfig(tasks=8, scenario="hot-key", hot_share=1, unrelated=20, hold_ms=1000,
                       hold_spread=0)  # fmt: skip
    items = plan_workload(bench)
    assert [i.hold_ms for i in items if not i.unrelated] == [1000] * 8
    assert not items[0].unrelated and sum(i.unrelated for i in items) == 20
    # Unrelated traffic by default: as many as sections with hot-key, none in mixed.
    assert LoadConfig(tasks=7, scenario="hot-key").effective_unrelated() == 7
    assert LoadConfig(tasks=7).effective_unrelated() == 0
    assert plan_workload(LoadConfig(tasks=0, unrelated=3)) == [loadtest.UNRELATED_ITEM] * 3


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
    assert (config.scenario, config.gate, config.unrelated) == ("mixed", True, None)
    hot = config_from_args(_parse(["--scenario", "hot-key", "--gate", "off", "--unrelated", "5",
                                   "--hot-share", "1", "--hold-spread", "0",
                                   "--hot-hold-ms", "900"]))  # fmt: skip
    assert (hot.scenario, hot.gate, hot.unrelated, hot.hot_share) == ("hot-key", False, 5, 1.0)
    assert hot.hot_hold_ms == 900
    assert hot.hold_spread == 0
    mix = config_from_args(_parse(["--preempt-ratio", "0.1", "--pair-ratio", "0.2"]))
    assert (mix.preempt_ratio, mix.pair_ratio) == (0.1, 0.2)
    assert (config.preempt_ratio, config.pair_ratio) == (0.0, 0.0)
    # With faults, tasks are sent over the time the faults take; without, at once.
    assert config.effective_duration() >= 10
    assert LoadConfig().effective_duration() == 0
    assert config.effective_visibility_timeout() > config.wait_timeout
    assert config.broker_kind == "redis"
    assert config_from_args(_parse(["--broker-kind", "amqp"])).broker_kind == "amqp"
    with pytest.raises(ValueError, match="--broker-kind is for a fleet the run starts"):
        config_from_args(
            _parse(["--broker-kind", "amqp", "--zk-hosts", "h:1", "--broker", "amqp://h//"])
        )
    for bad in (
        ["--broker-kind", "kafka"],
        ["--pools", "eventlet"],
        ["--shared-ratio", "2"],
        ["--pair-ratio", "-0.1"],
        ["--faults", "nap:1"],
        ["--scenario", "cold"],
        ["--gate", "maybe"],
        ["--unrelated", "-1"],
    ):
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
@pytest.mark.parametrize("gate", [True, False], ids=["gate-on", "gate-off"])
def test_hot_key_with_unrelated_traffic_gate_on_and_off(
    gate: bool, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The issue's shape: one prefork worker x2, 8 exclusive waits of 1 s on one key and 20
    unrelated tasks. Each run reports the unrelated tasks' latency and the gate it ran with;
    with the gate on the worker held hot-key messages outside its pool, with it off none.
    (Their latency targets are the benchmark's: ``make bench``, section gate.)"""
    config = LoadConfig(
        scenario="hot-key",
        hot_share=1.0,
        tasks=8,
        unrelated=20,
        hold_ms=1000,
        hold_spread=0.0,
        workers=1,
        pools=("prefork",),
        concurrency=2,
        gate=gate,
        out_dir=tmp_path,
        progress=False,
    )
    status, out, counts = _run(config, capsys)
    assert status == 0, out
    assert (counts["tasks"], counts["ran"], counts["lost"], counts["violations"]) == (28, 28, 0, 0)
    line = UNRELATED_LINE.search(out)
    assert line is not None, out
    assert (line["count"], line["gate"]) == ("20", "on" if gate else "off")
    assert float(line["p50"]) <= float(line["p95"]) <= float(line["p99"])
    assert (int(line["held"]) > 0) is gate, line.group(0)
    report = _report(tmp_path)
    assert len(report["unrelated_latency_seconds"]) == 20 and report["gate"] is gate
    # The 8 sections ran one at a time (no overlap), each once.
    assert report["violations"] == 0 and report["retried"] == 0 and len(report["hold_seconds"]) == 8


@pytest.mark.slow
@pytest.mark.acceptance
@pytest.mark.ensemble
@pytest.mark.timeout(600)
def test_every_fault_three_times_over_an_ensemble(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = LoadConfig(
        # Enough work for 33 faults 0.5 s apart on a loaded machine.
        tasks=300,
        # A hot key (30% of the sections wait on it, holding 2 s: busy most of the run) among
        # unrelated tasks: the gates hold messages for kill_held to aim at.
        scenario="hot-key",
        hot_share=0.3,
        # A fifth of the other sections rate-limited per key (issue 35) to one run in 10 s,
        # below what they ask for: admitted, skipped with the reason rate, or waiting for the
        # window (a wait past 12 s ends LockTimeout, a failure, not a loss).
        rate_ratio=0.2,
        rate="6/m",
        # Issue 36's tasks in the mix: of the other sections, a tenth lock two keys at once
        # (workers.pair_section, excluding the one-key sections on each) and a tenth of the
        # rest are sent with on_busy="preempt", on the hot key too, whose 2 s holds outlast the
        # lease's renewal interval so the break lands (the holder ends LockLost, a failure,
        # and must have exited before a newer section enters: a preempt excuses no overlap).
        pair_ratio=0.1,
        preempt_ratio=0.1,
        # Issue 42: ETA calls and a short visibility timeout in the mix, the gate on with its
        # default max hold (80% of the visibility timeout). A fifth of the sections are sent
        # with a countdown of 2-4 s, and Redis hands an unacknowledged message out again after
        # 6 s, less than a wait may last (12 s) and than a paused holder is stopped: a message
        # the worker keeps (its ETA, its gate, a paused pool process) outlives it. Every rate
        # window is checked on the admissions' ctimes, and no body may complete twice.
        eta_ratio=0.2,
        eta_countdown=4.0,
        # Issue 45: a tenth of the other sections begin a burst of 3 debounced calls of their
        # key (workers.debounced_section, 1 s of quiet) and a tenth a burst of 3 calls sent with
        # on_busy="replace": a superseded call (a skip, debounced or replaced) must never have
        # entered its section, and must name another call of the run.
        debounce_ratio=0.1,
        replace_ratio=0.1,
        burst=3,
        visibility_timeout=6.0,
        hot_hold_ms=2000,
        unrelated=100,
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
        # A call held past the gate's bound (4.8 s here) goes back to the broker and its wait
        # starts again at its next receipt: the hot key's waiters circulate until served
        # instead of ending LockTimeout at 12 s, so its backlog drains after the last send.
        result_timeout=120.0,
        out_dir=tmp_path,
        progress=False,
        keep_logs=True,
    )
    started = time.monotonic()
    status, out, counts = _run(config, capsys)
    took = time.monotonic() - started
    verdict = _verdict_first(out)
    assert counts["tasks"] == config.tasks + config.effective_unrelated()
    assert counts["violations"] == 0, verdict
    assert counts["stale"] == 0, verdict
    assert counts["lost"] == 0, verdict
    assert counts["leftover"] == 0, verdict
    assert counts["rate"] == 0 and counts["twice"] == 0, verdict
    # kombu's Redis transport may drop a message the broker was handing out when it or the
    # worker taking it is killed (workers/whereabouts.py; never started, no worker logged it
    # received, so no lock was involved): rare, and bounded here by those faults.
    consumer_deaths = config.faults["kill"] + config.faults["kill_held"]
    assert counts["dropped"] <= config.faults["broker_restart"] + consumer_deaths, verdict
    assert status == 0, verdict
    report = _report(tmp_path)
    assert report["rate_admissions"] > 0 and report["admissions_unread"] == 0, verdict
    assert report["superseded_violations"] == 0, verdict
    reasons = report["skip_reasons"]
    assert reasons.get("debounced", 0) > 0 and reasons.get("replaced", 0) > 0, reasons
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
    unrelated = UNRELATED_LINE.search(out)
    assert unrelated is not None and unrelated["gate"] == "on" and int(unrelated["held"]) > 0, out
    with capsys.disabled():  # the run's figures, visible in CI's log (its time is no target)
        print(f"\nfault run ({took:.0f} s): {report['report_line']}; injected per kind: "
              + ", ".join(f"{kind}={faults[kind][0]}" for kind in FAULT_KINDS)
              + f"; {unrelated.group(0)}")  # fmt: skip
