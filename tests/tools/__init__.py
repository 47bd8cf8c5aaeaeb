"""Tools tier: the tests of the repository's tools, not of the library: the fleet, load test
and fault injection (``workers/``: its checker, records, reports, sender, compose files, network
namespaces) and the benchmarks (``benchmarks/``). Synthetic histories and stand-ins mostly, a
few on the session's ZooKeeper or Redis; the whole folder in well under a minute."""
