"""What a kill of a whole worker records, read back from Redis: the compose fleet's ``kill``
(workers/docker_faults.py) and the local fleet's ``kill_held`` (workers/faults.py)."""

from __future__ import annotations

import os
import signal
import subprocess
from types import SimpleNamespace
from typing import Any

import redis

from workers.compose import Container
from workers.docker_faults import DockerFaultInjector
from workers.faults import FaultInjector, OpenSections
from workers.record import SectionEvent, SectionRecorder


def test_a_container_kill_records_every_process_of_it_that_ran_a_section(
    redis_client: redis.Redis,
) -> None:
    """A ``docker kill`` kills every process of the container, also one whose body had just
    ended: the holder a ``kill`` picks often has (its lock node goes at its release, after its
    body), and its result may not be stored. Recording only the processes with a section open
    made a copy that ran that body again count as a body completed twice (a fresh clone's
    ``make test``, issue 43's sitting); recorded, the checker takes it as Celery's
    at-least-once (``died_before_its_ack``). Another container's processes are not touched."""
    recorder = SectionRecorder(redis_client, "dk")

    def event(kind: str, task: str, host: str, pid: int, at: float, **extra: Any) -> None:
        recorder.record(
            SectionEvent(kind, task, "k", "exclusive", 1, hostname=host, pid=pid, time=at, **extra)  # type: ignore[arg-type]
        )

    event("enter", "ended", "celery@c1", 8, 1.0)
    event("exit", "ended", "celery@c1", 8, 1.2, outcome="ok")
    event("enter", "inside", "celery@c1", 9, 1.1)
    event("enter", "elsewhere", "celery@c2", 8, 1.1)
    injector = DockerFaultInjector.__new__(DockerFaultInjector)
    injector._sections = OpenSections(redis_client, "dk")
    injector._recorder = recorder
    injector._record_container_deaths(Container("id1", "p_worker_1", "worker", "c1", True, False))
    killed = [(e.hostname, e.pid) for e in recorder.events() if e.kind == "killed"]
    assert killed == [("celery@c1", 8), ("celery@c1", 9)]


def test_a_whole_worker_kill_records_every_process_of_it_that_ran_a_section(
    redis_client: redis.Redis,
) -> None:
    """The local fleet's ``kill_held`` (``FaultInjector._kill_whole``) kills a worker's main
    process and pool at once: like a container kill it takes a pool process whose body had just
    ended too. Recording only the processes with a section open made a copy that ran such a
    body again count as completed twice (the every-fault run of ``.ci/run`` at 6b09b10: task
    fbcf6004's pool process released its lock 0.1 s before the kill). Processes of the same
    node name that the kill did not take (an earlier incarnation's) are not recorded."""
    recorder = SectionRecorder(redis_client, "kw")
    group = subprocess.Popen(["sleep", "60"], preexec_fn=lambda: os.setpgid(0, 0))
    child = subprocess.Popen(["sleep", "60"], preexec_fn=lambda: os.setpgid(0, group.pid))
    node = "prefork3-kw@host"

    def event(kind: str, task: str, pid: int, at: float, **extra: Any) -> None:
        recorder.record(
            SectionEvent(kind, task, "k", "exclusive", 1, hostname=node, pid=pid, time=at, **extra)  # type: ignore[arg-type]
        )

    event("enter", "earlier-incarnation", 7, 0.5)
    event("exit", "earlier-incarnation", 7, 0.6, outcome="ok")
    event("enter", "ended", child.pid, 1.0)
    event("exit", "ended", child.pid, 1.2, outcome="ok")
    worker = SimpleNamespace(
        nodename=node,
        pid=group.pid,
        spec=SimpleNamespace(pool="prefork", concurrency=2),
        process_ids=lambda: [group.pid, child.pid],
        kill=lambda: os.killpg(group.pid, signal.SIGKILL),
    )
    fleet = SimpleNamespace(
        restart=lambda _worker: None,
        settings=SimpleNamespace(broker_url="redis://x", visibility_timeout=6.0),
    )
    injector = FaultInjector.__new__(FaultInjector)
    injector._sections = OpenSections(redis_client, "kw")
    injector._recorder = recorder
    try:
        record = injector._kill_whole(fleet, worker, 1, planted=False)  # type: ignore[arg-type]
    finally:
        for process in (group, child):
            process.kill()
            process.wait()
    assert record.ran
    killed = [(e.hostname, e.pid) for e in recorder.events() if e.kind == "killed"]
    assert killed == [(node, child.pid)]
