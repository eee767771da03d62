"""A random-weight hybrid model (Qwen3.5 text: Gated DeltaNet and gated attention, 3:1) saved as a checkpoint folder,
for timing kvforge's decode against its transformers reference where no real hybrid checkpoint is at hand:

    python -m kvforge.benchmarks.hybrid_model /tmp/qwen3_5-random
    kvforge bench latency --model /tmp/qwen3_5-random --dtype float32 --input-len 128 --output-len 128
    kvforge bench latency --model /tmp/qwen3_5-random --dtype float32 --input-len 128 --output-len 128 --backend hf

The default shape is a small Qwen3.5 one (hidden 1024, 24 layers of which 6 full attention, 8 query and 2 KV heads
of 256, 16 linear-attention heads of 128, MLP 3584, vocabulary 248320, tied embeddings: about 0.75B parameters);
--num-layers makes it shallower. Random weights decode random tokens, which is all a speed comparison needs. The
tokenizer is a word-level one over the vocabulary (the benchmarks feed token ids).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

SHAPE = dict(hidden_size=1024, intermediate_size=3584, num_attention_heads=8, num_key_value_heads=2, head_dim=256,
             linear_num_key_heads=16, linear_num_value_heads=16, linear_key_head_dim=128, linear_value_head_dim=128,
             linear_conv_kernel_dim=4, vocab_size=248320, max_position_embeddings=8192, tie_word_embeddings=True,
             bos_token_id=1, eos_token_id=2)  # fmt: skip


def save_tokenizer(folder: Path, vocab_size: int) -> None:
    """A word-level tokenizer of vocab_size tokens "t0" .. (t0 unknown, t1 begin, t2 end)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab_size)}, unk_token="t0"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="t0", bos_token="t1", eos_token="t2")
    fast.save_pretrained(folder)


def save_hybrid_model(folder: Path, num_layers: int, seed: int = 0) -> None:
    """A random Qwen3.5 text model of SHAPE with num_layers layers (every fourth one full attention)."""
    import transformers

    if num_layers < 1:
        raise ValueError(f"num_layers must be >= 1, got {num_layers}")
    layer_types = ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(num_layers)]
    config = transformers.Qwen3_5TextConfig(num_hidden_layers=num_layers, layer_types=layer_types, **SHAPE)
    with torch.random.fork_rng(devices=[]):  # transformers draws the weights from torch's global generator
        torch.manual_seed(seed)
        model = transformers.Qwen3_5ForCausalLM(config).eval()
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    save_tokenizer(folder, SHAPE["vocab_size"])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("folder", type=Path, help="where to save the checkpoint folder")
    parser.add_argument("--num-layers", type=int, default=24, help="layers (every fourth one full attention)")
    args = parser.parse_args(argv)
    save_hybrid_model(args.folder, args.num_layers)
    print(f"saved a random Qwen3.5-shaped model of {args.num_layers} layers to {args.folder}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
