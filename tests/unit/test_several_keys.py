"""``lock_key={name: [parameters]}``: several keys for one call, each the key a single-key task
gets for the same value, and the options that cannot go with several keys refused early."""

from __future__ import annotations

import inspect

import pytest

from celery_zklock.errors import ConfigurationError
from celery_zklock.task.keys import KeyBuilder, SeveralKeys, check_lock_key_spec
from celery_zklock.task.options import options_from_task, with_call_overrides

TASK = "proj.transfer"


def sync_account(account_id: int, full: bool = False) -> None: ...


def transfer(src: int, dst: int, amount: int = 0) -> None: ...


def refund(acct: int) -> None: ...


def _builder(function: object, lock_key: object) -> KeyBuilder:
    return KeyBuilder.for_callable(TASK, inspect.signature(function), lock_key)  # type: ignore[arg-type]


def test_each_key_is_the_single_key_tasks_key_for_that_value() -> None:
    single = _builder(sync_account, ["account_id"])
    several = _builder(transfer, {"account_id": ["src", "dst"]})
    keys = several.keys((7, 3), {"amount": 5})
    assert keys == tuple(sorted([single((7,), {}), single((3,), {})]))
    assert several.keys((3, 7), {}) == keys  # the order the caller lists them in is not kept
    assert several.keys((7,), {"dst": 7}) == (single((7,), {}),)  # a key listed twice: once
    assert several((7, 7), {}) == single((7,), {})  # one key: the single-key spelling works


def test_a_one_parameter_mapping_renames_the_key() -> None:
    renamed = _builder(refund, {"account_id": "acct"})
    assert renamed.keys((9,), {}) == (_builder(sync_account, ["account_id"])((9,), {}),)
    assert renamed.kind == "several" and renamed.of_key_arguments((9,), {}) == renamed((9,), {})


def test_one_key_asked_of_a_call_with_two_names_the_task() -> None:
    several = _builder(transfer, {"account_id": ["src", "dst"]})
    with pytest.raises(TypeError, match=r"locks 2 keys .*'account_id': \['src', 'dst'\]"):
        several((1, 2), {})
    with pytest.raises(TypeError, match="missing the lock key's argument 'dst'"):
        several.of_key_arguments((1,), {})


@pytest.mark.parametrize(
    ("lock_key", "fragment"),
    [
        ({"a": ["src"], "b": ["dst"]}, "lock_key has 2 entries"),
        ({}, "lock_key has 0 entries"),
        ({"account_id": []}, "is not valid"),
        ({"account_id": [1]}, "is not valid"),
        ({1: ["src"]}, "is not valid"),
        ({"account_id": b"src"}, "is not valid"),
        ({"account_id": ["src", "src"]}, "lists a parameter twice"),
    ],
)
def test_malformed_mappings_are_refused(lock_key: object, fragment: str) -> None:
    with pytest.raises(ConfigurationError, match=fragment) as refused:
        check_lock_key_spec(TASK, lock_key)
    assert TASK in str(refused.value) and '{"account_id": ["src", "dst"]}' in str(refused.value)


def test_a_parameter_the_task_does_not_have_is_named() -> None:
    with pytest.raises(ConfigurationError, match="names 'to', which is not a parameter"):
        _builder(transfer, {"account_id": ["src", "to"]})


def test_normalised_spec() -> None:
    assert check_lock_key_spec(TASK, {"k": ("a", "b")}) == SeveralKeys("k", ("a", "b"))
    assert check_lock_key_spec(TASK, {"k": "a"}) == SeveralKeys("k", ("a",))


@pytest.mark.parametrize(
    ("attribute", "value"),
    [
        ("lock_mode", "shared"),
        ("lock_on_busy", "preempt"),
        ("lock_rate", "2/s"),
        ("lock_dedupe", "queued"),
    ],
)
def test_options_of_one_keys_lock_are_refused_with_several_keys(
    attribute: str, value: object
) -> None:
    with pytest.raises(ConfigurationError, match=f"{attribute}=.*works on one key's lock"):
        options_from_task(TASK, {"lock_key": {"account_id": ["src", "dst"]}, attribute: value})
    # one parameter is one key: every option goes
    options_from_task(TASK, {"lock_key": {"account_id": "src"}, attribute: value})


def test_a_per_call_preempt_is_refused_with_several_keys() -> None:
    base = options_from_task(TASK, {"lock_key": {"account_id": ["src", "dst"]}})
    with pytest.raises(ConfigurationError, match=r"zklock\['on_busy'\]='preempt'"):
        with_call_overrides(base, TASK, {"on_busy": "preempt"})
    assert with_call_overrides(base, TASK, {"on_busy": "skip"}).on_busy == "skip"


def test_the_events_token_of_several_keys_is_hashable_and_in_path_order() -> None:
    """The metrics recorder keys leases by (task id, path, token): a dict cannot be a key."""
    from celery_zklock.locks import MultiLease
    from celery_zklock.task.run import fence_of

    class Held:
        def __init__(self, path: str, token: int) -> None:
            self.path, self.token = path, token

    lease = MultiLease([Held("/r/a", 9), Held("/r/b", 4)])  # type: ignore[list-item]
    assert fence_of(lease) == (9, 4)
    assert hash(("task", "/r/a + /r/b", fence_of(lease)))


def test_one_lease_and_several_answer_as_one_protocol() -> None:
    """A task's ``self.lock`` is a HeldLease: ``tokens`` by path and ``held`` on both kinds."""
    from celery_zklock.locks import MultiLease
    from celery_zklock.locks.contenders import Contender
    from celery_zklock.locks.lease import Hold, Lease
    from celery_zklock.task.run import fence_of

    class Clock:
        valid_until = float("inf")

        def expire_if_due(self) -> None: ...

    def lease(path: str, token: int) -> Lease:
        ours = Contender(1, "n", "write", token=token, session=1)
        return Lease(Hold(Clock(), path, ours, 0, 0), lambda h: None)

    one, both = lease("/r/a", 9), MultiLease([lease("/r/a", 9), lease("/r/b", 4)])
    assert (one.tokens, fence_of(one)) == ({"/r/a": 9}, 9)
    assert (both.tokens, fence_of(both)) == ({"/r/a": 9, "/r/b": 4}, (9, 4))
    assert one.held and both.held
    both.leases[1].release()
    assert not both.held and not both.lost
