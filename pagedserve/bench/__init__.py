"""Benchmarks: offline throughput and latency, online serving, the control path, kernels."""
