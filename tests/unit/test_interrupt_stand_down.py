"""An interruption stands down once the body was told of the loss: no second LockLost.

Per strategy, without ZooKeeper: the interruption is triggered as the lease clock's thread
triggers it (``_interrupt``), after :meth:`Interruption.stand_down` ran in the body's context,
and, for the signal, also with the signal sent by a thread that looked before the stand-down.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator

import pytest

from celery_zklock.errors import LockLost
from celery_zklock.task.interrupt import Interruption, _GreenletKill, _MainThreadSignal, arm
from tests.lockutil import let_interruption_land


@pytest.fixture
def main_thread_run() -> Iterator[Interruption]:
    assert threading.current_thread() is threading.main_thread()
    before = signal.getsignal(signal.SIGUSR2)
    interruption = arm()
    assert isinstance(interruption, _MainThreadSignal)
    try:
        yield interruption
    finally:
        interruption.disarm()
    assert signal.getsignal(signal.SIGUSR2) is before


@pytest.mark.parametrize("stood_down", [False, True])
def test_signal_not_raised_after_standing_down(
    main_thread_run: Interruption, stood_down: bool
) -> None:
    if stood_down:
        main_thread_run.stand_down()
    raised: list[str] = []
    try:
        main_thread_run._interrupt("lost")  # as the lease clock's thread does
        let_interruption_land()
    except LockLost as exc:
        raised.append(str(exc))
    assert raised == ([] if stood_down else ["lost"])


@pytest.mark.parametrize("stood_down", [False, True])
def test_a_signal_on_its_way_is_not_raised_after_standing_down(
    main_thread_run: Interruption, stood_down: bool
) -> None:
    """The lease clock's thread found the run armed and not stood down, the body stood down,
    then the signal was sent and handled: the handler itself stands down."""
    assert isinstance(main_thread_run, _MainThreadSignal)
    if stood_down:
        main_thread_run.stand_down()
    _MainThreadSignal._pending[main_thread_run.token] = "lost"  # what _interrupt set meanwhile
    raised: list[str] = []
    try:
        _MainThreadSignal._handler(signal.SIGUSR2, None)  # as the signal, in the main thread
    except LockLost as exc:
        raised.append(str(exc))
    assert raised == ([] if stood_down else ["lost"])


def test_a_check_on_another_thread_does_not_stand_the_body_down(
    main_thread_run: Interruption,
) -> None:
    """A thread the body handed its lease to learns of the loss: the body was not told, and
    its interruption still lands."""
    helper = threading.Thread(target=main_thread_run.stand_down)
    helper.start()
    helper.join(30)
    with pytest.raises(LockLost, match="lost"):
        main_thread_run._interrupt("lost")
        let_interruption_land()


def test_standing_down_leaves_a_nested_runs_interruption_armed(
    main_thread_run: Interruption,
) -> None:
    nested = arm()
    try:
        main_thread_run.stand_down()
        with pytest.raises(LockLost, match="nested lost"):
            nested._interrupt("nested lost")
            let_interruption_land()
    finally:
        nested.disarm()


@pytest.mark.parametrize("stood_down", [False, True])
def test_async_exception_not_set_after_standing_down(stood_down: bool) -> None:
    armed, triggered = threading.Event(), threading.Event()
    runs: list[Interruption] = []
    raised: list[str] = []

    def body() -> None:
        interruption = arm()
        runs.append(interruption)
        try:
            if stood_down:
                interruption.stand_down()
            armed.set()
            triggered.wait(30)  # a C call: an exception set meanwhile is raised after it
            let_interruption_land()
        except LockLost:
            raised.append("LockLost")
        finally:
            interruption.disarm()

    thread = threading.Thread(target=body)
    thread.start()
    assert armed.wait(30)
    runs[0]._interrupt("lost")  # from this thread, as the lease clock's thread does
    triggered.set()
    thread.join(30)
    assert runs[0].strategy == "async-exception"
    assert raised == ([] if stood_down else ["LockLost"])


@pytest.mark.parametrize("stood_down", [False, True])
def test_greenlet_not_thrown_into_after_standing_down(stood_down: bool) -> None:
    gevent = pytest.importorskip("gevent")
    raised: list[str] = []
    ready = gevent.event.Event()
    go = gevent.event.Event()

    def body() -> None:
        interruption = _GreenletKill(gevent.getcurrent())
        runs.append(interruption)
        try:
            if stood_down:
                interruption.stand_down()
            ready.set()
            go.wait(30)  # the hub runs the interruption's callback meanwhile, if armed
            gevent.sleep(0)
        except LockLost as exc:
            raised.append(str(exc))
        finally:
            interruption.disarm()

    runs: list[Interruption] = []
    greenlet = gevent.spawn(body)
    assert ready.wait(30)
    runs[0]._interrupt("lost")
    go.set()
    greenlet.join(30)
    assert greenlet.dead
    assert raised == ([] if stood_down else ["lost"])
