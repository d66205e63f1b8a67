"""Performance checks: one module per goal, each runnable as `python -m benchmarks.<name>`."""
