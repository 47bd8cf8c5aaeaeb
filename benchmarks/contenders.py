"""What the two Celery sections of ``python -m benchmarks`` share: their contenders, the app
settings, and the loop that warms the contenders up and times them.

Section 4 (:mod:`benchmarks.celery_fleet`) and section 6 (:mod:`benchmarks.enqueue`) each time
batches of one task of :mod:`benchmarks.celery_app` per contender: first one untimed warm-up
batch each, then ``repeats`` repetitions of one timed batch each, in an order rotated per
repetition (:func:`~benchmarks.common.rotated`). What a batch is and what it measures is the
section's own (a callable of the :data:`Batch` shape); :class:`Tally` keeps what came of them.
"""

from __future__ import annotations

from collections.abc import Callable, Container, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from benchmarks.celery_app import UNAVAILABLE
from benchmarks.common import rotated
from celery_zklock.testing import ZooKeeperServer
from workers.settings import Settings


@dataclass(frozen=True)
class Contender:
    """One task a section times, under the name ``label`` in its results.

    ``task`` is the task's name in :mod:`benchmarks.celery_app`, ``package`` the library it
    comes from and ``what`` a line on what it does. Section 4 takes its ratios and differences
    to the contender labelled ``baseline`` (none for a baseline itself); section 6 compares
    every contender to ``plain`` and ignores it. Section 6 sends the task with ``options`` (as
    ``apply_async``'s keyword arguments); with ``hit`` it times calls on one key that an
    untimed first call already queued. Section 4 uses neither.
    """

    label: str
    task: str
    package: str
    what: str
    baseline: str | None = "plain"
    hit: bool = False
    # left out of the hash, so that a contender stays hashable although a dict is not
    options: dict[str, Any] = field(default_factory=dict, hash=False)


Batch = Callable[[Contender, str, int], dict[str, Any]]
"""One batch of a section: ``(contender, tag, size)`` to the batch's figures. ``tag``
(``<label>-warm``, ``<label>-r<repetition>``) is unique per batch, for its keys and queues;
``size`` is how many tasks or calls it makes. A batch that fails raises."""


def section_settings(
    zk_server: ZooKeeperServer, redis_url: str, zk_root: str, **more: Any
) -> Settings:
    """The settings a section's app (and worker) runs with: ZooKeeper ``zk_server`` with its
    locks under ``zk_root``, the one Redis at ``redis_url`` as broker, result backend and
    record store, and ``more`` of :class:`~workers.settings.Settings`' fields."""
    return Settings(
        zk_hosts=zk_server.hosts,
        broker_url=redis_url,
        result_backend=redis_url,
        record_url=redis_url,
        zk_root=zk_root,
        **more,
    )


@dataclass
class Tally:
    """What came of a section's contenders: ``status`` maps the label of each contender that
    :meth:`warm_up` saw to ``"ok"``, or to why it was not measured or stopped being measured;
    ``samples`` maps the label of each one measured to the figures of its timed batches, one
    per repetition it completed, in order.

    A contender is not measured if its task is unavailable (``UNAVAILABLE`` of
    :mod:`benchmarks.celery_app`) or not registered, or if its warm-up batch raises; it stops
    being measured at the first timed batch that raises (the reason is cut to 500 characters).
    """

    status: dict[str, str] = field(default_factory=dict)
    samples: dict[str, list[dict[str, Any]]] = field(default_factory=dict)

    def warm_up(
        self,
        contenders: Sequence[Contender],
        registered: Container[str],
        batch: Batch,
        size: int,
    ) -> list[Contender]:
        """One untimed batch of ``size`` for each of ``contenders`` whose task is in
        ``registered``; the contenders to measure, in the order given."""
        measured: list[Contender] = []
        for contender in contenders:
            if contender.task in UNAVAILABLE or contender.task not in registered:
                reason = UNAVAILABLE.get(contender.task, "not registered")
                self.status[contender.label] = f"not measured: {reason}"
                continue
            try:
                batch(contender, f"{contender.label}-warm", size)
            except Exception as exc:
                self.status[contender.label] = (
                    f"not measured: {contender.package} failed its warm-up batch: {exc!r}"[:500]
                )
                continue
            self.status[contender.label] = "ok"
            measured.append(contender)
            self.samples[contender.label] = []
        return measured

    def repeat(
        self, measured: Sequence[Contender], repeats: int, batch: Batch, size: int
    ) -> Iterator[tuple[int, list[tuple[str, dict[str, Any]]]]]:
        """``repeats`` repetitions of one timed batch of ``size`` per contender still ``"ok"``,
        each repetition in another order. After each, yields its index (from 0) and, in the
        order of ``measured``, the label and figures of every batch it completed."""
        for rep in range(repeats):
            for contender in rotated(measured, rep):
                if self.status[contender.label] != "ok":
                    continue
                try:
                    sample = batch(contender, f"{contender.label}-r{rep}", size)
                except Exception as exc:
                    self.status[contender.label] = f"failed during repetition {rep + 1}: {exc!r}"[
                        :500
                    ]
                    continue
                self.samples[contender.label].append(sample)
            yield (
                rep,
                [
                    (c.label, self.samples[c.label][-1])
                    for c in measured
                    if len(self.samples[c.label]) == rep + 1
                ],
            )
