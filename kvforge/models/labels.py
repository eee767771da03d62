"""How many labels a classifier checkpoint's head has."""

from __future__ import annotations


def num_labels(hf_config: dict) -> int:
    """config.json's num_labels, else the size of its id2label, else 2 (the HF default)."""
    return hf_config.get("num_labels") or len(hf_config.get("id2label") or {}) or 2
