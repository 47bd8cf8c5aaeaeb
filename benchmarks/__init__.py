"""Side-by-side measurements of celery-zklock against a floor and against other recipes.

``python -m benchmarks`` (``make bench``) runs every section on a local ZooKeeper and Redis it
starts itself and writes ``benchmarks/results/latest.json`` and ``latest.md``;
``python -m benchmarks --quick`` does the same with small sizes. ``python -m benchmarks --help``
lists the options; :mod:`benchmarks.__main__` describes the sections.
"""
