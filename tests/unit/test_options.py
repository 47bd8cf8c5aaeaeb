"""Task lock options: defaults, validation messages, per-call overrides."""

from __future__ import annotations

import dataclasses
import json
import types
from typing import get_args

import pytest

from celery_zklock.errors import ConfigurationError
from celery_zklock.task import options as options_module
from celery_zklock.task.options import (
    CALL_OVERRIDES,
    LOCK_MODES,
    ON_BUSY_POLICIES,
    ON_LOST_POLICIES,
    ON_TIMEOUT_POLICIES,
    TASK_ATTRIBUTES,
    LockMode,
    LockOptions,
    OnBusy,
    OnLost,
    OnTimeout,
    TaskLockSpec,
    check_lock_name,
    options_from_task,
    with_call_overrides,
)

TASK = "proj.tasks.sync"


def test_defaults() -> None:
    options = options_from_task(TASK, {})
    assert options == LockOptions(
        name=TASK,
        key=None,
        mode="exclusive",
        on_busy="wait",
        timeout=60.0,
        on_timeout="raise",
        on_lost="raise",
        retry_countdown=5.0,
    )
    assert options.name == TASK  # dots of Celery task names are fine


def test_every_attribute_is_taken_and_normalised() -> None:
    options = options_from_task(
        TASK,
        {
            "lock_name": "accounts",
            "lock_key": ["account_id"],
            "lock_mode": "shared",
            "lock_on_busy": "retry",
            "lock_timeout": 3,
            "lock_on_timeout": "skip",
            "lock_on_lost": "retry",
            "lock_retry_countdown": 0,
        },
    )
    assert options == LockOptions(
        name="accounts",
        key=("account_id",),
        mode="shared",
        on_busy="retry",
        timeout=3.0,
        on_timeout="skip",
        on_lost="retry",
        retry_countdown=0.0,
    )
    assert isinstance(options.timeout, float)
    assert isinstance(options.retry_countdown, float)
    hash(options)  # frozen and hashable: usable as a cache key


def test_none_means_default_name_all_arguments_and_no_time_limit() -> None:
    options = options_from_task(TASK, {"lock_name": None, "lock_key": None, "lock_timeout": None})
    assert options.name == TASK
    assert options.key is None
    assert options.timeout is None


def test_key_shapes_are_kept() -> None:
    def pick(account_id: int) -> int:
        return account_id

    assert options_from_task(TASK, {"lock_key": "account_id"}).key == ("account_id",)
    assert options_from_task(TASK, {"lock_key": ["account_id"]}).key == ("account_id",)
    assert options_from_task(TASK, {"lock_key": pick}).key is pick
    assert options_from_task(TASK, {"lock_key": []}).key == ()


def test_a_format_string_key_is_refused_naming_the_task_and_the_option() -> None:
    with pytest.raises(ConfigurationError) as caught:
        options_from_task(TASK, {"lock_key": "{account_id}:{region}"})
    message = str(caught.value)
    assert message.startswith(f"task {TASK!r}: lock_key='{{account_id}}:{{region}}' is a format")
    assert 'lock_key=lambda account_id, region, **_: f"{account_id}:{region}"' in message


def test_constants_match_the_literal_types() -> None:
    assert LOCK_MODES == get_args(LockMode) == ("exclusive", "shared", "semaphore")
    assert ON_BUSY_POLICIES == get_args(OnBusy) == (
        "skip", "wait", "retry", "raise", "preempt", "replace",
    )  # fmt: skip
    assert ON_TIMEOUT_POLICIES == get_args(OnTimeout) == ("skip", "retry", "raise")
    assert ON_LOST_POLICIES == get_args(OnLost) == ("raise", "retry")
    fields = {field.name for field in dataclasses.fields(LockOptions)}
    assert set(TASK_ATTRIBUTES.values()) == fields
    assert all(attribute == "lock_" + field for attribute, field in TASK_ATTRIBUTES.items())
    assert fields >= CALL_OVERRIDES
    assert {"name", "key", "mode", "limit"}.isdisjoint(CALL_OVERRIDES)


NAME_RULES = "a lock name is one znode path segment"


@pytest.mark.parametrize(
    ("attribute", "value", "fragments"),
    [
        ("lock_mode", "exclusiv", ["lock_mode='exclusiv'", "'exclusive', 'shared'"]),
        ("lock_mode", None, ["lock_mode=None", "'exclusive', 'shared'"]),
        ("lock_mode", "EXCLUSIVE", ["lock_mode='EXCLUSIVE'"]),
        ("lock_on_busy", "block", ["lock_on_busy='block'", "'skip', 'wait', 'retry', 'raise'"]),
        ("lock_on_busy", 1, ["lock_on_busy=1", "'skip', 'wait', 'retry', 'raise'"]),
        ("lock_on_timeout", "wait", ["lock_on_timeout='wait'", "'skip', 'retry', 'raise'"]),
        ("lock_on_lost", "skip", ["lock_on_lost='skip'", "'raise', 'retry'"]),
        (
            "lock_timeout",
            -1,
            ["lock_timeout must be", ">= 0, got -1", "or None to wait without limit"],
        ),
        ("lock_timeout", "5", ["lock_timeout must be a number of seconds", "got '5'"]),
        ("lock_timeout", True, ["lock_timeout must be a number of seconds", "got True"]),
        ("lock_timeout", float("inf"), ["lock_timeout must be", "got inf (not finite)", "or None"]),
        ("lock_timeout", float("nan"), ["lock_timeout must be", "got nan (not finite)"]),
        ("lock_timeout", 10**400, ["lock_timeout must be", "(not finite)"]),
        ("lock_retry_countdown", -0.5, ["lock_retry_countdown must be", ">= 0, got -0.5"]),
        (
            "lock_retry_countdown",
            None,
            ["lock_retry_countdown must be a number of seconds", "None"],
        ),
        ("lock_name", "", ["lock_name='' is empty", NAME_RULES]),
        ("lock_name", "a/b", ["lock_name='a/b' contains '/'", NAME_RULES]),
        ("lock_name", "/abs", ["lock_name='/abs' contains '/'"]),
        ("lock_name", ".", ["lock_name='.' is a relative path segment"]),
        ("lock_name", "..", ["lock_name='..' is a relative path segment"]),
        ("lock_name", "a\x00b", ["contains the character U+0000"]),
        ("lock_name", "tab\there", ["contains the character U+0009"]),
        ("lock_name", "del\x7f", ["contains the character U+007F"]),
        ("lock_name", "c1\x85", ["contains the character U+0085"]),
        ("lock_name", "pua\ue000", ["contains the character U+E000"]),
        ("lock_name", "x\ufff0", ["contains the character U+FFF0"]),
        ("lock_name", "n" * 256, ["is longer than 255 characters"]),
        ("lock_name", 42, ["lock_name=42 is not a string"]),
        ("lock_key", 3.5, ["lock_key=3.5 of type float is not valid"]),
        ("lock_key", ["a", 1], ["lock_key lists 1 of type int"]),
    ],
)
def test_invalid_task_attribute(attribute: str, value: object, fragments: list[str]) -> None:
    with pytest.raises(ConfigurationError) as caught:
        options_from_task(TASK, {attribute: value})
    message = str(caught.value)
    assert message.startswith(f"task {TASK!r}: ")
    for fragment in fragments:
        assert fragment in message


def test_valid_unusual_values() -> None:
    assert options_from_task(TASK, {"lock_timeout": 0}).timeout == 0.0
    assert options_from_task(TASK, {"lock_name": "n" * 255}).name == "n" * 255
    assert options_from_task(TASK, {"lock_name": "é 日本 ...x"}).name == "é 日本 ...x"
    assert options_from_task(TASK, {"lock_name": "..."}).name == "..."


def test_unknown_attribute_is_named_with_a_suggestion() -> None:
    with pytest.raises(ConfigurationError) as caught:
        options_from_task(TASK, {"lock_on_bussy": "skip"})
    message = str(caught.value)
    assert message.startswith(f"task {TASK!r}: unknown lock option 'lock_on_bussy'")
    assert "(did you mean 'lock_on_busy'?)" in message
    assert "lock_retry_countdown" in message

    with pytest.raises(ConfigurationError, match=r"unknown lock option 'zzz'; the lock options"):
        options_from_task(TASK, {"zzz": 1})


def test_task_name_unusable_as_default_lock_name() -> None:
    with pytest.raises(ConfigurationError) as caught:
        options_from_task("reports/daily", {})
    message = str(caught.value)
    assert message.startswith("task 'reports/daily': lock_name (default: the task name)=")
    assert "contains '/'" in message
    assert "set lock_name to a valid name" in message
    assert options_from_task("reports/daily", {"lock_name": "reports.daily"}).name == (
        "reports.daily"
    )


def test_check_lock_name_contract() -> None:
    assert check_lock_name("ctx", "label", "ok.name") == "ok.name"
    with pytest.raises(ConfigurationError, match=r"^ctx: label='a/b' contains '/'; do X; a lock"):
        check_lock_name("ctx", "label", "a/b", "do X; ")


def test_lock_options_validate_themselves() -> None:
    with pytest.raises(ConfigurationError, match=r"LockOptions\(name='x'\): mode='both'"):
        LockOptions(name="x", key=None, mode="both")  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match="name='a/b' contains '/'"):
        LockOptions(name="a/b", key=None)
    with pytest.raises(
        ConfigurationError, match="timeout must be a number of seconds >= 0, got -1"
    ):
        LockOptions(name="x", key=None, timeout=-1)
    options = LockOptions(name="x", key=["a"], timeout=2)
    assert options.key == ("a",)
    assert options.timeout == 2.0
    with pytest.raises(dataclasses.FrozenInstanceError):
        options.mode = "shared"  # type: ignore[misc]


# --- per-call overrides ------------------------------------------------------------------------


@pytest.fixture
def base() -> LockOptions:
    return options_from_task(
        TASK, {"lock_key": ["account_id"], "lock_mode": "shared", "lock_on_busy": "skip"}
    )


def test_no_overrides_keeps_options(base: LockOptions) -> None:
    assert with_call_overrides(base, TASK, {}) == base


def test_overrides_change_only_their_keys(base: LockOptions) -> None:
    merged = with_call_overrides(base, TASK, {"on_busy": "wait", "timeout": 5})
    assert merged == dataclasses.replace(base, on_busy="wait", timeout=5.0)
    assert isinstance(merged.timeout, float)
    assert base.on_busy == "skip"  # the task's options are not changed
    assert base.timeout == 60.0


def test_every_override_key(base: LockOptions) -> None:
    merged = with_call_overrides(
        base,
        TASK,
        {
            "on_busy": "retry",
            "timeout": 0.25,
            "on_timeout": "skip",
            "on_lost": "retry",
            "retry_countdown": 1,
        },
    )
    assert merged == LockOptions(
        name=TASK,
        key=("account_id",),
        mode="shared",
        on_busy="retry",
        timeout=0.25,
        on_timeout="skip",
        on_lost="retry",
        retry_countdown=1.0,
    )


def test_overrides_after_a_json_round_trip(base: LockOptions) -> None:
    sent = {"on_busy": "wait", "timeout": None, "on_timeout": "retry", "retry_countdown": 2.5}
    received = json.loads(json.dumps(sent))
    merged = with_call_overrides(base, TASK, received)
    assert merged.on_busy == "wait"
    assert merged.timeout is None
    assert merged.on_timeout == "retry"
    assert merged.retry_countdown == 2.5
    assert with_call_overrides(base, TASK, json.loads('{"timeout": 5}')).timeout == 5.0


@pytest.mark.parametrize(
    ("overrides", "fragments"),
    [
        ({"on_busy": "sometimes"}, ["zklock['on_busy']='sometimes'", "'skip', 'wait'"]),
        ({"timeout": -2}, ["zklock['timeout'] must be", ">= 0, got -2", "or None"]),
        ({"timeout": "5"}, ["zklock['timeout'] must be", "got '5'"]),
        ({"timeout": False}, ["zklock['timeout'] must be", "got False"]),
        ({"on_timeout": "wait"}, ["zklock['on_timeout']='wait'", "'skip', 'retry', 'raise'"]),
        ({"on_lost": None}, ["zklock['on_lost']=None", "'raise', 'retry'"]),
        ({"retry_countdown": None}, ["zklock['retry_countdown'] must be a number of seconds"]),
        (
            {"on_bussy": "skip"},
            ["zklock override key 'on_bussy' is not allowed", "(did you mean 'on_busy'?)"],
        ),
        ({"mode": "exclusive"}, ["key 'mode' is not allowed", "fixed by the task"]),
        ({"lock_key": ["x"]}, ["key 'lock_key' is not allowed", "fixed by the task"]),
        ({"name": "other"}, ["key 'name' is not allowed", "fixed by the task"]),
        ({3: "x"}, ["key 3 is not allowed"]),
    ],
)
def test_invalid_overrides(
    base: LockOptions, overrides: dict[object, object], fragments: list[str]
) -> None:
    with pytest.raises(ConfigurationError) as caught:
        with_call_overrides(base, TASK, overrides)  # type: ignore[arg-type]
    message = str(caught.value)
    assert message.startswith(f"task {TASK!r}: zklock")
    for fragment in fragments:
        assert fragment in message
    if "is not allowed" in message:
        assert message.endswith(f"allowed keys: {', '.join(sorted(CALL_OVERRIDES))}")


@pytest.mark.parametrize("overrides", [None, ["on_busy", "wait"], "wait"])
def test_overrides_must_be_a_mapping(base: LockOptions, overrides: object) -> None:
    with pytest.raises(ConfigurationError) as caught:
        with_call_overrides(base, TASK, overrides)  # type: ignore[arg-type]
    assert str(caught.value).startswith(f"task {TASK!r}: zklock=")
    expected = f"give a dict with some of the keys {', '.join(sorted(CALL_OVERRIDES))}"
    assert expected in str(caught.value)


# -- acks_late without reject_on_worker_lost -----------------------------------------------------


def test_acks_late_without_reject_on_worker_lost_warns_once_at_definition(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import warnings

    from celery import Celery
    from celery import _state as celery_state

    # Only this test's tasks in its apps: not the shared tasks other modules defined.
    monkeypatch.setattr(celery_state, "_on_app_finalizers", set())

    from celery_zklock import ZkLockTask
    from celery_zklock.task.options import RedeliveryWarning
    from celery_zklock.worker.gate.step import install

    app = Celery("acks", set_as_current=False)
    with pytest.warns(RedeliveryWarning) as caught:

        @app.task(base=ZkLockTask, acks_late=True, shared=False)
        def late(k: str) -> None: ...

        app.finalize()  # the task class is made (a task of an app not yet finalized is lazy)
    (warning,) = caught
    text = str(warning.message)
    assert text.startswith(f"task {late.name!r}: acks_late without reject_on_worker_lost")
    assert "Celery acknowledges its message" in text and "WorkerLostError" in text
    assert "reject_on_worker_lost=True" in text
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # none of these warns, nor `late` again at worker start

        @app.task(base=ZkLockTask, acks_late=True, reject_on_worker_lost=True, shared=False)
        def safe(k: str) -> None: ...

        @app.task(base=ZkLockTask, shared=False)
        def early(k: str) -> None: ...

        assert safe.name != early.name  # both made now (the app is finalized)
        install(sender=type("Worker", (), {"app": app, "task_events": False})())
    # The app's settings count once the tasks are bound, as in a worker at start.
    app2 = Celery("acks2", set_as_current=False)
    app2.conf.task_acks_late = True

    @app2.task(base=ZkLockTask, shared=False)
    def by_settings(k: str) -> None: ...

    with pytest.warns(RedeliveryWarning) as caught:
        install(sender=type("Worker", (), {"app": app2, "task_events": False})())
    assert [str(w.message).split(":")[0] for w in caught] == [f"task {by_settings.name!r}"]


def _spec(**attrs: object) -> TaskLockSpec:
    class Task:
        def run(self, account_id: int, full: bool = False) -> None: ...

    for name, value in {"lock_key": ["account_id"], **attrs}.items():
        setattr(Task, name, value)
    return TaskLockSpec.compile(Task, TASK)


def test_a_calls_overrides_are_validated_once_per_process(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Issue 43: the gate, the run and the send of one call validate its overrides once (the
    same overrides give the same options), and only the keys given; equal values of another
    type (``True`` for ``1``) are validated on their own."""
    spec = _spec()
    checked: list[str] = []
    real = options_module._choice

    def counted(context: str, label: str, value: object, allowed: tuple[str, ...]) -> object:
        checked.append(label)
        return real(context, label, value, allowed)

    monkeypatch.setattr(options_module, "_choice", counted)
    first = spec.for_call({"on_busy": "skip", "timeout": 1})
    assert checked == ["zklock['on_busy']"]  # not the other four choices of the task
    assert spec.for_call(json.loads('{"timeout": 1, "on_busy": "skip"}')) is first
    assert checked == ["zklock['on_busy']"]
    assert first.on_busy == "skip" and first.timeout == 1.0 and first.mode == "exclusive"
    with pytest.raises(ConfigurationError, match="timeout"):
        spec.for_call({"on_busy": "skip", "timeout": True})
    with pytest.raises(ConfigurationError, match="on_bussy"):
        spec.for_call({"on_bussy": "skip"})
    with pytest.raises(ConfigurationError, match="preempt"):  # the rules between options too
        _spec(lock_key={"account_id": ["account_id"]}, lock_debounce=1.0).for_call(
            {"on_busy": "skip"}
        )


def test_a_call_resolved_by_the_gate_reaches_its_run_for_that_attempt_only() -> None:
    """The gate's paths (``zklock_paths``) are the run's for the attempt the gate resolved;
    a retry (another ``retries``) or a malformed field makes the run resolve again."""
    spec = _spec()
    call = spec.resolve("/root", (7,), {}, spec.options)
    assert call.paths == ("/root/proj.tasks.sync/account_id=7~" + call.paths[0].split("~")[1],)
    assert call.path == call.paths[0] and call.kind.kind == "write"
    assert spec.paths("/root", (7,), {}) == call.paths
    built = spec.paths("/root", (8,), {})
    assert built != call.paths
    carried = types.SimpleNamespace(retries=0, zklock_paths=[list(call.paths), 0])
    assert spec.paths("/root", (8,), {}, carried) == call.paths  # the gate's, as a tuple
    for value in ([list(call.paths), 1], [call.paths[0], 0], [[], 0], [[1], 0], None):
        assert (
            spec.paths("/root", (8,), {}, types.SimpleNamespace(retries=0, zklock_paths=value))
            == built
        )
    several = _spec(lock_key={"account_id": ["account_id", "full"]})
    call = several.resolve("/root", ("a",), {"full": "b"}, several.options)
    assert len(call.paths) == 2 and call.path == " + ".join(call.paths)
