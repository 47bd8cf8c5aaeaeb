"""Operator tools, the top layer: every lock under the root (:mod:`~celery_zklock.ops.holders`)
and the ``celery zklock`` commands (:mod:`~celery_zklock.ops.commands`)."""
