"""Lease safety on real ZooKeeper: a holder learns that its lease is lost BEFORE anyone else is
granted the lock (issue 10, Acceptance, first bullet).

Each scenario runs 20 trials. A trial: the holder acquires ``Mutex(holder_client, path)`` and
registers ``lease.on_lost``; a waiter (another client) blocks on ``Mutex(waiter_client,
path).acquire()``; then the holder is cut off silently (a black-hole proxy, or its ZooKeeper
member cut off from the leader). Both moments are taken with ``time.monotonic()`` in this one
process: ``margin = granted_at - lost_at`` must be > 0 in every trial, and the waiter must not be
granted before the holder's ``lease.valid_for``, read at the cut, ran out. A trial whose waiter is
never granted, or whose holder is never told, within 30 s of the cut fails.

Scenarios:

* a. standalone server, T = 4 s, the holder reaches ZooKeeper through a black-hole proxy and is
  idle otherwise;
* b. as a, and another thread sends one request on the holder's client every T/4 throughout;
* c. the holder asks for 20 s, the server caps sessions at 4 s, and the holder's client is
  started before the first ``Mutex`` object exists;
* e. as a, but the holder's client held and released another lock just before: its lease clock's
  renewer is lingering idle when the trial's lease is granted (a worker between two tasks);
* d. 3-member ensemble (tick 1 s, syncLimit 5), T = 2 s, the holder connected only to a
  follower, the waiter to the leader; the follower is cut off from the other members while
  the holder-follower link stays up;
* f. as a, on a ``Semaphore`` of 2 leases: the holder takes one, a companion on the waiter's
  client the other, and the waiter queues for a lease (docs/semaphore.md: never more than N).

Black-hole trials run concurrently, each cutting at a random moment after its acquire; in d,
rounds of a few holders share one cut, made at a random moment, with holders started at random
moments before it. So the cut falls at every phase of the clients' ping and renewal cycles and
of the servers' ticks. Only the public API is used: ``Mutex``,
``Lease.on_lost``, ``Lease.lost`` and ``Lease.valid_for``.
"""

from __future__ import annotations

import functools
import random
import statistics
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest
from kazoo.client import KazooClient

from celery_zklock import Lease, Mutex, Semaphore
from celery_zklock.testing.plugin import StackFactory
from celery_zklock.testing.proxy import TcpProxy
from celery_zklock.testing.zookeeper import ZooKeeperEnsemble, partition_unavailable_reason

TRIALS = 20
MAX_TRIALS = 80
"""Void trials (setup failed, lease lost before the cut) are run again, up to this many in all.
The follower case once saw 21 of 40 trials void at double load: the holder counted its lease lost
before the cut, the safe way to be wrong. Most of those were the partition rig's bug (another
run's cuts reached this ensemble's members, fixed in 65d0cc4); since then 0 per run."""
BATCH = 20
"""Black-hole trials run at the same time (each its own proxy, clients and lock path)."""
ROUND = 4
"""Follower trials per cut of the follower (each its own clients and lock path): the server's
timers (the follower's sync limit, the leader's session expiry ticks) are shared by a round,
so rounds are small to sample their phases too."""
EVENT_BOUND = 30.0
"""Seconds after the cut within which the grant and the holder's loss notice must both come."""
SETUP_BOUND = 15.0
LOCK_PARENT = "/lease-safety"


@dataclass
class Outcome:
    """What one trial saw; times are ``time.monotonic()`` of this process."""

    index: int
    cut_at: float | None = None
    held_until: float | None = None
    """When the holder's lease would run out by ``Lease.valid_for`` read at the cut."""
    lost_at: float | None = None
    granted_at: float | None = None
    error: str | None = None
    void: str | None = None
    """Why the trial measured nothing and is run again: its setup failed, or its lease was
    already lost (spuriously, as a loaded machine can make it) before the cut."""

    @property
    def margin(self) -> float | None:
        """Seconds by which the holder knew before the waiter was granted (> 0 is safe)."""
        if self.lost_at is None or self.granted_at is None:
            return None
        return self.granted_at - self.lost_at

    def problem(self) -> str | None:
        """Why this trial has no valid margin, or None (a void trial has no problem)."""
        if self.void is not None:
            return None
        if self.error is not None:
            return self.error
        if self.cut_at is None:
            return "never cut"
        if self.granted_at is None:
            return f"the waiter was not granted within {EVENT_BOUND:.0f} s of the cut"
        if self.lost_at is None:
            return (
                f"the holder was never told that its lease was lost (waited {EVENT_BOUND:.0f} s "
                f"after the cut; the waiter was granted {self.granted_at - self.cut_at:.2f} s "
                "after the cut)"
            )
        if self.granted_at < self.cut_at:
            return f"the waiter was granted {self.cut_at - self.granted_at:.2f} s before the cut"
        if self.held_until is not None and self.granted_at < self.held_until:
            return (
                f"the waiter was granted {self.held_until - self.granted_at:.3f} s before the "
                "holder's Lease.valid_for, read at the cut, ran out"
            )
        return None


def _start_client(hosts: str, timeout: float) -> KazooClient:
    client = KazooClient(hosts=hosts, timeout=timeout)
    try:
        client.start(timeout=SETUP_BOUND)
    except Exception:
        client.close()
        raise
    return client


def _stop_client(client: KazooClient | None) -> None:
    if client is not None:
        client.stop()
        client.close()


class Trial:
    """One holder and one waiter on a lock path of their own.

    :meth:`prepare` connects the holder (its client started before its first ``Mutex``),
    acquires, registers ``on_lost``, connects the waiter and returns once the waiter's node is
    queued behind the holder's. :meth:`cut` records the cut time (the caller cuts);
    :meth:`wait` waits for the grant and the loss notice; :meth:`close` releases everything.
    """

    def __init__(
        self,
        index: int,
        *,
        holder_hosts: str,
        waiter_hosts: str,
        holder_timeout: float,
        traffic_every: float | None = None,
        warm: bool = False,
        permits: int | None = None,
    ) -> None:
        self.outcome = Outcome(index)
        self.warm = warm
        self.permits = permits  # None: a Mutex; else a Semaphore of that many leases
        self.path = f"{LOCK_PARENT}/trial-{index}-{random.getrandbits(32):08x}"
        self.holder_hosts = holder_hosts
        self.waiter_hosts = waiter_hosts
        self.holder_timeout = holder_timeout
        self.traffic_every = traffic_every
        self.holder: KazooClient | None = None
        self.waiter: KazooClient | None = None
        self.lease: Lease | None = None
        self._lost = threading.Event()
        self._granted = threading.Event()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []

    def _lock(self, client: KazooClient) -> Mutex:
        if self.permits is None:
            return Mutex(client, self.path)
        return Semaphore(client, self.path, max_leases=self.permits)

    def _on_lost(self, *_reason: object) -> None:
        if self.outcome.lost_at is None:
            self.outcome.lost_at = time.monotonic()
        self._lost.set()

    def prepare(self) -> None:
        self.holder = _start_client(self.holder_hosts, self.holder_timeout)
        if self.warm:  # the renewer, started by this lease, lingers after its release
            Mutex(self.holder, f"{self.path}-before").acquire(timeout=SETUP_BOUND).release()
        self.lease = self._lock(self.holder).acquire(timeout=SETUP_BOUND)
        self.lease.on_lost(self._on_lost)
        self.waiter = _start_client(self.waiter_hosts, 10.0)
        waiter = self.waiter
        for _ in range((self.permits or 1) - 1):  # the other leases, held until the close
            self._lock(waiter).acquire(timeout=SETUP_BOUND)
        queued = (self.permits or 1) + 1
        waiting = threading.Thread(
            target=self._wait_for_grant, args=(waiter,), name="waiter", daemon=True
        )
        waiting.start()
        self._threads.append(waiting)
        deadline = time.monotonic() + SETUP_BOUND
        while len(waiter.get_children(self.path)) < queued:
            if time.monotonic() >= deadline or self._granted.is_set():
                raise AssertionError(
                    f"trial {self.outcome.index}: the waiter did not queue behind the holder"
                )
            time.sleep(0.01)
        if self.traffic_every is not None:
            traffic = threading.Thread(target=self._traffic, name="traffic", daemon=True)
            traffic.start()
            self._threads.append(traffic)
        assert not self.lease.lost, f"trial {self.outcome.index}: lease lost before the cut"

    def _wait_for_grant(self, client: KazooClient) -> None:
        try:
            self._lock(client).acquire(timeout=SETUP_BOUND + 2 * EVENT_BOUND)
        except Exception as exc:  # reported as the trial's error
            if not self._stop.is_set():
                self.outcome.error = f"the waiter's acquire failed: {exc!r}"
        else:
            self.outcome.granted_at = time.monotonic()
        finally:
            self._granted.set()

    def _traffic(self) -> None:
        """One request on the holder's client every ``traffic_every`` s, never waiting on it."""
        assert self.holder is not None and self.traffic_every is not None
        while not self._stop.wait(self.traffic_every):
            try:
                self.holder.exists_async("/")
            except Exception as exc:  # the client was closed under us: the trial is over
                if not self._stop.is_set():
                    self.outcome.error = f"the holder's traffic failed: {exc!r}"
                return

    def cut(self, at: float) -> None:
        """Record the cut, and until when the holder's lease says it holds (``valid_for``)."""
        assert self.lease is not None
        self.outcome.cut_at = at
        self.outcome.held_until = time.monotonic() + self.lease.valid_for

    def wait(self) -> None:
        """Wait for the grant and the loss notice, each at most EVENT_BOUND s after the cut."""
        assert self.outcome.cut_at is not None
        deadline = self.outcome.cut_at + EVENT_BOUND
        for event in (self._granted, self._lost):
            event.wait(max(0.0, deadline - time.monotonic()))

    def close(self) -> None:
        self._stop.set()
        for thread in self._threads:
            if thread.name == "traffic":
                thread.join(10)
        _stop_client(self.holder)
        _stop_client(self.waiter)  # ends a waiter still blocked in acquire
        for thread in self._threads:
            thread.join(10)


def _run(name: str, trials: list[Trial], body: Callable[[Trial], None]) -> None:
    """Run ``body`` for every trial, BATCH at a time, each in its own thread; close each."""

    def one(trial: Trial) -> None:
        outcome = trial.outcome
        try:
            body(trial)
        except Exception as exc:
            failure = f"{type(exc).__name__}: {exc}"
            if outcome.cut_at is None:
                outcome.void = f"setup failed: {failure}"
            else:
                outcome.error = outcome.error or failure
        finally:
            trial.close()
        lost_at, cut_at = outcome.lost_at, outcome.cut_at
        if lost_at is not None and cut_at is not None and lost_at < cut_at:
            outcome.void = f"lease lost {cut_at - lost_at:.2f} s before the cut"

    for start in range(0, len(trials), BATCH):
        threads = [
            threading.Thread(target=one, args=(trial,), name=f"{name}-{trial.outcome.index}")
            for trial in trials[start : start + BATCH]
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(SETUP_BOUND + 2 * EVENT_BOUND + 30)
            assert not thread.is_alive(), f"{thread.name} did not finish"


def valid(outcomes: list[Outcome]) -> int:
    """How many trials measured a margin."""
    return sum(o.void is None and o.problem() is None for o in outcomes)


def _report(name: str, outcomes: list[Outcome], capsys: pytest.CaptureFixture[str]) -> None:
    """Print every margin and a summary line; fail unless TRIALS trials have a margin and every
    margin is > 0. Void trials (run again) are listed and counted, never failed."""
    margins = [
        o.margin
        for o in outcomes
        if o.void is None and o.problem() is None and o.margin is not None
    ]
    voids = [o for o in outcomes if o.void is not None]
    for o in outcomes:
        detail = f"void, run again: {o.void}" if o.void is not None else o.problem()
        if detail is None:
            assert o.cut_at is not None and o.lost_at is not None and o.granted_at is not None
            detail = (
                f"lost {o.lost_at - o.cut_at:.3f} s, granted {o.granted_at - o.cut_at:.3f} s "
                f"after the cut: margin {o.margin:+.3f} s"
            )
        print(f"  [{name}] trial {o.index:2d}: {detail}")
    if margins:
        summary = (
            f"lease safety {name}: margin (grant - holder told) over {len(margins)}/"
            f"{len(outcomes)} trials: min {min(margins):+.3f} s, median "
            f"{statistics.median(margins):+.3f} s, max {max(margins):+.3f} s; "
            f"{sum(m > 0 for m in margins)} > 0; {len(voids)} void"
        )
    else:
        summary = f"lease safety {name}: no trial produced a margin"
    print(summary)
    with capsys.disabled():  # the summary is visible without -s too
        print(f"\n{summary}")
    problems = [f"trial {o.index}: {o.problem()}" for o in outcomes if o.problem() is not None]
    unsafe = [m for m in margins if m <= 0]
    short = [f"only {len(margins)} of {TRIALS} trials measured a margin"]
    assert not problems and not unsafe and len(margins) >= TRIALS, (
        f"{summary}\n"
        + ("\n".join(short) + "\n" if len(margins) < TRIALS else "")
        + (f"{len(unsafe)} trial(s) granted the lock before the holder knew\n" if unsafe else "")
        + "\n".join(problems)
    )


def _blackhole_scenario(
    name: str,
    zk_stack_factory: StackFactory,
    capsys: pytest.CaptureFixture[str],
    *,
    requested_timeout: float,
    session_timeout: float,
    traffic_every: float | None = None,
    max_session_timeout_ms: int = 60_000,
    warm: bool = False,
    permits: int | None = None,
) -> None:
    """Trials whose holder reaches a standalone server through a proxy that turns silent.

    ``session_timeout`` is the T the server grants (used only to spread the cut moments).
    """
    server = zk_stack_factory.server(max_session_timeout_ms=max_session_timeout_ms)
    outcomes: list[Outcome] = []
    while valid(outcomes) < TRIALS and len(outcomes) < MAX_TRIALS:
        first = len(outcomes)
        count = min(TRIALS - valid(outcomes), MAX_TRIALS - first)
        outcomes += _blackhole_round(
            name, server, range(first, first + count), requested_timeout, session_timeout,
            traffic_every, warm, permits,
        )  # fmt: skip
    _report(name, outcomes, capsys)


def _blackhole_round(
    name: str,
    server: Any,
    indices: range,
    requested_timeout: float,
    session_timeout: float,
    traffic_every: float | None,
    warm: bool,
    permits: int | None = None,
) -> list[Outcome]:
    """One round of concurrent black-hole trials; their outcomes."""
    proxies = {index: TcpProxy("127.0.0.1", server.port).start() for index in indices}
    trials = [
        Trial(
            index,
            holder_hosts=proxy.address,
            waiter_hosts=server.hosts,
            holder_timeout=requested_timeout,
            traffic_every=traffic_every,
            warm=warm,
            permits=permits,
        )
        for index, proxy in proxies.items()
    ]

    def body(trial: Trial) -> None:
        proxy = proxies[trial.outcome.index]
        try:
            trial.prepare()
            # Cut at a random moment of the holder's ping and renewal cycles.
            time.sleep(random.uniform(0.2, 0.2 + session_timeout))
            trial.cut(time.monotonic())
            proxy.blackhole = True
            trial.wait()
        finally:
            proxy.stop()  # before the clients stop: their goodbyes go nowhere

    try:
        _run(name, trials, body)
    finally:
        for proxy in proxies.values():
            proxy.stop()
    return [trial.outcome for trial in trials]


@pytest.mark.slow
def test_a_idle_holder_behind_black_hole(
    zk_stack_factory: StackFactory, capsys: pytest.CaptureFixture[str]
) -> None:
    """a: T = 4 s, holder idle, silent partition: told before the waiter is granted."""
    _blackhole_scenario(
        "a-idle", zk_stack_factory, capsys, requested_timeout=4.0, session_timeout=4.0
    )


@pytest.mark.slow
def test_e_holder_granted_while_its_renewer_lingers_idle(
    zk_stack_factory: StackFactory, capsys: pytest.CaptureFixture[str]
) -> None:
    """e: as a, the lease granted while the client's renewer lingers after an earlier lease
    (it is not woken for the grant; it must still renew, and tell the loss, in time)."""
    _blackhole_scenario(
        "e-warm", zk_stack_factory, capsys, requested_timeout=4.0, session_timeout=4.0, warm=True
    )


@pytest.mark.slow
def test_f_semaphore_holder_behind_black_hole(
    zk_stack_factory: StackFactory, capsys: pytest.CaptureFixture[str]
) -> None:
    """f: as a, one of a Semaphore's 2 leases cut off: the waiter for a lease is granted only
    after that holder was told (never 3 holders of 2 leases)."""
    _blackhole_scenario(
        "f-semaphore", zk_stack_factory, capsys, requested_timeout=4.0, session_timeout=4.0,
        permits=2,
    )  # fmt: skip


@pytest.mark.slow
def test_b_holder_with_traffic_behind_black_hole(
    zk_stack_factory: StackFactory, capsys: pytest.CaptureFixture[str]
) -> None:
    """b: as a, with one request on the holder's client every T/4 from another thread."""
    _blackhole_scenario(
        "b-traffic",
        zk_stack_factory,
        capsys,
        requested_timeout=4.0,
        session_timeout=4.0,
        traffic_every=1.0,
    )


@pytest.mark.slow
def test_c_capped_session_client_started_first(
    zk_stack_factory: StackFactory, capsys: pytest.CaptureFixture[str]
) -> None:
    """c: 20 s asked, 4 s granted by the server, client started before the first Mutex."""
    _blackhole_scenario(
        "c-capped",
        zk_stack_factory,
        capsys,
        requested_timeout=20.0,
        session_timeout=4.0,
        max_session_timeout_ms=4000,
    )


def _follower_trial(
    trial: Trial, *, ready: threading.Barrier, cut: threading.Event, session_timeout: float
) -> None:
    """One holder of a follower round: start at a random moment, then wait for the cut."""
    time.sleep(random.uniform(0.0, session_timeout))
    try:
        trial.prepare()
    except Exception as exc:
        trial.outcome.void = f"setup failed: {type(exc).__name__}: {exc}"
    finally:
        ready.wait(SETUP_BOUND + session_timeout + 5)
    if trial.outcome.void is not None:
        return
    if not cut.wait(SETUP_BOUND + session_timeout + 10):
        raise AssertionError("the round was never cut")
    trial.wait()


@pytest.fixture
def follower_ensemble(zk_stack_factory: StackFactory) -> Iterator[ZooKeeperEnsemble]:
    reason = partition_unavailable_reason()
    if reason is not None:
        pytest.skip(f"cannot cut a ZooKeeper member off here: {reason}")
    yield zk_stack_factory.ensemble(
        3, tick_time_ms=1000, sync_limit_ticks=5, init_limit_ticks=5, isolatable=True
    )


@pytest.mark.slow
@pytest.mark.ensemble
@pytest.mark.timeout(900)  # rounds of void trials run again under load
def test_d_holder_on_follower_cut_off_from_leader(
    follower_ensemble: ZooKeeperEnsemble, capsys: pytest.CaptureFixture[str]
) -> None:
    """d: T = 2 s on a follower whose link to the leader is cut (tick 1 s, syncLimit 5)."""
    ensemble = follower_ensemble
    session_timeout = 2.0
    trials: list[Trial] = []
    while valid([t.outcome for t in trials]) < TRIALS and len(trials) < MAX_TRIALS:
        start = len(trials)
        leader = ensemble.leader()
        follower = next(n for n in ensemble.nodes if n.myid != leader)
        batch = [
            Trial(
                index,
                holder_hosts=f"127.0.0.1:{follower.port}",
                waiter_hosts=f"127.0.0.1:{ensemble.node(leader).port}",
                holder_timeout=session_timeout,
            )
            for index in range(start, start + ROUND)
        ]
        trials += batch
        ready = threading.Barrier(len(batch) + 1)
        cut = threading.Event()
        body = functools.partial(
            _follower_trial, ready=ready, cut=cut, session_timeout=session_timeout
        )
        runner = threading.Thread(target=_run, args=("d-follower", batch, body))
        runner.start()
        try:
            ready.wait(SETUP_BOUND + session_timeout + 10)
            time.sleep(random.uniform(0.0, session_timeout))
            cut_at = time.monotonic()
            for trial in batch:
                trial.cut(cut_at)
            ensemble.isolate(follower.myid)
            cut.set()
            runner.join(SETUP_BOUND + 2 * EVENT_BOUND + 60)
        finally:
            cut.set()
            ensemble.heal(follower.myid)
        assert not runner.is_alive(), "a round of trials did not finish"
        ensemble.wait_serving(60)
    _report("d-follower", [trial.outcome for trial in trials], capsys)
