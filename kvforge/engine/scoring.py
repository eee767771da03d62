"""Scoring (query, document) pairs, shared by LLM.score and the server's /score and /rerank.

A cross-encoder (a pooling model with a classifier head) reads each pair as one input, the tokenizer's pair
encoding, and its head's probability is the score; an embedding model embeds each text on its own and the score is
the cosine similarity of the two embeddings.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from kvforge.outputs import PoolingOutput, PoolingRequestOutput
from kvforge.tokenizer import Tokenizer


def pair_up(queries: str | Sequence[str], documents: str | Sequence[str]) -> tuple[list[str], list[str]]:
    """(queries, documents) of equal length: one query against every document, or pairs in order."""
    queries = [queries] if isinstance(queries, str) else list(queries)
    documents = [documents] if isinstance(documents, str) else list(documents)
    if len(queries) == 1:
        queries = queries * len(documents)
    if len(queries) != len(documents) or not documents:
        raise ValueError(f"scoring takes one query or as many queries as documents, and at least one document; "
                         f"got {len(queries)} queries and {len(documents)} documents")
    return queries, documents


def pair_prompts(tokenizer: Tokenizer, queries: list[str], documents: list[str]) -> list[dict]:
    """A cross-encoder's inputs: each pair as one input, with the tokenizer's separators and token types."""
    prompts = []
    for query, document in zip(queries, documents, strict=True):
        token_ids, token_type_ids = tokenizer.encode_pair(query, document)
        prompts.append({"prompt_token_ids": token_ids, "token_type_ids": token_type_ids})
    return prompts


def cosine_scores(embedded: list[PoolingRequestOutput]) -> list[PoolingRequestOutput]:
    """An embedding model's scores: `embedded` holds the queries' embeddings, then the documents'."""
    num_pairs = len(embedded) // 2
    queries = torch.stack([o.outputs.data for o in embedded[:num_pairs]])
    documents = torch.stack([o.outputs.data for o in embedded[num_pairs:]])
    scores = F.cosine_similarity(queries, documents, dim=1)
    return [PoolingRequestOutput(d.request_id, q.prompt_token_ids + d.prompt_token_ids, PoolingOutput(score[None]))
            for q, d, score in zip(embedded[:num_pairs], embedded[num_pairs:], scores)]
