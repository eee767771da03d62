"""Loading the same model in Hugging Face transformers, as the reference peer."""

from __future__ import annotations

from pathlib import Path

import torch


def load_hf_model(model: str | None, dtype: str = "auto"):
    """transformers' model for a kvforge model argument (a folder, a .gguf file, or None: the default)."""
    from transformers import AutoModelForCausalLM

    if model is None:
        from kvforge.loader.default_model import default_model_path

        model = default_model_path()
    torch_dtype = torch.float32 if dtype in ("auto", "float32") else getattr(torch, dtype)
    path = Path(model)
    if path.is_file():
        return AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                    dtype=torch_dtype).eval()
    return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch_dtype).eval()
