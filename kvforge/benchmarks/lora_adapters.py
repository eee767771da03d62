"""Random LoRA adapters for a base model, written as PEFT folders (adapter_config.json + adapter_model.safetensors):
what `kvforge bench lora` serves. Shapes come from the base model's config (the HF config, or a GGUF file's read
as one); A and B are random, so every adapter changes the model's outputs.

    python -m kvforge.benchmarks.lora_adapters OUT_DIR --count 4 --rank 16 [--model PATH]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def module_shapes(hf_config: dict) -> dict[str, tuple[int, int]]:
    """(out_features, in_features) of each target module of a Llama-family decoder layer."""
    hidden, heads = hf_config["hidden_size"], hf_config["num_attention_heads"]
    head_dim = hf_config.get("head_dim") or hidden // heads
    kv = (hf_config.get("num_key_value_heads") or heads) * head_dim
    inter = hf_config["intermediate_size"]
    return {"q_proj": (heads * head_dim, hidden), "k_proj": (kv, hidden), "v_proj": (kv, hidden),
            "o_proj": (hidden, heads * head_dim), "gate_proj": (inter, hidden), "up_proj": (inter, hidden),
            "down_proj": (hidden, inter)}


def write_adapter(folder: Path, hf_config: dict, rank: int, seed: int, alpha: float = 32.0) -> Path:
    """One random adapter of every target module of every layer."""
    from safetensors.torch import save_file

    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(hf_config["num_hidden_layers"]):
        for name, (out_features, in_features) in module_shapes(hf_config).items():
            part = "self_attn" if name in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            prefix = f"base_model.model.model.layers.{layer}.{part}.{name}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, in_features, generator=generator) / in_features**0.5
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(out_features, rank, generator=generator) * 0.01
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": alpha, "use_rslora": False, "bias": "none",
              "target_modules": list(TARGETS), "task_type": "CAUSAL_LM"}
    (folder / "adapter_config.json").write_text(json.dumps(config, indent=2))
    return folder


def write_adapters(out_dir: Path, hf_config: dict, count: int, rank: int) -> list[Path]:
    return [write_adapter(out_dir / f"adapter-{i}", hf_config, rank, seed=i) for i in range(count)]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--count", type=int, default=4)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--model", default=None, help="the base model (default: the default model)")
    args = parser.parse_args()
    from kvforge import LLM

    llm = LLM(args.model, enforce_eager=True, kv_cache_memory="64MiB")
    for folder in write_adapters(args.out_dir, llm.engine.hf_config, args.count, args.rank):
        print(folder)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
