"""Benchmarks: every variant of a spec timed side by side in one process."""
