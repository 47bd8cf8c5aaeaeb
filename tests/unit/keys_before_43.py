"""celery_zklock/task/keys.py before issue 43's restructuring (commit 5ec7393), frozen: the old
version ``test_keys_unchanged.py`` compares the new one with, value for value (keys name
ZooKeeper nodes, so a fleet mixing both versions must compute the same names). Do not change it.
"""

from __future__ import annotations

import contextlib
import datetime
import decimal
import enum
import hashlib
import inspect
import json
import re
import reprlib
import string
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final, Literal, TypeAlias

from celery_zklock.errors import ConfigurationError

__all__ = [
    "MAX_KEY_LENGTH",
    "KeyBuilder",
    "LockKeyError",
    "LockKeySpec",
    "SeveralKeys",
    "canonical_json",
    "check_lock_key_spec",
    "key_for_value",
]

MAX_KEY_LENGTH: Final = 100
"""Upper bound on the length of every key this module returns."""

PREFIX_LENGTH: Final = 64
"""Length of the readable part of a key before the ``~``."""

HASH_LENGTH: Final = 32
"""Number of hex characters of SHA-256 kept in a key (128 bits)."""

MAX_DEPTH: Final = 100
"""Deepest nesting of containers accepted in a value (deeper raises :class:`LockKeyError`)."""

LockKeySpec: TypeAlias = (
    "Sequence[str] | str | Mapping[str, str | Sequence[str]] | SeveralKeys | Callable[..., object]"
    " | None"
)
"""What a task's ``lock_key`` may be: see the module docstring."""

KeyKind = Literal["all", "names", "callable", "several"]

# The JSON-like form every value is reduced to before it is encoded.
_Json: TypeAlias = "bool | int | str | list[_Json] | dict[str, _Json] | None"

# Tag key of the tagged forms ({"__t": "uuid", "v": "..."}). A user dict that has this key itself
# is wrapped as {"__t": "dict", "v": {...}}, so a user dict can never pass for a tagged value.
_TAG: Final = "__t"

# Integers are JSON numbers; json refuses to write ints of more than 4300 digits.
_MAX_INT_DIGITS: Final = 4000
_MAX_INT_BITS: Final = 14_000  # 2**14000 has 4215 digits

_UNSAFE_CHARS: Final = re.compile(r"[^A-Za-z0-9._,=+@-]")

_SUPPORTED: Final = (
    "None, bool, int, float, str, list, tuple, dict with str keys, set, frozenset, bytes, "
    "Decimal, UUID, datetime, date, time or Enum"
)

# str() of a Decimal follows the thread's context (``capitals``): pin one.
_DECIMAL_CONTEXT: Final = decimal.Context(capitals=1)

_short_repr = reprlib.Repr()
_short_repr.maxstring = 60
_short_repr.maxother = 60


class LockKeyError(ConfigurationError):
    """A lock key could not be built from a call's argument values.

    Raised at call time when an argument (or a callable ``lock_key``'s return value) has no
    stable canonical encoding, for example an arbitrary
    object whose only text form contains its memory address. The message names the task, the
    argument (with the path inside it) and the offending type, and what to do instead. Retrying
    the same call fails the same way.
    """


@dataclass(frozen=True)
class SeveralKeys:
    """A ``lock_key`` of several keys, normalised: one key per parameter of ``parameters``, each
    the key of ``{name: value}`` (what ``lock_key=[name]`` gives for that value)."""

    name: str
    parameters: tuple[str, ...]


class _Unencodable(Exception):
    """Internal: a value at ``path`` cannot be encoded; turned into :class:`LockKeyError`."""

    def __init__(self, path: str, value: object, reason: str) -> None:
        super().__init__(path, reason)
        self.path = path
        self.type_name = _type_name(value)
        self.reason = reason


def _type_name(value: object) -> str:
    cls = type(value)
    if cls.__module__ == "builtins":
        return cls.__qualname__
    return f"{cls.__module__}.{cls.__qualname__}"


def _tag(tag: str, value: _Json) -> _Json:
    return {_TAG: tag, "v": value}


def _number(value: int | float | decimal.Decimal, path: str) -> _Json:
    """The canonical form of a number: equal numbers (``==``) get equal forms.

    ``bool``, ``int``, ``float`` and ``Decimal`` compare by value in Python (``True == 1 ==
    1.0 == Decimal("1.00")``), and so do their keys: a number equal to an integer is that JSON
    integer, any other finite number ``{"__t": "num", "v": "<digits>E<exponent>"}``, its exact
    value with the trailing zeros of its digits stripped (a float's exact binary value, so
    ``0.5 == Decimal("0.5")`` share a form and ``0.1 != Decimal("0.1")`` do not). Infinities
    are ``"Infinity"`` and ``"-Infinity"``; every NaN is ``"NaN"`` (NaN equals nothing, not even
    itself, but a key must equal itself).
    """
    if isinstance(value, int):  # bool too
        number = int.__int__(value)
        # (str() of an int of more than 4300 digits raises: look at the bits first)
        if number.bit_length() > _MAX_INT_BITS or len(str(abs(number))) > _MAX_INT_DIGITS:
            raise _Unencodable(path, value, f"it has more than {_MAX_INT_DIGITS} digits")
        return number
    exact = decimal.Decimal(float.__float__(value)) if isinstance(value, float) else value
    if exact.is_nan():
        return _tag("num", "NaN")
    if exact.is_infinite():
        return _tag("num", "-Infinity" if exact.is_signed() else "Infinity")
    sign, digits, exponent = exact.as_tuple()
    assert isinstance(exponent, int)
    text = "".join(map(str, digits)).lstrip("0")
    if not text:
        return 0
    stripped = text.rstrip("0")
    exponent += len(text) - len(stripped)
    if exponent >= 0:
        if len(stripped) + exponent > _MAX_INT_DIGITS:
            raise _Unencodable(path, value, f"it has more than {_MAX_INT_DIGITS} digits")
        return int(f"{'-' if sign else ''}{stripped}{'0' * exponent}")
    return _tag("num", f"{'-' if sign else ''}{stripped}E{exponent}")


def _normalise(value: object, path: str, depth: int, active: set[int]) -> _Json:
    """Reduce ``value`` to its canonical JSON-like form or raise :class:`_Unencodable`.

    ``active`` holds the ids of the containers being normalised on the way down, to detect a
    container that contains itself.
    """
    if depth > MAX_DEPTH:
        raise _Unencodable(path, value, f"it is nested more than {MAX_DEPTH} levels deep")
    if value is None:
        return value
    # Enum first: IntEnum and StrEnum members are also ints and strs. An Enum member stands for
    # its value, so the key is the same whether the caller passed the member or the raw value
    # (Celery's JSON serializer turns an IntEnum into a plain int on the way to the worker).
    if isinstance(value, enum.Enum):
        return _normalise(value.value, f"{path}.value", depth + 1, active)
    # Subclasses of str/int/float are reduced to the exact base type so that an overridden
    # __str__ or __repr__ cannot change the encoding.
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int | float | decimal.Decimal):
        return _number(value, path)
    if isinstance(value, list | tuple | dict):
        if id(value) in active:
            raise _Unencodable(path, value, "it contains itself")
        active.add(id(value))
        try:
            if isinstance(value, dict):
                return _normalise_dict(value, path, depth, active)
            return [
                _normalise(item, f"{path}[{index}]", depth + 1, active)
                for index, item in enumerate(value)
            ]
        finally:
            active.discard(id(value))
    if isinstance(value, set | frozenset):
        items = [_normalise(item, f"{path}{{...}}", depth + 1, active) for item in value]
        return _tag("set", sorted(items, key=_dumps))
    if isinstance(value, bytes | bytearray):
        return _tag("bytes", bytes(value).hex())
    if isinstance(value, uuid.UUID):
        return _tag("uuid", str(uuid.UUID(int=value.int)))
    if isinstance(value, datetime.datetime):
        # Equal aware datetimes are equal instants: encode them in UTC so that the same instant
        # given in two time zones is the same key. Naive ones stay as they are (no offset).
        # (Near datetime.min/max the conversion overflows: such a value keeps its own offset,
        # which still never matches a converted one.)
        if value.utcoffset() is not None:
            with contextlib.suppress(OverflowError):
                value = value.astimezone(datetime.timezone.utc)
        return _tag("datetime", datetime.datetime.isoformat(value))
    if isinstance(value, datetime.date):
        return _tag("date", datetime.date.isoformat(value))
    if isinstance(value, datetime.time):
        return _tag("time", datetime.time.isoformat(value))
    raise _Unencodable(path, value, "it has no stable encoding")


def _normalise_dict(value: Mapping[Any, object], path: str, depth: int, active: set[int]) -> _Json:
    out: dict[str, _Json] = {}
    for key, item in value.items():
        if not isinstance(key, str):
            raise _Unencodable(
                path, value, f"it has a key of type {_type_name(key)} (only str keys are supported)"
            )
        name = str.__str__(key)
        out[name] = _normalise(item, f"{path}[{_short_repr.repr(name)}]", depth + 1, active)
    return _wrap_dict(out)


def _wrap_dict(out: dict[str, _Json]) -> _Json:
    return _tag("dict", out) if _TAG in out else out


# One encoder for every key: json.dumps with options builds a new encoder per call.
_CANONICAL_ENCODER: Final = json.JSONEncoder(
    sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False
)


def _dumps(normalised: _Json) -> str:
    return _CANONICAL_ENCODER.encode(normalised)


def _value_error(exc: _Unencodable) -> LockKeyError:
    return LockKeyError(
        f"cannot encode {exc.path} of type {exc.type_name}: {exc.reason}; use {_SUPPORTED}"
    )


def canonical_json(value: object) -> str:
    """Return the canonical JSON text of ``value``: equal inputs give equal text everywhere.

    The text is ASCII JSON with sorted object keys and no spaces, over this normalised form:

    * ``None`` and ``str`` (and subclasses of ``str``) as themselves.
    * numbers (``bool``, ``int``, ``float``, ``Decimal``, and their subclasses) by value, so that
      equal numbers give equal text: a number equal to an integer as that JSON integer (``1``,
      ``1.0``, ``True`` and ``Decimal("1.00")`` are all ``1``; ``-0.0`` is ``0``), any other as
      ``{"__t": "num", "v": "<digits>E<exponent>"}`` of its exact value (``0.5`` is
      ``"5E-1"``, like ``Decimal("0.5")``), ``"Infinity"``, ``"-Infinity"`` or ``"NaN"``.
    * ``list`` and ``tuple`` both as a JSON array: ``[1, 2]`` and ``(1, 2)`` give the *same* text,
      deliberately, as a tuple arrives in the worker as a list after a JSON round trip.
    * ``dict`` with ``str`` keys as a JSON object (a dict whose keys include ``"__t"`` is wrapped as
      ``{"__t": "dict", "v": {...}}`` so it never looks like a tagged value). Other keys raise.
    * ``Enum`` members as their value (so ``Color.RED`` and ``1`` give the same text when
      ``Color.RED.value == 1``).
    * tagged forms ``{"__t": tag, "v": text}``: ``bytes``/``bytearray`` (``"bytes"``, hex),
      ``UUID`` (``"uuid"``), ``datetime`` (``"datetime"``, ISO 8601; aware ones converted to UTC
      so equal instants match), ``date``, ``time``, and ``set``/``frozenset`` (``"set"``, the
      elements sorted by their canonical text; ``set`` and ``frozenset`` give the same text).

    Raises :class:`LockKeyError` naming the path inside ``value`` and the type that cannot be
    encoded (any other type, a dict with a non-``str`` key, a container that contains itself,
    nesting deeper than :data:`MAX_DEPTH`, or an integer of more than 4000 digits).
    """
    try:
        return _dumps(_normalise(value, "value", 0, set()))
    except _Unencodable as exc:
        raise _value_error(exc) from None


def _render(normalised: _Json, limit: int, top: bool = False) -> str:
    """Short human-readable text of a normalised value; stops growing once past ``limit``."""
    if normalised is None or isinstance(normalised, bool | int):
        return repr(normalised)
    if isinstance(normalised, str):
        return normalised[: limit + 1]
    if isinstance(normalised, list):
        return "[" + _render_items((_render(item, limit) for item in normalised), limit) + "]"
    if _TAG in normalised:
        tag, inner = normalised[_TAG], normalised["v"]
        if tag == "dict" and isinstance(inner, dict):
            return _render_dict(inner, limit, top)
        if tag == "set" and isinstance(inner, list):
            return "{" + _render_items((_render(item, limit) for item in inner), limit) + "}"
        if tag == "num" and isinstance(inner, str):
            return _render_number(inner)
        return _render(inner, limit)
    return _render_dict(normalised, limit, top)


def _render_number(text: str) -> str:
    """``0.1`` for a float's exact value, the decimal text for a value no float has."""
    exact = decimal.Decimal(text)
    nearest = float(exact)
    if decimal.Decimal(nearest) == exact:
        return repr(nearest)
    with decimal.localcontext(_DECIMAL_CONTEXT):
        return str(exact)


def _render_dict(normalised: dict[str, _Json], limit: int, top: bool) -> str:
    items = (f"{name}={_render(normalised[name], limit)}" for name in sorted(normalised))
    text = _render_items(items, limit)
    return text if top else "{" + text + "}"


def _render_items(items: Iterable[str], limit: int) -> str:
    parts: list[str] = []
    length = 0
    for item in items:
        parts.append(item)
        length += len(item) + 1
        if length > limit:
            break
    return ",".join(parts)


def _key_from_normalised(normalised: _Json) -> str:
    digest = hashlib.sha256(_dumps(normalised).encode("ascii")).hexdigest()[:HASH_LENGTH]
    prefix = _UNSAFE_CHARS.sub("_", _render(normalised, PREFIX_LENGTH, top=True)[:PREFIX_LENGTH])
    return f"{prefix}~{digest}"


def key_for_value(value: object) -> str:
    """Return the lock key (``<readable-prefix>~<hash>``) of one value.

    This is the key a task gets when its ``lock_key`` resolves to ``value``: a dict of parameter
    names to argument values for ``None``, a name or a list of names, the return value for a
    callable. Raises :class:`LockKeyError` as
    :func:`canonical_json` does.
    """
    try:
        return _key_from_normalised(_normalise(value, "value", 0, set()))
    except _Unencodable as exc:
        raise _value_error(exc) from None


def check_lock_key_spec(
    task_name: str, lock_key: object, signature: inspect.Signature | None = None
) -> LockKeySpec:
    """Check the shape of a ``lock_key`` and return it normalised.

    Returns ``None``, the callable, or a ``tuple`` of names: a ``str`` is one parameter name
    (``"account_id"`` becomes ``("account_id",)``, the same key as ``["account_id"]``). Raises
    :class:`~celery_zklock.errors.ConfigurationError` naming the task and ``lock_key`` when the
    value is of another type, is ``bytes``, is a sequence holding a non-``str`` or a name twice,
    or is a string containing ``{`` (a retired format string: the message shows the callable
    that replaces it, with the task's parameters when ``signature`` is given). That names exist
    in the task's signature is checked by :class:`KeyBuilder`.
    """
    if lock_key is None or isinstance(lock_key, SeveralKeys):
        return lock_key
    if isinstance(lock_key, Mapping):
        return _several_keys(task_name, lock_key)
    if isinstance(lock_key, str):
        if "{" in lock_key:
            raise ConfigurationError(_format_string_retired(task_name, lock_key, signature))
        lock_key = (lock_key,)
    elif callable(lock_key):
        return lock_key
    if isinstance(lock_key, Sequence) and not isinstance(lock_key, bytes | bytearray):
        names: list[str] = []
        for name in lock_key:
            if not isinstance(name, str):
                raise ConfigurationError(
                    f"task {task_name!r}: lock_key lists {_short_repr.repr(name)} of type "
                    f"{_type_name(name)}; a list lock_key holds parameter names (str)"
                )
            if name in names:
                raise ConfigurationError(
                    f"task {task_name!r}: lock_key lists the parameter {name!r} twice"
                )
            names.append(name)
        return tuple(names)
    raise ConfigurationError(
        f"task {task_name!r}: lock_key={_short_repr.repr(lock_key)} of type "
        f"{_type_name(lock_key)} is not valid; give None (all arguments), a parameter name, a "
        f"list of parameter names, a callable taking the task's arguments, or {{name: [parameter, "
        f"...]}} for several keys"
    )


def _several_keys(task_name: str, lock_key: Mapping[object, object]) -> SeveralKeys:
    """``{name: parameter}`` or ``{name: [parameter, ...]}`` as a :class:`SeveralKeys`."""
    usage = (
        "a mapping lock_key has one entry, the key's name and the parameters that each give "
        'one key, e.g. lock_key={"account_id": ["src", "dst"]}'
    )
    if len(lock_key) != 1:
        raise ConfigurationError(
            f"task {task_name!r}: lock_key has {len(lock_key)} entries; {usage}"
        )
    [(name, parameters)] = lock_key.items()
    if isinstance(parameters, str):
        parameters = (parameters,)
    if (
        not isinstance(name, str)
        or not isinstance(parameters, Sequence)
        or isinstance(parameters, bytes | bytearray)
        or not parameters
        or not all(isinstance(p, str) for p in parameters)
    ):
        raise ConfigurationError(
            f"task {task_name!r}: lock_key={_short_repr.repr(dict(lock_key))} is not valid; {usage}"
        )
    if len(set(parameters)) != len(parameters):
        raise ConfigurationError(f"task {task_name!r}: lock_key lists a parameter twice; {usage}")
    return SeveralKeys(name, tuple(parameters))


_FString: TypeAlias = tuple[str, list[str]]
_FIELD_ROOT: Final = re.compile(r"[^.\[]*")
_FIELD_LOOKUP: Final = re.compile(r"\.([^.\[]+)|\[([^\]]+)\]")


def _format_string_retired(
    task_name: str, lock_key: str, signature: inspect.Signature | None
) -> str:
    """The refusal of a format-string ``lock_key``, with the lambda that replaces it."""
    try:
        parsed = list(string.Formatter().parse(lock_key))
        body, roots = _as_f_string(parsed)
    except ValueError:  # not even a valid format string: show it as it is
        body, roots = f"f{lock_key!r}", []
    if signature is not None:  # the task's own parameters, so positional calls still fit
        plain = [p.replace(annotation=p.empty) for p in signature.parameters.values()]
        parameters = str(signature.replace(parameters=plain, return_annotation=signature.empty))
        parameters = parameters[1:-1]
    else:
        parameters = ", ".join([*dict.fromkeys(r for r in roots if r.isidentifier()), "**_"])
    return (
        f"task {task_name!r}: lock_key={lock_key!r} is a format string, and format-string keys "
        f"are retired (a plain string is one parameter name); give lock_key a callable, called "
        f"with the task's arguments, whose return value is the key: "
        f"lock_key=lambda {parameters}: {body}"
    )


def _as_f_string(
    parsed: list[tuple[str, str | None, str | None, str | None]],
) -> tuple[str, list[str]]:
    """The f-string that formats as ``str.format`` did, and the fields' root names
    (``{payload[id]}`` becomes ``{payload['id']}``: an f-string would look ``id`` up)."""
    parts: list[str] = []
    roots: list[str] = []
    for literal, field, spec, conversion in parsed:
        parts.append(literal.replace("{", "{{").replace("}", "}}"))
        if field is None:
            continue
        root = _FIELD_ROOT.match(field).group()  # type: ignore[union-attr]
        if not root.isidentifier():
            raise ValueError(f"positional field {{{field}}}")
        roots.append(root)
        lookups = "".join(
            f".{attr}" if attr else f"[{int(key) if key.isdigit() else key!r}]"
            for attr, key in _FIELD_LOOKUP.findall(field[len(root) :])
        )
        parts.append(
            "{"
            + root
            + lookups
            + (f"!{conversion}" if conversion else "")
            + (f":{spec}" if spec else "")
            + "}"
        )
    body = "".join(parts)
    if '"' in body or "\\" in body:
        raise ValueError("quotes or backslashes")
    return f'f"{body}"', roots


class KeyBuilder:
    """Computes a task's lock key from its call arguments, according to its ``lock_key``.

    Build one per task at definition time with :meth:`for_callable`, which validates the
    ``lock_key`` against the task's signature and raises
    :class:`~celery_zklock.errors.ConfigurationError` naming the task when it cannot work. Then
    call it with each call's ``(args, kwargs)``; it is stateless and thread-safe.
    """

    __slots__ = ("_names", "kind", "lock_key", "signature", "task_name")

    def __init__(self, task_name: str, signature: inspect.Signature, lock_key: object) -> None:
        """Prefer :meth:`for_callable`; same arguments, same checks."""
        spec = check_lock_key_spec(task_name, lock_key, signature)
        self.task_name: Final = task_name
        self.signature: Final = signature
        self.lock_key: Final[LockKeySpec] = spec
        self._names: tuple[str, ...] = ()
        kind: KeyKind
        if spec is None:
            kind = "all"
        elif isinstance(spec, tuple | SeveralKeys):
            kind = "names" if isinstance(spec, tuple) else "several"
            self._names = spec if isinstance(spec, tuple) else spec.parameters
            for name in self._names:
                if name not in signature.parameters:
                    raise ConfigurationError(
                        f"task {task_name!r}: lock_key names {name!r}, which is not a "
                        f"parameter of the task; its parameters are: "
                        f"{_list(list(signature.parameters))}"
                    )
        else:
            kind = "callable"
        self.kind: Final[KeyKind] = kind

    @classmethod
    def for_callable(
        cls, task_name: str, signature: inspect.Signature, lock_key: LockKeySpec
    ) -> KeyBuilder:
        """Validate ``lock_key`` against ``signature`` and return the task's key builder.

        ``signature`` is the signature the task is called with (for a bound Celery task,
        ``inspect.signature(task.run)``, which already excludes ``self``).

        Raises :class:`~celery_zklock.errors.ConfigurationError` naming the task: a name that is
        not a parameter (with the list of parameters), a format string (with the callable that
        replaces it), or a ``lock_key`` of an unsupported type.
        """
        return cls(task_name, signature, lock_key)

    def _bind(self, args: Sequence[object], kwargs: Mapping[str, object]) -> dict[str, object]:
        try:
            bound = self.signature.bind(*args, **kwargs)
        except TypeError as exc:
            raise TypeError(f"task {self.task_name!r}: {exc}") from exc
        bound.apply_defaults()
        return dict(bound.arguments)

    def canonical(self, args: Sequence[object], kwargs: Mapping[str, object]) -> str:
        """The canonical JSON text the key of this call is the hash of (for logs and tools).

        Raises what :meth:`__call__` raises.
        """
        return _dumps(self._normalised(args, kwargs))

    def __call__(self, args: Sequence[object], kwargs: Mapping[str, object]) -> str:
        """Return the lock key of one call: ``<readable-prefix>~<32 hex>``.

        Raises ``TypeError`` (its message prefixed with the task name) when the arguments do not
        fit the task's signature or give several keys (see :meth:`keys`), :class:`LockKeyError`
        when a value has no stable encoding, and whatever a callable ``lock_key`` raises.
        """
        return _key_from_normalised(self._normalised(args, kwargs))

    def keys(self, args: Sequence[object], kwargs: Mapping[str, object]) -> tuple[str, ...]:
        """Every lock key of one call, sorted, each once: one, but for a ``lock_key`` of
        several keys (:class:`SeveralKeys`), which gives one per distinct value. Raises what
        :meth:`__call__` raises, but never for several keys."""
        if self.kind != "several":
            return (self(args, kwargs),)
        return tuple(sorted(self._each_key(self._bind(args, kwargs))))

    def _each_key(self, arguments: Mapping[str, object]) -> dict[str, _Json]:
        """Several keys: each distinct key of the call, with its canonical value."""
        assert isinstance(self.lock_key, SeveralKeys)
        name = self.lock_key.name
        values = (
            _wrap_dict({name: self._encode(arguments[parameter], name, f"argument {parameter!r}")})
            for parameter in self._names
        )
        return {_key_from_normalised(value): value for value in values}

    def _only(self, each_key: dict[str, _Json]) -> _Json:
        """The canonical value of a several-keys call that gives one key; else TypeError."""
        if len(each_key) == 1:
            return next(iter(each_key.values()))
        raise TypeError(
            f"task {self.task_name!r} locks {len(each_key)} keys for these arguments (lock_key="
            f"{self._spelled()}): ask for one key's lock through a task that locks it alone"
        )

    def of_key_arguments(self, args: Sequence[object], kwargs: Mapping[str, object]) -> str:
        """The lock key from the arguments it is made of, as an operator asks "who holds
        account x?" (``task.lock_path("x")``): when ``lock_key`` names parameters, only those
        are needed, the others may be left out. Positional arguments bind in the signature's
        order (give a later parameter by name). Any other ``lock_key`` needs the whole call,
        as :meth:`__call__`.

        Raises ``TypeError`` naming the task and the key's missing arguments, or arguments
        that fit no parameter; otherwise what :meth:`__call__` raises.
        """
        if self.kind not in ("names", "several"):
            return self(args, kwargs)
        try:
            bound = self.signature.bind_partial(*args, **kwargs)
        except TypeError as exc:
            raise TypeError(f"task {self.task_name!r}: {exc}") from exc
        bound.apply_defaults()
        missing = [name for name in self._names if name not in bound.arguments]
        if missing:
            raise TypeError(
                f"task {self.task_name!r}: missing the lock key's argument"
                f"{'s' if len(missing) > 1 else ''} {', '.join(map(repr, missing))} (lock_key="
                f"{self._spelled()}; the task's other arguments may be left out)"
            )
        if self.kind == "several":
            return _key_from_normalised(self._only(self._each_key(bound.arguments)))
        return _key_from_normalised(self._encode_arguments(dict(bound.arguments)))

    def _spelled(self) -> str:
        spec = self.lock_key
        if isinstance(spec, SeveralKeys):
            return repr({spec.name: list(self._names)})
        return str(list(self._names))

    def _normalised(self, args: Sequence[object], kwargs: Mapping[str, object]) -> _Json:
        arguments = self._bind(args, kwargs)
        if self.kind == "several":
            return self._only(self._each_key(arguments))
        if self.kind == "callable":
            assert callable(self.lock_key)
            function = self.lock_key
            value = function(*args, **kwargs)
            where = f"the value returned by lock_key {_callable_name(function)}"
            return self._encode(value, "value", where)
        return self._encode_arguments(arguments)

    def _encode_arguments(self, arguments: dict[str, object]) -> _Json:
        if self.kind == "names":
            arguments = {name: arguments[name] for name in self._names}
        return _wrap_dict(
            {
                name: self._encode(value, name, f"argument {name!r}")
                for name, value in arguments.items()
            }
        )

    def _encode(self, value: object, path: str, where: str) -> _Json:
        try:
            return _normalise(value, path, 0, set())
        except _Unencodable as exc:
            inside = "" if exc.path == path else f" at {exc.path}"
            raise LockKeyError(
                f"task {self.task_name!r}: cannot build the lock key from {where}: the value"
                f"{inside} is of type {exc.type_name} and {exc.reason}; pass {_SUPPORTED}, "
                f"or give lock_key a callable that returns such a value"
            ) from None

    def __repr__(self) -> str:
        return f"KeyBuilder({self.task_name!r}, kind={self.kind!r}, lock_key={self.lock_key!r})"


def _list(names: list[str]) -> str:
    return ", ".join(names) if names else "(none)"


def _callable_name(function: Callable[..., object]) -> str:
    name = getattr(function, "__qualname__", None) or type(function).__qualname__
    return str(name)
