"""Kernels: one file per op (torch reference + Triton kernel + launcher); `ops` picks the implementation."""
