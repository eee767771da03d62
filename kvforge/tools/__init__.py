"""Developer tools that are not part of serving: `kvforge compile-kernels` (cross_compile)."""
