"""Fleet tier: the worker fleet, its faults, the load test, the demo and the stack command."""
