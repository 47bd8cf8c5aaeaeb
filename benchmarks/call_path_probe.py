"""The probe of ``python -m benchmarks.call_path --worker``: the library functions a process
enters, in every thread, while a window is open.

:func:`install` makes :func:`_profile` the profile function of the calling thread and of every
thread started after it (``sys.setprofile`` and ``threading.setprofile``): install it before the
process starts any thread. While no window is open the function only reads one module-level
flag. Between :func:`start` and :func:`stop` each ``call`` event of a function whose module is
``celery_zklock`` or below it (``celery_zklock.testing`` apart) is counted under
``(module, qualname)``, in the order first entered; :func:`stop` returns only what the window saw.

Another process is driven by signals (:func:`listen`): :data:`START_SIGNAL` opens its window and
acknowledges with an empty file ``<pid>.on`` in the directory named by :data:`DIR_ENV`;
:data:`STOP_SIGNAL` closes it and writes what it counted to ``<pid>.json`` there. The counting
side uses :func:`open_windows` and :func:`close_windows`. Two real-time signals, because Celery
owns SIGUSR1 and the library's interruption SIGUSR2. The probe and its handlers live here, outside
the library, so they never count themselves.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from collections.abc import Iterable
from pathlib import Path
from types import FrameType
from typing import Any, Final

#: The directory where the probed processes acknowledge and write their counts.
DIR_ENV: Final = "CALLPATH_PROBE_DIR"
START_SIGNAL: Final = signal.SIGRTMIN + 5
STOP_SIGNAL: Final = signal.SIGRTMIN + 6
LIBRARY: Final = "celery_zklock"
EXCLUDED: Final = "celery_zklock.testing"

Function = tuple[str, str]
"""A function: its module and its qualified name."""

_active = False
_counts: dict[Function, int] = {}
_directory: Path | None = None


def counted(module: str) -> bool:
    """Whether a function of ``module`` is one of the library's (its testing package apart)."""
    ours = module == LIBRARY or module.startswith(LIBRARY + ".")
    return ours and not (module == EXCLUDED or module.startswith(EXCLUDED + "."))


def _profile(frame: FrameType, event: str, arg: Any) -> None:
    if _active and event == "call":
        module = frame.f_globals.get("__name__")
        if isinstance(module, str) and counted(module):
            code = frame.f_code  # co_qualname: Python 3.11 and later
            key = (module, getattr(code, "co_qualname", code.co_name))
            # Two threads may lose one increment between them; never a function.
            _counts[key] = _counts.get(key, 0) + 1


def install() -> None:
    """Profile this thread and every thread started from now on (closed until :func:`start`)."""
    sys.setprofile(_profile)
    threading.setprofile(_profile)


def start() -> None:
    """Open this process's window: forget earlier counts, count from now."""
    global _active
    _counts.clear()
    _active = True


def stop() -> dict[Function, int]:
    """Close the window; the calls of each function it saw, in the order first entered."""
    global _active
    _active = False
    return dict(_counts)  # one C-level copy: a late insert from another thread cannot break it


# ---------------------------------------------------------------- a probed process's signals


def listen(directory: Path) -> None:
    """Open and close this process's window on :data:`START_SIGNAL` / :data:`STOP_SIGNAL`,
    answering in ``directory`` (call from the main thread, as ``signal.signal`` requires)."""
    global _directory
    _directory = directory
    signal.signal(START_SIGNAL, _on_start)
    signal.signal(STOP_SIGNAL, _on_stop)


def _on_start(signum: int, frame: FrameType | None) -> None:
    start()
    if _directory is not None:
        (_directory / f"{os.getpid()}.on").touch()


def _on_stop(signum: int, frame: FrameType | None) -> None:
    counts = stop()
    if _directory is not None:
        path = _directory / f"{os.getpid()}.json"
        partial = path.with_suffix(".part")
        partial.write_text(json.dumps([[m, f, n] for (m, f), n in counts.items()]))
        os.replace(partial, path)  # the counter never reads half a file


# ------------------------------------------------------------------------ the counting side


def open_windows(pids: Iterable[int], directory: Path, timeout: float = 10.0) -> None:
    """Open the window of each of ``pids`` (listening on ``directory``); return once every one
    acknowledged. Raises TimeoutError naming those that did not."""
    pids = list(pids)
    for pid in pids:
        (directory / f"{pid}.on").unlink(missing_ok=True)
        (directory / f"{pid}.json").unlink(missing_ok=True)
    for pid in pids:
        os.kill(pid, START_SIGNAL)
    _wait_for(directory, pids, ".on", timeout)


def close_windows(
    pids: Iterable[int], directory: Path, timeout: float = 10.0
) -> dict[int, dict[Function, int]]:
    """Close the window of each of ``pids``; what each counted (as :func:`stop` returns it)."""
    pids = list(pids)
    for pid in pids:
        os.kill(pid, STOP_SIGNAL)
    _wait_for(directory, pids, ".json", timeout)
    return {
        pid: {
            (module, function): calls
            for module, function, calls in json.loads((directory / f"{pid}.json").read_text())
        }
        for pid in pids
    }


def _wait_for(directory: Path, pids: list[int], suffix: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while missing := [pid for pid in pids if not (directory / f"{pid}{suffix}").exists()]:
        if time.monotonic() >= deadline:
            raise TimeoutError(f"no {suffix} answer from pids {missing} within {timeout:g} s")
        time.sleep(0.005)
