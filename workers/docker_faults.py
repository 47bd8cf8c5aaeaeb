"""The fault kinds through Docker, for a fleet on Docker Compose (:mod:`workers.compose`).

:class:`DockerFaultInjector` is the :class:`~workers.faults.FaultInjector` of a compose run: the
same plan, the same targets (a worker inside a section, found from the run's records) and the
same records, with the fault made by Docker:

- ``kill``: ``docker kill`` of the holder's worker container, then ``docker start``; every
  process of it that entered a section is recorded as killed (its open sections end killed).
- ``pause``: ``docker pause`` of the holder's container (every process in it) until the server
  expired the holder's session, then ``docker unpause``; the sections open in it are recorded
  as paused (a forced loss, as with SIGSTOP).
- ``partition``: ``docker network disconnect`` of the holder's container from the project's
  ``coordination`` network (ZooKeeper only: Redis is on ``data``) until its session expired,
  then ``docker network connect``.
- ``leader``: ``docker kill`` of the ZooKeeper leader's container, then ``docker start`` once
  another node leads.
- ``quorum_loss``: ``docker kill`` of the ZooKeeper leader's container and another node's, so
  the third stops serving; ``docker start`` of both after the session timeout plus
  :data:`~workers.faults.QUORUM_LOSS_MARGIN` seconds, and the fault is over once a node leads.
- ``broker_restart``: ``docker kill`` and ``docker start`` of the broker's container (its
  append-only file, fsync always, keeps every message).
- ``expire`` works as in every run (through ZooKeeper). ``blackhole`` and ``follower_partition``
  need local processes and are recorded as not run.

A worker container found stopped between faults is started again (:meth:`revive`), its open
sections first recorded as killed.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Final

import redis

from celery_zklock.zk import four_letter
from workers.compose import WORKER_SERVICE, ZOO_SERVICES, ComposeProject, Container, docker
from workers.faults import (
    NOT_RECONNECTED,
    QUORUM_LOSS_MARGIN,
    FaultEnvironment,
    FaultInjector,
    _NotRun,
    _Target,
    _Unavailable,
    _wait_for,
)
from workers.record import FaultRecord

__all__ = ["DOCKER_FAULT_KINDS", "DockerFaultInjector"]

DOCKER_FAULT_KINDS: Final = (
    "kill",
    "pause",
    "partition",
    "leader",
    "quorum_loss",
    "broker_restart",
    "expire",
)
"""The kinds a compose run injects; the others are recorded as not run."""
COORDINATION_NETWORK: Final = "coordination"
SERVE_TIMEOUT: Final = 60.0


class DockerFaultInjector(FaultInjector):
    """A :class:`FaultInjector` whose faults go through Docker to ``compose``'s containers."""

    def __init__(
        self,
        env: FaultEnvironment,
        plan: Mapping[str, int],
        compose: ComposeProject,
        **kwargs: float,
    ) -> None:
        super().__init__(env, plan, **kwargs)  # type: ignore[arg-type]
        self.compose = compose

    # -- between faults -----------------------------------------------------------------
    def revive(self) -> None:
        """Start worker containers that stopped on their own, first recording their open
        sections as killed."""
        for container in self.compose.containers(WORKER_SERVICE):
            if not container.running:
                self._record_container_deaths(container, late=True)
                docker("start", container.id)

    def _record_container_deaths(self, container: Container, *, late: bool = False) -> None:
        """Record every process of ``container`` that entered a section in this run as killed
        (its open sections end killed); ``late``: the container was found stopped, not stopped
        by us just now. Not only those with a section open: one whose body had just ended may
        not have stored its result (the checker's ``died_before_its_ack``), as the holder a
        ``kill`` picks often has (its lock node goes at its release, after its body's end)."""
        now = time.time()
        for hostname, pid in self._sections.ran_sections(lambda host, _: _in(container, host)):
            self._recorder.record_kill(hostname, pid, now, late=late)

    def _open_in(self, container: Container) -> list[tuple[str, int]]:
        """(node name, pid) of every process with a section open in ``container``."""
        return sorted(
            {(e.hostname, e.pid) for e in self._sections.refresh() if _in(container, e.hostname)}
        )

    # -- targets ------------------------------------------------------------------------
    def _held_in_container(self) -> tuple[_Target, Container]:
        """A holder (see ``FaultInjector._holder``) and its worker container."""
        while True:
            target = self._holder(local=False)
            container = self.compose.worker_of(target.event.hostname)
            if container is not None and container.running and not container.paused:
                return target, container
            if self._stop.is_set():
                raise _NotRun("the run ended before a target was found")
            time.sleep(0.05)

    def _describe(self, target: _Target, container: Container) -> str:
        return f"{target.describe()} in container {container.name}"

    # -- the faults -----------------------------------------------------------------------
    def _kill(self) -> FaultRecord:
        target, container = self._held_in_container()
        described = self._describe(target, container)
        killed_at = time.time()
        docker("kill", container.id)
        self._record_container_deaths(container)
        started = time.monotonic()
        docker("start", container.id)
        detail = (
            f"docker kill of the worker container; docker start after "
            f"{time.monotonic() - started:.1f} s; its messages return after the broker's "
            "visibility timeout"
        )
        return FaultRecord("kill", killed_at, described, True, detail)

    def _pause(self) -> FaultRecord:
        while True:
            target, container = self._held_in_container()
            paused_at = time.time()
            started = time.monotonic()
            docker("pause", container.id)
            if self._still_holding(target):
                break
            docker("unpause", container.id)  # it let go before the pause landed: aim again
        held = self._open_in(container)
        for hostname, pid in held:  # stamped before the pause (see FaultInjector._pause)
            self._recorder.record_forced_loss(
                "paused", hostname, pid, paused_at, session_timeout=self.env.session_timeout
            )

        def unpause() -> None:
            docker("unpause", container.id, check=False)

        with self._undo_on_exit(unpause):
            expired_after = self._wait_node_gone(target.event.node, self._expiry_deadline())
        if expired_after is None:  # unpaused with its session: the pause excuses nothing
            for hostname, pid in held:
                self._recorder.record_survived(hostname, pid, time.time())
        paused = time.monotonic() - started
        detail = f"docker pause of the worker container for {paused:.1f} s" + (
            f" (the server expired the holder's session after {expired_after:.1f} s), then "
            "docker unpause"
            if expired_after is not None
            else ", unpaused before its session expired"
        )
        return FaultRecord("pause", paused_at, self._describe(target, container), True, detail)

    def _partition(self) -> FaultRecord:
        network = self.compose.network(COORDINATION_NETWORK)
        while True:
            target, container = self._held_in_container()
            cut_at = time.time()
            started = time.monotonic()
            docker("network", "disconnect", network, container.id)
            if self._still_holding(target):
                break
            docker("network", "connect", network, container.id)  # it let go first: aim again

        def heal() -> None:
            docker("network", "connect", network, container.id, check=False)

        with self._undo_on_exit(heal):
            expired_after = self._wait_node_gone(target.event.node, self._expiry_deadline())
        cut_for = time.monotonic() - started
        detail = f"docker network disconnect from {network} for {cut_for:.1f} s" + (
            f" (the server expired the session after {expired_after:.1f} s), then reconnected"
            if expired_after is not None
            else ", reconnected before the session expired"
        )
        return FaultRecord("partition", cut_at, self._describe(target, container), True, detail)

    def _leader(self) -> FaultRecord:
        self._under_load()
        leader = self._zoo_leader(timeout=SERVE_TIMEOUT)
        if leader is None:
            raise _NotRun(f"no ZooKeeper node led within {SERVE_TIMEOUT:g} s")
        container = self.compose.container(leader)
        killed_at = time.time()
        started = time.monotonic()
        docker("kill", container.id)

        def restart() -> None:
            docker("start", container.id, check=False)

        with self._undo_on_exit(restart):
            successor = self._zoo_leader(timeout=SERVE_TIMEOUT, besides=leader)
            elected = time.monotonic() - started
        if not _wait_for(lambda: self._zoo_mode(leader) is not None, SERVE_TIMEOUT, 0.2):
            raise _NotRun(f"{leader} killed, but not serving {SERVE_TIMEOUT:g} s after start")
        back = time.monotonic() - started
        detail = (
            f"docker kill of the leader's container; {successor or 'no node'} led after "
            f"{elected:.2f} s; {leader} started again and serving after {back:.2f} s"
        )
        return FaultRecord(
            "leader", killed_at, f"ZooKeeper {leader} ({container.name})", True, detail
        )

    def _quorum_loss(self) -> FaultRecord:
        self._under_load()
        leader = self._zoo_leader(timeout=SERVE_TIMEOUT)
        if leader is None:
            raise _NotRun(f"no ZooKeeper node led within {SERVE_TIMEOUT:g} s")
        followers = [service for service in ZOO_SERVICES if service != leader]
        down = [leader, self._rng.choice(followers)]
        (left,) = (service for service in followers if service not in down)
        containers = [self.compose.container(service) for service in down]
        outage = self.env.session_timeout + QUORUM_LOSS_MARGIN
        killed_at = time.time()
        started = time.monotonic()

        ids = [container.id for container in containers]

        def restart() -> None:
            docker("start", *ids, check=False)

        with self._undo_on_exit(restart):
            docker("kill", *ids)  # one command: both go at once, no election between
            served = _wait_for(lambda: self._zoo_mode(left) is None, outage, 0.1)
            no_quorum = time.monotonic() - started
            self._stop.wait(max(0.0, outage - no_quorum))
            kept_down = time.monotonic() - started
        successor = self._zoo_leader(timeout=SERVE_TIMEOUT)
        if successor is None:
            raise _NotRun(f"no ZooKeeper node led {SERVE_TIMEOUT:g} s after docker start")
        back = time.monotonic() - started
        ended = time.time()
        reconnected = self._wait_reconnected()
        stopped = (
            f"{left} stopped serving after {no_quorum:.2f} s"
            if served
            else f"{left} still served {no_quorum:.1f} s after"
        )
        detail = (
            f"docker kill of the leader's container and another node's; {stopped} (no "
            f"quorum); kept down {kept_down:.1f} s (session timeout "
            f"{self.env.session_timeout:g} s + {QUORUM_LOSS_MARGIN:g} s), then docker start; "
            f"{successor} led {back - kept_down:.2f} s later, {back:.1f} s after the kill"
            + ("" if reconnected else "; " + NOT_RECONNECTED)
        )
        described = f"ZooKeeper {' and '.join(down)} ({', '.join(c.name for c in containers)})"
        return FaultRecord("quorum_loss", killed_at, described, True, detail, ended)

    def _zoo_mode(self, service: str) -> str | None:
        """``leader``/``follower`` as ``service`` answers ``srvr``, or None."""
        answer = four_letter.ask("127.0.0.1", self.compose.port(service, 2181), "srvr", timeout=2.0)
        return four_letter.parse("srvr", answer or "").get("Mode")

    def _zoo_leader(self, timeout: float, besides: str = "") -> str | None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for service in ZOO_SERVICES:
                if service != besides and self._zoo_mode(service) == "leader":
                    return service
            time.sleep(0.1)
        return None

    def _broker_restart(self) -> FaultRecord:
        self._under_load()
        container = self.compose.container("redis")
        url = self.compose.broker_url()
        killed_at = time.time()
        started = time.monotonic()
        docker("kill", container.id)
        docker("start", container.id)
        client = redis.Redis.from_url(url, socket_timeout=1.0, socket_connect_timeout=1.0)
        try:
            answered = _wait_for(lambda: _pings(client), SERVE_TIMEOUT, 0.05)
        finally:
            client.close()
        down = time.monotonic() - started
        ended = time.time()
        if not answered:
            raise _NotRun(f"the broker did not answer {SERVE_TIMEOUT:g} s after docker start")
        detail = f"docker kill and docker start of the broker's container; down {down:.2f} s"
        return FaultRecord(
            "broker_restart", killed_at, f"broker Redis ({container.name})", True, detail, ended
        )

    def _blackhole(self) -> FaultRecord:
        raise _Unavailable("not injected through Docker (local runs only: a network namespace)")

    def _follower_partition(self) -> FaultRecord:
        raise _Unavailable("not injected through Docker (local runs only: iptables on the host)")

    def _stall_before_write(self) -> FaultRecord:
        raise _Unavailable("not injected through Docker (local runs only: a planted section)")


def _pings(client: redis.Redis) -> bool:
    try:
        return bool(client.ping())
    except redis.RedisError:
        return False


def _in(container: Container, hostname: str) -> bool:
    """Whether the worker named ``hostname`` (``name@host``) runs in ``container``."""
    return hostname.rpartition("@")[2] == container.hostname
