"""Task options checked when the app finalizes (issue 46, item 2), without a server: ``@app.task``
returns a lazy proxy until then, and finalizing makes and binds every task, so a misspelt option
is refused there, naming the task and the option, whether it was given to the decorator or set
in a shared base class; and a Celery command ended by such a refusal prints it as one line.
The worker's start: tests/task/test_setting_names_workers.py."""

from __future__ import annotations

import io
import re
import sys
from typing import Any

import pytest
from celery import Celery

from celery_zklock import ZkLockTask
from celery_zklock.errors import ConfigurationError
from celery_zklock.worker import wiring

REFUSED = re.escape("unknown lock option 'lock_on_bussy' (did you mean 'lock_on_busy'?)")


def app_of(name: str) -> Celery:
    # Not finalized, and its tasks not shared: no other app of this process makes them.
    return Celery(name, broker="memory://", set_as_current=False)


def test_a_misspelt_option_of_a_lazy_task_is_refused_when_the_app_finalizes() -> None:
    app = app_of("lazy")

    @app.task(base=ZkLockTask, lock_key=["key"], lock_on_bussy="skip", shared=False)
    def sync(key: str) -> str:
        return key

    assert not app.finalized  # nothing checked at the decorator: Celery made no class yet
    with pytest.raises(ConfigurationError, match=rf"^task 'tests\..*sync': {REFUSED}"):
        app.finalize()


def test_a_misspelt_option_of_a_shared_base_class_is_refused_when_the_app_finalizes() -> None:
    """The decorator's keywords land in the task's own class, which the validator reads; an
    option set in a base class of the app's tasks is checked as the task is bound (before, a
    misspelt one left the option at its default without a word)."""

    class SkipWhenBusy(ZkLockTask):  # type: ignore[misc]
        lock_on_bussy = "skip"

        def lock_note(self) -> str:  # a helper method of the base class is no option
            return "note"

    app = app_of("base")

    @app.task(base=SkipWhenBusy, lock_key=["key"], shared=False)
    def sync(key: str) -> str:
        return key

    with pytest.raises(ConfigurationError, match=rf"^task 'tests\..*sync': {REFUSED}"):
        app.finalize()


def test_a_base_class_with_helpers_and_right_options_passes() -> None:
    class SkipWhenBusy(ZkLockTask):  # type: ignore[misc]
        lock_on_busy = "skip"

        @property
        def lock_label(self) -> str:
            return "label"

    app = app_of("fine")

    @app.task(base=SkipWhenBusy, lock_key=["key"], shared=False)
    def sync(key: str) -> str:
        return key

    app.finalize()
    task: Any = app.tasks[sync.name]
    assert task._zklock_spec.options.on_busy == "skip"


def test_a_celery_command_ended_by_a_configuration_error_prints_one_line(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The process's excepthook (a worker finalizes its app before any signal is sent): one
    line for a ConfigurationError in Celery's command line; anything else as before."""
    assert sys.excepthook is wiring._one_line_exit
    passed_on: list[type[BaseException]] = []
    monkeypatch.setattr(wiring, "_previous_excepthook", lambda kind, *_: passed_on.append(kind))
    monkeypatch.setitem(sys.modules, "celery.bin.celery", sys.modules.get("celery.bin.celery"))
    err = io.StringIO()
    monkeypatch.setattr(sys, "stderr", err)
    wiring._one_line_exit(ConfigurationError, ConfigurationError("task 'x': bad"), None)
    wiring._one_line_exit(KeyError, KeyError("k"), None)
    assert err.getvalue() == "celery-zklock: task 'x': bad\n"
    assert passed_on == [KeyError]
    monkeypatch.delitem(sys.modules, "celery.bin.celery")  # not Celery's command line
    wiring._one_line_exit(ConfigurationError, ConfigurationError("elsewhere"), None)
    assert passed_on == [KeyError, ConfigurationError]
