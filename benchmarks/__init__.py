"""Side-by-side measurements of celery-zklock against a floor and against other recipes.

Each module is runnable: ``python -m benchmarks.recipes --help``. Results are printed and written
as JSON under ``benchmarks/results/``.
"""
