"""Write GGUF files of public Llama models' exact shapes with random weights, quantized by llama.cpp.

Speed benchmarks (kvforge against llama.cpp) need files the size and layout of what users download,
not the weights themselves. This script writes an F16 GGUF of the model's shapes with random weights
(matrices normal(0, 0.02), norms 1 + normal(0, 0.01): finite logits), streamed one tensor at a time so
an 8B model never sits in memory, then runs llama.cpp's own `llama-quantize` for each requested type.

Shapes are the public config.json values:
  llama-1b  meta-llama/Llama-3.2-1B: hidden 2048, intermediate 8192, 16 layers, 32 heads, 8 KV heads,
            head_dim 64, vocab 128256, rope_theta 500000, rms eps 1e-5, context 131072, tied embeddings
            (its llama3 rope scaling, rope_freqs.weight, is left out: no effect on speed).
  llama-8b  meta-llama/Meta-Llama-3-8B: hidden 4096, intermediate 14336, 32 layers, 32 heads, 8 KV heads,
            head_dim 128, vocab 128256, rope_theta 500000, rms eps 1e-5, context 8192, untied output.
The tokenizer is SmolLM2's byte-level BPE (from kvforge's default model file), its 49152 tokens padded
with "<|reserved_N|>" tokens of type UNUSED up to the 128256 embedding rows.

  python scripts/make_gguf_models.py --model llama-1b --out /work/models --llama-bin "$(bash peers/llama-cpp.sh)"
writes /work/models/llama-1b-{Q4_0,Q4_K_M,Q5_K_M,Q6_K,Q8_0}.gguf; files that exist are skipped.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np


@dataclass(frozen=True)
class Shape:
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    rope_theta: float
    rms_eps: float
    context: int
    tied: bool
    name: str


MODELS = {
    "llama-1b": Shape(2048, 8192, 16, 32, 8, 64, 128256, 500000.0, 1e-5, 131072, True, "Llama-3.2-1B"),
    "llama-8b": Shape(4096, 14336, 32, 32, 8, 128, 128256, 500000.0, 1e-5, 8192, False, "Meta-Llama-3-8B"),
}
DEFAULT_TYPES = {"llama-1b": ["Q4_0", "Q4_K_M", "Q5_K_M", "Q6_K", "Q8_0"], "llama-8b": ["Q4_K_M"]}
# UNUSED rather than CONTROL: 79k special tokens would slow both tokenizers' special-token matching.
PAD_TOKEN_TYPE = int(gguf.TokenType.UNUSED)
CHUNK = 1 << 24  # random values generated per step


def tensor_shapes(s: Shape) -> list[tuple[str, tuple[int, ...]]]:
    """(name, numpy row-major shape [out, in]) of every tensor, in file order."""
    q, kv = s.heads * s.head_dim, s.kv_heads * s.head_dim
    out: list[tuple[str, tuple[int, ...]]] = [("token_embd.weight", (s.vocab, s.hidden))]
    for i in range(s.layers):
        out += [
            (f"blk.{i}.attn_norm.weight", (s.hidden,)),
            (f"blk.{i}.attn_q.weight", (q, s.hidden)),
            (f"blk.{i}.attn_k.weight", (kv, s.hidden)),
            (f"blk.{i}.attn_v.weight", (kv, s.hidden)),
            (f"blk.{i}.attn_output.weight", (s.hidden, q)),
            (f"blk.{i}.ffn_norm.weight", (s.hidden,)),
            (f"blk.{i}.ffn_gate.weight", (s.intermediate, s.hidden)),
            (f"blk.{i}.ffn_up.weight", (s.intermediate, s.hidden)),
            (f"blk.{i}.ffn_down.weight", (s.hidden, s.intermediate)),
        ]
    out.append(("output_norm.weight", (s.hidden,)))
    if not s.tied:
        out.append(("output.weight", (s.vocab, s.hidden)))
    return out


def random_tensor(rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    """Norms (1-D): F32 1 + N(0, 0.01); matrices: F16 N(0, 0.02), filled in chunks to bound memory."""
    if len(shape) == 1:
        return (1.0 + 0.01 * rng.standard_normal(shape, dtype=np.float32)).astype(np.float32)
    flat = np.empty(int(np.prod(shape)), dtype=np.float16)
    for start in range(0, flat.size, CHUNK):
        n = min(CHUNK, flat.size - start)
        chunk = rng.standard_normal(n, dtype=np.float32)
        chunk *= 0.02
        flat[start : start + n] = chunk
    return flat.reshape(shape)


def add_tokenizer(writer: gguf.GGUFWriter, vocab: int) -> None:
    """Copy the default model's tokenizer.* fields, padding tokens and token types to `vocab`."""
    from kvforge.loader.default_model import default_model_path

    reader = gguf.GGUFReader(default_model_path())
    for key, field in reader.fields.items():
        if not key.startswith("tokenizer."):
            continue
        value = field.contents()
        if key == "tokenizer.ggml.tokens":
            value = value + [f"<|reserved_{i}|>" for i in range(vocab - len(value))]
        elif key == "tokenizer.ggml.token_type":
            value = value + [PAD_TOKEN_TYPE] * (vocab - len(value))
        sub_type = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(key, value, field.types[0], sub_type=sub_type)


def write_f16(model: str, path: Path, seed: int) -> None:
    """Stream an F16 GGUF of `model` with random weights to `path` (via a .part file)."""
    s = MODELS[model]
    part = path.with_name(path.name + ".part")
    writer = gguf.GGUFWriter(part, "llama")
    writer.add_name(f"{s.name} (random weights)")
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    writer.add_context_length(s.context)
    writer.add_embedding_length(s.hidden)
    writer.add_block_count(s.layers)
    writer.add_feed_forward_length(s.intermediate)
    writer.add_head_count(s.heads)
    writer.add_head_count_kv(s.kv_heads)
    writer.add_rope_freq_base(s.rope_theta)
    writer.add_layer_norm_rms_eps(s.rms_eps)
    writer.add_rope_dimension_count(s.head_dim)
    writer.add_vocab_size(s.vocab)
    add_tokenizer(writer, s.vocab)
    shapes = tensor_shapes(s)
    for name, shape in shapes:
        dtype = np.dtype(np.float32 if len(shape) == 1 else np.float16)
        writer.add_tensor_info(name, shape, dtype, int(np.prod(shape)) * dtype.itemsize)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    rng = np.random.default_rng(seed)
    for _, shape in shapes:
        writer.write_tensor_data(random_tensor(rng, shape))
    writer.close()
    part.rename(path)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", choices=sorted(MODELS), required=True)
    p.add_argument("--out", type=Path, required=True, help="folder for MODEL-TYPE.gguf files")
    p.add_argument("--llama-bin", type=Path, required=True, help="folder holding llama-quantize")
    p.add_argument("--types", nargs="+", help="llama-quantize types (default: per model)")
    p.add_argument("--keep-f16", action="store_true", help="keep MODEL-F16.gguf after quantizing")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)

    args.out.mkdir(parents=True, exist_ok=True)
    quantize = args.llama_bin / "llama-quantize"
    if not quantize.is_file():
        p.error(f"{quantize} not found")
    f16 = args.out / f"{args.model}-F16.gguf"
    todo = [t for t in args.types or DEFAULT_TYPES[args.model] if not (args.out / f"{args.model}-{t}.gguf").exists()]
    if not todo:
        print("all files exist")
        return 0
    if not f16.exists():
        t0 = time.perf_counter()
        write_f16(args.model, f16, args.seed)
        print(f"wrote {f16} in {time.perf_counter() - t0:.0f} s", flush=True)
    for qtype in todo:
        dst = args.out / f"{args.model}-{qtype}.gguf"
        part = dst.with_name(dst.name + ".part")
        t0 = time.perf_counter()
        log = subprocess.run([str(quantize), str(f16), str(part), qtype, "2"], capture_output=True, text=True)
        if log.returncode != 0:
            part.unlink(missing_ok=True)
            sys.stderr.write(log.stdout[-4000:] + log.stderr[-4000:])
            print(f"llama-quantize {qtype} failed ({log.returncode})", file=sys.stderr)
            return 1
        part.rename(dst)
        print(f"wrote {dst} in {time.perf_counter() - t0:.0f} s", flush=True)
    if not args.keep_f16:
        f16.unlink()
    return 0


if __name__ == "__main__":
    sys.exit(main())
