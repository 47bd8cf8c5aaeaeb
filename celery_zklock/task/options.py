"""A task's lock options: what they mean, their defaults, and their validation.

:func:`options_from_task` turns a task's ``lock_*`` attributes into a :class:`LockOptions` at
definition time; :func:`with_call_overrides` applies a call's ``zklock={...}`` on top of it. Both
validate every value and raise :class:`~celery_zklock.errors.ConfigurationError` with a message
that names the task, the option, the bad value and the allowed values, so a misconfigured task
fails when it is defined (or when it is called with a bad override), never half-way through.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import inspect
import reprlib
import threading
import warnings
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Final, Literal, TypeVar, get_args

from celery_zklock.errors import ConfigurationError
from celery_zklock.locks.contenders import LOCK_MODES, LockKind, LockMode, lock_kind
from celery_zklock.locks.rate import Rate, parse_rate
from celery_zklock.task.keys import KeyBuilder, LockKeySpec, SeveralKeys, check_lock_key_spec
from celery_zklock.task.policy import expect_preempted
from celery_zklock.zk.validate import forbidden_in_znode, positive_int, seconds

__all__ = [
    "CALL_OPTION",
    "CALL_OVERRIDES",
    "DEDUPE_MODES",
    "DEDUPE_UNAVAILABLE_POLICIES",
    "DEFAULT_DEDUPE_TTL",
    "DEFAULT_DEDUPE_UNAVAILABLE",
    "DEFAULT_MODE",
    "DEFAULT_ON_BUSY",
    "DEFAULT_ON_LOST",
    "DEFAULT_ON_TIMEOUT",
    "DEFAULT_ON_UNAVAILABLE",
    "DEFAULT_RETRY_COUNTDOWN",
    "DEFAULT_TIMEOUT",
    "LOCK_MODES",
    "MAX_LOCK_NAME_LENGTH",
    "ON_BUSY_POLICIES",
    "ON_LOST_POLICIES",
    "ON_TIMEOUT_POLICIES",
    "ON_UNAVAILABLE_POLICIES",
    "OPTIONS",
    "TASK_ATTRIBUTES",
    "Dedupe",
    "DedupeUnavailable",
    "LockMode",
    "LockOptions",
    "LockedCall",
    "Naming",
    "OnBusy",
    "OnLost",
    "OnTimeout",
    "OnUnavailable",
    "OptionRule",
    "RedeliveryWarning",
    "TaskLockSpec",
    "check_lock_name",
    "check_redelivery",
    "options_from_task",
    "request_overrides",
    "signature_of_run",
    "with_call_overrides",
]

OnBusy = Literal["skip", "wait", "retry", "raise", "preempt", "replace"]
OnTimeout = Literal["skip", "retry", "raise"]
OnLost = Literal["raise", "retry"]
OnUnavailable = Literal["wait", "retry", "raise"]
Dedupe = Literal["queued", "running"]
DedupeUnavailable = Literal["raise", "send"]

ON_BUSY_POLICIES: Final[tuple[OnBusy, ...]] = get_args(OnBusy)
ON_TIMEOUT_POLICIES: Final[tuple[OnTimeout, ...]] = get_args(OnTimeout)
ON_LOST_POLICIES: Final[tuple[OnLost, ...]] = get_args(OnLost)
ON_UNAVAILABLE_POLICIES: Final[tuple[OnUnavailable, ...]] = get_args(OnUnavailable)
DEDUPE_MODES: Final[tuple[Dedupe, ...]] = get_args(Dedupe)
DEDUPE_UNAVAILABLE_POLICIES: Final[tuple[DedupeUnavailable, ...]] = get_args(DedupeUnavailable)

DEFAULT_MODE: Final[LockMode] = "exclusive"
DEFAULT_ON_BUSY: Final[OnBusy] = "wait"
DEFAULT_TIMEOUT: Final[float] = 60.0
DEFAULT_ON_TIMEOUT: Final[OnTimeout] = "raise"
DEFAULT_ON_LOST: Final[OnLost] = "raise"
DEFAULT_ON_UNAVAILABLE: Final[OnUnavailable] = "wait"
DEFAULT_RETRY_COUNTDOWN: Final[float] = 5.0
DEFAULT_DEDUPE_TTL: Final[float] = 3600.0
DEFAULT_DEDUPE_UNAVAILABLE: Final[DedupeUnavailable] = "raise"
DEFAULT_DEBOUNCE_MAX: Final[float] = 30.0

MAX_REMEMBERED_OVERRIDES: Final = 64
"""Distinct per-call overrides a task remembers validated (then it starts again)."""

MAX_LOCK_NAME_LENGTH: Final = 255
"""Longest accepted lock name (one znode path segment)."""


@dataclass(frozen=True)
class OptionRule:
    """One lock option: whether a call may override it, and the rule its value must keep.

    ``check(naming, label, value)`` returns the normalised value or raises
    :class:`~celery_zklock.errors.ConfigurationError` with a message starting
    ``<naming.context>: <label>=``.
    """

    per_call: bool
    check: Callable[[Naming, str, object], object]


@dataclass(frozen=True)
class Naming:
    """How values being validated are named in messages: the task, the message's opening
    (``task 'x'``) and the label of each field (``lock_on_busy``, ``zklock['on_busy']``)."""

    task: str
    context: str
    label: Callable[[str], str] = str


def _choice_of(allowed: tuple[str, ...]) -> Callable[[Naming, str, object], object]:
    return lambda naming, label, value: _choice(naming.context, label, value, allowed)


OPTIONS: Final[Mapping[str, OptionRule]] = MappingProxyType(
    {
        "name": OptionRule(False, lambda n, label, v: check_lock_name(n.context, label, v)),
        "key": OptionRule(False, lambda n, label, v: check_lock_key_spec(n.task, v)),
        "mode": OptionRule(False, _choice_of(LOCK_MODES)),
        "limit": OptionRule(False, lambda n, label, v: _limit(n.context, label, v)),
        "on_busy": OptionRule(True, _choice_of(ON_BUSY_POLICIES)),
        "timeout": OptionRule(True, lambda n, label, v: _timeout(n.context, label, v)),
        "on_timeout": OptionRule(True, _choice_of(ON_TIMEOUT_POLICIES)),
        "on_lost": OptionRule(True, _choice_of(ON_LOST_POLICIES)),
        "on_unavailable": OptionRule(True, _choice_of(ON_UNAVAILABLE_POLICIES)),
        "retry_countdown": OptionRule(True, lambda n, label, v: _seconds(n.context, label, v)),
        "dedupe": OptionRule(True, lambda n, label, v: _dedupe(n.context, label, v)),
        "dedupe_raise": OptionRule(True, lambda n, label, v: _flag(n.context, label, v)),
        "dedupe_ttl": OptionRule(True, lambda n, label, v: _positive(n.context, label, v)),
        "dedupe_unavailable": OptionRule(True, _choice_of(DEDUPE_UNAVAILABLE_POLICIES)),
        "rate": OptionRule(True, lambda n, label, v: _rate(n.context, label, v)),
        "debounce": OptionRule(False, lambda n, label, v: _optional_positive(n.context, label, v)),
        "debounce_max": OptionRule(
            False, lambda n, label, v: _optional_positive(n.context, label, v)
        ),
    }
)
"""Every lock option (a :class:`LockOptions` field), the one table the task attributes, the
per-call keys and the validation derive from."""

TASK_ATTRIBUTES: Final[Mapping[str, str]] = MappingProxyType(
    {f"lock_{field}": field for field in OPTIONS}
)
"""Task attribute (decorator keyword) -> :class:`LockOptions` field, for every lock option."""

CALL_OVERRIDES: Final[frozenset[str]] = frozenset(
    field for field, rule in OPTIONS.items() if rule.per_call
)
"""Keys a call may pass in ``apply_async(..., zklock={...})``. The lock name, key, mode and limit
are not among them: they decide *which* lock a task takes and how many may hold it, and every call
of a task must agree (a semaphore's contenders with another limit fail with ``LimitMismatch``)."""

_short_repr = reprlib.Repr()
_short_repr.maxstring = 80
_short_repr.maxother = 80

_T = TypeVar("_T", bound=str)

# How the values being validated are named in error messages. Set by options_from_task and
# with_call_overrides around the one validation, in LockOptions.__post_init__.
_naming: ContextVar[Naming | None] = ContextVar("zklock_option_naming", default=None)


@contextmanager
def _named(naming: Naming) -> Iterator[None]:
    token = _naming.set(naming)
    try:
        yield
    finally:
        _naming.reset(token)


@dataclass(frozen=True)
class LockOptions:
    """The validated lock options of one task (or of one call, after its overrides).

    Every instance is valid: the constructor checks and normalises every field by the rules
    of :data:`OPTIONS` (a list ``key`` becomes a tuple, an ``int`` timeout a ``float``) and
    raises :class:`~celery_zklock.errors.ConfigurationError` otherwise. Build them with
    :func:`options_from_task` for messages that name the task.
    """

    name: str
    """``lock_name``: the znode path segment under the root (default: the task name). Tasks
    with the same name share locks."""

    key: LockKeySpec
    """``lock_key``: which arguments identify the lock (see :mod:`celery_zklock.task.keys`)."""

    mode: LockMode = DEFAULT_MODE
    """``lock_mode``: ``exclusive`` (one holder) or ``shared`` (readers together, writers alone:
    ``shared`` tasks take the read side of a read-write lock, ``exclusive`` ones the write side),
    or ``semaphore`` (at most ``limit`` at once, see :class:`~celery_zklock.Semaphore`)."""

    limit: int | None = None
    """``lock_limit``: with ``mode="semaphore"`` (and only there, where it is required), how many
    runs may hold one lock key at once, a whole number ``>= 1``. Not per call: every contender of
    a semaphore must use the same limit."""

    on_busy: OnBusy = DEFAULT_ON_BUSY
    """``lock_on_busy``, when the lock is held by another: ``skip`` (end SUCCESS with a skip
    result, body not run), ``wait`` (block up to ``timeout``), ``retry`` (``self.retry`` after
    ``retry_countdown``), ``raise`` (fail with ``LockBusy``), ``preempt`` (ask the holders to
    end, as ``celery zklock break`` does, then wait up to ``timeout``: the newest call wins) or
    ``replace`` (wait up to ``timeout`` as the key's one waiting call: a newer call replaces
    it, and the replaced one is skipped, reason ``replaced``; see
    :mod:`celery_zklock.task.replace`)."""

    timeout: float | None = DEFAULT_TIMEOUT
    """``lock_timeout``: seconds a ``wait`` may last, ``>= 0``; ``None`` (only when given
    explicitly) waits without limit."""

    on_timeout: OnTimeout = DEFAULT_ON_TIMEOUT
    """``lock_on_timeout``, when a ``wait`` reaches ``timeout``: ``skip``, ``retry`` or
    ``raise`` (fail with ``LockTimeout``)."""

    on_lost: OnLost = DEFAULT_ON_LOST
    """``lock_on_lost``, when the lock is lost while the body runs: ``raise`` (fail with
    ``LockLost``) or ``retry`` (retry after ``retry_countdown``)."""

    on_unavailable: OnUnavailable = DEFAULT_ON_UNAVAILABLE
    """``lock_on_unavailable``, when ZooKeeper cannot be reached: ``wait`` (ride the outage
    out at a worker's gate, without a pool slot, up to ``zklock_outage_budget``; then
    ``retry``: see :func:`celery_zklock.task.sendback.ride_out`), ``retry`` (``self.retry`` with
    ``ZooKeeperUnavailable`` after ``retry_countdown``) or ``raise``. Called directly or
    eagerly, every policy raises."""

    retry_countdown: float = DEFAULT_RETRY_COUNTDOWN
    """``lock_retry_countdown``: seconds before a ``retry`` policy's new attempt, ``>= 0``."""

    dedupe: Dedupe | None = None
    """``lock_dedupe``, deduplication when sending (see :mod:`celery_zklock.task.dedupe`): None
    (every call sends), ``queued`` (a call whose key has an earlier message not started yet
    sends nothing and returns that message's ``AsyncResult``) or ``running`` (... queued or
    running)."""

    dedupe_raise: bool = False
    """``lock_dedupe_raise``: a deduplicated call raises ``AlreadyQueued`` (with the earlier
    message's task id) instead of returning its ``AsyncResult``."""

    dedupe_ttl: float = DEFAULT_DEDUPE_TTL
    """``lock_dedupe_ttl``: seconds after which a marker whose message never ran (a caller killed
    before sending, a lost or purged message, a worker killed mid-run) stops deduplicating its
    key, ``> 0``: the worst case (see :mod:`celery_zklock.task.dedupe`)."""

    dedupe_unavailable: DedupeUnavailable = DEFAULT_DEDUPE_UNAVAILABLE
    """``lock_dedupe_unavailable``, when ZooKeeper does not answer a deduplicated call within
    the app's ``zklock_dedupe_timeout``: ``raise`` (``apply_async`` raises
    ``ZooKeeperUnavailable`` and nothing is sent) or ``send`` (the message is sent without
    deduplication, with a warning)."""

    rate: Rate | None = None
    """``lock_rate``: at most N runs per period per lock key, fleet-wide, in Celery's syntax
    (``"10/s"``, ``"100/m"``, ``"1/h"``; see :class:`~celery_zklock.RateLimit`), or None. A run
    is admitted once it holds its lock; over the rate, ``on_busy`` applies (reason ``rate``)."""

    debounce: float | None = None
    """``lock_debounce``: seconds of quiet (see :mod:`celery_zklock.task.debounce`), or None.
    Calls of one key coalesce fleet-wide: one run, with the last call's arguments, once no call
    of the key came for this long (or ``debounce_max`` after the window's first call); every
    other call is skipped (reason ``debounced``). Exclusive mode only; not per call."""

    debounce_max: float | None = None
    """``lock_debounce_max``: the longest a debounce window lasts from its first call, in
    seconds, ``>= lock_debounce``; None: :data:`DEFAULT_DEBOUNCE_MAX`, or ``lock_debounce``
    where that is longer. Only with ``lock_debounce``."""

    @property
    def debounce_cap(self) -> float:
        """The window's cap in seconds (``debounce_max`` or its default); needs ``debounce``."""
        assert self.debounce is not None
        if self.debounce_max is not None:
            return self.debounce_max
        return max(DEFAULT_DEBOUNCE_MAX, self.debounce)

    def __post_init__(self) -> None:
        naming = _naming.get() or Naming(str(self.name), f"LockOptions(name={self.name!r})")
        for field, rule in OPTIONS.items():
            value = rule.check(naming, naming.label(field), getattr(self, field))
            object.__setattr__(self, field, value)
        _check_combinations(naming, self)


def options_from_task(task_name: str, attrs: Mapping[str, object]) -> LockOptions:
    """Build a task's :class:`LockOptions` from its ``lock_*`` attributes.

    ``attrs`` maps attribute names (the keys of :data:`TASK_ATTRIBUTES`) to values; a missing
    attribute takes its default. ``lock_name=None`` means the default (the task name) and
    ``lock_key=None`` means all arguments; ``lock_timeout=None`` means *no limit*, so pass it
    only when the user set it.

    Raises :class:`~celery_zklock.errors.ConfigurationError` naming the task, the attribute, the
    bad value and what is allowed: an attribute name not in :data:`TASK_ATTRIBUTES` (a typo such
    as ``lock_on_bussy``), a mode or policy not among its choices, a timeout or countdown that is
    not a finite number ``>= 0``, a lock name that is not one znode path segment (empty, ``.``,
    ``..``, containing ``/`` or a control character), or a ``lock_key`` of the wrong shape.
    """
    context = f"task {task_name!r}"
    for attribute in attrs:
        if attribute not in TASK_ATTRIBUTES:
            raise ConfigurationError(
                f"{context}: unknown lock option {_short_repr.repr(attribute)}"
                f"{_did_you_mean(attribute, TASK_ATTRIBUTES)}; the lock options are: "
                f"{', '.join(TASK_ATTRIBUTES)}"
            )
    values = {TASK_ATTRIBUTES[attribute]: value for attribute, value in attrs.items()}
    if values.get("name") is None:
        # The task name as the default lock name: say so if it cannot be one.
        values["name"] = check_lock_name(
            context,
            "lock_name (default: the task name)",
            task_name,
            "set lock_name to a valid name; ",
        )
    values.setdefault("key", None)
    with _named(Naming(task_name, context, lambda field: f"lock_{field}")):
        return LockOptions(**values)  # type: ignore[arg-type]


def with_call_overrides(
    options: LockOptions, task_name: str, overrides: Mapping[str, object]
) -> LockOptions:
    """Return ``options`` with one call's ``zklock={...}`` overrides applied.

    Allowed keys are :data:`CALL_OVERRIDES` (``on_busy``, ``timeout``, ``on_timeout``,
    ``on_lost``, ``retry_countdown``), with the same values as the task attributes; keys not given
    keep the task's value, and ``timeout=None`` means no limit. Values are accepted as they arrive
    after a JSON round trip (strings, ``int`` or ``float`` numbers, ``null``). ``options`` itself is
    not changed.

    Raises :class:`~celery_zklock.errors.ConfigurationError` naming the task and the key when
    ``overrides`` is not a mapping, a key is not allowed (name, key and mode cannot change per
    call; neither can a semaphore's limit), or a value is not valid for its key.
    """
    context = f"task {task_name!r}"
    if not isinstance(overrides, Mapping):
        raise ConfigurationError(
            f"{context}: zklock={_short_repr.repr(overrides)} is not valid; give a dict with "
            f"some of the keys {_allowed_keys()}"
        )
    for key in overrides:
        if key not in CALL_OVERRIDES:
            fixed = ""
            per_task = ("name", "key", "mode", "limit")
            if isinstance(key, str) and key.removeprefix("lock_") in per_task:
                fixed = " (the lock name, key, mode and limit are fixed by the task, not per call)"
            raise ConfigurationError(
                f"{context}: zklock override key {_short_repr.repr(key)} is not allowed{fixed}"
                f"{_did_you_mean(key, CALL_OVERRIDES)}; allowed keys: {_allowed_keys()}"
            )
    naming = Naming(task_name, context, lambda field: f"zklock[{field!r}]")
    call = copy.copy(options)  # only the keys given are checked: the rest are valid already
    for key, value in overrides.items():
        object.__setattr__(call, key, OPTIONS[key].check(naming, naming.label(key), value))
    _check_combinations(naming, call)
    return call


def check_lock_name(context: str, label: str, value: object, advice: str = "") -> str:
    """Return ``value`` if it can be one znode path segment, else raise ConfigurationError.

    A lock name is a non-empty ``str`` of at most :data:`MAX_LOCK_NAME_LENGTH` characters, not
    ``.`` or ``..``, without ``/`` and without the characters ZooKeeper rejects in paths (NUL and
    other control characters, U+007F-U+009F, surrogates and U+E000-U+F8FF, U+FFF0-U+FFFF). Dots
    are allowed (``proj.tasks.sync``). The message starts with ``context`` (``task 'x'``), names
    ``label`` and the value, and ends with ``advice`` (if any) before the rules.
    """
    rules = (
        "a lock name is one znode path segment: a non-empty string without '/' or control "
        "characters, not '.' or '..'"
    )
    problem: str | None = None
    if not isinstance(value, str):
        problem = "is not a string"
    elif value == "":
        problem = "is empty"
    elif value in (".", ".."):
        problem = "is a relative path segment"
    elif "/" in value:
        problem = "contains '/'"
    elif len(value) > MAX_LOCK_NAME_LENGTH:
        problem = f"is longer than {MAX_LOCK_NAME_LENGTH} characters"
    else:
        bad = next((char for char in value if forbidden_in_znode(char)), None)
        if bad is not None:
            problem = f"contains the character U+{ord(bad):04X}"
    if problem is None:
        assert isinstance(value, str)
        return value
    raise ConfigurationError(
        f"{context}: {label}={_short_repr.repr(value)} {problem}; {advice}{rules}"
    )


def _choice(context: str, label: str, value: object, allowed: tuple[_T, ...]) -> _T:
    for choice in allowed:
        if value == choice and isinstance(value, str):
            return choice
    raise ConfigurationError(
        f"{context}: {label}={_short_repr.repr(value)} is not valid; allowed values: "
        f"{', '.join(repr(choice) for choice in allowed)}"
    )


def _seconds(context: str, label: str, value: object) -> float:
    return seconds(f"{context}: {label}", value, zero=True)


def _timeout(context: str, label: str, value: object) -> float | None:
    if value is None:
        return None
    return seconds(
        f"{context}: {label}", value, zero=True, advice=", or None to wait without limit"
    )


def _dedupe(context: str, label: str, value: object) -> Dedupe | None:
    if value is None:
        return None
    return _choice(context, label, value, DEDUPE_MODES)


def _flag(context: str, label: str, value: object) -> bool:
    if isinstance(value, bool):
        return value
    raise ConfigurationError(f"{context}: {label}={_short_repr.repr(value)} must be True or False")


def _positive(context: str, label: str, value: object) -> float:
    return seconds(f"{context}: {label}", value)


def _rate(context: str, label: str, value: object) -> Rate | None:
    return None if value is None else parse_rate(value, f"{context}: {label}")


def _optional_positive(context: str, label: str, value: object) -> float | None:
    return None if value is None else seconds(f"{context}: {label}", value)


def _limit(context: str, label: str, value: object) -> int | None:
    return None if value is None else positive_int(f"{context}: {label}", value)


def _check_combinations(naming: Naming, options: LockOptions) -> None:
    """The rules between options, after each option's own."""
    _check_limit_with_mode(naming, options.mode, options.limit)
    _check_several_keys(naming, options)
    _check_debounce_and_replace(naming, options)


def _check_several_keys(naming: Naming, options: LockOptions) -> None:
    """A task that locks several keys at once (a :class:`~celery_zklock.MultiLock`) is
    exclusive, and takes no option that works on one key's lock: ``preempt``, a rate, dedupe."""
    key = options.key
    if not isinstance(key, SeveralKeys) or len(key.parameters) < 2:
        return
    refused = [
        f"{naming.label(field)}={value!r}"
        for field, value, fits in (
            ("mode", options.mode, options.mode == "exclusive"),
            ("on_busy", options.on_busy, options.on_busy != "preempt"),
            ("rate", options.rate, options.rate is None),
            ("dedupe", options.dedupe, options.dedupe is None),
        )
        if not fits
    ]
    if refused:
        raise ConfigurationError(
            f"{naming.context}: {naming.label('key')} gives several keys, which are taken "
            f"together and exclusively, and {', '.join(refused)} works on one key's lock: drop "
            "it, or lock one key per task"
        )


def _check_debounce_and_replace(naming: Naming, options: LockOptions) -> None:
    """What ``lock_debounce`` and ``lock_on_busy="replace"`` combine with, refused when the
    task is defined (or, for a per-call ``on_busy``, when the call is made): both work on one
    exclusive key, and a dedupe marker would keep the *first* call where they keep the last."""
    label = naming.label
    debounce, replace = options.debounce, options.on_busy == "replace"
    if debounce is None and options.debounce_max is not None:
        raise ConfigurationError(
            f"{naming.context}: {label('debounce_max')}={options.debounce_max} is the cap of a "
            f"debounce window: set {label('debounce')} (seconds of quiet) too, or drop it"
        )
    for name, on in (("debounce", debounce is not None), ("on_busy", replace)):
        if not on:
            continue
        what = f"{label(name)}={getattr(options, name)!r}"
        refused = [
            (f"{label('mode')}={options.mode!r}", "works on one exclusive key: use "
             f"{label('mode')}='exclusive'") if options.mode != "exclusive" else None,
            (f"{label('dedupe')}={options.dedupe!r}", "keeps the newest call, and "
             f"deduplication keeps the oldest: drop {label('dedupe')}") if options.dedupe else None,
            (f"{label('key')} with several keys", "works on one key's lock: lock one key per "
             "task") if _several(options.key) else None,
        ]  # fmt: skip
        problem = next((r for r in refused if r is not None), None)
        if problem is not None:
            raise ConfigurationError(f"{naming.context}: {what} with {problem[0]}: {what} "
                                     f"{problem[1]}")  # fmt: skip
    if replace and options.rate is not None:
        raise ConfigurationError(
            f"{naming.context}: {label('on_busy')}='replace' with {label('rate')}="
            f"'{options.rate}' is not defined: over the rate use 'wait', or drop the rate"
        )
    if debounce is None:
        return
    if options.on_busy in ("skip", "raise"):
        raise ConfigurationError(
            f"{naming.context}: {label('debounce')}={debounce} with {label('on_busy')}="
            f"{options.on_busy!r}: the call that ends the window would be dropped when the lock "
            "is busy, and with it the last call's arguments; use 'wait' (the default), "
            "'replace', 'retry' or 'preempt'"
        )
    if options.debounce_max is not None and options.debounce_max < debounce:
        raise ConfigurationError(
            f"{naming.context}: {label('debounce_max')}={options.debounce_max} is shorter than "
            f"{label('debounce')}={debounce}: the cap of a window is at least its quiet period"
        )


def _several(key: object) -> bool:
    return isinstance(key, SeveralKeys) and len(key.parameters) > 1


def _check_limit_with_mode(naming: Naming, mode: LockMode, limit: int | None) -> None:
    """The rule between two options: a limit with ``semaphore``, and with it only."""
    mode_label, limit_label = naming.label("mode"), naming.label("limit")
    if mode == "semaphore" and limit is None:
        raise ConfigurationError(
            f"{naming.context}: {mode_label}='semaphore' needs {limit_label}, the most runs at "
            "once per lock key (a whole number >= 1)"
        )
    if mode != "semaphore" and limit is not None:
        raise ConfigurationError(
            f"{naming.context}: {limit_label}={limit} is only for {mode_label}='semaphore' "
            f"({mode_label}={mode!r} decides how many run at once); set "
            f"{mode_label}='semaphore' for at most {limit} at once, or drop {limit_label}"
        )


def _allowed_keys() -> str:
    return ", ".join(sorted(CALL_OVERRIDES))


def _did_you_mean(key: object, known: Mapping[str, object] | frozenset[str]) -> str:
    if not isinstance(key, str):
        return ""
    matches = difflib.get_close_matches(key, sorted(known), n=1)
    return f" (did you mean {matches[0]!r}?)" if matches else ""


@dataclass(frozen=True)
class TaskLockSpec:
    """A task's lock, compiled once when the task class is made (:meth:`compile`): its
    validated options and the function from call arguments to the lock key, from which every
    call's options (:meth:`for_call`) and lock path (:meth:`path`) follow."""

    task_name: str
    options: LockOptions
    keys: KeyBuilder
    kind: LockKind
    """The lock kind of the task's mode (:func:`~celery_zklock.locks.contenders.lock_kind`):
    every call's, as neither the mode nor the limit is per call."""
    _calls: dict[Any, LockOptions] = dataclasses.field(default_factory=dict, compare=False)
    """Each call's overrides validated once per process: their items (with each value's
    type, as ``1``, ``1.0`` and ``True`` are equal) -> the call's options."""

    @classmethod
    def compile(cls, task_class: type, name: str | None) -> TaskLockSpec:
        """Check and compile the ``lock_*`` attributes of ``task_class``, a ``ZkLockTask``
        subclass, for the task named ``name``.

        Raises :class:`~celery_zklock.errors.ConfigurationError` naming the task and the
        option: an option :func:`options_from_task` refuses, a misspelt ``lock_*`` attribute
        (it lands as a class attribute), a ``lock_key`` that does not fit the signature of the
        class's ``run`` (see :class:`~celery_zklock.task.keys.KeyBuilder`), or no name at all (a
        class-based task used before it was registered).
        """
        if not name:
            raise ConfigurationError(
                f"{task_class.__qualname__} has no task name: register an instance "
                "(app.register_task) or set its name before it is used"
            )
        # An option without a class attribute of ZkLockTask (which stays small) takes its
        # default unless the task sets it.
        attrs = {
            attr: getattr(task_class, attr) for attr in TASK_ATTRIBUTES if hasattr(task_class, attr)
        }
        attrs.update(
            (attr, value)
            for attr, value in vars(task_class).items()
            if attr.startswith("lock_") and attr not in TASK_ATTRIBUTES
        )
        # The key first: its checks know the signature (a retired format string's message
        # shows the callable that replaces it, with the task's own parameters).
        keys = KeyBuilder.for_callable(name, signature_of_run(task_class), attrs["lock_key"])
        attrs["lock_key"] = keys.lock_key
        options = options_from_task(name, attrs)
        spec = cls(name, options, keys, lock_kind(options.mode, options.limit))
        check_redelivery(name, task_class)
        expect_preempted(task_class)
        return spec

    def for_call(self, overrides: Mapping[str, object] | None) -> LockOptions:
        """The options of one call: the task's, with the call's ``zklock={...}`` applied
        (validated at their first use in this process, then remembered)."""
        if not overrides:
            return self.options if overrides is None else self._overridden(overrides)
        try:
            seen = frozenset((key, type(value), value) for key, value in overrides.items())
            options = self._calls.get(seen)
        except (TypeError, AttributeError):  # not hashable, or not a mapping: validate to say why
            return self._overridden(overrides)
        if options is None:
            options = self._overridden(overrides)
            if len(self._calls) >= MAX_REMEMBERED_OVERRIDES:
                self._calls.clear()
            self._calls[seen] = options
        return options

    def _overridden(self, overrides: Mapping[str, object]) -> LockOptions:
        return with_call_overrides(self.options, self.task_name, overrides)

    def resolve(self, root: str, args: Any, kwargs: Any, options: LockOptions) -> LockedCall:
        """One call resolved, as the worker's gate holds it: its ``options`` (:meth:`for_call`'s),
        its lock paths (:meth:`paths`) and its lock kind (:attr:`kind`). Raises what
        :meth:`paths` raises."""
        paths = self.paths(root, args, kwargs)
        return LockedCall(options, paths, self.kind, PATHS_JOINED_BY.join(paths))

    def path(self, root: str, args: Any, kwargs: Any) -> str:
        """The lock path of one call: ``<root>/<lock name>/<key of the arguments>``, ``root``
        being the app's ``zklock_root`` (the lock name is never per call). Raises what
        :meth:`KeyBuilder.__call__ <celery_zklock.task.keys.KeyBuilder.__call__>` raises."""
        return f"{root}/{self.options.name}/{self.keys(args, kwargs)}"

    def paths(self, root: str, args: Any, kwargs: Any, request: Any = None) -> tuple[str, ...]:
        """Every lock path of one call, sorted: one, or several for a ``lock_key`` of several
        keys (see :meth:`KeyBuilder.keys <celery_zklock.task.keys.KeyBuilder.keys>`, which
        raises for arguments the key cannot take). For a run's ``request``, the paths the gate
        resolved for this very attempt (:data:`PATHS_FIELD`) when it did, as they are: the run
        does not build the key again."""
        carried = getattr(request, PATHS_FIELD, None)  # None without a request
        if isinstance(carried, (list, tuple)) and len(carried) == 2:
            paths, retries = carried
            if (
                retries == (request.retries or 0)
                and isinstance(paths, (list, tuple))
                and paths
                and all(isinstance(path, str) for path in paths)
            ):
                return tuple(paths)
        prefix = f"{root}/{self.options.name}/"
        return tuple(map(prefix.__add__, self.keys.keys(args, kwargs)))  # prefix + each key

    def key_path(self, root: str, args: Any, kwargs: Any) -> str:
        """:meth:`path` from the key's arguments only (an operator's question, see
        :meth:`KeyBuilder.of_key_arguments <celery_zklock.task.keys.KeyBuilder.of_key_arguments>`):
        the same path for the same key."""
        return f"{root}/{self.options.name}/{self.keys.of_key_arguments(args, kwargs)}"


@dataclass(frozen=True)
class LockedCall:
    """One call of a locked task as the worker's gate resolves it
    (:meth:`TaskLockSpec.resolve`): its options (the task's with the call's overrides), its lock
    paths (sorted; several for a ``lock_key`` of several keys), the lock kind of its mode and,
    for messages and the gate's lines, its ``path``: the one path, or every path joined by
    :data:`PATHS_JOINED_BY`. The gate's paths reach the run (:data:`PATHS_FIELD`)."""

    options: LockOptions
    paths: tuple[str, ...]
    kind: LockKind
    path: str


class RedeliveryWarning(UserWarning):
    """A locked task's delivery options lose its call in a case the user may not expect."""


_warned_redelivery: set[str] = set()
_warned_lock = threading.Lock()


def check_redelivery(task_name: str, task: object) -> None:
    """Warn (:class:`RedeliveryWarning`, once per task name and process) when ``task`` (a task
    class or instance) acknowledges late without ``reject_on_worker_lost``: Celery's rule then
    loses the call of a pool process that dies. Values still None (not set on the task) are
    not judged: they come from the app's ``task_acks_late`` / ``task_reject_on_worker_lost``
    when the task is bound, and a worker checks them again then
    (:mod:`celery_zklock.worker.gate`)."""
    if not getattr(task, "acks_late", None) or getattr(task, "reject_on_worker_lost", None):
        return
    with _warned_lock:
        if task_name in _warned_redelivery:
            return
        _warned_redelivery.add(task_name)
    warnings.warn(
        f"task {task_name!r}: acks_late without reject_on_worker_lost: if the process running "
        "it dies (kill -9, the OOM killer, a crash), Celery acknowledges its message and ends "
        "the task FAILURE (WorkerLostError), so the call is never run again; its lock goes when "
        "the dead process's ZooKeeper session expires. Set reject_on_worker_lost=True (or "
        "task_reject_on_worker_lost) to have the broker deliver it again: the copy waits for "
        "the dead run's lock node to go, then runs.",
        RedeliveryWarning,
        stacklevel=2,
    )


def signature_of_run(task_class: type) -> inspect.Signature:
    """The signature callers use: without ``self`` for bound tasks and class-based ``run``."""
    raw = inspect.getattr_static(task_class, "run")
    if isinstance(raw, staticmethod):
        return inspect.signature(raw.__func__)
    signature = inspect.signature(raw)
    return signature.replace(parameters=list(signature.parameters.values())[1:])


CALL_OPTION: Final = "zklock"
"""The ``apply_async`` keyword (and message header) of a call's lock option overrides."""

RECEIVED_OPTION: Final = "zklock_received"
"""The request field in which the worker's gate (:mod:`celery_zklock.worker.gate`) tells the run
when the call reached the gate, as ``[time.time(), retries]``: a ``wait`` counts ``lock_timeout``
from there. A retry's message carries its first attempt's field along; the run takes it only when
its ``retries`` are the run's own (an older gate's bare number is taken as it is)."""
RECEIPT_FIELD: Final = "zklock_receipt"
"""The request field in which the worker's main process notes when it received the message
(``time.time()``, before any ETA wait): the gate's broker bound counts from there."""


BEHIND_ITSELF_FIELD: Final = "zklock_behind_itself"
"""The request field in which the worker's gate notes that it held the call behind a run of the
same task id (a resend, or a copy, of a call still running then): its run looks whether that
call ended before running the body (see :mod:`celery_zklock.task.delivery`)."""

PATHS_JOINED_BY: Final = " + "
"""How a call's several lock paths read as one path, in messages and the gate's lines."""

PATHS_FIELD: Final = "zklock_paths"
"""The request field in which the worker's gate tells the run the lock paths it resolved for
the call, as ``[[path, ...], retries]``, so the run does not build the key again; taken only
for the attempt the gate resolved (as :data:`RECEIVED_OPTION`)."""


def received_at(request: Any) -> float | None:
    """When the call of ``request`` (a task's request context) reached its worker's gate,
    if the gate said so for this very attempt (see :data:`RECEIVED_OPTION`)."""
    value = getattr(request, RECEIVED_OPTION, None)
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, (list, tuple)) and len(value) == 2:
        at, retries = value
        if isinstance(at, (int, float)) and retries == (request.retries or 0):
            return float(at)
    return None


def request_overrides(request: Any) -> Mapping[str, Any] | None:
    """The per-call ``zklock`` overrides a request carries, if any (in a worker a message's
    custom headers become request attributes; elsewhere they stay in ``headers``)."""
    overrides = getattr(request, CALL_OPTION, None)
    if overrides is None:
        overrides = (getattr(request, "headers", None) or {}).get(CALL_OPTION)
    return overrides if isinstance(overrides, Mapping) else None
