"""Benchmarks: see docs/benchmarks.md."""
