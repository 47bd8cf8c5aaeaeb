"""``ZkLockTask``: a Celery task that runs its body under a ZooKeeper lock keyed by its arguments.

The class stays thin over the recipes: it turns options and arguments into a lock path, picks
the side of a :class:`~celery_zklock.ReadWriteLock` (``exclusive`` tasks take the write side,
``shared`` ones the read side, so both kinds of one ``lock_name`` exclude each other correctly),
applies the busy policy, and releases in every outcome.

Outcomes of one run:

- lock granted: the body runs with ``self.lock`` = the :class:`~celery_zklock.Lease`. From the
  moment acquire returns it the lease is released in a ``finally`` (success, exception,
  ``Retry``, ``Ignore``, ``Reject``, a soft time limit, a loss before the body started). If the
  lease was lost before the release - the body interrupted (:mod:`celery_zklock.interrupt`),
  never started, or already returned - the task ends with :class:`~celery_zklock.LockLost`
  (``lock_on_lost="retry"``: a retry), never SUCCESS.
- busy, ``skip``: SUCCESS with a JSON result for which :func:`is_skipped` is true, naming the
  lock and the holder's task id; the body does not run.
- busy, ``wait``: waits up to ``lock_timeout``; then ``lock_on_timeout`` (skip, retry, raise).
- busy, ``retry``: ``self.retry(countdown=lock_retry_countdown)``; ``raise``: fails with
  :class:`~celery_zklock.LockBusy`.
- a node of this very task id in the lock's queue: our own previous attempt finishing (we wait
  for it whatever the policy), or another delivery of the same message (we wait for it to go,
  and are ignored while it lives): see :mod:`celery_zklock.delivery`.
- ZooKeeper unreachable or failing, before or during a wait: in a worker the task retries
  (``ZooKeeperUnavailable``, Celery's ``max_retries`` applies, then it fails with that reason);
  called directly or eagerly it raises. Never a timeout or a skip.
"""

from __future__ import annotations

import inspect
import logging
import sys
import threading
import time
from collections.abc import Mapping
from typing import Any, ClassVar

from celery import Task
from celery.signals import worker_process_shutdown, worker_shutdown
from kazoo.client import KazooClient
from kazoo.exceptions import KazooException

from celery_zklock import delivery, signals
from celery_zklock.config import client_config, lock_root
from celery_zklock.errors import (
    LockBusy,
    LockLost,
    LockTimeout,
    ZooKeeperUnavailable,
)
from celery_zklock.interrupt import Interruption, arm
from celery_zklock.keys import KeyBuilder
from celery_zklock.locks import Lease, ReadWriteLock
from celery_zklock.options import (
    DEFAULT_MODE,
    DEFAULT_ON_BUSY,
    DEFAULT_ON_LOST,
    DEFAULT_ON_TIMEOUT,
    DEFAULT_RETRY_COUNTDOWN,
    DEFAULT_TIMEOUT,
    TASK_ATTRIBUTES,
    LockOptions,
    options_from_task,
    with_call_overrides,
)
from celery_zklock.session import close_clients, get_client

logger = logging.getLogger("celery_zklock")

SKIP_MARKER = "__zklock_skipped__"
CALL_OPTION = "zklock"
QUEUE_READ_TIMEOUT = 5.0
"""Seconds ZooKeeper may take to answer a look at the lock's queue (else: unavailable)."""


class _Run:
    """One locked run: its lease from the moment acquire returns it, and its times."""

    __slots__ = ("granted_at", "lease", "started")

    def __init__(self, started: float) -> None:
        self.started = started
        self.lease: Lease | None = None
        self.granted_at: float | None = None


def is_skipped(result: Any) -> bool:
    """True if ``result`` is the result of a run skipped because its lock was busy.

    Accepts the value itself (as returned by ``AsyncResult.get()``, after the backend's JSON
    round trip) or a ready ``AsyncResult``.
    """
    if hasattr(result, "ready") and hasattr(result, "result"):
        if not result.ready():
            return False
        result = result.result
    return isinstance(result, Mapping) and result.get(SKIP_MARKER) is True


def _request_overrides(request: Any) -> Mapping[str, Any] | None:
    """The per-call ``zklock`` overrides a request carries, if any."""
    overrides = getattr(request, CALL_OPTION, None)
    if overrides is None:
        overrides = (getattr(request, "headers", None) or {}).get(CALL_OPTION)
    return overrides if isinstance(overrides, Mapping) else None


def _gevent_patched() -> bool:
    if "gevent" not in sys.modules:
        return False
    from gevent import monkey

    return bool(monkey.is_module_patched("socket"))


def _signature_of_run(cls: type) -> inspect.Signature:
    """The signature callers use: without ``self`` for bound tasks and class-based ``run``."""
    raw = inspect.getattr_static(cls, "run")
    if isinstance(raw, staticmethod):
        return inspect.signature(raw.__func__)
    signature = inspect.signature(raw)
    params = list(signature.parameters.values())
    return signature.replace(parameters=params[1:])


class ZkLockTask(Task):  # type: ignore[misc]
    """Base class of tasks that run under a ZooKeeper lock; see the module docstring.

    Options (decorator keywords or class attributes), validated when the task class is created:
    ``lock_name``, ``lock_key``, ``lock_mode``, ``lock_on_busy``, ``lock_timeout``,
    ``lock_on_timeout``, ``lock_on_lost``, ``lock_retry_countdown``. Per call:
    ``apply_async(..., zklock={"on_busy": "wait", "timeout": 5})``.
    """

    lock_name: ClassVar[str | None] = None
    lock_key: ClassVar[Any] = None
    lock_mode: ClassVar[str] = DEFAULT_MODE
    lock_on_busy: ClassVar[str] = DEFAULT_ON_BUSY
    lock_timeout: ClassVar[float | None] = DEFAULT_TIMEOUT
    lock_on_timeout: ClassVar[str] = DEFAULT_ON_TIMEOUT
    lock_on_lost: ClassVar[str] = DEFAULT_ON_LOST
    lock_retry_countdown: ClassVar[float] = DEFAULT_RETRY_COUNTDOWN

    _zklock_options: ClassVar[LockOptions | None] = None
    _zklock_keys: ClassVar[KeyBuilder | None] = None

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls._zklock_options = None
        cls._zklock_keys = None
        # A class with a body and a name is a task definition: fail now on bad options.
        if getattr(cls, "name", None) and inspect.getattr_static(cls, "run") is not Task.run:
            cls._zklock_setup()

    @classmethod
    def _zklock_setup(cls) -> tuple[LockOptions, KeyBuilder]:
        options, keys = cls._zklock_options, cls._zklock_keys
        if options is not None and keys is not None:
            return options, keys
        name = str(cls.name)
        attrs = {attr: getattr(cls, attr) for attr in TASK_ATTRIBUTES}
        # Misspelt options (lock_on_bussy=...) land as class attributes: report them.
        attrs.update(
            (attr, value)
            for attr, value in vars(cls).items()
            if attr.startswith("lock_") and attr not in TASK_ATTRIBUTES
        )
        options = options_from_task(name, attrs)
        keys = KeyBuilder.for_callable(name, _signature_of_run(cls), options.key)
        cls._zklock_options, cls._zklock_keys = options, keys
        return options, keys

    # -- sending -------------------------------------------------------------------------
    def apply_async(self, args: Any = None, kwargs: Any = None, *rest: Any, **options: Any) -> Any:
        """Celery's ``apply_async``, plus ``zklock={...}`` per-call lock options.

        The overrides are validated here, in the caller, and travel in the message headers.
        """
        self._carry_call_options(options)
        return super().apply_async(args, kwargs, *rest, **options)

    def apply(self, args: Any = None, kwargs: Any = None, *rest: Any, **options: Any) -> Any:
        """Celery's ``apply`` (run here, now), with the same ``zklock={...}`` option."""
        self._carry_call_options(options)
        return super().apply(args, kwargs, *rest, **options)

    def _carry_call_options(self, options: dict[str, Any]) -> None:
        overrides = options.pop(CALL_OPTION, None)
        if overrides is None:
            return
        base, _ = self._zklock_setup()
        with_call_overrides(base, self.name, overrides)
        headers = dict(options.get("headers") or {})
        headers[CALL_OPTION] = dict(overrides)
        options["headers"] = headers

    def signature_from_request(
        self, request: Any = None, args: Any = None, kwargs: Any = None, **options: Any
    ) -> Any:
        """Celery's ``signature_from_request`` (used by ``self.retry()``), keeping ``zklock``.

        In a worker the message's custom headers become request attributes, not
        ``request.headers``, so without this a retry would drop the caller's overrides.
        """
        signature = super().signature_from_request(request, args, kwargs, **options)
        overrides = _request_overrides(self.request if request is None else request)
        if overrides is not None:
            headers = dict(signature.options.get("headers") or {})
            headers[CALL_OPTION] = dict(overrides)
            signature.options["headers"] = headers
        return signature

    def _call_options(self) -> LockOptions:
        base, _ = self._zklock_setup()
        overrides = _request_overrides(self.request)
        if overrides is None:
            return base
        return with_call_overrides(base, self.name, overrides)

    # -- the lease inside the body ---------------------------------------------------------
    _zklock_local: ClassVar[threading.local] = threading.local()

    @property
    def lock(self) -> Lease:
        """The :class:`Lease` the running body holds (its ``token`` is the fencing token).

        Raises RuntimeError outside the body of a locked run.
        """
        stack: list[Lease] = getattr(self._zklock_local, "stack", [])
        if not stack:
            raise RuntimeError(f"task {self.name!r}: self.lock is only set inside the task body")
        return stack[-1]

    # -- running -------------------------------------------------------------------------
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        options = self._call_options()
        _, keys = self._zklock_setup()
        path = f"{lock_root(self.app.conf)}/{options.name}/{keys(args, kwargs)}"
        client = self._zklock_client(options)
        rw = ReadWriteLock(client, path)
        side = rw.write if options.mode == "exclusive" else rw.read
        run = _Run(time.monotonic())
        try:
            skipped = self._zklock_acquire(run, client, side, path, options)
            lease = run.lease  # from the moment acquire returned it, the finally releases it
            if lease is None:
                return skipped
            run.granted_at = time.monotonic()
            result = self._run_holding(lease, path, options, run, args, kwargs)
        finally:
            self._release(run, path)
        if lease.lost:
            exc = LockLost(
                f"task {self.name!r} [{self.request.id}]: lock {path} (token {lease.token}) was "
                f"lost while the task ran: {lease.lost_reason}"
            )
            if options.on_lost == "retry":
                raise self.retry(exc=exc, countdown=options.retry_countdown)
            raise exc
        return result

    def _run_holding(
        self, lease: Lease, path: str, options: LockOptions, run: _Run, args: Any, kwargs: Any
    ) -> Any:
        """Announce the grant, arm this run's interruption and run the body (None if lost)."""
        task_id = self.request.id
        waited = (run.granted_at or run.started) - run.started
        self._event("acquired", path, token=lease.token, mode=options.mode, waited=waited)
        signals.lock_acquired.send(
            sender=self, task_id=task_id, path=path, token=lease.token, mode=options.mode,
            waited=waited,
        )  # fmt: skip
        interruption: Interruption | None = None

        def on_lost(reason: str) -> None:
            # Runs on the lease clock's thread or greenlet, where self.request is not this run's.
            if interruption is not None:
                interruption.fire(reason)
            self._event("lost", path, task_id=task_id, token=lease.token, reason=reason)
            signals.lock_lost.send(
                sender=self, task_id=task_id, path=path, token=lease.token, reason=reason
            )

        stack: list[Lease] = self._zklock_local.__dict__.setdefault("stack", [])
        try:
            stack.append(lease)
            interruption = arm()
            lease.on_lost(on_lost)
            lease.check()  # lost before the body started (even during the receivers above)
            return super().__call__(*args, **kwargs)
        except LockLost:
            if not lease.lost:
                raise  # the body's own LockLost (e.g. of a nested lock): not ours
            return None
        finally:
            try:
                if interruption is not None:
                    interruption.disarm()
            finally:
                lease.remove_on_lost(on_lost)
                if stack and stack[-1] is lease:
                    stack.pop()

    def _release(self, run: _Run, path: str) -> None:
        lease = run.lease
        if lease is None:
            return
        lease.release()
        if run.granted_at is not None:  # announced: tell that it ended
            held = time.monotonic() - run.granted_at
            self._event("released", path, token=lease.token, held=held, lost=lease.lost)
            signals.lock_released.send(
                sender=self, task_id=self.request.id, path=path, token=lease.token, held=held
            )

    def _zklock_client(self, options: LockOptions) -> KazooClient:
        config = client_config(
            self.app.conf, handler="gevent" if _gevent_patched() else "threading"
        )
        try:
            return get_client(config)
        except Exception as exc:
            error = ZooKeeperUnavailable(
                f"task {self.name!r}: could not connect to ZooKeeper at {config.hosts!r} within "
                f"{config.connect_timeout}s ({exc!r}); check zklock_hosts / ZKLOCK_HOSTS"
            )
            raise self._retry_or(error, options) from exc

    def _retry_or(self, error: Exception, options: LockOptions) -> BaseException:
        """In a worker: the Retry to raise; called directly or eagerly: ``error`` itself."""
        request = self.request
        if request.called_directly or request.is_eager:
            return error
        return self.retry(exc=error, countdown=options.retry_countdown)  # type: ignore[no-any-return]

    def _zklock_acquire(
        self, run: _Run, client: KazooClient, side: Any, path: str, options: LockOptions
    ) -> Any:
        """Take the lock into ``run.lease`` under the busy policy; else return a skip result.

        ZooKeeper unreachable or failing (during the try-lock, a wait or a look at the queue)
        takes the unavailable path, never the timeout policy.
        """
        try:
            return self._acquire_by_policy(run, client, side, path, options)
        except (ZooKeeperUnavailable, KazooException) as exc:
            error = ZooKeeperUnavailable(
                f"task {self.name!r}: ZooKeeper failed while acquiring lock {path}: {exc}"
            )
            raise self._retry_or(error, options) from exc

    def _acquire_by_policy(
        self, run: _Run, client: KazooClient, side: Any, path: str, options: LockOptions
    ) -> Any:
        identity = delivery.identity(self)
        request = self.request
        retries = request.retries or 0
        # A message handed out again may be a copy of a run that already finished.
        settled = not (request.delivery_info or {}).get("redelivered")
        while True:
            run.lease = side.acquire(blocking=False, data=identity)
            if run.lease is None:
                queue = delivery.read_queue(client, path, QUEUE_READ_TIMEOUT)
                own = delivery.first_of_task(queue, request.id)
                if own is not None and own.retries >= retries:
                    settled = delivery.await_original(self, client, side, path, own, self._event)
                    continue
                skipped = self._when_busy(run, side, path, options, queue, own is not None)
                if run.lease is None:
                    return skipped
            elif side.kind == "read":  # granted beside other readers: is one of them ours?
                ours = run.lease.node.rsplit("/", 1)[1]
                ahead = delivery.read_queue(client, path, QUEUE_READ_TIMEOUT, before=ours)
                original = delivery.first_of_task(ahead, request.id)
                if original is not None and original.retries >= retries:
                    run.lease.release()  # never beside the original
                    run.lease = None
                    settled = delivery.await_original(
                        self, client, side, path, original, self._event
                    )
                    continue
            if not settled:
                delivery.ignore_if_finished(self, path, self._event)
            return None

    def _when_busy(
        self, run: _Run, side: Any, path: str, options: LockOptions, queue: Any, own: bool
    ) -> Any:
        """Apply the busy policy: the lock into ``run.lease`` (wait), a skip result, or raise."""
        request = self.request
        policy: str = options.on_busy
        if own:
            policy = "wait"  # our own previous attempt is finishing its release
            self._event("own-retry-waits", path, holder=request.id)
        holder = delivery.blocker(queue, side.kind)
        holder_id = holder.task_id if holder is not None else None
        self._event("busy", path, policy=policy, holder=holder_id)
        signals.lock_busy.send(
            sender=self, task_id=request.id, path=path, policy=policy, holder=holder_id
        )
        if policy == "wait":
            try:
                run.lease = side.acquire(timeout=options.timeout, data=delivery.identity(self))
                return None
            except LockTimeout:
                return self._after_timeout(path, options, holder_id)
        if policy == "skip":
            return self._skip_result(path, holder_id, "busy")
        busy = LockBusy(f"task {self.name!r}: lock {path} is held by task {holder_id}")
        if policy == "retry":
            raise self.retry(exc=busy, countdown=options.retry_countdown)
        raise busy

    def _after_timeout(self, path: str, options: LockOptions, holder_id: Any) -> Any:
        self._event("timeout", path, policy=options.on_timeout, holder=holder_id)
        if options.on_timeout == "skip":
            return self._skip_result(path, holder_id, "timeout")
        error = LockTimeout(
            f"task {self.name!r}: lock {path} not granted within {options.timeout}s "
            f"(held by task {holder_id})"
        )
        if options.on_timeout == "retry":
            raise self.retry(exc=error, countdown=options.retry_countdown)
        raise error

    def _skip_result(self, path: str, holder_id: Any, reason: str) -> dict[str, Any]:
        return {SKIP_MARKER: True, "reason": reason, "lock": path, "holder": holder_id}

    def _event(self, event: str, path: str, **fields: Any) -> None:
        fields = {"task_id": self.request.id, **fields, "task": self.name, "path": path}
        text = " ".join(
            f"{k}={v:.4f}" if isinstance(v, float) else f"{k}={v}" for k, v in fields.items()
        )
        level = logging.WARNING if event in ("lost", "duplicate-ignored") else logging.INFO
        logger.log(
            level, "zklock event=%s %s", event, text, extra={"zklock": {"event": event, **fields}}
        )


def _close_clients_on_shutdown(**_: Any) -> None:
    close_clients()


worker_process_shutdown.connect(_close_clients_on_shutdown, weak=False)
worker_shutdown.connect(_close_clients_on_shutdown, weak=False)
