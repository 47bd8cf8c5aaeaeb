"""``ZkLockTask``: a Celery task that runs its body under a ZooKeeper lock keyed by its arguments.

The class stays thin over the recipes: it turns options and arguments into a lock path, picks
the side of a :class:`~celery_zklock.ReadWriteLock` (``exclusive`` tasks take the write side,
``shared`` ones the read side, so both kinds of one ``lock_name`` exclude each other correctly),
applies the busy policy, and releases in every outcome.

Outcomes of one run:

- lock granted: the body runs with ``self.lock`` = the :class:`~celery_zklock.Lease`; the lease
  is released in a ``finally`` (success, exception, ``Retry``, ``Ignore``, ``Reject``, soft time
  limit). If the lease was lost before the release - whether the body was interrupted or had
  already returned - the task ends with :class:`~celery_zklock.LockLost` (``lock_on_lost="retry"``:
  a retry), never SUCCESS.
- busy, ``skip``: SUCCESS with a JSON result for which :func:`is_skipped` is true, naming the
  lock and the holder's task id; the body does not run.
- busy, ``wait``: waits up to ``lock_timeout``; then ``lock_on_timeout`` (skip, retry, raise).
- busy, ``retry``: ``self.retry(countdown=lock_retry_countdown)``; ``raise``: fails with
  :class:`~celery_zklock.LockBusy`.
- the holder is this very task id: with a lower retry count it is our own previous attempt
  still finishing (``self.retry`` publishes before it raises), so we wait for it whatever the
  policy; with the same retry count it is another delivery of the same message: we wait up to
  1.5 session timeouts + 1 s for the lock. Still held: a duplicate of a run in progress (e.g. a
  Redis visibility-timeout redelivery), logged and ignored (``Ignore``: no state is written, so
  the running original's result stands). Granted: the first delivery's process died (a killed
  prefork child's message comes back at once), so this one runs, unless the task's result
  becomes final within 2 s (the original released just before Celery stored its result). With
  ``acks_late`` Celery is at-least-once: without a result backend, or one slower than that, such
  a copy runs the task a second time - after the original, never beside it.
- ZooKeeper unreachable: in a worker the task retries (``ZooKeeperUnavailable``, Celery's
  ``max_retries`` applies, then it fails with that reason); called directly or eagerly it raises.
"""

from __future__ import annotations

import inspect
import json
import logging
import os
import socket
import sys
import threading
import time
from collections.abc import Mapping
from typing import Any, ClassVar

from celery import Task, states
from celery.exceptions import Ignore
from celery.signals import worker_process_shutdown, worker_shutdown
from kazoo.client import KazooClient
from kazoo.exceptions import KazooException

from celery_zklock import signals
from celery_zklock.config import client_config, lock_root
from celery_zklock.errors import (
    LockBusy,
    LockLost,
    LockTimeout,
    ZooKeeperUnavailable,
)
from celery_zklock.interrupt import arm
from celery_zklock.keys import KeyBuilder
from celery_zklock.locks import Lease, ReadWriteLock
from celery_zklock.locks.rwlock import LockSide
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
RESULT_SETTLE_SECONDS = 2.0
"""How long a copy of a message that got its task's lock waits for the original's result."""
CALL_OPTION = "zklock"


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
        started = time.monotonic()
        try:
            lease = self._zklock_acquire(side, path, options)
        except KazooException as exc:  # e.g. the session expired twice during the acquire
            error = ZooKeeperUnavailable(
                f"task {self.name!r}: ZooKeeper failed while acquiring lock {path}: {exc!r}"
            )
            raise self._retry_or(error, options) from exc
        if not isinstance(lease, Lease):
            return lease  # a skip result
        waited = time.monotonic() - started
        self._event("acquired", path, token=lease.token, mode=options.mode, waited=waited)
        signals.lock_acquired.send(
            sender=self, task_id=self.request.id, path=path, token=lease.token,
            mode=options.mode, waited=waited,
        )  # fmt: skip
        return self._run_holding(lease, path, options, args, kwargs)

    def _run_holding(
        self, lease: Lease, path: str, options: LockOptions, args: Any, kwargs: Any
    ) -> Any:
        try:
            interruption = arm()
        except BaseException:
            lease.release()
            raise
        task_id = self.request.id

        def on_lost(reason: str) -> None:
            # Runs on the lease clock's thread or greenlet, where self.request is not this run's.
            interruption.fire(reason)  # first: before logging and user receivers
            self._event("lost", path, task_id=task_id, token=lease.token, reason=reason)
            signals.lock_lost.send(
                sender=self, task_id=task_id, path=path, token=lease.token, reason=reason
            )

        stack = self._zklock_local.__dict__.setdefault("stack", [])
        stack.append(lease)
        granted_at = time.monotonic()
        lease.on_lost(on_lost)
        try:
            try:
                result = super().__call__(*args, **kwargs)
            except LockLost:
                if not lease.lost:
                    raise  # the body's own LockLost (e.g. of a nested lock): not ours
                result = None
        finally:
            try:
                interruption.disarm()
            finally:
                lease.remove_on_lost(on_lost)
                stack.pop()
                lease.release()
                held = time.monotonic() - granted_at
                self._event("released", path, token=lease.token, held=held, lost=lease.lost)
                signals.lock_released.send(
                    sender=self, task_id=task_id, path=path, token=lease.token, held=held
                )
        if lease.lost:
            exc = LockLost(
                f"task {self.name!r} [{task_id}]: lock {path} (token {lease.token}) was lost "
                f"while the task ran: {lease.lost_reason}"
            )
            if options.on_lost == "retry":
                raise self.retry(exc=exc, countdown=options.retry_countdown)
            raise exc
        return result

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

    def _identity(self) -> bytes:
        request = self.request
        return json.dumps(
            {
                "task_id": request.id,
                "task": self.name,
                "retries": request.retries or 0,
                "worker": request.hostname or socket.gethostname(),
                "pid": os.getpid(),
            },
            separators=(",", ":"),
        ).encode()

    def _zklock_acquire(self, side: LockSide, path: str, options: LockOptions) -> Any:
        identity = self._identity()
        try:
            lease = side.acquire(blocking=False, data=identity)
        except LockTimeout as exc:
            raise self._retry_or(
                ZooKeeperUnavailable(f"task {self.name!r}: ZooKeeper did not answer: {exc}"),
                options,
            ) from exc
        if lease is not None:
            return lease
        holder = self._holder(side)
        request = self.request
        policy: str = options.on_busy
        if holder.get("task_id") == request.id and request.id is not None:
            if int(holder.get("retries", 0)) < (request.retries or 0):
                policy = "wait"  # our own previous attempt is finishing its release
                self._event("own-retry-waits", path, holder=request.id)
            else:
                return self._same_delivery_holds(side, path, identity)
        holder_id = holder.get("task_id")
        self._event("busy", path, policy=policy, holder=holder_id)
        signals.lock_busy.send(
            sender=self, task_id=request.id, path=path, policy=policy, holder=holder_id
        )
        if policy == "wait":
            try:
                return side.acquire(timeout=options.timeout, data=identity)
            except LockTimeout:
                return self._after_timeout(path, options, holder_id)
        if policy == "skip":
            return self._skip_result(path, holder_id, "busy")
        busy = LockBusy(f"task {self.name!r}: lock {path} is held by task {holder_id}")
        if policy == "retry":
            raise self.retry(exc=busy, countdown=options.retry_countdown)
        raise busy

    def _same_delivery_holds(self, side: LockSide, path: str, identity: bytes) -> Lease:
        """The holder is this task id at this retry count: another delivery of this message.

        Either it is still running (a Redis visibility-timeout redelivery): then its node stays
        and this copy is ignored; or the process running it died (``kill -9``, a prefork child
        lost, whose message Celery hands out again at once): then its node goes when the server
        expires that session, within a session timeout. So wait that long (and a half) for the
        lock. If it comes and the first delivery left no final state, this one runs the task.
        """
        request = self.request
        grace = 1.5 * side.session_timeout + 1.0
        self._event("same-delivery-waits", path, holder=request.id, grace=grace)
        try:
            lease = side.acquire(timeout=grace, data=identity)
        except LockTimeout:
            self._event("duplicate-ignored", path, holder=request.id)
            raise Ignore(
                f"task {request.id} is already running under lock {path}: duplicate "
                "delivery ignored"
            ) from None
        if self._finished_already(request.id, settle=RESULT_SETTLE_SECONDS):
            lease.release()
            self._event("duplicate-ignored", path, holder=request.id, finished=True)
            raise Ignore(f"task {request.id} already finished: duplicate delivery ignored")
        return lease

    def _finished_already(self, task_id: str, settle: float) -> bool:
        """True if the result backend holds a final state for ``task_id`` within ``settle`` s.

        A run releases its lock just before Celery stores its result: a copy that got the lock
        from a finished original sees the result a moment later, one whose original died never.
        """
        deadline = time.monotonic() + settle
        while True:
            try:
                if self.AsyncResult(task_id).state in states.READY_STATES:
                    return True
            except Exception:  # no result backend, or it is unreachable: we cannot tell, so run
                logger.debug("zklock: could not read the state of %s", task_id, exc_info=True)
                return False
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.05)

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

    def _holder(self, side: LockSide) -> dict[str, Any]:
        try:
            data = side.blocker_data(timeout=5.0)
        except Exception:
            return {}
        try:
            parsed = json.loads(data) if data else {}
        except ValueError:  # a Curator or kazoo contender: its data is not ours
            return {}
        return parsed if isinstance(parsed, dict) else {}

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
