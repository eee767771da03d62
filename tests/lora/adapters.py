"""Random PEFT LoRA adapters of tiny base models, saved as PEFT folders, and the PEFT model that runs them."""

from __future__ import annotations

from pathlib import Path

import torch

ALL_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def save_adapter(base_folder: Path, folder: Path, rank: int, targets: list[str], seed: int, alpha: float = 16.0,
                 rslora: bool = False) -> Path:
    """A LoRA adapter of the base checkpoint with random A and B (B nonzero, so it changes the outputs)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(base_folder, dtype=torch.float32)
    config = LoraConfig(r=rank, lora_alpha=alpha, target_modules=targets, use_rslora=rslora, lora_dropout=0.0,
                        init_lora_weights=False)
    model = get_peft_model(base, config)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.1)
    model.save_pretrained(folder)
    return folder


def peft_model(base_folder: Path, adapter_folder: Path | None):
    """The transformers base model with the adapter applied by PEFT (or alone), float32, eval mode."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(base_folder, dtype=torch.float32).eval()
    return base if adapter_folder is None else PeftModel.from_pretrained(base, adapter_folder).eval()


def greedy(model, prompt: list[int], num_new: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(input_ids=torch.tensor([prompt]), max_new_tokens=num_new, min_new_tokens=num_new,
                             do_sample=False, pad_token_id=0)
    return out[0, len(prompt) :].tolist()


def logits(model, prompt: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=torch.tensor([prompt])).logits[0].float()
