"""ZooKeeper plumbing, the bottom layer above :mod:`celery_zklock.errors`: the kazoo handler
(:mod:`~celery_zklock.zk.handler`), the adapter over kazoo's private API
(:mod:`~celery_zklock.zk.adapter`), calls and deadlines (:mod:`~celery_zklock.zk.calls`), the
process's clients (:mod:`~celery_zklock.zk.client`), their settings and validation
(:mod:`~celery_zklock.zk.settings`, :mod:`~celery_zklock.zk.validate`), what an outage logs
(:mod:`~celery_zklock.zk.outages`) and the four-letter-word client
(:mod:`~celery_zklock.zk.four_letter`). Nothing here knows of locks or tasks.
"""
