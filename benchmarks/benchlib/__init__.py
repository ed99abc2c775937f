"""Shared pieces of the trace-proxy benchmarks: workload, upstream, load generator, processes."""
