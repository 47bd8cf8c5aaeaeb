"""One locked run of a ``ZkLockTask``: acquire under the policy, hold while the body runs, release.

:class:`LockedRun` works out the call's options, lock path, lock side and identity once, then:

1. **acquire**: a try-lock; when busy, the task's busy policy (:mod:`celery_zklock.task.policy`),
   after :mod:`celery_zklock.task.delivery` has looked for another delivery of this very task in the
   queue. ZooKeeper failing on the way is the ``unavailable`` situation, never a busy lock.
2. **hold**: from the moment acquire returns a lease, a ``finally`` releases it. The lease is
   announced, the body's interruption armed (:mod:`celery_zklock.task.interrupt`), and the body runs
   with ``task.lock`` set - unless the lease was already lost.
3. **release**, then the verdict: a lease lost at any point between grant and release (the body
   interrupted, never started, or already returned) ends the run under ``lock_on_lost``, never
   SUCCESS.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any, Final, NoReturn

from celery.exceptions import Retry
from kazoo.client import KazooClient
from kazoo.exceptions import KazooException

from celery_zklock.errors import (
    ConfigurationError,
    LockLost,
    LockTimeout,
    LossCode,
    RateLimited,
    ZooKeeperUnavailable,
)
from celery_zklock.locks import Lease, MultiLock, Mutex
from celery_zklock.locks.contenders import READ, WRITE, Contender, first_blocker, holding
from celery_zklock.locks.context import context_for
from celery_zklock.locks.holders import request_break
from celery_zklock.locks.identity import identity as node_identity
from celery_zklock.locks.lease import HeldLease
from celery_zklock.locks.rate import RATE_NODE, RateLimit
from celery_zklock.task import canvas, debounce, delivery, replace, sendback, visibility
from celery_zklock.task.dedupe import release as release_marker
from celery_zklock.task.events import emit
from celery_zklock.task.generation import is_newer, of_request
from celery_zklock.task.interrupt import STOPPING, Interruption, arm
from celery_zklock.task.metrics import count_outcome, count_rate
from celery_zklock.task.options import (
    BEHIND_ITSELF_FIELD,
    PATHS_JOINED_BY,
    RECEIPT_FIELD,
    LockOptions,
    TaskLockSpec,
    received_at,
    request_overrides,
)
from celery_zklock.task.policy import Situation, decide, skip_result
from celery_zklock.zk.calls import Deadline
from celery_zklock.zk.client import get_client
from celery_zklock.zk.settings import settings_of

QUEUE_READ_TIMEOUT: Final = 5.0
"""Seconds ZooKeeper may take to answer a look at the lock's queue (else: unavailable)."""

PREEMPTED: Final = "preempted by a newer call (lock_on_busy='preempt')"
"""The reason a preempted holder's ``LockLost`` gives, after the preempting task's name."""
LOST_TELL_WAIT: Final = 5.0
"""Longest wait, at the end of an interrupted body, for the ``lost`` event to be told."""
CONNECTED_PATIENCE: Final = 1.0
"""Seconds a run waits for its process's client to connect again before ZooKeeper counts as
unreachable (the client reconnects within about a second of ZooKeeper answering)."""
MAX_LOOKS: Final = 3
"""Try-locks a busy run makes while the holder keeps going before it can be named."""

held_leases = threading.local()
"""Per thread (or greenlet), ``stack``: the leases of the locked bodies running there, the
innermost last (the one ``ZkLockTask.lock`` gives)."""


def fence_of(lease: HeldLease) -> int | tuple[int, ...]:
    """The fencing token a run's events name: the lease's, or for several keys each path's, in
    the order of the paths (the order of ``LockedRun.path``)."""
    tokens = tuple(lease.tokens.values())
    return tokens if len(tokens) > 1 else tokens[0]


def loss_code(lease: HeldLease) -> LossCode | None:
    """Why ``lease`` was lost, as the run tells it: the lease's code, except that a break
    asked by a newer ``preempt`` call (:data:`PREEMPTED` in its reason) is ``PREEMPTED``."""
    code = lease.lost_code
    if code is LossCode.BROKEN and PREEMPTED in (lease.lost_reason or ""):
        return LossCode.PREEMPTED
    return code


def holder_in_the_way(queue: list[Contender], side: Mutex | MultiLock) -> Contender | None:
    """The contender a busy run names as the holder, None when the lock looks free: the first
    in the way of a new acquire (:func:`~celery_zklock.locks.contenders.first_blocker`), a
    semaphore's run looking as a reader does (at the first writer: its queue's head)."""
    return first_blocker(queue, WRITE if side.kind == "write" else READ)


class LockedRun:
    """One call of a locked task; see the module docstring. Use once: :meth:`run`."""

    def __init__(self, task: Any, spec: TaskLockSpec, args: Any, kwargs: Any):
        request = task.request
        self.task = task
        self.request = request  # read once: each task.request is a lookup in a local stack
        self.settings = settings_of(task.app)
        self.options: LockOptions = spec.for_call(request_overrides(request))
        self.paths = spec.paths(self.settings.root, args, kwargs, request)  # or the gate's
        self.path = PATHS_JOINED_BY.join(self.paths)  # for messages: the one path, or all
        self.kind = spec.kind  # the mode's, on each path (the mode is never per call)
        self.task_id = request.id
        self.generation = of_request(request, run=True)  # see celery_zklock.task.generation
        self.in_worker = not (request.called_directly or request.is_eager)
        self.lease: HeldLease | None = None
        self.started = time.monotonic()
        self.granted_at: float | None = None
        self.fence: int | tuple[int, ...] = 0  # once granted: the lease's, for its events
        self.lost_told = False
        self.lost_told_event: threading.Event | None = None

    def run(self, body: Callable[[], Any]) -> Any:
        """Acquire, run ``body`` holding the lock, release; the task's result or a skip result.

        With ``dedupe``, the call's marker goes when the run starts (``queued``) or when it ends
        any way but a retry (``running``): see :mod:`celery_zklock.task.dedupe`."""
        client = self._client()
        dedupe = self.options.dedupe
        if dedupe == "queued":
            self._remove_marker(client, starting=True)
        keep_marker = False
        try:
            return self._run(client, body)
        except Retry:
            keep_marker = True  # the retry's message carries this task id: the marker is its own
            raise
        except delivery.DuplicateDelivery:
            keep_marker = True  # the marker names this task id, but the original's run owns it
            raise
        except sendback.SentBack:
            keep_marker = True  # the message sent back carries this task id: the marker is its
            raise
        finally:
            if dedupe == "running" and not keep_marker:
                self._remove_marker(client, starting=False)

    def _remove_marker(self, client: KazooClient, starting: bool) -> None:
        """Remove the call's dedupe marker. ZooKeeper failing: before the body (``queued``) the
        ``unavailable`` retry, as for the acquire; after it (``running``) a warning event only,
        as the run's outcome stands and the marker stops counting once its state is final (see
        :mod:`celery_zklock.task.dedupe`)."""
        try:
            release_marker(client, self.path, self.task_id)
        except (ZooKeeperUnavailable, KazooException) as exc:
            if starting:
                self._unavailable(
                    f"ZooKeeper failed while removing the dedupe marker of lock {self.path}: "
                    f"{exc!r}",
                    exc,
                )
            self._log("marker-left", self.path, error=repr(exc))

    def _run(self, client: KazooClient, body: Callable[[], Any]) -> Any:
        """Acquire on the lock side this run contends on (the lock kind of its mode, see
        :func:`~celery_zklock.locks.contenders.lock_kind`, on its path or on each of its paths),
        hold, release, then the verdict on a lease lost meanwhile; ZooKeeper failing while
        acquiring is the ``unavailable`` situation."""
        side = (
            MultiLock(client, self.paths, kind=self.kind)
            if len(self.paths) > 1
            else Mutex(client, self.path, kind=self.kind)
        )
        if self.options.debounce is not None and self.in_worker and not self.request.retries:
            debounced = debounce.before_lock(self, client)  # or sent back to wait its window
            if debounced is not None:
                return debounced
        try:
            try:
                skipped = self._acquire(client, side)
            except (ZooKeeperUnavailable, KazooException) as exc:
                self._unavailable(f"ZooKeeper failed while acquiring lock {self.path}: {exc}", exc)
            lease = self.lease  # from the moment acquire returned it, the finally releases it
            if lease is None:
                return skipped
            if self.options.rate is not None and (refused := self._admit(client)) is not None:
                return refused
            self.granted_at, self.fence = time.monotonic(), fence_of(lease)
            if self.in_worker:
                visibility.started(self.task)
            result = self._hold(lease, body)
        finally:
            self._release()
        if lease.lost:
            self._apply(
                "preempted" if loss_code(lease) is LossCode.PREEMPTED else "lost",
                self.options.on_lost,
                f"task {self.task.name!r} [{self.task_id}]: lock {self.path} (token "
                f"{self.fence}) was lost while the task ran: {lease.lost_reason}",
                code=loss_code(lease),
            )
        return result

    # -- situations -----------------------------------------------------------------------
    def _apply(
        self,
        situation: Situation,
        policy: str,
        message: str,
        holder: Any = None,
        cause: BaseException | None = None,
        code: LossCode | None = None,
    ) -> Any:
        """Act on ``situation`` under ``policy``: a skip result, None for ``wait``, or raise
        (a ``LockLost`` carries the lease's loss ``code``)."""
        verdict = decide(situation, policy, in_worker=self.in_worker)
        if verdict.action == "skip":
            visibility.skipped(self.task, self.path, holder, situation)
            skipped = skip_result(self.path, holder, situation)
            canvas.stop_after_skip(self.task, self.request, skipped)
            return skipped
        if verdict.action == "wait":
            return None
        assert verdict.error is not None
        error = verdict.error(message)
        if isinstance(error, LockLost):
            error.code = code
        if verdict.action == "retry":
            raise self.task.retry(exc=error, countdown=self.options.retry_countdown) from cause
        raise error from cause

    def _unavailable(self, message: str, cause: BaseException) -> NoReturn:
        """ZooKeeper cannot be reached: with ``lock_on_unavailable="wait"`` in a worker, and the
        outage budget not spent, the call is sent back to ride the outage out at a gate
        (:func:`celery_zklock.task.sendback.ride_out`); else the ``unavailable`` policy applies."""
        policy: str = self.options.on_unavailable
        if policy == "wait" and self.in_worker:
            now = time.time()
            since = sendback.unavailable_since(self.request) or now
            if now - since < self.settings.gate.outage_budget:
                self._log("sent-back", self.path, unavailable_for=round(now - since, 1))
                due = received_at(self.request)
                raise sendback.ride_out(self.task, self.request, since, due) from cause
        if policy == "wait":
            policy = "retry"  # the budget is spent (or no worker): as without riding out
        self._apply("unavailable", policy, f"task {self.task.name!r}: {message}", cause=cause)
        raise AssertionError("unreachable: the unavailable verdict always raises")

    def _client(self) -> KazooClient:
        config = self.settings.client
        try:
            client = get_client(config)
        except ConfigurationError:
            raise  # a setting to fix (TLS, the client factory): retrying cannot help
        except STOPPING:
            raise  # its soft time limit landed while connecting: fail at the limit, no retry
        except Exception as exc:
            self._unavailable(
                f"could not connect to ZooKeeper at {config.hosts!r} within "
                f"{config.connect_timeout}s ({exc!r}); check zklock_hosts / ZKLOCK_HOSTS",
                exc,
            )
        # A process's client that lost its connection: give the pool slot back soon rather
        # than wait in it for requests kazoo queues until it connects again.
        if not client.connected:
            try:
                what = f"waiting {CONNECTED_PATIENCE:g}s for a connection to {config.hosts!r}"
                context_for(client).await_connected(Deadline(CONNECTED_PATIENCE), what)
            except ZooKeeperUnavailable as exc:
                self._unavailable(str(exc), exc)
        return client

    # -- acquire --------------------------------------------------------------------------
    def _acquire(self, client: KazooClient, side: Mutex | MultiLock) -> Any:
        """Take the lock into ``self.lease`` under the busy policy; else return a skip result."""
        task, request = self.task, self.request
        identity = node_identity(task, request, self.generation)
        retries = request.retries or 0
        # A message handed out again, or held at a gate behind a run of its own task id (a
        # resend), may be a copy of a run that already finished.
        settled = not (request.delivery_info or {}).get("redelivered") and not getattr(
            request, BEHIND_ITSELF_FIELD, False
        )
        looks, looked = 0, False  # looked: for a final state before a busy policy
        while True:
            self.lease = side.acquire(blocking=False, data=identity)
            path = side.path  # for several keys: the one whose lock was busy
            if self.lease is None:
                queue = delivery.read_queue(client, path, QUEUE_READ_TIMEOUT)
                own = delivery.first_of_task(queue, self.task_id)
                if own is not None and own.retries >= retries:
                    settled = delivery.await_original(task, client, side, path, own, self._log)
                    continue
                looks += 1
                if holder_in_the_way(queue, side) is None and looks < MAX_LOOKS:
                    continue  # the holder went between our try and our look: try again
                # A copy of a call that ended meets another call's hold: it ends as a copy,
                # before its busy policy writes a state of its own over the final one.
                self._ignore_if_finished(settled, bool(retries))
                looked = looked or not settled
                skipped = self._when_busy(client, side, queue, identity, own is not None)
                if self.lease is None:
                    return skipped
            elif side.kind != "write":  # granted beside other holders: is one of them ours?
                assert isinstance(self.lease, Lease)  # several keys are taken for writing
                ours = self.lease.node.rsplit("/", 1)[1]
                ahead = delivery.read_queue(client, path, QUEUE_READ_TIMEOUT, before=ours)
                original = delivery.first_of_task(ahead, self.task_id)
                if original is not None and original.retries >= retries:
                    self.lease.release()  # never beside the original
                    self.lease = None
                    settled = delivery.await_original(task, client, side, path, original, self._log)
                    continue
            self._ignore_if_finished(settled or looked, bool(retries) or looked)
            return None

    def _ignore_if_finished(self, settled: bool, look_once: bool) -> None:
        """End the run as a copy (:class:`~celery_zklock.task.delivery.DuplicateDelivery`) if
        its call has a final state: looked for (up to 2 s) unless ``settled`` (a first delivery
        not held behind a run of its own task id); else looked at once if a copy may have ended
        the call meanwhile: with ``look_once`` (a retry, or a run that looked before its busy
        policy), for a message that reached its worker longer ago than the broker's redelivery
        bound (the worker's receipt, :data:`~celery_zklock.task.options.RECEIPT_FIELD`: the
        broker may have handed out a copy meanwhile), or one sent back
        (:mod:`celery_zklock.task.sendback`: to ride an outage out, or to wait for its rate
        window), published before the run that sent it was acknowledged, which a worker dying
        between the two leaves behind."""
        if not settled:
            delivery.ignore_if_finished(self.task, self.path, self._log)
            return
        request = self.request
        received = getattr(request, RECEIPT_FIELD, None)
        if (
            look_once
            or (
                isinstance(received, (int, float))
                and time.time() - received > self.settings.redelivery_timeout
            )
            or sendback.unavailable_since(request) is not None
            or sendback.first_due(request) is not None
        ):
            delivery.ignore_if_finished(self.task, self.path, self._log, settle=0.0)

    def _when_busy(
        self, client: KazooClient, side: Mutex | MultiLock, queue: Any, identity: bytes, own: bool
    ) -> Any:
        """The busy policy: the lock into ``self.lease`` (wait), a skip result, or raise."""
        policy: str = self.options.on_busy
        if own:
            policy = "wait"  # our own previous attempt is finishing its release
            self._log("own-retry-waits", self.path, holder=self.task_id)
        elif policy == "preempt" and (newer := self._newer_call(queue)) is not None:
            return self._superseded(newer)
        holder = holder_in_the_way(queue, side)
        holder_id = holder.task_id if holder is not None else None
        emit(self.task, "busy", self.path, task_id=self.task_id, policy=policy, holder=holder_id)
        outcome = self._apply(
            "busy",
            policy,
            f"task {self.task.name!r}: lock {side.path} is held by task {holder_id}",
            holder_id,
        )
        if outcome is not None:
            return outcome  # skipped
        if policy == "preempt":
            self._preempt(client, queue)
        visibility.waiting(self.task, self.path, holder_id)
        budget = self._wait_timeout()
        try:
            if policy == "replace":
                return self._wait_replacing(client, side, identity, budget)
            self.lease = side.acquire(timeout=budget, data=identity)
            return None
        except LockTimeout:
            policy = self.options.on_timeout
            self._log("timeout", self.path, policy=policy, holder=holder_id, waited_up_to=budget)
            return self._apply(
                "timeout",
                policy,
                f"task {self.task.name!r}: lock {self.path} not granted within "
                f"{self.options.timeout}s (held by task {holder_id})",
                holder_id,
            )

    def _wait_replacing(
        self, client: KazooClient, side: Mutex | MultiLock, identity: bytes, budget: float | None
    ) -> Any:
        """``replace``: wait as the key's one waiting call (:mod:`celery_zklock.task.replace`):
        the lock into ``self.lease``, or a skip (reason ``replaced``) naming the newer call."""
        assert isinstance(side, Mutex)  # one key: several keys refuse `replace`
        waiter = replace.Waiter(client, side.path, self.task_id, self.generation)
        try:
            self.lease = waiter.acquire(side, budget, identity)
        finally:
            waiter.close()
        if self.lease is not None:
            return None
        count_outcome(self.task.name, "replaced")
        by = waiter.replaced_by
        message = f"task {self.task.name!r}: a newer call {by} replaced it as the waiting call"
        return self._apply("replaced", "skip", f"{message} of lock {self.path}", by)

    def _newer_call(self, queue: list[Contender]) -> Contender | None:
        """``preempt``: the first node in ``queue`` of a newer call of this task (its
        generation above ours, see :mod:`celery_zklock.task.generation`), holding or waiting."""
        for contender in queue:
            found = contender.identity
            if (
                found.task == self.task.name
                and found.task_id != self.task_id
                and is_newer(found.generation, self.generation)
            ):
                return contender
        return None

    def _superseded(self, newer: Contender) -> Any:
        """``preempt`` meets a newer call of this task in the queue: it runs after (or
        instead of) this one, so this one is skipped (reason ``superseded``), never run after
        it and never preempting it (a preempted run's retry would preempt back: issue 42)."""
        emit(self.task, "busy", self.path, task_id=self.task_id, policy="skip",
             holder=newer.task_id)  # fmt: skip
        return self._apply(
            "superseded",
            "skip",
            f"task {self.task.name!r}: a newer call {newer.task_id} of lock {self.path} is "
            "queued or running",
            newer.task_id,
        )

    def _preempt(self, client: KazooClient, queue: list[Contender]) -> None:
        """``preempt``: ask every holder ahead of us of an older call (a lower generation, or
        none: see :mod:`celery_zklock.task.generation`) to end, as ``celery zklock break`` does:
        each such holder's body is interrupted and ends ``LockLost`` naming this task, its node
        goes, and only then is this run granted (its wait follows). Holders of a call not older than
        ours (another task's), not task runs, or paused, are waited for, up to ``lock_timeout``:
        a call never preempts a newer one, so two calls never preempt each other in turn."""
        by = f"task {self.task.name}[{self.task_id}]"
        for holder in holding(queue, self.options.limit):
            if holder.task_id == self.task_id:
                continue
            if not is_newer(self.generation, holder.identity.generation):
                self._log("preempt", self.path, holder=holder.task_id, outcome="not-older")
                continue
            outcome = request_break(client, f"{self.path}/{holder.name}", by, PREEMPTED)
            self._log("preempt", self.path, holder=holder.task_id, outcome=outcome.status)

    def _wait_timeout(self) -> float | None:
        """``lock_timeout``, counted from when the worker received the message where its gate
        says when (the message may have waited there)."""
        timeout = self.options.timeout
        received = received_at(self.request)
        if timeout is None or received is None:
            return timeout
        return max(0.0, timeout - (time.time() - received))

    def _admit(self, client: KazooClient) -> Any:
        """With ``lock_rate``, once the lock is held: be admitted under the key's rate (so an
        admission is counted only for a run that goes on to its body). None when admitted,
        else what ``on_busy`` makes of it (reason ``rate``): a skip result, a wait for the
        window up to ``lock_timeout`` (then ``on_timeout``), a retry when the window opens."""
        rate = self.options.rate
        assert rate is not None
        limit = RateLimit(client, f"{self.path}/{RATE_NODE}", rate)
        identity = node_identity(self.task, self.request, self.generation)
        try:
            opens_in = limit.admit(identity)
            count_rate(self.task.name, opens_in is None)
            if opens_in is None:
                return None
            message = (
                f"task {self.task.name!r}: lock {self.path} is over its rate {rate}; the "
                f"window admits a run in {opens_in:.3f}s"
            )
            self._log("rate-refused", self.path, rate=str(rate), opens_in=round(opens_in, 3))
            policy = self.options.on_busy
            if policy == "retry":
                raise self.task.retry(exc=RateLimited(message), countdown=opens_in)
            if policy not in ("wait", "preempt"):  # a rate is not a holder to preempt
                return self._apply("rate", policy, message)
            if self.in_worker:
                return self._wait_for_window(opens_in, message)
            if limit.acquire(timeout=self._wait_timeout(), data=identity):
                count_rate(self.task.name, True)
                return None
        except (ZooKeeperUnavailable, KazooException, LockTimeout) as exc:
            self._unavailable(f"ZooKeeper failed while admitting under the rate of {self.path}: "
                              f"{exc}", exc)  # fmt: skip
        return self._apply("timeout", self.options.on_timeout, f"{message}; lock_timeout passed")

    def _wait_for_window(self, opens_in: float, message: str) -> Any:
        """The throttle: a ``wait`` call over its rate waits for its window without a pool slot
        and without its lock, sent back to come again when the window opens
        (:mod:`celery_zklock.task.sendback`; not a retry). Its ``lock_timeout`` counts from when
        it first came (to a gate, or to this run without one: carried when sent back): a window
        that opens after it applies ``lock_on_timeout`` now."""
        due = received_at(self.request) or sendback.first_due(self.request) or time.time()
        timeout = self.options.timeout
        if timeout is not None and time.time() + opens_in > due + timeout:
            return self._apply("timeout", self.options.on_timeout,
                               f"{message}; that is past its lock_timeout")  # fmt: skip
        self._log("rate-waits", self.path, opens_in=round(opens_in, 3))
        reason = f"over the rate of lock {self.path}: sent back to come again in {opens_in:.3f}s"
        raise sendback.send_back(self.task, self.request, opens_in, reason, due=due)

    # -- hold and release -----------------------------------------------------------------
    def _hold(self, lease: HeldLease, body: Callable[[], Any]) -> Any:
        """Announce the grant, arm the body's interruption and run it (None if lost)."""
        task, task_id, path = self.task, self.task_id, self.path
        waited = (self.granted_at or self.started) - self.started
        emit(task, "acquired", path, task_id=task_id, token=self.fence, mode=self.options.mode,
             waited=waited)  # fmt: skip
        interruption: Interruption | None = None

        def on_lost(reason: str) -> None:
            # The lease clock's thread: interrupt first, then tell (log, receivers). The event
            # exists before lost_told says so (made only when lost: most runs never need one).
            told = self.lost_told_event = threading.Event()
            self.lost_told = True
            try:
                if interruption is not None:
                    interruption.fire(reason)
                emit(task, "lost", path, task_id=task_id, token=self.fence, reason=reason,
                     code=loss_code(lease))  # fmt: skip
            finally:
                told.set()

        stack: list[HeldLease] = held_leases.__dict__.setdefault("stack", [])
        try:
            try:
                stack.append(lease)
                interruption = arm()
                # A body told by self.lock.check() is not interrupted again: one LockLost.
                lease.on_check_raises(interruption.stand_down)
                lease.on_lost(on_lost)
                lease.check()  # lost before the body started (even during the receivers above)
                return body()
            finally:
                # The interruption can land up to this disarm, after the body ended too: the
                # except below takes it, and the outer finally disarms again if it cut this short.
                if interruption is not None:
                    interruption.disarm()
        except LockLost:
            if not lease.lost:
                raise  # the body's own LockLost (e.g. of a nested lock): not ours
            return None
        finally:
            try:
                if interruption is not None:
                    interruption.disarm()
            finally:
                lease.on_check_raises(None)
                lease.remove_on_lost(on_lost)
                if stack and stack[-1] is lease:
                    stack.pop()
                if self.lost_told and self.lost_told_event is not None:
                    self.lost_told_event.wait(LOST_TELL_WAIT)  # "lost" is heard before "released"

    def _release(self) -> None:
        lease = self.lease
        if lease is None:
            return
        lease.release()
        if self.granted_at is not None:  # announced: tell that it ended
            if lease.lost and not self.lost_told:  # found at the release: tell it too, once
                self.lost_told = True
                emit(self.task, "lost", self.path, task_id=self.task_id, token=self.fence,
                     reason=lease.lost_reason, code=loss_code(lease))  # fmt: skip
            held = time.monotonic() - self.granted_at
            emit(self.task, "released", self.path, task_id=self.task_id, token=self.fence,
                 held=held, lost=lease.lost)  # fmt: skip

    def _log(self, event: str, path: str, **fields: Any) -> None:
        emit(self.task, event, path, task_id=self.task_id, **fields)
