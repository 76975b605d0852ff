"""Bad inputs and faults run against the tiny config; ``tools/reliability_table.py`` turns the
results into ``docs/reliability.md`` and ``tests/test_reliability_*.py`` run subsets of them."""
