"""The worker's gate: messages of locked ``wait`` tasks whose lock is busy wait in the worker's
main process instead of a pool slot (see :mod:`celery_zklock.worker.gate.gate`)."""

from celery_zklock.worker.gate.gate import Gate
from celery_zklock.worker.gate.step import GateStep

__all__ = ["Gate", "GateStep"]
