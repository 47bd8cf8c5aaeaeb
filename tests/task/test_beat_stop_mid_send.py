"""A SIGTERM that stops the leader beat in the middle of a send (real ZooKeeper, memory broker).

``celery beat``'s SIGTERM/SIGINT handler (celery.apps.beat.Beat.install_sync_handler) calls
``scheduler.close()`` and raises SystemExit on the main thread, wherever that thread is: here
right after the leader's publish, before the send is recorded. The send must still be recorded
before the lease is released (the standby granted at the release must not send that due time
again: one send per due time across a graceful handover), and the SystemExit must reach
``celery.beat.Service.start`` (else the beat keeps running until SIGKILL).
"""

from __future__ import annotations

import os
import signal
import threading
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

from celery import Celery, beat
from celery.apps.beat import Beat
from kazoo.client import KazooClient

from celery_zklock.beat import LeaderScheduler, RunRecord, decode_state, encode_state
from celery_zklock.zk.settings import forget_settings, settings_of
from tests.lockutil import wait_for
from tests.unit.test_beat_state import queue_size

WATCHDOG = 15.0
"""Seconds after which the test stops a beat loop that did not exit on its own."""


def make_app(zk_hosts: str, root: str, queue: str) -> Celery:
    app = Celery("beat-stop-mid-send", broker="memory://", set_as_current=False)
    app.conf.zklock_hosts = zk_hosts
    app.conf.zklock_root = root
    app.conf.zklock_session_timeout = 4.0
    app.conf.zklock_beat_name = "mid-send"
    app.conf.beat_schedule = {
        "minutely": {"task": "unit.job", "schedule": 60.0, "options": {"queue": queue}}
    }
    return app


def test_sigterm_between_a_publish_and_its_record_records_it_hands_over_and_exits(
    zk_hosts: str, zk_client: KazooClient, lock_root: str, tmp_path: Path
) -> None:
    queue = f"mid-send-{tmp_path.name}"
    app = make_app(zk_hosts, lock_root, queue)
    settings = settings_of(app).beat
    last = datetime.now(timezone.utc) - timedelta(seconds=120)  # due once, now
    zk_client.create(
        settings.state,
        encode_state({"minutely": RunRecord(last, 5)}, leader="old:1", token=1, written_at=last),
        makepath=True,
    )

    class StoppedAfterPublish(app.amqp.Producer):  # type: ignore[misc,name-defined]
        def _publish(self, *args: Any, **kwargs: Any) -> Any:
            result = super()._publish(*args, **kwargs)
            os.kill(os.getpid(), signal.SIGTERM)  # the operator stops the leader: now
            return result

    service = beat.Service(app, max_interval=0.5, remote_control=False)
    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    a = LeaderScheduler(
        app,
        Producer=StoppedAfterPublish,
        schedule_filename=str(tmp_path / "a-schedule"),
        max_interval=0.5,  # what celery beat passes; also the loop's sleep once A is closed
    )
    b_app = make_app(zk_hosts, lock_root, queue)
    b: LeaderScheduler | None = None
    watchdog = threading.Timer(WATCHDOG, service._is_shutdown.set)
    try:
        service.__dict__["scheduler"] = a
        Beat.install_sync_handler(None, service)  # type: ignore[arg-type]  # celery beat's own
        assert a._elector is not None
        wait_for(lambda: a._elector is not None and a._elector.lease is not None, 20, "A leads")
        b = LeaderScheduler(b_app, schedule_filename=str(tmp_path / "b-schedule"))
        wait_for(lambda: len(zk_client.get_children(settings.election)) == 2, 20, "B queued")
        watchdog.start()
        service.start()  # celery beat's loop, on the main thread: A sends and is stopped
        exited = watchdog.is_alive()  # else the watchdog ended the loop
        assert a._closed and queue_size(app, queue) == 1
        state = decode_state(zk_client.get(settings.state)[0])
        assert state["minutely"].total_run_count == 6, "the send was not recorded before handover"

        elector = b._elector
        assert elector is not None
        wait_for(lambda: elector.lease is not None, 20, "B elected")  # granted at A's release
        for _ in range(3):
            b.tick()  # B's term: the entry is due in a minute, not now
        assert b.is_leader
        sent = queue_size(app, queue)
        assert sent == 1, f"one due time, sent {sent} times across a graceful handover"
        assert exited, "the SystemExit was swallowed: the beat loop kept running"
    finally:
        watchdog.cancel()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        a.close()
        if b is not None:
            b.close()
        forget_settings(app)
        forget_settings(b_app)
