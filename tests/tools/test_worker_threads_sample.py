"""benchmarks.worker_threads.sample_threads: a thread's CPU and switches, read from /proc."""

from __future__ import annotations

import os
import threading
import time

from benchmarks.worker_threads import ThreadSample, sample_threads


def test_counters_grow_with_cpu_and_sleeps() -> None:
    ident: list[int] = []
    samples: list[ThreadSample] = []
    ready, sampled = threading.Event(), threading.Event()

    def work() -> None:
        ident.append(threading.get_native_id())
        ready.set()
        sampled.wait(10)
        end = time.thread_time() + 0.05
        while time.thread_time() < end:
            pass
        for _ in range(5):
            time.sleep(0.001)
        samples.append(sample_threads(os.getpid())[ident[0]])

    thread = threading.Thread(target=work)
    thread.start()
    ready.wait(10)
    before = sample_threads(os.getpid())[ident[0]]
    sampled.set()
    thread.join()
    (after,) = samples
    assert after.ticks >= before.ticks + 4
    assert after.voluntary >= before.voluntary + 5
