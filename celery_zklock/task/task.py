"""``ZkLockTask``: a Celery task that runs its body under a ZooKeeper lock keyed by its arguments.

The class holds the lock options (compiled once, when the task class is made, into a
:class:`~celery_zklock.task.options.TaskLockSpec`), carries a call's ``zklock={...}`` overrides in
the message headers, and hands each call to a :class:`~celery_zklock.task.run.LockedRun`, which
acquires, holds and releases. Where each outcome is decided: :mod:`celery_zklock.task.policy` (busy,
timeout, lost, unavailable), :mod:`celery_zklock.task.delivery` (another delivery of the same
message), :mod:`celery_zklock.task.run` (the lease from grant to release),
:mod:`celery_zklock.task.interrupt` (stopping the body).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Mapping
from typing import Any, ClassVar, Final

from celery import Task, uuid

from celery_zklock.locks.lease import HeldLease
from celery_zklock.task import generation, lookup, sendback, visibility
from celery_zklock.task.dedupe import enqueue_once
from celery_zklock.task.options import (
    CALL_OPTION,
    DEFAULT_DEDUPE_TTL,
    DEFAULT_MODE,
    DEFAULT_ON_BUSY,
    DEFAULT_ON_LOST,
    DEFAULT_ON_TIMEOUT,
    DEFAULT_RETRY_COUNTDOWN,
    DEFAULT_TIMEOUT,
    LockOptions,
    TaskLockSpec,
    request_overrides,
)
from celery_zklock.task.policy import is_skipped
from celery_zklock.task.run import LockedRun, held_leases

__all__ = ["CALL_OPTION", "ZkLockTask", "has_locked_tasks", "is_skipped", "when_bound"]

_APPLY_ASYNC_POSITIONAL = ("task_id", "producer", "link", "link_error", "shadow")


class ZkLockTask(Task):  # type: ignore[misc]
    """Base class of tasks that run under a ZooKeeper lock: what each option means and allows in
    :mod:`celery_zklock.task.options`, the outcomes in :mod:`celery_zklock.task.policy`. Per call:
    ``apply_async(..., zklock={"on_busy": "wait", "timeout": 5})``. In a bound task's body,
    ``self.lock`` is the :class:`~celery_zklock.Lease` (``self.lock.token``: the fencing token)."""

    #: The lock's name, a znode path segment under ``zklock_root``; None: the task name.
    #: Tasks with the same lock name share locks.
    lock_name: ClassVar[str | None] = None
    #: Which arguments identify the lock: None (all, bound to the signature with defaults),
    #: one parameter name, a list of them, a callable, or {name: [params]} for several keys.
    lock_key: ClassVar[Any] = None
    #: ``exclusive`` (one holder), ``shared`` (readers together, writers alone) or
    #: ``semaphore`` (at most lock_limit at once).
    lock_mode: ClassVar[str] = DEFAULT_MODE
    #: With ``semaphore`` (required there, refused elsewhere): the most runs at once per key.
    lock_limit: ClassVar[int | None] = None
    #: When another holds the lock: skip, wait (up to lock_timeout), retry, raise or preempt.
    lock_on_busy: ClassVar[str] = DEFAULT_ON_BUSY
    #: Seconds a ``wait`` may last; None waits without limit.
    lock_timeout: ClassVar[float | None] = DEFAULT_TIMEOUT
    #: When a wait reaches lock_timeout: ``skip``, ``retry`` or ``raise``.
    lock_on_timeout: ClassVar[str] = DEFAULT_ON_TIMEOUT
    #: When the lock is lost while the body runs: ``raise`` (LockLost) or ``retry``.
    lock_on_lost: ClassVar[str] = DEFAULT_ON_LOST
    #: Seconds before a ``retry`` policy's new attempt.
    lock_retry_countdown: ClassVar[float] = DEFAULT_RETRY_COUNTDOWN
    #: Deduplicate when sending: None, ``queued`` or ``running`` (see celery_zklock.task.dedupe).
    lock_dedupe: ClassVar[str | None] = None
    #: A deduplicated call raises AlreadyQueued instead of returning the earlier AsyncResult.
    lock_dedupe_raise: ClassVar[bool] = False
    #: Seconds after which a marker whose message never ran stops deduplicating its key.
    lock_dedupe_ttl: ClassVar[float] = DEFAULT_DEDUPE_TTL
    #: At most N runs per period per key, fleet-wide: "10/s", "100/m", "1/h" (or None).
    lock_rate: ClassVar[str | None] = None

    _zklock_spec: ClassVar[TaskLockSpec | None] = None  # compiled lock: see _zklock_compile
    Request = "celery_zklock.task.request:LockedRequest"  # an ignored copy keeps its message

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls._zklock_spec = None
        # A class with a body is a task definition: fail now on bad options (without a name,
        # under the one app.register_task will give its instance).
        if inspect.getattr_static(cls, "run") is not Task.run:
            cls._zklock_compile(getattr(cls, "name", None) or f"{cls.__module__}.{cls.__name__}")

    @classmethod
    def _zklock_compile(cls, name: str | None = None) -> TaskLockSpec:
        """The lock of the task named ``name`` (default: the class's), compiled once."""
        spec = cls._zklock_spec
        if spec is None or spec.task_name != (name or cls.name):
            spec = cls._zklock_spec = TaskLockSpec.compile(cls, name or cls.name)
        return spec

    @classmethod
    def on_bound(cls, app: Any) -> None:  # Celery's hook, at each bind: see _bound
        _bound(cls, app)

    # -- sending -------------------------------------------------------------------------
    def apply_async(self, args: Any = None, kwargs: Any = None, *rest: Any, **options: Any) -> Any:
        """Celery's ``apply_async``, plus ``zklock={...}`` (validated here, in the caller) and
        the call's generation, carried in the message headers; with ``lock_dedupe``, sent only
        if no earlier message of the key counts (else that message's ``AsyncResult``)."""
        resend = options.pop(_RESEND, False)
        call = self._carry_call_options(options, None if resend else generation.next_generation())
        if call.dedupe is None:
            return super().apply_async(args, kwargs, *rest, **options)
        options.update(zip(_APPLY_ASYNC_POSITIONAL, rest, strict=False))  # by name
        task_id = options.pop("task_id", None) or uuid()
        send = functools.partial(super().apply_async, args, kwargs, task_id=task_id, **options)
        path = lookup.lock_path(self, args or (), kwargs or {}, whole_call=True)
        return enqueue_once(self, call, path, task_id, send, resend=resend)

    def apply(self, args: Any = None, kwargs: Any = None, *rest: Any, **options: Any) -> Any:
        """Celery's ``apply`` (run here, now), with the same ``zklock={...}`` option."""
        options.pop(_RESEND, None)  # an eager retry runs its signature with apply
        self._carry_call_options(options, generation.next_generation())
        return super().apply(args, kwargs, *rest, **options)

    def _carry_call_options(self, options: dict[str, Any], new: int | None) -> LockOptions:
        call = self._zklock_compile(self.name).for_call(overrides := options.pop(CALL_OPTION, None))
        options["headers"] = _message_headers(options.get("headers"), overrides, new)
        return call

    def signature_from_request(
        self, request: Any = None, args: Any = None, kwargs: Any = None, **options: Any
    ) -> Any:
        """Celery's ``signature_from_request`` (``self.retry()``, the re-send after a lost
        worker), as a re-send of the request's call: see :func:`_as_resend`."""
        signature = super().signature_from_request(request, args, kwargs, **options)
        return _as_resend(signature, self.request if request is None else request, options)

    # -- running -------------------------------------------------------------------------
    @property
    def lock(self) -> HeldLease:
        """The Lease the running body holds (a MultiLease for several keys), or RuntimeError."""
        stack: list[HeldLease] = getattr(held_leases, "stack", [])  # this thread's bodies'
        if not stack:
            raise RuntimeError(f"task {self.name!r}: self.lock is only set inside the task body")
        return stack[-1]  # the innermost body's

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        body = functools.partial(super().__call__, *args, **kwargs)
        return LockedRun(self, self._zklock_compile(self.name), args, kwargs).run(body)

    # -- operating -----------------------------------------------------------------------
    def lock_path(self, *args: Any, **kwargs: Any) -> str:
        """The lock path of a call with these arguments, or just its key's (no request)."""
        return lookup.lock_path(self, args, kwargs)

    def lock_holder(self, *args: Any, **kwargs: Any) -> lookup.Holder | None:
        """Who holds the lock a call with these arguments takes, or None; the first holder
        of a shared lock (all of them: :func:`celery_zklock.task.lookup.lock_holders`)."""
        return lookup.lock_holder(self, args, kwargs)


def _as_resend(signature: Any, request: Any, options: Mapping[str, Any]) -> Any:
    """``signature`` of a re-send of ``request``'s call, keeping ``zklock`` and the generation
    (request attributes in a worker, not headers), whose ``apply_async`` re-sends the request's
    own message (dedupe never drops). A retry (``retries`` raised) is another attempt: it does
    not carry when the attempt before first reached a gate (Celery copies a request's headers),
    so that its ``lock_timeout`` counts from its own arrival."""
    signature.options[_RESEND] = True
    kept = (request_overrides(request), generation.of_request(request))
    headers = _message_headers(signature.options.get("headers"), *kept)
    if options.get("retries", request.retries) != request.retries:
        headers.pop(sendback.FIRST_DUE, None)
    signature.options["headers"] = headers
    return signature


def _message_headers(
    headers: Mapping[str, Any] | None, overrides: Mapping[str, Any] | None, new: int | None
) -> dict[str, Any]:
    """A locked call's message headers: ``headers``, its ``zklock`` ``overrides`` if any, and a
    generation: the one ``headers`` carry already (a re-send, or the caller's own), else ``new``
    (None for a re-send of a message that had none: see celery_zklock.task.generation)."""
    carried = dict(headers or {})
    if overrides is not None:
        carried[CALL_OPTION] = dict(overrides)
    if new is not None:
        carried.setdefault(generation.GENERATION_HEADER, new)
    return carried


def has_locked_tasks(app: Any) -> bool:
    """Whether ``app`` has a ``ZkLockTask``: a worker of it needs the library's steps."""
    return any(isinstance(t, ZkLockTask) for t in app.tasks.values())


#: The ``apply_async`` option marking a re-send of the request's own message (see
#: ``signature_from_request``); taken out before Celery sees the options.
_RESEND: Final = "_zklock_resend"

_WHEN_BOUND: list[Callable[[Any], None]] = []


def when_bound(hook: Callable[[Any], None]) -> None:
    """Call ``hook(app)`` each time a ``ZkLockTask`` is bound to an app (Celery's ``on_bound``,
    when the app is finalized or the task registered): how the package has
    :func:`celery_zklock.worker.wiring.install` wire the app's workers, a layer above this one,
    without this layer importing it, and without anything connected at import."""
    _WHEN_BOUND.append(hook)


def _bound(task_class: Any, app: Any) -> None:
    """``task_class`` was bound to ``app`` (Celery read its config): its STARTED is the run's to
    write (:func:`~celery_zklock.task.visibility.take_over_started`), and the hooks run."""
    visibility.take_over_started(task_class)
    for hook in _WHEN_BOUND:
        hook(app)
