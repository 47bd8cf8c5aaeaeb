"""Issue 43's restructuring of the key encoder changed no key: the module before it
(``keys_before_43.py``, frozen) and the current one give the same key, canonical JSON and error
(type, message and cause) for every value of a seeded random corpus and of hand-picked edge cases,
and every ``KeyBuilder`` method the same answer for every kind of ``lock_key``."""

from __future__ import annotations

import collections
import datetime
import decimal
import enum
import inspect
import random
import sys
import types
import uuid
from collections.abc import Callable
from typing import Any

import pytest

from celery_zklock.task import keys as new
from tests.unit import keys_before_43 as old

SEED = 43
CORPUS_SIZE = 6000
CALLS = 1500


def outcome(function: Callable[..., object], *args: object) -> tuple[object, ...]:
    """What a call gives: its value, or its exception's type, message and cause."""
    try:
        return ("ok", function(*args))
    except Exception as exc:
        cause = exc.__cause__
        return (
            type(exc).__name__,
            str(exc),
            None if cause is None else (type(cause).__name__, str(cause)),
            exc.__suppress_context__,
        )


# --- the values ------------------------------------------------------------------------------


class Color(enum.Enum):
    RED = 1
    PAIR = (1, "a")
    NESTED = {"__t": "x", "k": [1.5]}
    HALF = 0.5
    BAD = 1j


class Level(enum.IntEnum):
    LOW = 1
    HIGH = 2


class Mode(str, enum.Enum):
    FAST = "fast"
    SLASH = "a/b"


class LoudStr(str):
    def __str__(self) -> str:
        return "LOUD"

    def __repr__(self) -> str:
        return "LOUD"


class LoudInt(int):
    def __repr__(self) -> str:
        return "LOUD"

    __str__ = __repr__


class LoudFloat(float):
    def __repr__(self) -> str:
        return "LOUD"


class MyDict(dict):  # type: ignore[type-arg]
    pass


class MyList(list):  # type: ignore[type-arg]
    pass


class MyDate(datetime.date):
    def isoformat(self) -> str:
        return "LOUD"


class Opaque:
    pass


class HashableSet(set):  # type: ignore[type-arg]
    """A set that can hold itself (only the depth limit stops its encoding)."""

    __hash__ = object.__hash__  # type: ignore[assignment]


class OtherStr(str):
    """Equal to its str but hashed apart: a dict may hold both as keys."""

    __hash__ = object.__hash__  # type: ignore[assignment]


ZONES = [
    datetime.timezone.utc,
    datetime.timezone(datetime.timedelta(hours=2), "CEST"),
    datetime.timezone(datetime.timedelta(hours=-9, minutes=-30)),
    datetime.timezone(datetime.timedelta(hours=23, minutes=59, seconds=59, microseconds=1)),
]
ALPHABET = (
    "abcXYZ019 ._,=+@-~/\\\"'{}[]:;<>?!*()#$%^&|`"
    "\x00\x01\x1f\x7f\t\n\r\u00e9\u00df\u4e2d\u0394\U0001f600\ud800\udfff\u2028\ufeff"
)
KEY_NAMES = ["a", "b", "v", "__t", "__t2", "_", "", "A", "\u00e9", "a" * 70, "x/y", "k'\"", "1"]
SPECIAL_FLOATS = [
    0.0, -0.0, float("inf"), float("-inf"), float("nan"), -float("nan"), 5e-324, -5e-324,
    1.7976931348623157e308, 0.1, 0.5, -0.75, 1e16, 1e22, 1e23, 2.0**53, 2.0**53 + 2, 123.456,
    1e-7, 3.0, -3.0, 1e300, 2.0**-1074 * 3,
]  # fmt: skip
SPECIAL_DECIMALS = [
    "NaN", "-NaN", "sNaN", "Infinity", "-Infinity", "0", "-0", "0E+5", "0E-5", "1.00", "1E+3",
    "-1.5E+3", "0.1", "0.50", "5E-1", "1E-400", "-1E-400", "1E+3999", "9E+3999", "1E+4000",
    "1.5E+3999", "1E-1000000", "123456789012345678901234567890.000", "1E-7", "4.9E-324",
    "0.3000000000000000166533453693773481063544750213623046875", "NaN123",
]  # fmt: skip


def huge_ints() -> list[int]:
    return [
        10**3999, -(10**3999), 10**4000 - 1, -(10**4000 - 1), 10**4000, -(10**4000),
        2**14000, 2**14000 - 1, -(2**14000), 2**14001, 2**20000, 2**63, -(2**63), 2**64 + 1,
    ]  # fmt: skip


def random_text(rng: random.Random) -> str:
    length = rng.choice([0, 1, 2, 5, 10, 30, 63, 64, 65, 66, 100, 200])
    return "".join(rng.choice(ALPHABET) for _ in range(length))


def random_int(rng: random.Random) -> int:
    roll = rng.random()
    if roll < 0.6:
        return rng.randrange(-1000, 1000)
    if roll < 0.9:
        return rng.getrandbits(rng.randrange(1, 200)) * rng.choice([1, -1])
    if roll < 0.97:
        return rng.getrandbits(rng.randrange(1, 14_000)) * rng.choice([1, -1])
    return rng.choice(huge_ints())


def random_float(rng: random.Random) -> float:
    roll = rng.random()
    if roll < 0.3:
        return rng.choice(SPECIAL_FLOATS)
    if roll < 0.5:
        return float(rng.randrange(-(10**6), 10**6))
    if roll < 0.7:
        return rng.randrange(-1000, 1000) / rng.choice([2, 4, 8, 10, 3, 1024])
    return rng.uniform(-1, 1) * 10.0 ** rng.randrange(-320, 308)


def random_decimal(rng: random.Random) -> decimal.Decimal:
    roll = rng.random()
    if roll < 0.3:
        return decimal.Decimal(rng.choice(SPECIAL_DECIMALS))
    if roll < 0.4:
        return decimal.Decimal(random_float(rng))
    digits = str(rng.getrandbits(rng.randrange(1, 120)))
    exponent = rng.choice([0, 1, -1, 5, -5, -30, 30, -400, 400, 3990, -5000])
    return decimal.Decimal(f"{rng.choice(['', '-'])}{digits}{'0' * rng.randrange(4)}E{exponent}")


def random_datetime(rng: random.Random) -> object:
    roll = rng.random()
    if roll < 0.1:
        base = rng.choice([datetime.datetime.min, datetime.datetime.max])
        return base.replace(tzinfo=rng.choice([None, *ZONES]))
    moment = datetime.datetime(2000, 1, 1) + datetime.timedelta(
        seconds=rng.randrange(-(10**9), 10**9), microseconds=rng.choice([0, rng.randrange(10**6)])
    )
    if roll < 0.5:
        return moment.replace(tzinfo=rng.choice(ZONES), fold=rng.randrange(2))
    if roll < 0.7:
        return moment.date() if rng.random() < 0.8 else MyDate(2024, 2, 29)
    if roll < 0.85:
        return moment.time().replace(tzinfo=rng.choice([None, *ZONES]))
    return moment


def random_scalar(rng: random.Random) -> object:
    kind = rng.randrange(16)
    if kind == 0:
        return rng.choice([None, True, False])
    if kind in (1, 2):
        return random_int(rng)
    if kind == 3:
        return random_float(rng)
    if kind == 4:
        return random_decimal(rng)
    if kind in (5, 6, 7):
        return random_text(rng)
    if kind == 8:
        data = bytes(rng.getrandbits(8) for _ in range(rng.choice([0, 1, 5, 31, 32, 33, 80])))
        return data if rng.random() < 0.7 else bytearray(data)
    if kind == 9:
        return uuid.UUID(int=rng.getrandbits(128))
    if kind == 10:
        return random_datetime(rng)
    if kind == 11:
        return rng.choice([*Color, *Level, *Mode])
    if kind == 12:
        return rng.choice(
            [LoudStr("quiet"), LoudInt(7), LoudFloat(0.25), LoudFloat(2.0), LoudStr("a" * 70)]
        )
    if kind == 13 and rng.random() < 0.3:  # no stable encoding: errors
        return rng.choice(
            [object(), 1j, Opaque(), range(3), ..., types.MappingProxyType({"a": 1}), 1 + 0j]
        )
    return rng.randrange(10)


def random_hashable(rng: random.Random, depth: int) -> object:
    if depth < 3 and rng.random() < 0.2:
        items = [random_hashable(rng, depth + 1) for _ in range(rng.randrange(4))]
        return tuple(items) if rng.random() < 0.5 else frozenset(items)
    value = random_scalar(rng)
    try:
        hash(value)
    except TypeError:
        return rng.randrange(100)
    return value


def random_value(rng: random.Random, depth: int = 0) -> object:
    if depth > 5 or rng.random() < 0.45:
        return random_scalar(rng)
    kind = rng.randrange(8)
    size = rng.choice([0, 1, 2, 3, 5, 8, 20] if depth < 2 else [0, 1, 2, 3])
    if kind in (0, 1):
        items = [random_value(rng, depth + 1) for _ in range(size)]
        return items if kind == 0 else tuple(items)
    if kind in (2, 3, 4):
        pairs: list[tuple[object, object]] = [
            (rng.choice(KEY_NAMES) if rng.random() < 0.7 else random_text(rng), None)
            for _ in range(size)
        ]
        if rng.random() < 0.05:  # a key that is not a str: an error
            pairs.append((rng.choice([1, None, (1, 2), LoudStr("k"), b"k"]), None))
            rng.shuffle(pairs)
        made = {key: random_value(rng, depth + 1) for key, _ in pairs}
        return made if kind != 4 else rng.choice([MyDict, collections.OrderedDict])(made)
    if kind == 5:
        items = [random_hashable(rng, depth + 1) for _ in range(size)]
        return set(items) if rng.random() < 0.5 else frozenset(items)
    if kind == 6:
        return MyList(random_value(rng, depth + 1) for _ in range(size))
    return random_scalar(rng)


def nested(depth: int, leaf: object = 1, container: str = "list") -> object:
    value = leaf
    for _ in range(depth):
        value = [value] if container == "list" else {"k": value}
    return value


def edge_values() -> list[object]:
    looped: list[object] = [1]
    looped.append(looped)
    looped_dict: dict[str, object] = {"a": 1}
    looped_dict["self"] = {"inner": looped_dict}
    shared = [1, 2]
    deep_enum = Color.NESTED
    holds_itself = HashableSet([1])
    holds_itself.add(holds_itself)
    values: list[object] = [
        None, True, False, 0, 1, -1, "", "a", "..", ".", "/", "a/b", "~", "x" * 64, "x" * 65,
        "x" * 1000, "\u00e9" * 70, "\ud800", "\x00", '"', "\\", *huge_ints(), *SPECIAL_FLOATS,
        *(decimal.Decimal(text) for text in SPECIAL_DECIMALS), [], (), {}, set(), frozenset(),
        b"", bytearray(), b"\x00\xff", {"__t": "uuid", "v": "x"}, {"__t": 1}, {"v": 1},
        {"__t": "num", "v": "5E-1"}, {"__t": "dict", "v": {}}, [shared, shared],
        {"a": shared, "b": shared}, looped, looped_dict, [looped], deep_enum, [deep_enum],
        {"a": deep_enum}, {1: 1}, {"a": 1, 2: {object()}}, {"a": object(), 2: 1}, {None: 1},
        {(1, 2): "x"}, {float("nan"), float("nan")}, {1, 0.5, False}, {0.5, decimal.Decimal("0.5")},
        {"a" * 70: object()}, {"a" * 70: [1, {"b" * 70: object()}]}, [object(), 1j],
        {"a": [1, [2, {"b": {3j}}]]}, {frozenset({1, 2}), frozenset({"a"}), (1, "b")},
        {("a", b"x"), ("a", b"y")}, [1] * 300, ["x" * 30] * 10, {f"k{i}": i for i in range(40)},
        {f"{i:03}" * 20: "v" * 70 for i in range(5)}, [[["x" * 70]]], [{"a": ["x" * 70]}],
        {"a": {"b": {"c": "x" * 70}}}, {"__t": {"__t": "x" * 70}}, [Color.PAIR, Level.HIGH],
        {"k": Mode.SLASH}, [Color.HALF, Color.BAD], Color.BAD, {"a": Color.BAD},
        datetime.datetime.min.replace(tzinfo=ZONES[1]),
        datetime.datetime.max.replace(tzinfo=ZONES[2]), datetime.time(23, 59, tzinfo=ZONES[3]),
        uuid.UUID(int=0), uuid.UUID(int=2**128 - 1), MyDate(2020, 1, 1), LoudStr("x"),
        LoudInt(-5), LoudFloat(-0.0), LoudFloat(0.1), MyDict(a=1), MyList([1, 2]),
        collections.OrderedDict([("b", 1), ("a", 2)]), {LoudStr("k"): 1, "k": 2},
        {"k": 1, LoudStr("k"): 2}, [1.0, 1, True, decimal.Decimal("1.000")],
        [10**4000], {"a": 10**4000}, {2**14001}, decimal.Decimal("1E+4000"),
        [decimal.Decimal("-1.5E+3999")], ["x" * 63, "y"], ["x" * 62, "y", "z" * 5],
        holds_itself, [holds_itself], {OtherStr("k"): 1, "k": 2}, {"k": 1, OtherStr("k"): [2]},
    ]  # fmt: skip
    for depth in (98, 99, 100, 101, 102):
        values += [nested(depth), nested(depth, container="dict"), nested(depth, Color.PAIR)]
        values += [nested(depth, {"a", "b"}), nested(depth, object()), nested(depth, 1j, "dict")]
    return values


def corpus() -> list[object]:
    rng = random.Random(SEED)
    return edge_values() + [random_value(rng) for _ in range(CORPUS_SIZE)]


# --- the comparisons -------------------------------------------------------------------------


def test_every_value_gives_the_old_key_canonical_text_and_error() -> None:
    sys.setrecursionlimit(max(sys.getrecursionlimit(), 3000))
    values = corpus()
    kinds = collections.Counter()
    for value in values:
        before = (outcome(old.key_for_value, value), outcome(old.canonical_json, value))
        after = (outcome(new.key_for_value, value), outcome(new.canonical_json, value))
        assert after == before, repr(value)[:500]
        kinds[before[0][0]] += 1
        if before[0][0] == "ok":
            kinds["long" if len(str(before[1][1])) > 64 else "short"] += 1
    # the corpus is varied: many keys, many refusals, long canonical texts (hashed prefixes)
    assert kinds["ok"] > 4000 and kinds["LockKeyError"] > 200 and kinds["long"] > 1000, kinds


def task_all(a: object, b: object = 0, *rest: object, c: object = None, **more: object) -> None:
    """Every kind of parameter."""


def task_one(key: str) -> None:
    """The common case: one argument."""


def task_tagged(__t: object, v: object = 1) -> None:
    """A parameter named like the tag key."""


def task_positional(a: object, /, b: object, *, c: object = 2) -> None:
    """Positional-only and keyword-only parameters."""


def echo(*args: object, **kwargs: object) -> object:
    return [args, kwargs]


def first(a: object, *_: object, **__: object) -> object:
    return a


def refuse(*_: object, **__: object) -> object:
    raise ValueError("no key for this call")


def unencodable(*_: object, **__: object) -> object:
    return {"x": [object()]}


SPECS: list[tuple[Callable[..., None], object]] = [
    (task_one, None), (task_one, "key"), (task_one, ["key"]), (task_one, []),
    (task_one, first), (task_one, {"key": "key"}), (task_one, {"a.b[0]{": "key"}),
    (task_all, None), (task_all, ["a"]), (task_all, ["b", "a"]), (task_all, ("c", "more")),
    (task_all, ["rest"]), (task_all, echo), (task_all, first), (task_all, refuse),
    (task_all, unencodable), (task_all, {"account": ["a", "b"]}), (task_all, {"__t": ["a", "c"]}),
    (task_all, {"": ["b", "a"]}), (task_all, {"v": "rest"}), (task_tagged, None),
    (task_tagged, ["__t"]), (task_tagged, ["v", "__t"]), (task_tagged, {"k": ["__t", "v"]}),
    (task_positional, None), (task_positional, ["b", "a"]), (task_positional, {"n": ["a", "c"]}),
    (task_positional, lambda a, b, c=0: (a, b, c)),
]  # fmt: skip


def random_call(
    rng: random.Random, fn: Callable[..., None]
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    names = [p.name for p in inspect.signature(fn).parameters.values() if p.kind <= p.KEYWORD_ONLY]
    if rng.random() < 0.5:  # often the same value twice: several keys that coincide
        same = random_value(rng)
        values = {name: same if rng.random() < 0.6 else random_value(rng) for name in names}
    else:
        values = {name: random_value(rng) for name in names}
    roll = rng.random()
    if fn is task_all:
        args: tuple[Any, ...] = (values["a"], values["b"], *[random_scalar(rng)] * rng.randrange(3))
        kwargs: dict[str, Any] = {"c": values["c"]} if rng.random() < 0.5 else {}
        if rng.random() < 0.3:
            kwargs[rng.choice(["x", "__t", "e\u0301"])] = random_value(rng)
        if roll < 0.2:
            args = args[:1]
    elif fn is task_tagged:
        args, kwargs = (values["__t"],), {"v": values["v"]} if roll < 0.5 else {}
    elif fn is task_positional:
        args, kwargs = (values["a"],), {"b": values["b"], "c": values["c"]}
    else:
        args, kwargs = (values["key"],), {}
    if roll > 0.95:  # arguments that do not fit the signature
        args, kwargs = (*args, 1, 2, 3), {**kwargs, "zz": 1} if roll > 0.97 else kwargs
    elif roll > 0.9:
        args = ()
    return args, kwargs


def partial_call(
    rng: random.Random, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[Any, ...]:
    """The arguments ``of_key_arguments`` gets: some of the call's, some left out."""
    if rng.random() < 0.5:
        return args, kwargs
    kept = {name: value for name, value in kwargs.items() if rng.random() < 0.5}
    return args[: rng.randrange(len(args) + 1)], kept


@pytest.mark.parametrize("index", range(len(SPECS)))
def test_every_key_builder_call_gives_the_old_answers(index: int) -> None:
    fn, lock_key = SPECS[index]
    signature = inspect.signature(fn)
    before = old.KeyBuilder.for_callable("proj.task", signature, lock_key)  # type: ignore[arg-type]
    after = new.KeyBuilder.for_callable("proj.task", signature, lock_key)  # type: ignore[arg-type]
    assert (after.kind, repr(after)) == (before.kind, repr(before))
    rng = random.Random(SEED * 1000 + index)
    kinds = collections.Counter()
    for _ in range(CALLS // len(SPECS) + 20):
        args, kwargs = random_call(rng, fn)
        for method in ("keys", "__call__", "canonical"):
            answer = outcome(getattr(before, method), args, kwargs)
            assert outcome(getattr(after, method), args, kwargs) == answer, (method, args, kwargs)
            kinds[answer[0]] += 1
        partial = partial_call(rng, args, kwargs)
        answer = outcome(before.of_key_arguments, *partial)
        assert outcome(after.of_key_arguments, *partial) == answer, ("of_key_arguments", partial)
    assert kinds["ok"] > 30 or lock_key in (refuse, unencodable), kinds


@pytest.mark.parametrize(
    "lock_key",
    [None, "a", "{a}", "{a[b]}.{c}", "{0}", ["a", 1], ["a", "a"], b"a", {"k": []},
     {"k": "a", "j": "b"}, {1: "a"}, {"k": ["a", "a"]}, 3, echo, ("a",), {"k": b"ab"}],
)  # fmt: skip
def test_lock_key_checks_are_unchanged(lock_key: object) -> None:
    signature = inspect.signature(task_all)
    before = outcome(old.check_lock_key_spec, "proj.task", lock_key, signature)
    assert outcome(new.check_lock_key_spec, "proj.task", lock_key, signature) == before
    before = outcome(lambda: repr(old.KeyBuilder("proj.task", signature, lock_key)))
    assert outcome(lambda: repr(new.KeyBuilder("proj.task", signature, lock_key))) == before
