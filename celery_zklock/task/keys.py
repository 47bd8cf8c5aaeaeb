"""Lock keys: from a task's call arguments to a canonical, hashed, znode-safe name.

A task's lock lives at ``<root>/<lock_name>/<key>``. The key is computed in the worker for every
call, so it must be the same for equal arguments in every process and every Python run, and must
differ for arguments that are not equal. This module guarantees both:

* Arguments are first reduced to a *canonical value* (see :func:`canonical_json`): JSON-like data
  with a fixed encoding, never ``hash()`` and never the ``repr`` of arbitrary objects. A value that
  has no stable encoding raises :class:`LockKeyError` instead of producing an unstable key.
* The key is ``<readable-prefix>~<hash>``: ``hash`` is the first 32 hex characters of the SHA-256 of
  the canonical JSON, so two different canonical values never share a key even when their readable
  prefixes are truncated to the same text. The prefix (at most 64 characters of
  ``[A-Za-z0-9._,=+@-]``, every other character replaced by ``_``) is only for humans reading the
  tree. The key is at most :data:`MAX_KEY_LENGTH` characters, is never ``.`` or ``..`` and never
  contains ``/`` or a control character, so it is always one valid znode name.

Which value is hashed depends on the task's ``lock_key`` (a :data:`LockKeySpec`):

* ``None``: every argument, bound to the task's signature with defaults applied, as a dict of
  parameter name to value. ``f(1)``, ``f(x=1)`` and ``f(1, full=False)`` give the same key for
  ``def f(x, full=False)``.
* a list or tuple of parameter names: the same dict restricted to those names; ``[]`` gives one
  fixed key (a singleton lock for the task). A ``*args`` parameter's value is its tuple, a
  ``**kwargs`` parameter's value its dict.
* a ``str``: one parameter name, the same as a list of that one name (``lock_key="account_id"``
  gives one lock per account). A string containing ``{`` is refused when the task class is made:
  format strings are retired (a callable does what they did, see ``docs/migration.md``).
* a callable: called as ``fn(*args, **kwargs)`` with the task's call arguments; its return value is
  the canonical value. Exceptions it raises propagate unchanged.
* a one-entry mapping ``{name: parameter}`` or ``{name: [parameter, ...]}`` (:class:`SeveralKeys`):
  one key per listed parameter, each the key a task with ``lock_key=[name]`` gets for that value
  (``lock_key={"account_id": ["src", "dst"]}`` locks the accounts ``src`` and ``dst`` as
  ``sync_account(account_id)`` with ``lock_key=["account_id"]`` does, under a shared
  ``lock_name``). Equal values give one key; the keys come sorted (see
  ``docs/multilock-and-preempt.md``).

Keys depend on the canonical value only, so tasks that share a ``lock_name`` share a lock for
equal values even when one uses a list of names and the other a callable returning the same dict.

**Numbers follow Python's equality.** ``1``, ``1.0``, ``True`` and ``Decimal("1.00")`` are equal
in Python and give one key (and ``0.5 == Decimal("0.5")``; ``0.1`` and ``Decimal("0.1")`` differ,
as in Python). The same call must take the same lock wherever it comes from: Celery's JSON keeps
``1`` and ``1.0`` apart on the way to the worker, but a producer in another language (JavaScript
writes ``1.0`` as ``1``) or a value computed elsewhere (``total / 2``) does not, and a lock that
split equal numbers would let two runs for what the program treats as one account run at once.
Merging only costs concurrency between values the program already calls equal. Every NaN is one
value (NaN equals nothing, but a key must equal itself).

Changing the encoding changes every lock name: processes of versions with different encodings
do not exclude each other, so do not mix them in one fleet. (Retiring format strings changed no
other key: ``None``, a list of names and a callable keep their paths.)
"""

from __future__ import annotations

import contextlib
import datetime
import decimal
import enum
import hashlib
import inspect
import itertools
import json
import re
import reprlib
import string
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Final, Literal, TypeAlias

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

# Tag key of the tagged forms ({"__t": "uuid", "v": "..."}). A user dict that has this key itself
# is wrapped as {"__t": "dict", "v": {...}}, so a user dict can never pass for a tagged value.
_TAG: Final = "__t"
_TAGGED: Final = '{"' + _TAG + '":"%s","v":%s}'  # % (tag, JSON text of the value)
_json_str: Final = json.encoder.encode_basestring_ascii  # a str as json.dumps writes it

# Integers are JSON numbers; json refuses to write ints of more than 4300 digits.
_MAX_INT_DIGITS: Final = 4000
_MAX_INT_BITS: Final = 14_000  # 2**14000 has 4215 digits

_UNSAFE_CHARS: Final = re.compile(r"[^A-Za-z0-9._,=+@-]")
_PATH_STEP: Final = re.compile(r"[.\[{]")  # where a value's path (value[0].value) goes into it

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


def _encode(
    value: object, path: str, depth: int, active: set[int], top: bool = False
) -> tuple[str, str]:
    """``value``'s canonical JSON text (see :func:`canonical_json`) and the first
    :data:`PREFIX_LENGTH` characters of its readable text, a key's prefix before its unsafe
    characters are replaced: ``None``, ints and strs as Python prints them, other numbers as
    ``0.1`` (the float they are, if one is), lists and tuples as ``[a,b]``, sets as ``{a,b}`` in
    canonical order, dicts as ``{name=value,...}`` sorted by name (without braces at the
    ``top``), other values as their tag's text.

    Raises :class:`_Unencodable` at ``path``. A ``depth`` of -1 marks a dict of arguments, whose
    values are each at the top, named by their key. ``active`` holds the ids of the containers
    being encoded on the way down, to detect a container that contains itself.
    """
    if depth > MAX_DEPTH:
        raise _Unencodable(path, value, f"it is nested more than {MAX_DEPTH} levels deep")
    if value is None:
        return "null", "None"
    # Enum first: IntEnum and StrEnum members are also ints and strs. An Enum member stands for
    # its value, so the key is the same whether the caller passed the member or the raw value
    # (Celery's JSON serializer turns an IntEnum into a plain int on the way to the worker).
    if isinstance(value, enum.Enum):
        return _encode(value.value, f"{path}.value", depth + 1, active, top)
    # Subclasses of str/int/float are reduced to the exact base type so that an overridden
    # __str__ or __repr__ cannot change the encoding.
    if isinstance(value, str):
        text = str.__str__(value)
        return _json_str(text), text[:PREFIX_LENGTH]
    if isinstance(value, int):  # bool too
        number = int.__int__(value)
        # (str() of an int of more than 4300 digits raises: look at the bits first)
        if number.bit_length() > _MAX_INT_BITS or len(str(abs(number))) > _MAX_INT_DIGITS:
            raise _Unencodable(path, value, f"it has more than {_MAX_INT_DIGITS} digits")
        text = str(number)
        return text, text[:PREFIX_LENGTH]
    if isinstance(value, float | decimal.Decimal):
        return _number(value, path)
    texts: list[str] = []  # of a container's items: canonical
    shown: list[str] = []  # and readable
    if isinstance(value, list | tuple | dict):
        if id(value) in active:
            raise _Unencodable(path, value, "it contains itself")
        active.add(id(value))
        try:
            if not isinstance(value, dict):
                for index, item in enumerate(value):
                    text, readable = _encode(item, f"{path}[{index}]", depth + 1, active)
                    texts.append(text)
                    shown.append(readable)
                return f"[{','.join(texts)}]", f"[{','.join(shown)}]"[:PREFIX_LENGTH]
            entries: dict[str, tuple[str, str]] = {}
            for key, item in value.items():
                if not isinstance(key, str):
                    raise _Unencodable(
                        path,
                        value,
                        f"it has a key of type {_type_name(key)} (only str keys are supported)",
                    )
                name = str.__str__(key)
                child = name if depth < 0 else f"{path}[{_short_repr.repr(name)}]"
                entries[name] = _encode(item, child, depth + 1, active)
        finally:
            active.discard(id(value))
        for name in sorted(entries):
            text, readable = entries[name]
            texts.append(f"{_json_str(name)}:{text}")
            shown.append(f"{name}={readable}")
        text, readable = "{" + ",".join(texts) + "}", ",".join(shown)
        return (
            _TAGGED % ("dict", text) if _TAG in entries else text,
            (readable if top else "{" + readable + "}")[:PREFIX_LENGTH],
        )
    if isinstance(value, set | frozenset):
        items = [_encode(item, f"{path}{{...}}", depth + 1, active) for item in value]
        for text, readable in sorted(items):  # by canonical text
            texts.append(text)
            shown.append(readable)
        return _TAGGED % ("set", f"[{','.join(texts)}]"), f"{{{','.join(shown)}}}"[:PREFIX_LENGTH]
    if isinstance(value, bytes | bytearray):
        tag, text = "bytes", bytes(value).hex()
    elif isinstance(value, uuid.UUID):
        tag, text = "uuid", str(uuid.UUID(int=value.int))
    elif isinstance(value, datetime.datetime):
        # Equal aware datetimes are equal instants: encode them in UTC so that the same instant
        # given in two time zones is the same key. Naive ones stay as they are (no offset).
        # (Near datetime.min/max the conversion overflows: such a value keeps its own offset,
        # which still never matches a converted one.)
        if value.utcoffset() is not None:
            with contextlib.suppress(OverflowError):
                value = value.astimezone(datetime.timezone.utc)
        tag, text = "datetime", datetime.datetime.isoformat(value)
    elif isinstance(value, datetime.date):
        tag, text = "date", datetime.date.isoformat(value)
    elif isinstance(value, datetime.time):
        tag, text = "time", datetime.time.isoformat(value)
    else:
        raise _Unencodable(path, value, "it has no stable encoding")
    return _TAGGED % (tag, _json_str(text)), text[:PREFIX_LENGTH]


def _number(value: float | decimal.Decimal, path: str) -> tuple[str, str]:
    """:func:`_encode` of a float or Decimal: equal numbers (``==``) get equal forms.

    ``bool``, ``int``, ``float`` and ``Decimal`` compare by value in Python (``True == 1 ==
    1.0 == Decimal("1.00")``), and so do their keys: a number equal to an integer is that JSON
    integer, any other finite number ``{"__t": "num", "v": "<digits>E<exponent>"}``, its exact
    value with the trailing zeros of its digits stripped (a float's exact binary value, so
    ``0.5 == Decimal("0.5")`` share a form and ``0.1 != Decimal("0.1")`` do not). Infinities
    are ``"Infinity"`` and ``"-Infinity"``; every NaN is ``"NaN"`` (NaN equals nothing, not even
    itself, but a key must equal itself).
    """
    exact = decimal.Decimal(float.__float__(value)) if isinstance(value, float) else value
    if exact.is_nan():
        text = "NaN"
    elif exact.is_infinite():
        text = "-Infinity" if exact.is_signed() else "Infinity"
    else:
        sign, digits, exponent = exact.as_tuple()
        assert isinstance(exponent, int)
        text = "".join(map(str, digits)).lstrip("0")
        if not text:
            return "0", "0"
        stripped = text.rstrip("0")
        exponent += len(text) - len(stripped)
        text = f"{'-' if sign else ''}{stripped}"
        if exponent >= 0:
            if len(stripped) + exponent > _MAX_INT_DIGITS:
                raise _Unencodable(path, value, f"it has more than {_MAX_INT_DIGITS} digits")
            text += "0" * exponent
            return text, text[:PREFIX_LENGTH]
        text += f"E{exponent}"
        if isinstance(value, float):  # readable: the float it is (below, without round trips)
            return _TAGGED % ("num", _json_str(text)), repr(float.__float__(value))
    # readable: the float it is, if one is, else its decimal text
    exact = decimal.Decimal(text)
    nearest = float(exact)
    if decimal.Decimal(nearest) == exact:
        readable = repr(nearest)
    else:
        with decimal.localcontext(_DECIMAL_CONTEXT):
            readable = str(exact)
    return _TAGGED % ("num", _json_str(text)), readable[:PREFIX_LENGTH]


def _key(canonical: str, readable: str) -> str:
    """The key of a value from its canonical JSON text and readable text (see :func:`_encode`)."""
    digest = hashlib.sha256(canonical.encode("ascii")).hexdigest()[:HASH_LENGTH]
    return f"{_UNSAFE_CHARS.sub('_', readable)}~{digest}"


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
        return _encode(value, "value", 0, set())[0]
    except _Unencodable as exc:
        raise _value_error(exc) from None


def key_for_value(value: object) -> str:
    """Return the lock key (``<readable-prefix>~<hash>``) of one value.

    This is the key a task gets when its ``lock_key`` resolves to ``value``: a dict of parameter
    names to argument values for ``None``, a name or a list of names, the return value for a
    callable. Raises :class:`LockKeyError` as
    :func:`canonical_json` does.
    """
    try:
        return _key(*_encode(value, "value", 0, set(), top=True))
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

    def canonical(self, args: Sequence[object], kwargs: Mapping[str, object]) -> str:
        """The canonical JSON text the key of this call is the hash of (for logs and tools).

        Raises what :meth:`__call__` raises.
        """
        return self._one(self._encoded(args, kwargs))[0]

    def __call__(self, args: Sequence[object], kwargs: Mapping[str, object]) -> str:
        """Return the lock key of one call: ``<readable-prefix>~<32 hex>``.

        Raises ``TypeError`` (its message prefixed with the task name) when the arguments do not
        fit the task's signature or give several keys (see :meth:`keys`), :class:`LockKeyError`
        when a value has no stable encoding, and whatever a callable ``lock_key`` raises.
        """
        return _key(*self._one(self._encoded(args, kwargs)))

    def keys(self, args: Sequence[object], kwargs: Mapping[str, object]) -> tuple[str, ...]:
        """Every lock key of one call, sorted, each once: one, but for a ``lock_key`` of
        several keys (:class:`SeveralKeys`), which gives one per distinct value. Raises what
        :meth:`__call__` raises, but never for several keys."""
        return tuple(sorted(set(itertools.starmap(_key, self._encoded(args, kwargs)))))

    def _one(self, encoded: list[tuple[str, str]]) -> tuple[str, str]:
        """The texts of a call's one key (equal keys of several are one); else TypeError."""
        if len(set(encoded)) == 1:
            return encoded[0]
        raise TypeError(
            f"task {self.task_name!r} locks {len(set(encoded))} keys for these arguments (lock_key="
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
        return _key(*self._one(self._encoded(args, kwargs, partial=True)))

    def _spelled(self) -> str:
        spec = self.lock_key
        if isinstance(spec, SeveralKeys):
            return repr({spec.name: list(self._names)})
        return str(list(self._names))

    def _encoded(
        self, args: Sequence[object], kwargs: Mapping[str, object], partial: bool = False
    ) -> list[tuple[str, str]]:
        """The canonical and readable texts (:func:`_encode`) of each key of one call: one, but
        one per parameter for several keys. ``partial``: the arguments may leave out any but
        the key's (:meth:`of_key_arguments`)."""
        try:
            bound = (self.signature.bind_partial if partial else self.signature.bind)(
                *args, **kwargs
            )
        except TypeError as exc:
            raise TypeError(f"task {self.task_name!r}: {exc}") from exc
        bound.apply_defaults()
        arguments = bound.arguments
        if partial and (missing := [name for name in self._names if name not in arguments]):
            raise TypeError(
                f"task {self.task_name!r}: missing the lock key's argument"
                f"{'s' if len(missing) > 1 else ''} {', '.join(map(repr, missing))} (lock_key="
                f"{self._spelled()}; the task's other arguments may be left out)"
            )
        spec = self.lock_key
        try:
            if isinstance(spec, SeveralKeys):  # each parameter's value as lock_key=[name] has it
                encoded = []
                for parameter in self._names:
                    value = {spec.name: arguments[parameter]}
                    encoded.append(_encode(value, "", -1, set(), top=True))
                return encoded
            if callable(spec):
                return [_encode(spec(*args, **kwargs), "value", 0, set(), top=True)]
            if self.kind == "names":
                named = self._names  # (zip, not a comprehension: one function fewer per call)
                arguments = dict(zip(named, map(arguments.__getitem__, named), strict=True))
            return [_encode(arguments, "", -1, set(), top=True)]
        except _Unencodable as exc:
            if callable(spec):
                root, where = "value", f"the value returned by lock_key {_callable_name(spec)}"
            elif isinstance(spec, SeveralKeys):
                root, where = spec.name, f"argument {parameter!r}"  # the loop's parameter
            else:  # the path starts with the parameter's name, an identifier
                root = _PATH_STEP.split(exc.path, maxsplit=1)[0]
                where = f"argument {root!r}"
            inside = "" if exc.path == root else f" at {exc.path}"
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
