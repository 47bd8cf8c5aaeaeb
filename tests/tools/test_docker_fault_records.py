"""What the compose fleet's ``kill`` records (workers/docker_faults.py), read back from Redis."""

from __future__ import annotations

from typing import Any

import redis

from workers.compose import Container
from workers.docker_faults import DockerFaultInjector
from workers.faults import OpenSections
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
