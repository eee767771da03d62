"""Turning scheduler output into model inputs and sampled tokens."""
