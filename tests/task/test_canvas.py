"""Skips inside chains, groups and chords on a real worker (celery_zklock.task.canvas, issue 34).

The lock of ``exclusive_section("busy", ...)`` is held by the test itself, so each call of it
is skipped (``lock_on_busy="skip"``); ``received`` records and returns what it got, and
``received_skips`` is the same task opted in to skip markers (``zklock_accepts_skipped``).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from celery import Celery, chain, chord, group
from celery.result import AsyncResult
from kazoo.client import KazooClient

from celery_zklock import ReadWriteLock, is_skipped
from tests.conftest import Broker
from tests.workerproc import workers

TIMEOUT = 30


@contextmanager
def _busy(zk_client: KazooClient) -> Iterator[None]:
    """Hold the lock that ``exclusive_section("busy", ...)`` takes, for the block."""
    from tests.taskapp import exclusive_section

    lease = ReadWriteLock(zk_client, exclusive_section.lock_path("busy", 0.0)).write.acquire(
        timeout=10
    )
    try:
        yield
    finally:
        lease.release()


def _received(tmp: Path) -> dict[str, Any]:
    """Tag -> the value that ``received``/``received_skips`` got, for the steps that ran."""
    from tests.taskapp import read_records

    return {record["tag"]: record["value"] for record in read_records(tmp / "received")}


def test_a_skip_stops_its_chain_unless_the_next_step_accepts_skips(
    taskenv: tuple[Celery, dict[str, str], Path], broker: Broker, zk_client: KazooClient
) -> None:
    """Before the fix: the steps after the skip ran with the marker as their argument, and the
    chain's result was theirs ({"received": marker})."""
    app, _, tmp = taskenv
    env = broker.env
    from tests.taskapp import exclusive_section, received, received_skips

    with _busy(zk_client), workers(app, "threads", 1, env, tmp, prefix="chain") as (worker,):
        q = {"queue": worker.queue}
        stopped = chain(
            exclusive_section.s("busy", 0.0).set(**q),
            received.s("a").set(**q),
            received.s("b").set(**q),
        ).apply_async()
        opted_in = chain(
            exclusive_section.s("busy", 0.0).set(**q), received_skips.s("c").set(**q)
        ).apply_async()
        flowing = chain(
            exclusive_section.s("free", 0.0).set(**q), received.s("d").set(**q)
        ).apply_async()
        link = received.s("e").set(**q)
        link.freeze()
        linked = exclusive_section.apply_async(("busy", 0.0), link=link, **q)

        last = stopped.get(timeout=TIMEOUT)
        assert is_skipped(last), last  # the chain's result says skipped, and does not hang
        assert is_skipped(stopped.parent.get(timeout=TIMEOUT))
        assert is_skipped(stopped.parent.parent.get(timeout=TIMEOUT))
        assert last["lock"] == exclusive_section.lock_path("busy", 0.0)

        got = opted_in.get(timeout=TIMEOUT)
        assert is_skipped(got["received"]), got  # the opted-in step ran with the marker

        assert not is_skipped(flowing.get(timeout=TIMEOUT)["received"])  # no skip, no change

        assert is_skipped(linked.get(timeout=TIMEOUT))
        assert is_skipped(AsyncResult(link.id, app=app).get(timeout=TIMEOUT))
        ran = _received(tmp)
    assert "a" not in ran and "b" not in ran and "e" not in ran, ran
    assert is_skipped(ran["c"]) and "token" in ran["d"], ran


def test_groups_keep_markers_and_chord_bodies_get_none(
    taskenv: tuple[Celery, dict[str, str], Path], broker: Broker, zk_client: KazooClient
) -> None:
    """A group's results keep each member's own (a skip's marker); a chord's body gets None for
    a skipped member, the marker if it opts in, and no chord hangs, also when a member is a
    chain stopped by a skip. Before the fix: the bodies got the markers as results."""
    app, _, tmp = taskenv
    env = broker.env
    from tests.taskapp import exclusive_section, received, received_skips

    with _busy(zk_client), workers(app, "threads", 1, env, tmp, prefix="chord") as (worker,):
        q = {"queue": worker.queue}

        def members(free: str) -> list[Any]:
            return [
                exclusive_section.s("busy", 0.0).set(**q),
                exclusive_section.s(free, 0.0).set(**q),
            ]

        grouped = group(members("g")).apply_async()
        plain = chord(members("h"), received.s("plain").set(**q)).apply_async()
        opted_in = chord(members("i"), received_skips.s("opted").set(**q)).apply_async()
        stopped_member = chain(
            exclusive_section.s("busy", 0.0).set(**q), received.s("member").set(**q)
        )
        nested = chord(
            [stopped_member, exclusive_section.s("j", 0.0).set(**q)],
            received.s("nested").set(**q),
        ).apply_async()

        skipped, ran = grouped.get(timeout=TIMEOUT)
        assert is_skipped(skipped) and "token" in ran, (skipped, ran)

        first, second = plain.get(timeout=TIMEOUT)["received"]
        assert first is None and "token" in second, (first, second)

        first, second = opted_in.get(timeout=TIMEOUT)["received"]
        assert is_skipped(first) and "token" in second, (first, second)

        first, second = nested.get(timeout=TIMEOUT)["received"]
        assert first is None and "token" in second, (first, second)
        got = _received(tmp)
    assert "member" not in got, got
