"""Random PEFT LoRA adapters of tiny base models, saved as PEFT folders, and the PEFT model that runs them."""

from __future__ import annotations

from pathlib import Path

import torch

ALL_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def save_adapter(base_folder: Path, folder: Path, rank: int, targets: list[str], seed: int, alpha: float = 16.0,
                 rslora: bool = False, parameters: list[str] | None = None) -> Path:
    """A LoRA adapter of the base checkpoint with random A and B (B nonzero, so it changes the outputs); parameters:
    PEFT's target_parameters (e.g. the stacked experts' "mlp.experts.gate_up_proj")."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(base_folder, dtype=torch.float32)
    config = LoraConfig(r=rank, lora_alpha=alpha, target_modules=targets, use_rslora=rslora, lora_dropout=0.0,
                        init_lora_weights=False, target_parameters=parameters)
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


def save_per_expert_adapter(base_folder: Path, folder: Path, rank: int, seed: int, alpha: float = 16.0) -> Path:
    """An adapter of every routed expert's gate_proj, up_proj and down_proj as per-expert modules, the way PEFT saves
    an adapter of transformers 4's expert modules (layers.0.mlp.experts.3.gate_proj.lora_A.weight [r, hidden]); PEFT
    converts it to transformers 5's stacked experts when it loads it. Random A and B."""
    import json

    from safetensors.torch import save_file
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(base_folder)
    hidden, inter = config.hidden_size, config.moe_intermediate_size
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(config.num_hidden_layers):
        for expert in range(config.num_experts):
            for proj, (num_out, num_in) in {"gate_proj": (inter, hidden), "up_proj": (inter, hidden),
                                            "down_proj": (hidden, inter)}.items():
                prefix = f"base_model.model.model.layers.{layer}.mlp.experts.{expert}.{proj}"
                tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, num_in, generator=generator) / num_in**0.5
                tensors[f"{prefix}.lora_B.weight"] = torch.randn(num_out, rank, generator=generator) * 0.1
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    (folder / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": str(base_folder), "r": rank,
        "lora_alpha": alpha, "lora_dropout": 0.0, "bias": "none", "use_rslora": False,
        "target_modules": ["gate_proj", "up_proj", "down_proj"]}))
    return folder
