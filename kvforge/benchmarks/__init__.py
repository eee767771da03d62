"""Benchmarks: offline throughput, serving and kernels."""
