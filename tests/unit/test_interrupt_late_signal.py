"""A lease lost just as the body ends: the interruption's signal never meets the default handler.

The lease clock's thread looks whether the run is armed, then sends the signal; the main thread,
its body done, disarms and puts the previous handler back (in a pool process the default one,
which ends the process). The kill and the handler's restoration share a lock, and the main
thread takes a signal still pending for it before the restoration, so a kill that looked before
the disarm is delivered with our handler. Forced here: the clock's kill is
held until the main thread is about to restore. In a child process, as the failure ends the
process.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

SCENARIO = textwrap.dedent(
    """
    import signal, threading
    import celery_zklock.task.interrupt as interrupt
    from celery_zklock.task.interrupt import _MainThreadSignal

    signal.signal(signal.SIGUSR2, signal.SIG_DFL)  # what a pool process or solo worker has
    at_kill, restoring = threading.Event(), threading.Event()
    real_kill = signal.pthread_kill  # to the main thread (os.kill to the process before)

    def held_kill(thread_id, signum):
        at_kill.set()  # the clock thread looked: the run was armed
        restoring.wait(5)  # held until the main thread is about to restore the handler
        real_kill(thread_id, signum)

    class Lock:
        # The real lock; the main thread's entering (the restoration) releases the held kill.
        def __init__(self, lock):
            self.lock = lock
        def __enter__(self):
            if threading.current_thread() is threading.main_thread():
                restoring.set()
            return self.lock.__enter__()
        def __exit__(self, *exc):
            return self.lock.__exit__(*exc)

    lock = getattr(_MainThreadSignal, "_kill_lock", None)  # none before the fix
    if lock is not None:
        _MainThreadSignal._kill_lock = Lock(lock)
    signal.pthread_kill = held_kill
    run = interrupt.arm()
    assert run.strategy == "signal", run.strategy
    clock = threading.Thread(target=run.fire, args=("lease lost",))
    clock.start()
    assert at_kill.wait(5)
    run.disarm()  # the body returned
    restoring.set()  # (without the lock: the kill goes now, after the restoration)
    clock.join(5)
    assert not clock.is_alive()
    assert signal.getsignal(signal.SIGUSR2) == signal.SIG_DFL
    print("survived")
    """
)


def test_a_kill_that_looked_before_the_disarm_lands_before_the_default_handler() -> None:
    done = subprocess.run(
        [sys.executable, "-c", SCENARIO], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0 and done.stdout.strip() == "survived", (
        f"rc {done.returncode} (a negative rc is the signal that ended the process)\n"
        f"{done.stdout}{done.stderr}"
    )
