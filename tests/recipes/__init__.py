"""Recipe tier: the lock recipes, the lease clock and the local stack on ZooKeeper and Redis."""
