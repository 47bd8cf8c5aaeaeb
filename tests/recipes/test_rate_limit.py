"""RateLimit on real ZooKeeper: at most N admissions in any window of the period, decided on
ZooKeeper's clock, across sessions; tries answer at once; the path stays bounded."""

from __future__ import annotations

import threading
import time

import pytest
from kazoo.client import KazooClient

from celery_zklock import ConfigurationError, RateLimit
from celery_zklock.locks.rate import ADMISSION_PREFIX, Rate, parse_rate


def most_in_any_window(times: list[float], window: float) -> int:
    ordered = sorted(times)
    return max((sum(1 for t in ordered[i:] if t < start + window) for i, start in
                enumerate(ordered)), default=0)  # fmt: skip


def test_four_sessions_never_exceed_the_rate(sessions: list[KazooClient], lock_root: str) -> None:
    """4 sessions calling acquire() in a loop for 6 s on "5/s": never more than 5 admissions in
    any 0.95 s window, at least 80 % of the 30 the rate allows, and at most 2 x N admission
    nodes left afterwards. An admission's time is when ZooKeeper decided it (``admitted_at``,
    its node's ctime): the time acquire returned adds this host's scheduling delays, tens of
    milliseconds on a loaded machine, which are not the limiter's to keep."""
    path = f"{lock_root}/api"
    admitted: list[float] = []
    guard = threading.Lock()
    start = time.monotonic()
    end = start + 6.0

    def caller(client: KazooClient) -> None:
        limit = RateLimit(client, path, "5/s")
        while True:
            remaining = end - time.monotonic()
            if remaining <= 0 or not limit.acquire(timeout=remaining):
                return
            with guard:
                admitted.append(limit.admitted_at)

    threads = [threading.Thread(target=caller, args=(c,)) for c in sessions]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    shown = " ".join(f"{t - min(admitted):.3f}" for t in sorted(admitted))
    assert most_in_any_window(admitted, 0.95) <= 5, shown
    assert len(admitted) >= 24, len(admitted)
    left = [n for n in sessions[0].get_children(path) if n.startswith(ADMISSION_PREFIX)]
    assert len(left) <= 10, left


def test_a_try_over_the_limit_answers_at_once(zk_client: KazooClient, lock_root: str) -> None:
    limit = RateLimit(zk_client, f"{lock_root}/report", "2/h")
    assert limit.acquire(blocking=False) and limit.acquire(blocking=False)
    started = time.monotonic()
    assert limit.acquire(blocking=False) is False
    assert time.monotonic() - started < 0.5
    started = time.monotonic()
    assert limit.acquire(timeout=1.0) is False  # the window opens in an hour: no wait
    assert time.monotonic() - started < 0.5
    assert len(limit.admissions()) == 2


def test_a_blocking_acquire_sleeps_until_the_window_admits(
    zk_client: KazooClient, other_client: KazooClient, lock_root: str
) -> None:
    path = f"{lock_root}/burst"
    first = RateLimit(zk_client, path, "1/s")
    assert first.acquire(blocking=False)
    started = time.monotonic()
    assert RateLimit(other_client, path, "1/s").acquire(timeout=5)
    waited = time.monotonic() - started
    assert 0.5 < waited < 2.0, waited


def test_rates_are_parsed_in_celery_syntax() -> None:
    assert parse_rate("10/s") == Rate(10, 1.0)
    assert parse_rate("100/m") == Rate(100, 60.0)
    assert parse_rate("1/h") == Rate(1, 3600.0)
    assert parse_rate("3") == Rate(3, 1.0)
    for bad in ("0/s", "10/d", "ten/s", 5, None, "1.5/s"):
        with pytest.raises(ConfigurationError, match="'N/s', 'N/m' or 'N/h'"):
            parse_rate(bad)
