"""Benchmarks: our engine against its peers on the same model and workload (not run by `pytest`)."""
