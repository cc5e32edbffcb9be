"""Benchmarks (GPU only): runnable scripts, `python -m benchmarks.<name>`."""
