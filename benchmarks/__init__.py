"""Benchmark scripts (run from the repository root as ``python -m benchmarks.<name>``) and their shared helpers."""
