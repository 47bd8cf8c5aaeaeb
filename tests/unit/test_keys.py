"""Lock keys from task arguments: equivalence, stability, distinctness, safety and every error."""

from __future__ import annotations

import datetime
import decimal
import enum
import hashlib
import inspect
import json
import os
import random
import re
import subprocess
import sys
import textwrap
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from celery_zklock.errors import ConfigurationError
from celery_zklock.task.keys import (
    MAX_KEY_LENGTH,
    KeyBuilder,
    LockKeyError,
    LockKeySpec,
    canonical_json,
    check_lock_key_spec,
    key_for_value,
)

KEY_SHAPE = re.compile(r"^[A-Za-z0-9._,=+@-]{0,64}~[0-9a-f]{32}$")
REPO = Path(__file__).resolve().parents[2]


def sync_account(account_id: int, full: bool = False) -> None:
    """The example task body of the design."""


def builder(
    fn: Callable[..., object], lock_key: LockKeySpec, task: str = "proj.sync"
) -> KeyBuilder:
    return KeyBuilder.for_callable(task, inspect.signature(fn), lock_key)


def sha(text: str) -> str:
    return hashlib.sha256(text.encode("ascii")).hexdigest()[:32]


def assert_safe(key: str) -> None:
    assert KEY_SHAPE.match(key), key
    assert len(key) <= MAX_KEY_LENGTH
    assert key not in (".", "..")
    assert "/" not in key
    assert not any(ord(char) < 0x20 or ord(char) == 0x7F for char in key)


class Color(enum.Enum):
    RED = 1
    BLUE = "blue"


class Level(enum.IntEnum):
    LOW = 1


# --- equivalence of call forms, defaults -------------------------------------------------------


def test_all_arguments_call_forms_give_one_key() -> None:
    keys = builder(sync_account, None)
    forms: list[tuple[tuple[object, ...], dict[str, object]]] = [
        ((42,), {}),
        ((), {"account_id": 42}),
        ((42, False), {}),
        ((42,), {"full": False}),
        ((), {"full": False, "account_id": 42}),
    ]
    results = {keys(args, kwargs) for args, kwargs in forms}
    assert results == {"account_id=42,full=0~" + sha('{"account_id":42,"full":0}')}
    assert keys((42, True), {}) not in results
    assert keys((43,), {}) not in results


def test_binding_agrees_with_signature_bind() -> None:
    """Every call form, fitting or not, gives what ``Signature.bind`` gives: the key of the
    bound arguments with defaults applied, or the same TypeError."""

    def task(a: int, b: int = 2, c: str = "x") -> None: ...

    keys = builder(task, None)
    signature = inspect.signature(task)
    calls: list[tuple[tuple[object, ...], dict[str, object]]] = [
        ((1,), {}), ((1, 3), {}), ((1, 3, "y"), {}), ((), {"a": 1}), ((1,), {"c": "z"}),
        ((), {"c": "z", "a": 1, "b": 5}), ((1, 2, "y", 4), {}), ((), {}), ((1,), {"a": 1}),
        ((1,), {"d": 4}), ((), {"b": 3}), ((1, 2), {"b": 2}),
    ]  # fmt: skip
    for args, kwargs in calls:
        try:
            bound = signature.bind(*args, **kwargs)
        except TypeError as exc:
            with pytest.raises(TypeError, match=re.escape(str(exc))):
                keys(args, kwargs)
            continue
        bound.apply_defaults()
        assert keys(args, kwargs) == key_for_value(dict(bound.arguments)), (args, kwargs)


def test_all_arguments_is_the_key_of_the_bound_dict() -> None:
    keys = builder(sync_account, None)
    assert keys((42,), {}) == key_for_value({"account_id": 42, "full": False})
    assert keys.canonical((42,), {}) == '{"account_id":42,"full":0}'


def test_arguments_get_the_key_of_the_bound_dict() -> None:
    """Every kind of argument (bool, int subclasses, huge ints, str subclasses, enums...) gets
    the key of the bound arguments' dict; equal numbers share it."""

    class Number(int):
        def __repr__(self) -> str:
            return "spoofed"

    class Text(str):
        def __str__(self) -> str:
            return "spoofed"

    def task(a: object, b: object = None) -> None: ...

    values: list[object] = [
        None, "", "x", "~/é", 0, -1, 2**63 - 1, -(2**63), 2**63, 2**64, -(2**64), 10**400,
        True, False, Number(7), Text("t"), Level.LOW, Color.BLUE, 1.0, 0.5, [1], {"__t": 1},
    ]  # fmt: skip
    keys, names = builder(task, None), builder(task, ["a"])
    for value in values:
        assert keys((value,), {}) == key_for_value({"a": value, "b": None}), value
        assert keys((), {"a": 1, "b": value}) == key_for_value({"a": 1, "b": value}), value
        assert names((value,), {}) == key_for_value({"a": value}), value
    assert keys((True,), {}) == keys((1,), {}) and keys((Number(7),), {}) == keys((7,), {})


def test_named_arguments_only_and_defaults_applied() -> None:
    by_account = builder(sync_account, ["account_id"])
    assert by_account((42,), {}) == by_account((42, True), {}) == by_account((), {"account_id": 42})
    assert by_account((42,), {}) == "account_id=42~" + sha('{"account_id":42}')
    assert by_account((42,), {}) != by_account((7,), {})

    by_full = builder(sync_account, ("full",))
    assert by_full((1,), {}) == by_full((2, False), {}) == by_full((3,), {"full": False})
    assert by_full((1,), {}) != by_full((1, True), {})


def test_empty_list_is_one_fixed_key() -> None:
    singleton = builder(sync_account, [])
    assert singleton((1,), {}) == singleton((2, True), {}) == key_for_value({})
    assert singleton((1,), {}).startswith("~")


def test_var_positional_and_var_keyword_parameters() -> None:
    def task(first: int, *items: int, **extra: object) -> None: ...

    by_items = builder(task, ["items"])
    assert by_items((0, 1, 2), {}) == by_items((9, 1, 2), {"x": 1})
    assert by_items((0, 1, 2), {}) != by_items((0, 1), {})
    assert by_items((0,), {}) == key_for_value({"items": []})

    by_extra = builder(task, ["extra"])
    assert by_extra((0,), {"b": 2, "a": 1}) == by_extra((5, 6), {"a": 1, "b": 2})
    assert by_extra((0,), {"a": 1}) != by_extra((0,), {"a": 2})

    everything = builder(task, None)
    assert everything.canonical((0, 1), {"z": True}) == ('{"extra":{"z":1},"first":0,"items":[1]}')


def test_positional_only_parameters_are_bound_by_name() -> None:
    def task(a: int, /, b: int = 2) -> None: ...

    keys = builder(task, ["a", "b"])
    assert keys((1,), {}) == keys((1, 2), {}) == keys((1,), {"b": 2})


def test_signature_of_a_bound_celery_task_excludes_self() -> None:
    from celery import Celery

    app = Celery("keys-test", set_as_current=False)

    def body(self: Any, account_id: int, full: bool = False) -> None: ...

    task = app.task(bind=True, name="proj.sync_account")(body)
    assert "self" in inspect.signature(body).parameters
    keys = KeyBuilder.for_callable(task.name, inspect.signature(task.run), ["account_id"])
    assert keys((42,), {}) == builder(sync_account, ["account_id"])((42,), {})
    with pytest.raises(ConfigurationError, match="'self'"):
        KeyBuilder.for_callable(task.name, inspect.signature(task.run), ["self"])


# --- a bare string: one parameter name; format strings retired --------------------------------


def test_a_bare_string_is_one_parameter_name() -> None:
    """``lock_key="account_id"`` is one lock per account. It used to be a format string without
    fields, so every call of the task shared one lock, silently."""
    keys = builder(sync_account, "account_id")
    assert keys.kind == "names" and keys.lock_key == ("account_id",)
    assert keys((1,), {}) != keys((2,), {})
    assert keys((1,), {}) == keys((), {"account_id": 1, "full": True})
    # the same lock as the list of that one name, so the two spellings share locks
    assert keys((42,), {}) == builder(sync_account, ["account_id"])((42,), {})
    assert keys((42,), {}).startswith("account_id=42~")


def test_a_bare_string_that_is_not_a_parameter_is_refused() -> None:
    with pytest.raises(ConfigurationError) as caught:
        builder(sync_account, "acount_id", task="proj.one")
    assert str(caught.value) == (
        "task 'proj.one': lock_key names 'acount_id', which is not a parameter of the task; "
        "its parameters are: account_id, full"
    )


@pytest.mark.parametrize(
    ("spec", "call", "expected_lambda"),
    [
        (
            "{account_id}:{region}",
            ((42,), {}),
            "lambda account_id, region='eu', *, full=False: f\"{account_id}:{region}\"",
        ),
        (
            "{payload[id]}-{payload[0]}{{x}}{account_id!r:>5}",
            ((7, {"id": 3, 0: "zero"}), {}),
            "lambda account_id, payload: f\"{payload['id']}-{payload[0]}{{x}}{account_id!r:>5}\"",
        ),
        ("{}", ((1,), {}), None),  # positional field: shown as it was
        ("{account_id", ((1,), {}), None),  # does not even parse: still refused, as a string
    ],
)
def test_format_strings_are_refused_with_the_callable_that_replaces_them(
    spec: str, call: tuple[tuple[object, ...], dict[str, object]], expected_lambda: str | None
) -> None:
    def task(account_id: int, region: str = "eu", *, full: bool = False) -> None: ...

    def with_payload(account_id: int, payload: dict[object, object]) -> None: ...

    fn = with_payload if "payload" in spec else task
    with pytest.raises(ConfigurationError) as caught:
        builder(fn, spec, task="proj.fmt")
    message = str(caught.value)
    assert message.startswith(f"task 'proj.fmt': lock_key={spec!r} is a format string")
    assert "retired" in message and "callable" in message
    suggested = "lambda " + message.split("lock_key=lambda ", 1)[1]
    if expected_lambda is None:
        assert suggested.endswith(f": f{spec!r}")
        return
    assert suggested == expected_lambda
    # valid Python that takes the task's call arguments and formats as the format string did
    replacement = eval(suggested)
    args, kwargs = call
    bound = inspect.signature(fn).bind(*args, **kwargs)
    bound.apply_defaults()
    assert replacement(*args, **kwargs) == spec.format(**bound.arguments)
    assert builder(fn, replacement)(args, kwargs) == key_for_value(spec.format(**bound.arguments))


def test_a_format_string_without_the_signature_names_its_fields() -> None:
    """Checked without a signature (a LockOptions made by hand), the advice still shows a
    lambda: over the fields' parameters, and any other argument."""
    with pytest.raises(ConfigurationError) as caught:
        check_lock_key_spec("t", "{a.b}-{c[0]}-{a}")
    assert str(caught.value).endswith('lock_key=lambda a, c, **_: f"{a.b}-{c[0]}-{a}"')


def test_other_keys_did_not_change_when_format_strings_went() -> None:
    """Running fleets depend on their lock paths: None, lists of names and callables give the
    keys they gave before (figures from the version with format strings)."""

    def task(account_id: int, region: str = "eu", full: bool = False) -> None: ...

    assert builder(task, None)((42,), {}) == (
        "account_id=42,full=0,region=eu~1850f44289d35fcb1d09bcba4fac7676"
    )
    assert (
        builder(task, ["account_id"])((42,), {}) == "account_id=42~7ed11c99f80ea3f657a818707546e14c"
    )
    assert builder(task, ["account_id", "region"])((42,), {"region": "us"}) == (
        "account_id=42,region=us~f6584fb701fdea8b9b40bdb43e66b21e"
    )
    pick = lambda account_id, region="eu", full=False: [account_id, region]  # noqa: E731
    assert builder(task, pick)((42,), {}) == "_42,eu_~155459a4ff738f17f5d4acb8b60e2a98"
    assert builder(task, None)((42, 1.5, {"x": [1]}), {}) == (
        "account_id=42,full=_x=_1__,region=1.5~244ee6f1461bbcdf0d1b2be43a230d43"
    )


# --- callables ---------------------------------------------------------------------------------


def test_callable_gets_the_call_arguments_and_its_value_is_the_key() -> None:
    seen: list[tuple[tuple[object, ...], dict[str, object]]] = []

    def pick(*args: object, **kwargs: object) -> object:
        seen.append((args, kwargs))
        return {"account": kwargs.get("account_id", args[0] if args else None)}

    keys = builder(sync_account, pick)
    assert keys.kind == "callable"
    assert keys((42,), {"full": True}) == key_for_value({"account": 42})
    assert seen == [((42,), {"full": True})]
    assert keys((), {"account_id": 42}) == keys((42,), {})


def test_callable_exceptions_propagate() -> None:
    class Boom(Exception):
        pass

    def explode(*args: object, **kwargs: object) -> object:
        raise Boom("from lock_key")

    with pytest.raises(Boom, match="from lock_key"):
        builder(sync_account, explode)((1,), {})


def test_callable_returning_an_unencodable_value() -> None:
    def key_of(account_id: int, full: bool = False) -> object:
        return {"conn": object()}

    with pytest.raises(LockKeyError) as caught:
        builder(sync_account, key_of, task="proj.cb")((1,), {})
    message = str(caught.value)
    assert message.startswith("task 'proj.cb': cannot build the lock key from the value returned")
    assert "key_of" in message
    assert "at value['conn']" in message
    assert "of type object" in message


def test_callable_is_not_called_when_arguments_do_not_fit() -> None:
    calls: list[object] = []
    keys = builder(sync_account, lambda *a, **k: calls.append(a))
    with pytest.raises(TypeError, match=r"^task 'proj\.sync': missing a required argument"):
        keys((), {})
    assert calls == []


# --- binding errors ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "kwargs", "fragment"),
    [
        ((), {}, "missing a required argument: 'account_id'"),
        ((1, True, 3), {}, "too many positional arguments"),
        ((1,), {"color": "red"}, "unexpected keyword argument 'color'"),
        ((1,), {"account_id": 1}, "multiple values for argument 'account_id'"),
    ],
)
@pytest.mark.parametrize("spec", [None, ["account_id"], "account_id", len])
def test_binding_errors_name_the_task(
    spec: LockKeySpec, args: tuple[object, ...], kwargs: dict[str, object], fragment: str
) -> None:
    with pytest.raises(TypeError) as caught:
        builder(sync_account, spec, task="proj.bind")(args, kwargs)
    assert str(caught.value).startswith("task 'proj.bind': ")
    assert fragment in str(caught.value)
    assert isinstance(caught.value.__cause__, TypeError)


# --- lock_key definition errors ----------------------------------------------------------------


def test_unknown_name_lists_the_parameters() -> None:
    with pytest.raises(ConfigurationError) as caught:
        builder(sync_account, ["account_id", "acount"], task="proj.names")
    assert str(caught.value) == (
        "task 'proj.names': lock_key names 'acount', which is not a parameter of the task; "
        "its parameters are: account_id, full"
    )


def test_unknown_name_on_a_task_without_parameters() -> None:
    def task() -> None: ...

    with pytest.raises(ConfigurationError, match=r"its parameters are: \(none\)"):
        builder(task, ["x"])


@pytest.mark.parametrize(
    ("spec", "fragments"),
    [
        (5, ["lock_key=5 of type int is not valid", "a parameter name", "callable"]),
        (b"account_id", ["of type bytes is not valid"]),
        ({"account_id"}, ["of type set is not valid", "list of parameter names"]),
        (["account_id", 3], ["lock_key lists 3 of type int", "parameter names (str)"]),
        (["account_id", "account_id"], ["lists the parameter 'account_id' twice"]),
    ],
)
def test_bad_lock_key_shapes(spec: object, fragments: list[str]) -> None:
    with pytest.raises(ConfigurationError) as caught:
        KeyBuilder.for_callable("proj.shape", inspect.signature(sync_account), spec)  # type: ignore[arg-type]
    assert str(caught.value).startswith("task 'proj.shape': ")
    for fragment in fragments:
        assert fragment in str(caught.value)


def test_check_lock_key_spec_normalises() -> None:
    assert check_lock_key_spec("t", None) is None
    assert check_lock_key_spec("t", "a") == ("a",)
    assert check_lock_key_spec("t", ["a", "b"]) == ("a", "b")
    assert check_lock_key_spec("t", []) == ()
    assert check_lock_key_spec("t", len) is len


def test_builder_keeps_a_copy_of_a_list_spec() -> None:
    names = ["account_id"]
    keys = builder(sync_account, names)
    names.append("full")
    assert keys.lock_key == ("account_id",)
    assert keys((1,), {}) == keys((1, True), {})


# --- unencodable values at call time -----------------------------------------------------------


class Opaque:
    pass


@pytest.mark.parametrize(
    ("value", "where", "type_name"),
    [
        (Opaque(), "", "tests.unit.test_keys.Opaque"),
        (lambda: 1, "", "function"),
        ({"a": [1, Opaque()]}, " at payload['a'][1]", "tests.unit.test_keys.Opaque"),
        ({1: "x"}, "", "dict"),
        ([{"k": {2: 3}}], " at payload[0]['k']", "dict"),
        ((1, {Opaque()}), " at payload[1]{...}", "tests.unit.test_keys.Opaque"),
        (Color, "", "enum.EnumType" if sys.version_info >= (3, 11) else "enum.EnumMeta"),
        (datetime.timedelta(1), "", "datetime.timedelta"),
        (complex(1, 2), "", "complex"),
    ],
)
def test_unencodable_argument_names_task_argument_and_type(
    value: object, where: str, type_name: str
) -> None:
    def task(account_id: int, payload: object = None) -> None: ...

    with pytest.raises(LockKeyError) as caught:
        builder(task, None, task="proj.bad")((1, value), {})
    message = str(caught.value)
    assert message.startswith(
        f"task 'proj.bad': cannot build the lock key from argument 'payload': the value{where} "
        f"is of type {type_name} and "
    )
    assert "give lock_key a callable" in message
    assert isinstance(caught.value, ConfigurationError)
    assert isinstance(caught.value, ValueError)


def test_non_str_dict_key_reason() -> None:
    with pytest.raises(LockKeyError, match=r"has a key of type int \(only str keys"):
        builder(sync_account, None)(({1: 2},), {})


def test_self_containing_and_too_deep_values() -> None:
    loop: list[object] = [1]
    loop.append(loop)
    with pytest.raises(LockKeyError, match=r"at account_id\[1\] is of type list and it contains"):
        builder(sync_account, None)((loop,), {})

    deep: object = 0
    for _ in range(150):
        deep = [deep]
    with pytest.raises(LockKeyError, match="nested more than 100 levels deep"):
        builder(sync_account, None)((deep,), {})

    shared = [1, 2]
    assert canonical_json([shared, shared]) == "[[1,2],[1,2]]"  # a repeat is not a cycle


# --- canonical form ----------------------------------------------------------------------------


def test_canonical_json_of_every_supported_type() -> None:
    amsterdam = datetime.timezone(datetime.timedelta(hours=1))
    assert canonical_json(None) == "null"
    assert canonical_json(True) == "1"
    assert canonical_json(-7) == "-7"
    assert canonical_json("é/~") == '"\\u00e9/~"'
    assert canonical_json(0.5) == '{"__t":"num","v":"5E-1"}'
    assert canonical_json(-2.0) == "-2"
    assert canonical_json((1, [2])) == "[1,[2]]"
    assert canonical_json({"b": 1, "a": 2}) == '{"a":2,"b":1}'
    assert canonical_json(b"\x00\xff") == '{"__t":"bytes","v":"00ff"}'
    assert canonical_json(bytearray(b"\x01")) == '{"__t":"bytes","v":"01"}'
    assert canonical_json(decimal.Decimal("1.50")) == '{"__t":"num","v":"15E-1"}'
    assert canonical_json(decimal.Decimal("1.5E+3")) == "1500"
    assert canonical_json(uuid.UUID(int=255)) == (
        '{"__t":"uuid","v":"00000000-0000-0000-0000-0000000000ff"}'
    )
    assert canonical_json(datetime.datetime(2024, 1, 1, 12, 30)) == (
        '{"__t":"datetime","v":"2024-01-01T12:30:00"}'
    )
    assert canonical_json(datetime.datetime(2024, 1, 1, 12, 30, tzinfo=amsterdam)) == (
        '{"__t":"datetime","v":"2024-01-01T11:30:00+00:00"}'
    )
    assert canonical_json(datetime.date(2024, 2, 29)) == '{"__t":"date","v":"2024-02-29"}'
    assert canonical_json(datetime.time(8, 5, 1)) == '{"__t":"time","v":"08:05:01"}'
    assert canonical_json(Color.BLUE) == '"blue"'
    assert canonical_json({"b", "a", 1}) == '{"__t":"set","v":["a","b",1]}'
    assert canonical_json({"__t": "uuid", "v": "x"}) == (
        '{"__t":"dict","v":{"__t":"uuid","v":"x"}}'
    )


def test_aware_datetimes_at_the_edge_of_the_range() -> None:
    plus_one = datetime.timezone(datetime.timedelta(hours=1))
    earliest = datetime.datetime(1, 1, 1, tzinfo=plus_one)
    assert canonical_json(earliest) == '{"__t":"datetime","v":"0001-01-01T00:00:00+01:00"}'


def test_canonical_json_error_names_the_path() -> None:
    with pytest.raises(LockKeyError) as caught:
        canonical_json({"a": [Opaque()]})
    assert str(caught.value).startswith(
        "cannot encode value['a'][0] of type tests.unit.test_keys.Opaque: it has no stable "
        "encoding; "
        "use None, bool, int"
    )


def test_special_numbers_are_encoded() -> None:
    nan, inf = float("nan"), float("inf")
    keys = {key_for_value(x) for x in (nan, inf, -inf, 0.0)}
    assert len(keys) == 4
    assert key_for_value(inf).startswith("inf~") and key_for_value(-inf).startswith("-inf~")
    assert key_for_value(inf) == key_for_value(decimal.Decimal("Infinity"))
    # NaN equals nothing in Python, yet a key must equal itself: every NaN is one key
    assert key_for_value(nan) == key_for_value(-nan) == key_for_value(decimal.Decimal("NaN"))
    assert key_for_value(nan) == key_for_value(decimal.Decimal("-sNaN"))


def test_huge_numbers_are_refused_not_expanded() -> None:
    assert key_for_value(10**3999) == key_for_value(decimal.Decimal("1E+3999"))
    for value in (10**4000, -(2**20000), decimal.Decimal("1E+4000"), decimal.Decimal("1E+999999")):
        with pytest.raises(LockKeyError, match="more than 4000 digits"):
            key_for_value(value)
    assert canonical_json(decimal.Decimal("1E-999999")) == '{"__t":"num","v":"1E-999999"}'


def test_number_text_ignores_the_thread_context() -> None:
    value = decimal.Decimal("1.2345E-7")
    expected = (canonical_json(value), key_for_value(value))
    with decimal.localcontext() as context:
        context.capitals = 0
        context.prec = 2
        assert str(+value) == "1.2e-7"
        assert (canonical_json(value), key_for_value(value)) == expected
    assert expected == ('{"__t":"num","v":"12345E-11"}', "1.2345E-7~" + sha(expected[0]))


def test_subclasses_encode_as_their_base_type() -> None:
    class Loud(str):
        def __str__(self) -> str:
            return "LOUD"

    class Count(int):
        def __repr__(self) -> str:
            return "Count()"

        def __int__(self) -> int:
            return 999

    class Stamp(datetime.date):
        def isoformat(self) -> str:
            return "never"

    assert canonical_json(Loud("soft")) == canonical_json("soft")
    assert canonical_json(Count(3)) == "3"
    assert canonical_json(Stamp(2024, 1, 2)) == canonical_json(datetime.date(2024, 1, 2))
    assert canonical_json({Loud("k"): 1}) == '{"k":1}'


# --- distinctness and documented collisions ----------------------------------------------------


def test_close_values_never_share_a_key() -> None:
    values: list[object] = [
        1,
        "1",
        None,
        "None",
        "true",
        0,
        "",
        [],
        {},
        [1],
        {"a": 1},
        {"a": "1"},
        {1},
        [[1]],
        b"1",
        bytearray(b"2"),
        "31",
        0.5,
        0.25,
        0.1,
        decimal.Decimal("0.1"),
        -1,
        float("inf"),
        uuid.UUID(int=1),
        "00000000-0000-0000-0000-000000000001",
        {"__t": "uuid", "v": "00000000-0000-0000-0000-000000000001"},
        {"__t": "num", "v": "5E-1"},
        {"__t": "dict", "v": {}},
        datetime.date(2024, 1, 1),
        "2024-01-01",
        datetime.datetime(2024, 1, 1),
        datetime.datetime(2024, 1, 1, tzinfo=datetime.timezone.utc),
        datetime.time(0, 0),
    ]
    keys = [key_for_value(value) for value in values]
    assert len(set(keys)) == len(values)
    texts = [canonical_json(value) for value in values]
    assert len(set(texts)) == len(values)


def test_equal_numbers_share_a_key() -> None:
    """Numbers follow Python's ``==``: the same call takes the same lock, however each producer
    spelled the number (see the module docstring of celery_zklock.task.keys)."""
    groups: list[list[object]] = [
        [1, 1.0, True, decimal.Decimal("1"), decimal.Decimal("1.00"), Level.LOW],
        [0, 0.0, -0.0, False, decimal.Decimal("0E+5"), decimal.Decimal("-0")],
        [0.5, decimal.Decimal("0.50"), decimal.Decimal("5E-1")],
        [2**53, float(2**53), decimal.Decimal(2**53)],
        [{"a": 1, "b": [True]}, {"a": 1.0, "b": [1]}],
    ]
    for group in groups:
        assert all(a == b for a in group for b in group)
        assert len({key_for_value(value) for value in group}) == 1, group
    assert len({key_for_value(group[0]) for group in groups}) == len(groups)
    # as in Python, a float that is not exactly a decimal fraction is not that fraction
    assert decimal.Decimal("0.1") != 0.1
    assert key_for_value(0.1) != key_for_value(decimal.Decimal("0.1"))
    assert key_for_value(0.1).startswith("0.1~") and key_for_value(2**53 + 1) != key_for_value(
        float(2**53 + 1)
    )
    by_account = builder(sync_account, ["account_id"])
    assert by_account((42,), {}) == by_account((42.0,), {}) == by_account((42, True), {})


def test_documented_collisions() -> None:
    assert key_for_value([1, 2]) == key_for_value((1, 2))
    assert key_for_value({1, 2}) == key_for_value(frozenset({2, 1}))
    assert key_for_value(Color.RED) == key_for_value(1)
    assert key_for_value(Level.LOW) == key_for_value(1)
    paris = datetime.timezone(datetime.timedelta(hours=2), "CEST")
    utc_noon = datetime.datetime(2024, 6, 1, 12, tzinfo=datetime.timezone.utc)
    assert key_for_value(utc_noon) == key_for_value(utc_noon.astimezone(paris))
    assert key_for_value({"a": 1, "b": 2}) == key_for_value({"b": 2, "a": 1})


def test_random_values_distinct_iff_canonical_text_distinct() -> None:
    rng = random.Random(20240229)

    def value(depth: int = 0) -> object:
        choice = rng.randrange(9 if depth < 3 else 5)
        if choice == 0:
            return rng.randrange(-3, 4)
        if choice == 1:
            return rng.choice(["", "a", "b", "1", "a/b", "é", ".."])
        if choice == 2:
            return rng.choice([0.5, 0.25, -0.75, 3.5])
        if choice == 3:
            return rng.choice([None, True, False])
        if choice == 4:
            return bytes(rng.randrange(3) for _ in range(rng.randrange(3)))
        if choice in (5, 6):
            return [value(depth + 1) for _ in range(rng.randrange(3))]
        if choice == 7:
            return frozenset(rng.randrange(4) for _ in range(rng.randrange(3)))
        return {rng.choice("abc"): value(depth + 1) for _ in range(rng.randrange(3))}

    by_text: dict[str, str] = {}
    by_key: dict[str, str] = {}
    for _ in range(3000):
        item = value()
        text, key = canonical_json(item), key_for_value(item)
        assert_safe(key)
        assert by_text.setdefault(text, key) == key
        assert by_key.setdefault(key, text) == text
    assert len(by_key) > 500


# --- znode safety and bounds -------------------------------------------------------------------


@pytest.mark.parametrize(
    "value",
    [
        "a/b",
        "/",
        ".",
        "..",
        "../../etc",
        "é",
        "日本語",
        "\x00\x01\n\x7f",
        "~~~",
        "\ud800",
        "😀",
        {"a/b": "c/d"},
        "",
        [],
        {},
    ],
)
def test_keys_are_znode_safe(value: object) -> None:
    assert_safe(key_for_value(value))
    assert_safe(builder(sync_account, None)((value,), {}))
    assert_safe(builder(sync_account, "account_id")((value,), {}))
    assert_safe(builder(sync_account, lambda *args, **kwargs: value)((1,), {}))


def test_unsafe_characters_become_underscores_but_keys_stay_distinct() -> None:
    slash, dot = key_for_value("a/b"), key_for_value("a_b")
    assert slash.split("~")[0] == dot.split("~")[0] == "a_b"
    assert slash != dot
    assert key_for_value("é") != key_for_value("è")
    assert key_for_value("x=1,y@z+-.").startswith("x=1,y@z+-.~")


def test_long_values_are_bounded_and_distinct() -> None:
    keys = builder(sync_account, None)
    long_a = keys(("x" * 10_000,), {})
    long_b = keys(("x" * 10_001,), {})
    assert long_a != long_b
    assert long_a.split("~")[0] == long_b.split("~")[0]
    assert len(long_a.split("~")[0]) == 64
    assert len(long_a) <= MAX_KEY_LENGTH
    huge = key_for_value(list(range(100_000)))
    assert huge.startswith("_0,1,2,3,")
    assert_safe(huge)
    assert huge != key_for_value(list(range(100_001)))


def test_readable_prefixes() -> None:
    assert key_for_value({"account_id": 42, "full": False}).startswith("account_id=42,full=0~")
    assert key_for_value({"a": [1, None], "b": {"c": 0.25}}).startswith("a=_1,None_,b=_c=0.25_~")
    assert key_for_value({"s": {"b", "a"}}).startswith("s=_a,b_~")
    assert key_for_value(uuid.UUID(int=1)).startswith("00000000-0000-0000-0000-000000000001~")


# --- stability ---------------------------------------------------------------------------------

STABLE_VALUE_SOURCE = """
import datetime, decimal, uuid
STABLE_VALUE = {
    "account_id": 42,
    "full": False,
    "region": "eu/west",
    "tags": {"b", "a", "c", "d", "e"},
    "ratio": 0.5,
    "when": datetime.date(2024, 2, 29),
    "id": uuid.UUID("12345678-1234-5678-1234-567812345678"),
    "amount": decimal.Decimal("10.50"),
    "raw": b"\\x01\\xff",
    "items": (1, [2, None]),
}
"""


def stable_value() -> Any:
    namespace: dict[str, Any] = {}
    exec(STABLE_VALUE_SOURCE, namespace)
    return namespace["STABLE_VALUE"]


STABLE_CANONICAL = (
    '{"account_id":42,"amount":{"__t":"num","v":"105E-1"},"full":0,'
    '"id":{"__t":"uuid","v":"12345678-1234-5678-1234-567812345678"},"items":[1,[2,null]],'
    '"ratio":{"__t":"num","v":"5E-1"},"raw":{"__t":"bytes","v":"01ff"},'
    '"region":"eu/west","tags":{"__t":"set","v":["a","b","c","d","e"]},'
    '"when":{"__t":"date","v":"2024-02-29"}}'
)
STABLE_KEY = (
    "account_id=42,amount=10.5,full=0,id=12345678-1234-5678-1234-5678"
    "~d568468bb35f4c5819b21eaf1c2da48b"
)


def test_key_algorithm_is_pinned() -> None:
    # A change here changes every lock name in every deployed fleet: mixed versions would no
    # longer exclude each other. Change it only on purpose (last: numbers by equality).
    assert canonical_json(stable_value()) == STABLE_CANONICAL
    assert STABLE_KEY.endswith("~" + sha(STABLE_CANONICAL))
    assert key_for_value(stable_value()) == STABLE_KEY
    assert key_for_value({"account_id": 42, "full": False}) == (
        "account_id=42,full=0~2bc2767754ed105dd2a05ff5173f5d83"
    )


@pytest.mark.parametrize("seed", ["0", "1", "12345"])
def test_key_is_the_same_in_another_process_with_another_hash_seed(seed: str) -> None:
    script = STABLE_VALUE_SOURCE + textwrap.dedent(
        """
        import inspect, json
        from celery_zklock.task.keys import KeyBuilder, key_for_value

        def task(account_id, full=False, **extra): ...

        keys = KeyBuilder.for_callable("t", inspect.signature(task), None)
        print(json.dumps([
            key_for_value(STABLE_VALUE),
            keys((7,), {"tags": frozenset({"x", "y", "z", "w"}), "m": {"q": 1, "p": 2}}),
        ]))
        """
    )
    environment = {**os.environ, "PYTHONHASHSEED": seed}
    environment["PYTHONPATH"] = os.pathsep.join(
        filter(None, [str(REPO), environment.get("PYTHONPATH")])
    )
    done = subprocess.run(
        [sys.executable, "-c", script],
        env=environment,
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )
    here = builder(lambda account_id, full=False, **extra: None, None, task="t")
    expected = [
        STABLE_KEY,
        here((7,), {"m": {"p": 2, "q": 1}, "tags": frozenset({"w", "z", "y", "x"})}),
    ]
    assert json.loads(done.stdout) == expected
