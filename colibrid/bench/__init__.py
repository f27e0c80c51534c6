"""Benchmarks: each prints its figure beside the limit measured in the same run."""
