"""Task tier: ZkLockTask called directly, eagerly and on real `celery worker` processes."""
