"""Model architectures, one file per family, and the registry from HF architecture names."""
